"""The worker with many runs live: one tick's cost, threads, SSH connections and RSS.

`HOSTS` loopback sshd hosts (each its own sshd, logged into as the bot's own user, so no
bootstrap is paid), each listed with 8 GPUs, and the real worker's tick (`tick_job`:
the use cases' tick, the runs' poll and dispatch, the outbox) over SIZES live runs. Each run is a command that waits (`sleep`) under the runner, with its watcher (a
thread and a channel on its host's one connection). At each size: the tick's median and
slowest of TICKS ticks, and this process's threads, SSH connections (one per host that
was dialled) and RSS. Then one run among the most ends, and the time from its exit to its
result DM (the notifier's send) is measured as in `bench.run_end`. Goals (issue 39): tick
p99 under 1 s and RSS under 300 MB at 200 runs, exit-to-DM under 5 s.

What it does not model: hosts across a network (every sshd is on this machine, so a
poll's round trip is loopback's), and the runs' own processes share this machine's two
cores with the worker (mostly asleep).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sqlmodel import Session, select

from bench.run_end import ResultDms, ssh_runtime
from bot.app.hosts.hostcheck import hostcheck_job
from bot.app.hosts.remote import PreparedHost
from bot.faces.dispatch import handle_text
from bot.faces.runtime import Runtime
from bot.faces.worker import Worker, tick_job
from db.models import TrainingRun
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.ssh_hosts import SshdUnavailable, start_lab

HOSTS = int(os.environ.get("GPUBOT_BENCH_LIVE_HOSTS", "50"))
GPUS_PER_HOST = 8
# The 0, 50 and 200 on 50 hosts. Every run's own processes are on this machine too
# (`runs_rss_mb`): about 19 MB a run since the runner's supervisor stopped importing torch
# (about 200 MB before, when 200 runs did not fit this machine's 24 GB).
# GPUBOT_BENCH_LIVE_SIZES=0,10,20 (and GPUBOT_BENCH_LIVE_HOSTS=5): a smaller look.
SIZES = tuple(int(n) for n in os.environ.get("GPUBOT_BENCH_LIVE_SIZES", "0,50,200").split(","))
TICKS = 20
GUARD_S = 300.0  # a hang, not a figure
GOALS = {"tick_p99_s": 1.0, "rss_mb": 300.0, "exit_to_dm_s": 5.0}


def _rss_mb() -> float:
    """This process's resident memory now (not the peak), from /proc."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _groups_rss_mb(pgids: set[int]) -> float:
    """The resident memory of every process in these process groups (the runs' own: the
    launcher's shell, the runner, its command), read from /proc."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                pgrp = int(fh.read().rpartition(")")[2].split()[2])
            if pgrp in pgids:
                with open(f"/proc/{entry}/statm") as fh:
                    total += int(fh.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return round(total / 2**20, 1)


def _live(rt: Runtime) -> list[TrainingRun]:
    with Session(rt.engine) as s:
        return list(s.exec(select(TrainingRun).where(TrainingRun.state == "running")))


def _tick(rt: Runtime, notifier: ResultDms) -> float:
    # The host checks hand out their due checks (off the tick, on their own pool) as the
    # worker's job of their own does: a host whose link dropped under load comes back.
    hostcheck_job(rt.service)
    t0 = time.perf_counter()
    tick_job(rt.service, notifier)
    return time.perf_counter() - t0


def _measure(rt: Runtime, client: SshClient, tmp: Path) -> dict[str, Any]:
    notifier = ResultDms()
    actor = rt.service.actor("bench")
    out: dict[str, Any] = {}
    submitted = 0
    stamp = tmp / "exit-stamp"
    for size in SIZES:
        while submitted < size:
            if submitted == size - 1 and size == SIZES[-1]:
                # The one that ends among the rest: waits until told, then stamps its exit.
                go = tmp / "go"
                code = (  # one line: `/gpu run` takes one command line
                    "import os, time; "
                    f"[time.sleep(0.2) for _ in iter(lambda: os.path.exists({str(go)!r}), True)]; "
                    f"open({str(stamp)!r}, 'w').write(repr(time.time()))"
                )
                line = f"/gpu run --gpus 1 -- {sys.executable} -c {code!r}"
            else:
                line = "/gpu run --gpus 1 -- sleep 3600"
            reply = handle_text(rt.service, actor, line)
            if reply.error:
                raise RuntimeError(reply.view.text)
            submitted += 1
        # Each start pays the runner's precision probe (torch imported, about a second of
        # CPU): 200 starts on two cores take minutes.
        deadline = time.monotonic() + GUARD_S + 3.0 * size
        while len(_live(rt)) < size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(_live(rt))} of {size} runs started")
            _tick(rt, notifier)
        # Settled: every runner past its precision probe (its status file written), so
        # the ticks measured are not sharing the two cores with 200 torch imports (on a
        # deployment each host has its own); then the watchers made.
        while not all(Path(r.placement["status"]).exists() for r in _live(rt)):
            if time.monotonic() > deadline:
                raise RuntimeError("the runs' status files were never all written")
            _tick(rt, notifier)
            time.sleep(0.5)
        for _ in range(2):
            _tick(rt, notifier)
        ticks = sorted(_tick(rt, notifier) for _ in range(TICKS))
        out[str(size)] = {
            "live_runs": len(_live(rt)),
            "tick_median_s": round(statistics.median(ticks), 3),
            "tick_max_s": round(ticks[-1], 3),
            "threads": threading.active_count(),
            "ssh_connections": sum(1 for s in client._slots.values() if s.conn is not None),
            "rss_mb": _rss_mb(),
            # What the runs themselves hold on their hosts (here: this machine).
            "runs_rss_mb": _groups_rss_mb(
                {int(r.placement["pgid"]) for r in _live(rt) if "pgid" in r.placement}
            ),
        }
    # One run ends among the rest: exit -> result DM under the real worker (its watcher
    # asks for a tick; the interval tick is the default's).
    last = max(r.id or 0 for r in _live(rt))
    worker = Worker(rt.service, notifier, rt.settings.tick_seconds)
    worker.start()
    try:
        (tmp / "go").write_text("")
        deadline = time.monotonic() + GUARD_S
        while last not in notifier.arrived:
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {last}'s result DM never came")
            time.sleep(0.05)
    finally:
        worker.stop()
    out["exit_to_dm_s"] = round(notifier.arrived[last] - float(stamp.read_text()), 3)
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def _end_runs(rt: Runtime) -> None:
    """Every run's process group killed (they run as this user on this machine)."""
    with Session(rt.engine) as s:
        for run in s.exec(select(TrainingRun)):
            pgid = (run.placement or {}).get("pgid")
            if isinstance(pgid, int):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)


