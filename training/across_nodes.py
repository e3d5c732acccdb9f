"""One run across the nodes of a Slurm job: `python -m training.across_nodes -- RUNNER…`.

A Slurm job of several nodes runs its batch script on the first node only. This module is
that script's program (the bot's `SlurmExecutor` exec's it): it picks a free port for
torchrun's rendezvous on the first node and exec's `srun`, which starts one task per node
(`--ntasks-per-node=1`); each task is this module again (`--task PORT`), which exec's the
runner line it was given with the node's place in the run added: `--nnodes` (the job's
node count), `--node-rank` (`SLURM_NODEID`) and `--rdzv-endpoint` (the first node's
address as Slurm gives it to every task, `SLURM_LAUNCH_NODE_IPADDR`, and the port).

Why exec all the way: Slurm's warning before a limit and a preemption (`--signal=B:TERM`)
reach the batch script alone, which is then `srun`, and srun forwards SIGTERM to every
task, which is then the runner itself: each node's runner checkpoints and exits as on a
host. `--kill-on-bad-exit=1`: a node whose part fails ends the others' parts, so a run is
never left half alive.

The first node's runner writes the run's status file; the others write their own beside
it (`status.node1.json`, …), so no node overwrites the run's result. Only the standard
library is used: this runs on the cluster's nodes in the run's environment.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

RUNNER = "training.runner"


def free_port() -> int:
    """A port free on this node now, for node 0's rendezvous store (torchrun binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_status_file(path: str, rank: int) -> str:
    """Node `rank`'s own status file: the run's for node 0, one beside it for the rest."""
    if rank == 0:
        return path
    p = PurePosixPath(path)
    return str(p.with_name(f"{p.stem}.node{rank}{p.suffix}"))


def srun_argv(port: int, runner: Sequence[str], nodes: int, python: str) -> list[str]:
    """The batch script's srun: one task per node, each this module with `--task`."""
    return [
        "srun",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        python,
        "-m",
        "training.across_nodes",
        "--task",
        str(port),
        "--",
        *runner,
    ]


def task_argv(runner: Sequence[str], env: Mapping[str, str], port: int) -> list[str]:
    """The runner line with this node's place in the run: the options go before the
    runner's own `--` (what follows it is the person's command, never touched)."""
    words = list(runner)
    try:
        at = words.index(RUNNER) + 1
    except ValueError:
        raise SystemExit(f"across_nodes: no `-m {RUNNER}` in the line it was given") from None
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    rank = int(env.get("SLURM_NODEID") or "0")
    head = env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    end = words.index("--", at) if "--" in words[at:] else len(words)
    own = words[at:end]
    if "--status-file" in own:
        i = own.index("--status-file") + 1
        own[i] = node_status_file(own[i], rank)
    place = ["--nnodes", str(nodes), "--node-rank", str(rank), "--rdzv-endpoint", f"{head}:{port}"]
    return [*words[:at], *place, *own, *words[end:]]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    task_port: int | None = None
    if args[:1] == ["--task"] and len(args) > 1:
        task_port = int(args[1])
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m training.across_nodes [--task PORT] -- RUNNER LINE", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if task_port is None:  # the batch script, on the job's first node
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        line = srun_argv(free_port(), args, nodes, sys.executable)
    else:  # one node's task
        line = task_argv(args, env, task_port)
    sys.stdout.flush()
    os.execvp(line[0], line)
    return 127  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
