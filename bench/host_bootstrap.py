"""A fresh host's bootstrap from the local wheel cache, and a second one (a no-op).

The host is an isolated test account behind a real sshd (tests/ssh_hosts.py): only the
system python3, an empty home. Goals: under 120 s from nothing, under 2 s again.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from provisioning.bootstrap import bootstrap
from provisioning.ssh import SshClient
from tests.isolated_hosts import isolated_target
from tests.ssh_hosts import isolated_unavailable, pip_env, start_isolated_lab

FRESH_GOAL_S = 120.0
AGAIN_GOAL_S = 2.0


def run() -> dict[str, object]:
    reason = isolated_unavailable()
    if reason is not None:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory(prefix="gpubot-bench-hosts-") as tmp:
        lab = start_isolated_lab(Path(tmp), {"lab-a": "127.0.0.4"})
        client = SshClient(connect_timeout=5, command_timeout=120)
        try:
            target = isolated_target(lab, "lab-a")
            t0 = time.perf_counter()
            first = bootstrap(client, target, remote_root="~/.gpubot", env=pip_env())
            fresh_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = bootstrap(client, target, remote_root="~/.gpubot", env=pip_env())
            again_s = time.perf_counter() - t0
        finally:
            client.close()
            lab.stop()
    return {
        "fresh_s": round(fresh_s, 2),
        "fresh_goal_s": FRESH_GOAL_S,
        "again_s": round(again_s, 3),
        "again_goal_s": AGAIN_GOAL_S,
        "fresh_steps": list(first.steps),
        "again_noop": again.noop,
    }


def headline(figures: dict[str, object]) -> list[str]:
    if "skipped" in figures:
        return [f"skipped: {figures['skipped']}"]
    return [
        f"fresh host bootstrap {figures['fresh_s']} s (goal < {FRESH_GOAL_S:g} s), "
        f"again {figures['again_s']} s (goal < {AGAIN_GOAL_S:g} s)"
    ]
