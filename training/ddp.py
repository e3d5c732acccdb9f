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

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def under_torchrun() -> bool:
    """True inside a torchrun worker: then the runner trains instead of launching."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


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


def torchrun_command(
    nproc_per_node: int,
    target: list[str],
    *,
    module: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "gpubot",
    rdzv_timeout_s: int = 600,
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts `target` as `nproc_per_node` workers on this host.

    `target` is a module and its arguments when `module` is true (``["training.runner",
    ...]``), otherwise a whole command (``["python", "train.py", ...]``), which torchrun
    runs as given (``--no-python``) so the user's interpreter and flags are kept.
    For ``nnodes > 1`` `rdzv_endpoint` (``host:port`` of the node-0 host, reachable from
    all) is required and the same command runs on every host with its own `node_rank`;
    a node that has not joined within `rdzv_timeout_s` fails the rendezvous on every
    host, so a host that never started does not leave the others waiting forever.
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError("need at least one process per node and one node")
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        # Port 0: the store binds a free port itself, so parallel runs cannot collide.
        cmd += [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            "--local-addr=127.0.0.1",
        ]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a multi-host run needs the rendezvous endpoint host:port")
        # The static rendezvous, not c10d's dynamic one: c10d numbers the nodes by sorting
        # their addresses, so global rank 0 (the one writer of the status file and the
        # result) could land on any host; static makes node 0's first process rank 0,
        # on the host the bot reads. Node 0 serves the store at the endpoint.
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-conf=timeout={rdzv_timeout_s}",
        ]
    cmd += [f"--rdzv-id={rdzv_id}", "--max-restarts=0"]
    if module:
        cmd += ["-m", *target]
    else:
        cmd += ["--no-python", *target]
    return cmd


# Linux ioctls that read an interface's IPv4 address and netmask (netdevice(7)).
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def interface_towards(host: str, port: int) -> str | None:
    """The network interface this machine reaches `host` through, or None where unknown.

    Gloo (and NCCL's bootstrap) pick their own listening address from the hostname, which
    on a stock Debian/Ubuntu image resolves to 127.0.1.1: the other nodes then dial a
    loopback address and the run hangs in its first collective. The interface that routes
    to node 0 is the one every node can be reached on. IPv4 and Linux only; elsewhere the
    libraries' own choice stands.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: no packet leaves, the kernel only routes
            local = ipaddress.ip_address(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = name.encode()[:15].ljust(256, b"\0")
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, request)[20:24])
            except OSError:
                continue  # no IPv4 address on it
            if local in ipaddress.ip_network(f"{addr}/{mask}", strict=False):
                return name
    return None
