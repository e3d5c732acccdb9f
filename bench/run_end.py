"""How long after a run's process exits its owner has the result DM, with the default tick.

The worker's tick is 15 s; a run's end is learnt from its watcher (bot.app.runs.watch),
which asks for a tick as soon as the process is gone. Each run here is a short command
that writes the time it exits (`time.time()`, this machine's clock, which the SSH host
shares: it is a loopback sshd) as its last act; the figure is from then to the moment
the result DM reaches the notifier (the terminal's or Slack's `send`). Two places a run
can be: this machine (the local runner) and a host over SSH (a loopback sshd logged into
as the bot's own user, so no bootstrap is paid). Goal: about 2 s; median of RUNS.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import environment
from bot.app.config import load_settings
from bot.app.hosts.remote import Prepare, PreparedHost
from bot.app.service.common import OutboxItem
from bot.faces.dispatch import handle_text
from bot.faces.runtime import Runtime, build_runtime
from bot.faces.worker import Worker
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.runtime_helpers import checked
from tests.ssh_hosts import SshdUnavailable, SshLab, start_lab

RUNS = 7
GOAL_S = 2.0
GUARD_S = 120.0  # a hang, not a figure


class ResultDms:
    """The notifier: when each run's result DM arrived (bench.live_runs uses it too)."""

    def __init__(self) -> None:
        self.arrived: dict[int, float] = {}
        self.changed = threading.Condition()

    def send(self, item: OutboxItem) -> None:
        text = item.view.text
        if item.edit_of is None and text.startswith("Run #") and " finished" in text:
            run_id = int(text.split("#", 1)[1].split(" ", 1)[0])
            with self.changed:
                self.arrived[run_id] = time.time()
                self.changed.notify_all()


def _measure(rt: Runtime, tmp: Path) -> list[float]:
    notifier = ResultDms()
    worker = Worker(rt.service, notifier, rt.settings.tick_seconds)
    worker.start()
    actor = rt.service.actor("bench")
    gaps: list[float] = []
    try:
        for i in range(RUNS):
            stamp = tmp / f"exit-{i}"
            code = f"import time; time.sleep(1); open({str(stamp)!r}, 'w').write(repr(time.time()))"
            reply = handle_text(rt.service, actor, f"/gpu run -- {sys.executable} -c {code!r}")
            run_id = int(reply.extra["run_id"])
            with notifier.changed:
                ok = notifier.changed.wait_for(
                    lambda run_id=run_id: run_id in notifier.arrived,  # type: ignore[misc]
                    GUARD_S,
                )
            if not ok:
                raise RuntimeError(f"run {run_id}'s result DM never came")
            gaps.append(notifier.arrived[run_id] - float(stamp.read_text()))
    finally:
        worker.stop()
    return gaps


def _local(tmp: Path) -> list[float]:
    with environment(
        GPUBOT_PROVIDER="local", GPUBOT_HOME=str(tmp / "home"), GPUBOT_LOCAL_SLOTS="1"
    ):
        rt = build_runtime(load_settings())
    try:
        return _measure(rt, tmp)
    finally:
        rt.engine.dispose()


def _ssh(tmp: Path) -> list[float]:
    lab = start_lab(tmp / "lab", {"gpu-a": "127.0.0.2"})
    client = SshClient(connect_timeout=5, command_timeout=60)
    host = lab.hosts["gpu-a"]

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        return PreparedHost(root=str(tmp / "onhost"), python=sys.executable)

    try:
        entry = f"gpu-a={lab.user}@{host.address}:{host.port}/1xcpu"
        rt = ssh_runtime(lab, entry, tmp / "home-ssh", client, prepare)
        try:
            return _measure(rt, tmp)
        finally:
            rt.engine.dispose()
    finally:
        client.close()
        lab.stop()


def ssh_runtime(
    lab: SshLab, hosts: str, home: Path, client: SshClient, prepare: Prepare
) -> Runtime:
    """The bot over these loopback hosts (`GPUBOT_SSH_HOSTS` entries), each prepared by
    `prepare` instead of the bootstrap (bench.live_runs builds its runtime here too)."""
    with environment(
        GPUBOT_PROVIDER="ssh",
        GPUBOT_HOME=str(home),
        GPUBOT_SSH_KEY=str(lab.client_key),
        GPUBOT_SSH_HOSTS=hosts,
    ):
        return checked(build_runtime(load_settings(), ssh=client, prepare=prepare))


def _figures(gaps: list[float]) -> dict[str, object]:
    return {
        "median_s": round(statistics.median(gaps), 3),
        "max_s": round(max(gaps), 3),
        "runs": [round(g, 3) for g in gaps],
    }


def run() -> dict[str, object]:
    out: dict[str, object] = {"goal_s": GOAL_S, "tick_s": load_settings().tick_seconds}
    with tempfile.TemporaryDirectory(prefix="gpubot-bench-end-") as tmp:
        out["local"] = _figures(_local(Path(tmp) / "local"))
        try:
            out["ssh"] = _figures(_ssh(Path(tmp) / "ssh"))
        except SshdUnavailable as exc:
            out["ssh"] = {"skipped": str(exc)}
    return out


def headline(figures: dict[str, object]) -> list[str]:
    lines = []
    for where in ("local", "ssh"):
        f = figures.get(where)
        if isinstance(f, dict) and "median_s" in f:
            lines.append(
                f"{where}: process exit -> result DM median {f['median_s']} s, max {f['max_s']} s "
                f"(goal about {GOAL_S:g} s; tick {figures['tick_s']} s)"
            )
        elif isinstance(f, dict):
            lines.append(f"{where}: skipped: {f.get('skipped')}")
    return lines
