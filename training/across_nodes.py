"""One run across the nodes of a Slurm job: `python -m training.across_nodes -- RUNNER…`.

A Slurm job of several nodes runs its batch script on the first node only. This module is
that script's program (the bot's `SlurmExecutor` exec's it): it picks a free port for
torchrun's rendezvous on the first node and runs `srun`, which starts one task per node
(`--ntasks-per-node=1`); each task is this module again (`--task PORT`), which exec's the
runner line it was given with the node's place in the run added: `--nnodes` (the job's
node count), `--node-rank` (`SLURM_NODEID`) and `--rdzv-endpoint` (the first node's
address as Slurm gives it to every task, `SLURM_LAUNCH_NODE_IPADDR`, and the port).

Why the batch script stays a parent of srun instead of exec'ing it: Slurm's warning before
a limit and a preemption (`--signal=B:TERM`), and the bot's cancel (`scancel --batch
--signal=TERM`), reach the batch script alone, and srun answers a SIGTERM by killing its
tasks ("forcing job termination", SIGKILL: seen on Slurm 22.05), so a run would never
checkpoint. This script catches it and tells the runners through Slurm instead:
`scancel --signal=TERM JOB` (every step of the job, not the batch step), so every node's
runner gets SIGTERM as on a host, they stop on the same step, rank 0 checkpoints, and srun
then exits with their status, which this script exits with. Each task exec's the runner
(its process is the runner itself). `--kill-on-bad-exit=1`: a node whose part fails ends
the others' parts, so a run is never left half alive.

The first node's runner writes the run's status file; the others write their own beside
it (`status.node1.json`, …), so no node overwrites the run's result. Only the standard
library is used: this runs on the cluster's nodes in the run's environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
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
        print(
            "usage: python -m training.across_nodes [--task PORT] -- RUNNER LINE", file=sys.stderr
        )
        return 2
    env = dict(os.environ)
    if task_port is None:  # the batch script, on the job's first node
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        return launch(srun_argv(free_port(), args, nodes, sys.executable), env)
    line = task_argv(args, env, task_port)  # one node's task
    sys.stdout.flush()
    os.execvp(line[0], line)
    return 127  # not reached: exec replaced this process


def forward_argv(signum: int, job_id: str) -> list[str]:
    """The scancel that passes a signal the batch script got to every node's runner:
    every step of the job but the batch step (no --full), so it never comes back here."""
    return ["scancel", f"--signal={signal.Signals(signum).name.removeprefix('SIG')}", job_id]


def launch(line: Sequence[str], env: Mapping[str, str]) -> int:
    """srun as a child; SIGTERM and SIGINT passed on through Slurm (see the module's
    docstring); srun's exit status is the batch script's."""
    sys.stdout.flush()
    child = subprocess.Popen(list(line))
    job_id = env.get("SLURM_JOB_ID", "")

    def forward(signum: int, _frame: object) -> None:
        if not job_id:  # not under Slurm: the child is told directly
            child.send_signal(signum)
            return
        # Never srun itself (it would kill the tasks): when scancel fails, the job is
        # ending and slurmstepd signals every process of it anyway.
        subprocess.run(forward_argv(signum, job_id), check=False)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
