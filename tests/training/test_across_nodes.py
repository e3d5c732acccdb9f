"""training.across_nodes without Slurm: the runner line each node's task runs, and the
batch script's launcher passing a SIGTERM on and exiting with its child's status. The
same program under a real two-node Slurm: tests/provisioning/test_slurm_nodes.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.across_nodes import forward_argv, node_status_file, task_argv

RUNNER = [
    "/venv/bin/python", "-m", "training.runner", "--run-id", "7",
    "--status-file", "/w/runs/7/status.json", "--gpus", "4",
    "--", "python", "train.py", "--status-file", "mine",
]  # fmt: skip


def test_each_node_gets_its_rank_and_the_first_nodes_rendezvous_before_the_persons_command() -> (
    None
):
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5"}
    line = task_argv(RUNNER, env, 29411)
    cut = line.index("--")
    own, persons = line[:cut], line[cut:]
    assert own[:3] == RUNNER[:3]
    assert own[3:9] == ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.5:29411"]
    # Node 1 writes its own status beside the run's; the person's words are untouched.
    assert own[own.index("--status-file") + 1] == "/w/runs/7/status.node1.json"
    assert persons == ["--", "python", "train.py", "--status-file", "mine"]
    first = task_argv(RUNNER, {**env, "SLURM_NODEID": "0"}, 29411)
    assert first[first.index("--status-file") + 1] == "/w/runs/7/status.json"


def test_status_files_and_the_scancel_that_passes_a_signal_on() -> None:
    assert node_status_file("/r/status.json", 0) == "/r/status.json"
    assert node_status_file("/r/status.json", 3) == "/r/status.node3.json"
    # Every step of the job but the batch script's own (no --full): never back here.
    assert forward_argv(signal.SIGTERM, "42") == ["scancel", "--signal=TERM", "42"]


def test_the_launcher_passes_sigterm_on_and_exits_with_its_childs_status(tmp_path: Path) -> None:
    """Not under Slurm (no SLURM_JOB_ID) the child is told directly; the child here
    stands for srun: it exits 75 on SIGTERM, as runners that checkpointed make it."""
    ready = tmp_path / "ready"
    child = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(60)\n"
    )
    code = (
        "import sys\n"
        "from training.across_nodes import launch\n"
        f"sys.exit(launch([sys.executable, '-c', {child!r}], {{}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75
