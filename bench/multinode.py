"""A two-node digits run against a one-node one: wall time and test accuracy.

Both nodes are isolated test hosts (tests/ssh_hosts.py: their own accounts behind real
sshd on 127.0.0.4 and .5), so they share this machine's cores: the figure shows what
running across hosts costs here (rendezvous, gloo over TCP, a second torch start), not a
speed-up. The accuracy must match (same effective batch: tests/multinode.py). Runs only
where the isolated hosts exist; lab-a is bootstrapped unless a bootstrap is already there
(`host_bootstrap` before this leaves one), lab-b gets a copy of it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from provisioning.bootstrap import bootstrap
from provisioning.ssh import SshClient
from tests.isolated_hosts import clone_prepared, isolated_target, remove_clone
from tests.multinode import DigitsRun, Node, run_digits
from tests.ssh_hosts import isolated_unavailable, pip_env, start_isolated_lab
from training.recipes import get_recipe


def _figures(run: DigitsRun) -> dict[str, object]:
    head = run.statuses[0]
    summary = head.summary if head is not None else None
    return {
        "ok": all(r.ok for r in run.results)
        and all(s is not None and s.state == "done" for s in run.statuses),
        "wall_s": round(run.wall_s, 2),
        "train_s": round(summary.wall_s, 2) if summary and summary.wall_s else None,
        "test_accuracy": round(run.accuracy, 4) if run.accuracy is not None else None,
        "world_size": head.world_size if head is not None else None,
    }


def run() -> dict[str, object]:
    reason = isolated_unavailable()
    if reason is not None:
        return {"skipped": reason}
    epochs = get_recipe("digits").epochs
    with tempfile.TemporaryDirectory(prefix="gpubot-bench-multinode-") as tmp:
        lab = start_isolated_lab(Path(tmp), fresh=False)
        client = SshClient(connect_timeout=5, command_timeout=120)
        copy: Path | None = None
        try:
            target_a, target_b = isolated_target(lab, "lab-a"), isolated_target(lab, "lab-b")
            t0 = time.perf_counter()
            prepared_a = bootstrap(client, target_a, remote_root="~/.gpubot", env=pip_env())
            prepare_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            copy = clone_prepared(lab, "lab-a", "lab-b")
            prepared_b = bootstrap(client, target_b, remote_root="~/.gpubot", env=pip_env())
            clone_s = time.perf_counter() - t0
            nodes = [Node(target_a, prepared_a), Node(target_b, prepared_b)]
            one = run_digits(client, nodes[:1], "bench-one-node", epochs=epochs)
            two = run_digits(client, nodes, "bench-two-nodes", epochs=epochs)
        finally:
            client.close()
            if copy is not None:
                remove_clone(copy)
            lab.stop()
    return {
        "epochs": epochs,
        "lab_a_bootstrap_s": round(prepare_s, 2),
        "lab_a_bootstrap_noop": prepared_a.noop,
        "lab_b_clone_s": round(clone_s, 2),
        "one_node": _figures(one),
        "two_nodes": _figures(two),
    }


def headline(figures: dict[str, object]) -> list[str]:
    if "skipped" in figures:
        return [f"skipped: {figures['skipped']}"]
    one, two = figures["one_node"], figures["two_nodes"]
    assert isinstance(one, dict) and isinstance(two, dict)
    return [
        f"digits x{figures['epochs']} epochs: one node {one['wall_s']} s "
        f"(acc {one['test_accuracy']}), two nodes {two['wall_s']} s "
        f"(acc {two['test_accuracy']}); both nodes share this machine's cores"
    ]