def run() -> dict[str, object]:
    out: dict[str, object] = {"goals": GOALS, "hosts": HOSTS, "gpus_per_host": GPUS_PER_HOST}
    with tempfile.TemporaryDirectory(prefix="gpubot-bench-live-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            lab = start_lab(tmp / "lab", {f"h{i:02d}": f"127.0.3.{i + 1}" for i in range(HOSTS)})
        except SshdUnavailable as exc:
            return {**out, "skipped": str(exc)}
        client = SshClient(connect_timeout=10, command_timeout=60)

        def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
            return PreparedHost(root=str(tmp / "onhost" / target.name), python=sys.executable)

        rt: Runtime | None = None
        try:
            entries = ",".join(
                f"{name}={lab.user}@{h.address}:{h.port}/{GPUS_PER_HOST}xT4"
                for name, h in lab.hosts.items()
            )
            rt = ssh_runtime(lab, entries, tmp / "home", client, prepare)
            out.update(_measure(rt, client, tmp))
        finally:
            if rt is not None:
                _end_runs(rt)
                rt.engine.dispose()
            client.close()
            lab.stop()
    return out


def headline(figures: dict[str, Any]) -> list[str]:
    if "skipped" in figures:
        return [f"skipped: {figures['skipped']}"]
    lines = []
    for size in SIZES:
        f = figures.get(str(size))
        if isinstance(f, dict):
            lines.append(
                f"{f['live_runs']} runs live on {figures['hosts']} hosts: tick median "
                f"{f['tick_median_s']} s, slowest {f['tick_max_s']} s; {f['threads']} threads, "
                f"{f['ssh_connections']} SSH connections, RSS {f['rss_mb']} MB (the runs' "
                f"own processes: {f['runs_rss_mb']} MB)"
            )
    lines.append(
        f"a run ending among {SIZES[-1]}: exit -> result DM {figures.get('exit_to_dm_s')} s "
        f"(goals: tick p99 < {GOALS['tick_p99_s']:g} s, RSS < {GOALS['rss_mb']:g} MB, "
        f"exit -> DM < {GOALS['exit_to_dm_s']:g} s)"
    )
    return lines
