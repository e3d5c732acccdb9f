"""Several processes, one model: torchrun command lines and the DDP plumbing inside a worker.

The runner never forks its own workers: ``--gpus N`` (N > 1) re-launches the run under
``python -m torch.distributed.run`` (torchrun), which owns rendezvous, environment and
worker restarts. On one host the rendezvous is a c10d store on 127.0.0.1 with a port the
OS picks; across hosts the caller (the bot, which knows the hosts) passes the
rendezvous endpoint, the node count and this node's rank, and runs the same command on
every host.

Inside a worker, `DistInfo.from_env` reads what torchrun set (RANK, WORLD_SIZE,
LOCAL_RANK). The backend is NCCL on CUDA and gloo on CPU, so the same code paths run in
CPU-only tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.launching import interface_towards, torchrun_command, under_torchrun

__all__ = ["DistInfo", "interface_towards", "torchrun_command", "under_torchrun"]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes the status file and checkpoints: one writer, no races."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def from_env() -> DistInfo:
        return DistInfo(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )


def init_process_group(info: DistInfo, device: torch.device) -> None:
    if not info.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def any_rank(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise OR of 0/1 flags over all ranks, so every rank stops on the same step.

    A SIGTERM or a clock reaches the ranks at slightly different moments; if each acted
    on its own, one would leave a collective that the others wait in forever.
    """
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
