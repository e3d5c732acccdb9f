"""The digits recipe on isolated hosts, on one node or across several: shared by the test
(tests/provisioning/test_runs_across_hosts.py) and the bench (bench/multinode.py).

Every node runs the runner as the bot starts it (the host's bootstrapped venv, its
uploaded code on PYTHONPATH), over SSH as that host's own account. The runs use the same
effective batch (64, the recipe's reference) whatever the node count: each optimizer
step then sees the same 64 samples with the same learning rate, split across the nodes,
so one node and two must reach the same accuracy, and any gap is the multi-node path's.
"""

from __future__ import annotations

import posixpath
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from provisioning import shell
from provisioning.bootstrap import BootstrapReport
from provisioning.ssh import RunResult, SshClient, SshTarget
from training.status import RunStatus, parse_status

EFFECTIVE_BATCH = 64
# Both hosts are this machine's two cores: one intra-op thread per process, so two
# nodes do not fight over the cores with spinning OpenMP threads (a real host has its own).
NODE_ENV = {"OMP_NUM_THREADS": "1"}
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Node:
    """A prepared host: where to reach it and what its bootstrap left there."""

    target: SshTarget
    prepared: BootstrapReport


@dataclass(frozen=True)
class DigitsRun:
    """One run's outcome: each node's exit and status file (node 0's holds the result)."""

    results: tuple[RunResult, ...]
    statuses: tuple[RunStatus | None, ...]
    wall_s: float

    @property
    def accuracy(self) -> float | None:
        head = self.statuses[0]
        if head is None:
            return None
        value = head.metrics.get("test_accuracy")
        return float(value) if value is not None else None


def free_port(address: str) -> int:
    """A port free on `address` now, for node 0's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def digits_line(
    node: Node,
    status_file: str,
    *,
    run_id: str,
    epochs: int,
    nnodes: int = 1,
    node_rank: int = 0,
    endpoint: str | None = None,
) -> str:
    argv = [
        node.prepared.venv_python,
        "-m",
        "training.runner",
        *("--recipe", "digits", "--device", "cpu", "--seed", "0"),
        *("--epochs", str(epochs), "--effective-batch", str(EFFECTIVE_BATCH)),
        *("--status-file", status_file, "--run-id", run_id, "--quiet"),
    ]
    if nnodes > 1:
        assert endpoint is not None
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        argv += ["--rdzv-endpoint", endpoint]
    return shell.join(argv)


def run_digits(client: SshClient, nodes: list[Node], run_id: str, *, epochs: int) -> DigitsRun:
    """The run on every node at once (node 0's address is the rendezvous); waits for all."""
    endpoint = None
    if len(nodes) > 1:
        head = nodes[0].target.host
        endpoint = f"{head}:{free_port(head)}"

    def one(rank: int) -> tuple[RunResult, RunStatus | None]:
        node = nodes[rank]
        run_dir = posixpath.join(node.prepared.root, "runs", run_id)
        status_file = posixpath.join(run_dir, "status.json")
        made = client.run(node.target, shell.join(["mkdir", "-p", "--", run_dir]), timeout=30)
        assert made.ok, made.stderr
        line = digits_line(
            node,
            status_file,
            run_id=run_id,
            epochs=epochs,
            nnodes=len(nodes),
            node_rank=rank,
            endpoint=endpoint,
        )
        env = {"PYTHONPATH": node.prepared.code_dir, **NODE_ENV}
        result = client.run(node.target, line, timeout=RUN_TIMEOUT_S, cwd=run_dir, env=env)
        raw = client.read_file(node.target, status_file)
        return result, parse_status(raw.decode()) if raw else None

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        outcomes = list(pool.map(one, range(len(nodes))))
    wall_s = time.monotonic() - started
    return DigitsRun(
        results=tuple(r for r, _ in outcomes),
        statuses=tuple(s for _, s in outcomes),
        wall_s=wall_s,
    )
