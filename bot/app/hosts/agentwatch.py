"""The worker's side of the host agents: renew leases, act on spot notices and reboots.

Called at the top of `RunService.poll` (not as its own periodic job) for three reasons:
the lease must be renewed on *every* poll of a host the bot still wants, and poll is
the one place that already walks the hosts with runs; the reports must be read *before*
poll looks at each run, or a run lost in a reboot (dead process, status still
"running") would be failed there instead of requeued; and a preempted run's checkpoint
must be copied in the same pass that sees its exit, because a spot reclaim takes the
disk away two minutes after the notice. Two jobs would race over the same runs.

What a resumable stop becomes (`requeue_resumable`): a run whose status says
``preempted`` (the runner's exit 75 after a checkpoint), or whose host's agent reported
it interrupted or lost, goes back in line *with its checkpoint*: the checkpoint dir is
copied from the host to ``$GPUBOT_HOME/checkpoints/<run id>/`` at once, the run keeps a
``resume_from`` in its placement, and `Dispatcher._start` (bot.app.runs.dispatch) uploads that copy into the new
run dir's checkpoints before starting, wherever it lands; the runner resumes from it.

A host whose agent reports a spot notice this boot is marked ``unreachable`` (still
billed as running): dispatch places nothing new on a machine that has two minutes left.
Everything here is best effort per host: an SSH failure is logged, never fatal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import shutil
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from sqlmodel import col, select

from bot.app.hosts.hostagent import (
    AgentReport,
    HostHolds,
    holds_by_host,
    node_hosts,
    read_agent_report,
    renew_lease,
)
from bot.app.money.billing import note_host_state
from bot.domain import views
from bot.domain.durations import ascii_digits
from db.models import (
    HOST_READY,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RUN_ON_HOST,
    Host,
    Reservation,
    TrainingRun,
)
from db.session import locked, transaction
from provisioning.hostshell import HostShell
from provisioning.manifest import parse_remote_manifest, remote_manifest_command_line
from provisioning.ssh import SshError, SshTarget
from training.status import RunStatus, parse_status

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from bot.app.ports import Core, HostAccess

log = logging.getLogger(__name__)

# The states in which a run has (or is about to have) a process on its host; bot.app.runs'
# RUN_STARTING/RUN_RUNNING/RUN_CANCELLING (bot.app.runs imports this module, not the reverse).
# A run stopped for a resume this many times is failed instead: a script that always
# exits 75, or a host type that is always reclaimed, must not loop forever.
MAX_RESUMES = 10
# An agent whose heartbeat is older than this is not guarding its host.
STALE_HEARTBEAT_S = 600.0
LIST_TIMEOUT_S = 60.0
SPOT_REASON = "spot reclaim"
REBOOT_REASON = "the host rebooted"


class WatchedRuns(Protocol):
    """What the watch needs of the run service (bot.app.runs.RunService, whose poll calls
    it): the core's clock and settings, how to reach a host, the engine, and the one way
    a stopped run goes back in line. A port, so that runs can import this module."""

    @property
    def core(self) -> Core: ...

    @property
    def access(self) -> HostAccess: ...

    @property
    def engine(self) -> Engine: ...

    def requeue(
        self, run_id: int, resume_from: dict[str, Any], view: views.View, dedupe: str
    ) -> bool:
        """Back in line with its checkpoint; False when it was no longer running."""
        ...


@dataclass
class WatchReport:
    """One pass over the hosts, for the log and the tests."""

    renewed: list[str] = field(default_factory=list)  # hosts whose lease was written
    interrupted: list[int] = field(default_factory=list)  # runs newly marked interrupted
    requeued: list[int] = field(default_factory=list)  # runs put back in line (lost ones)
    draining: list[str] = field(default_factory=list)  # hosts marked unreachable on a notice
    errors: list[str] = field(default_factory=list)  # "host: what failed"


# --- the pass over the hosts ------------------------------------------------------------


# A lease whose holds have not changed is written again after this long (the agent stops
# a host only after `AgentInstall.lease_s`, 900 s by default, without one); a change of
# holds is written at the next poll. Written every poll, 50 hosts' leases were 50 SSH
# writes every 15 s for nothing new.
RENEW_EVERY_S = 60.0
# Hosts watched in parallel in one pass.
WATCH_THREADS = 8


class Leases:
    """The leases this worker wrote, by host: what they held and when (the bot's clock,
    the lease's own `renewed_at`)."""

    def __init__(self, every_s: float = RENEW_EVERY_S) -> None:
        self.every_s = every_s
        self._written: dict[str, tuple[HostHolds, datetime]] = {}
        self._lock = threading.Lock()

    def due(self, host: str, holds: HostHolds, now: datetime) -> bool:
        with self._lock:
            last = self._written.get(host)
        if last is None or last[0] != holds:
            return True
        age = (now - last[1]).total_seconds()
        return age >= self.every_s or age < 0

    def wrote(self, host: str, holds: HostHolds, now: datetime) -> None:
        with self._lock:
            self._written[host] = (holds, now)

    def forget(self, host: str) -> None:
        with self._lock:
            self._written.pop(host, None)


def watch_hosts(
    runs: WatchedRuns, providers: Collection[str], leases: Leases | None = None
) -> WatchReport:
    """Renew the lease of every host of these providers (those whose hosts run the agent)
    and act on its agent's report; never raises SSH errors (each is logged and counted),
    so a dead host cannot stop the poll. With `leases`, a lease is written only when its
    holds changed or it is `RENEW_EVERY_S` old; without, on every pass. Hosts are
    watched in parallel (`WATCH_THREADS`), each on its own connection."""
    report = WatchReport()
    now = runs.core.clock.now()
    with transaction(runs.engine, write=False) as s:
        on_hosts = list(
            s.exec(
                select(TrainingRun.host_id, TrainingRun.placement).where(
                    col(TrainingRun.state).in_(RUN_ON_HOST)
                )
            ).all()
        )
        holding = {host_id for host_id, _ in on_hosts} | set(
            s.exec(select(Reservation.host_id).where(Reservation.state == RES_ACTIVE)).all()
        )
        # Every node of a run over several hosts is watched, not only node 0's host.
        nodes_on = set().union(*(node_hosts(p or {}) for _, p in on_hosts))
        # Plain columns, not Host objects: building a hundred of them was most of an
        # idle tick at a hundred hosts.
        columns: Any = (Host.id, Host.name, Host.state)
        hosts = [
            (host_id, name)
            for host_id, name, state in s.exec(
                select(*columns)
                .where(col(Host.provider).in_(list(providers)))
                .order_by(col(Host.id))
            )
            if state == HOST_READY or host_id in holding or name in nodes_on
        ]
        holds = holds_by_host(s, [host_id for host_id, _ in hosts])

    def one(host: tuple[int, str]) -> None:
        host_id, name = host
        try:
            _watch_host(runs, host_id, name, holds[host_id], now, report, leases)
        except SshError as exc:
            log.warning("host agent on %s: %s", name, exc)
            report.errors.append(f"{name}: {exc}")
        except Exception as exc:  # one host's failure must not hide the others' reports
            log.exception("host agent on %s", name)
            report.errors.append(f"{name}: {exc}")

    if len(hosts) < 2:
        for host in hosts:
            one(host)
    else:
        with ThreadPoolExecutor(min(WATCH_THREADS, len(hosts)), "agent-watch") as pool:
            list(pool.map(one, hosts))
    return report


def _watch_host(
    runs: WatchedRuns,
    host_id: int,
    name: str,
    holds: HostHolds,
    now: datetime,
    report: WatchReport,
    leases: Leases | None,
) -> None:
    seat = runs.access.runner_for(name)
    if seat is None:
        return
    runner, target, runs_dir = seat.runner, seat.target, seat.runs_dir
    agent_dir = str(runs_dir.parent / "agent")  # bootstrap puts both under one root
    if leases is None or leases.due(name, holds, now):
        try:
            renew_lease(runner, target, holds, now, agent_dir=agent_dir)
            report.renewed.append(name)
            if leases is not None:
                leases.wrote(name, holds, now)
        except SshError as exc:  # the report may still be readable; the next poll renews
            if leases is not None:
                leases.forget(name)
            log.warning("could not renew the lease on %s: %s", name, exc)
            report.errors.append(f"{name}: lease: {exc}")
    agent = read_agent_report(runner, target, now, agent_dir=agent_dir)
    if agent.heartbeat_age_s is not None and agent.heartbeat_age_s > STALE_HEARTBEAT_S:
        log.warning(
            "the host agent on %s last beat %.0fs ago: the host is not guarded",
            name,
            agent.heartbeat_age_s,
        )
    if agent.interruption is not None:
        _note_interruption(runs, host_id, name, agent, now, report)
    for lost in agent.lost_runs:
        if not lost.run_id.isdigit():
            continue
        if _requeue_lost(runs, runner, target, name, int(lost.run_id), lost.lost_at):
            report.requeued.append(int(lost.run_id))


def _note_interruption(
    runs: WatchedRuns,
    host_id: int,
    name: str,
    agent: AgentReport,
    now: datetime,
    report: WatchReport,
) -> None:
    """Marks the runs the agent signalled, so poll requeues them (not fails them) once
    their process has exited, and keeps new work off the host."""
    notice = (agent.interruption or {}).get("notice") or {}
    action = str(notice.get("action", "")) if isinstance(notice, dict) else ""
    with transaction(runs.engine) as s:
        # db.session's lock order: the runs (by id), then the host, each read under its
        # lock, so a placement update that committed meanwhile (a pgid) is not written over.
        ids = sorted({int(r) for r in agent.interrupted_runs if ascii_digits(r)})
        signalled = {r: locked(s, TrainingRun, r) for r in ids}
        host = locked(s, Host, host_id)
        if host is not None and host.state == HOST_READY:
            host.state = HOST_UNREACHABLE
            host.updated_at = now
            s.add(host)
            s.flush()
            note_host_state(s, host, now, runs.core.settings)
            report.draining.append(name)
            log.warning("spot notice on %s (%s): no new work goes there", name, action or "?")
        for run_id, run in signalled.items():
            if run is None or run.state not in RUN_ON_HOST:
                continue
            # Any node's host: a notice on node 1's instance stops the whole run (poll
            # signals every node, and it is requeued once, from node 0's checkpoint).
            if name not in node_hosts(run.placement) or "interrupted" in run.placement:
                continue
            run.placement = {
                **run.placement,
                "interrupted": {
                    "reason": SPOT_REASON,
                    "action": action,
                    "at": now.isoformat(),
                    "host": name,
                },
            }
            s.add(run)
            report.interrupted.append(int(run_id))


def _requeue_lost(
    runs: WatchedRuns,
    runner: HostShell,
    target: SshTarget,
    host_name: str,
    run_id: int,
    lost_at: float,
) -> bool:
    """A run the agent saw die with a reboot goes back in line once: the report keeps
    the entry, so the event's key is remembered in the run's ``resume_from``."""
    key = f"{host_name}@{lost_at:.3f}"
    with transaction(runs.engine, write=False) as s:
        run = s.get(TrainingRun, run_id)
        if run is None or run.state not in RUN_ON_HOST or run.placement.get("host") != host_name:
            return False
        placement = dict(run.placement)
    if key in (placement.get("resume_from") or {}).get("lost_seen", []):
        return False
    pgid = placement.get("pgid")
    if isinstance(pgid, int) and runner.is_alive(target, pgid):
        return False  # the agent's view is older than this run's process: leave it be
    status = None
    if placement.get("status"):
        raw = runner.read_file(target, str(placement["status"]))
        status = parse_status(raw.decode("utf-8", "replace")) if raw else None

    def copy(local: Path) -> int:
        if not placement.get("checkpoints"):
            return 0
        return download_checkpoints(runner, target, str(placement["checkpoints"]), local)

    return requeue_resumable(runs, run_id, placement, copy, status, REBOOT_REASON, key)


# --- requeue with the checkpoint ----------------------------------------------------------


def resumable_stop(placement: dict[str, Any], status: RunStatus | None) -> bool:
    """Whether poll should requeue (not finish) a run whose process has ended: it stopped
    with a checkpoint to be resumed (exit 75), or its host was reclaimed under it."""
    if status is not None and status.state == "preempted":
        return True
    # Reclaimed under it: whatever it said on the way out (a script killed by the signal
    # "failed"), it did not fail; but one that finished or hit its own --max did end.
    return "interrupted" in placement and (
        status is None or status.state not in ("done", "time_limit")
    )


def checkpoint_home(runs: WatchedRuns, run_id: int) -> Path:
    return checkpoint_dir(runs.core.settings.home, run_id)


def checkpoint_dir(home: str | Path, run_id: int) -> Path:
    """Where the bot keeps a run's last checkpoint (GPUBOT_HOME/checkpoints/ID): what a
    requeued run, or `/gpu run --resume ID`, starts from."""
    return Path(home).resolve() / "checkpoints" / str(run_id)


def holds_files(local: Path) -> bool:
    """Whether a kept checkpoint directory has anything to resume from."""
    return local.is_dir() and any(p.is_file() for p in local.rglob("*"))


def save_for_resume(
    local: Path, run_id: int, copy: Callable[[Path], int], status: RunStatus
) -> int | None:
    """A run that stopped at its time limit after a checkpoint: copies that checkpoint off
    its host (`copy`, the executor's) into `local`; the step it holds, or None when there is
    none to go on from (it stopped before its first checkpoint, or the copy failed)."""
    if status.checkpoint_step is None:
        return None
    try:
        copy(local)
    except (SshError, OSError) as exc:
        log.warning("could not keep run %s's checkpoint: %s", run_id, exc)
        return None
    have = holds_files(local)
    return status.checkpoint_step if have else None


def requeue_resumable(
    runs: WatchedRuns,
    run_id: int,
    placement: dict[str, Any],
    copy: Callable[[Path], int],
    status: RunStatus | None,
    reason: str | None = None,
    lost_key: str | None = None,
) -> bool:
    """Copies the run's checkpoint off its host (`copy` into a local directory, returning
    how many files: the executor's), then puts the run back in line with a
    ``resume_from`` and DMs the owner. False only when it stopped for a resume too often:
    then the caller finishes it as usual."""
    previous = dict(placement.get("resume_from") or {})
    count = int(previous.get("count", 0)) + 1
    if count > MAX_RESUMES:
        log.warning("run %s stopped for a resume %d times; not requeued again", run_id, count)
        return False
    host = str(placement.get("host", "?"))
    interrupted = placement.get("interrupted") or {}
    reason = reason or interrupted.get("reason") or "stopped by SIGTERM"
    # Where it was interrupted, in the DM: the host of the node that got the notice.
    where = str(interrupted.get("host") or host)
    local = checkpoint_home(runs, run_id)
    copied = 0
    try:
        copied = copy(local)
    except (SshError, OSError) as exc:
        log.warning("could not copy run %s's checkpoint from %s: %s", run_id, host, exc)
    have = holds_files(local)
    step = status.checkpoint_step if status is not None else None
    if have and step is None and previous.get("dir"):
        step = previous.get("step")  # nothing newer was written; the old copy still holds
    resume_from: dict[str, Any] = {
        "dir": str(local) if have else None,
        "step": step if have else None,
        "host": host,
        "reason": reason,
        "count": count,
        "copied_files": copied,
        "lost_seen": [*previous.get("lost_seen", []), *([lost_key] if lost_key else [])],
    }
    text = requeued_text(run_id, where, reason, resume_from["step"], have)
    if runs.requeue(run_id, resume_from, requeued_view(run_id, text), f"{run_id}:{count}"):
        log.warning("run %s requeued (%s on %s), resume step %s", run_id, reason, host, step)
    return True  # requeued now, or already moved on (cancelled, requeued by another path)


def requeued_text(run_id: int, host: str, reason: str, step: int | None, have: bool) -> str:
    if have and step:
        tail = f"resumes from step {step}"
    elif have:
        tail = "resumes from its last checkpoint"
    else:
        tail = "starts again from step 0: it had no checkpoint yet"
    return f"Run #{run_id} was interrupted on {host} ({reason}); it is back in line and {tail}."


def requeued_view(run_id: int, text: str) -> views.View:
    return views.View(text=text, blocks=(views.Text(text), views.cancel_run_button(run_id)))


# --- moving a checkpoint dir ------------------------------------------------------------------


def _in_flight(rel: str) -> bool:
    """A checkpoint being written (training.checkpoint's ``.latest.pt.XXXX.tmp``)."""
    base = posixpath.basename(rel)
    return base.startswith(".") and base.endswith(".tmp")


def download_checkpoints(runner: HostShell, target: SshTarget, remote_dir: str, local: Path) -> int:
    """Copies remote_dir's files into `local` (replacing what was there once the copy is
    whole and checked); returns how many. Nothing on the host: `local` is left as it
    was, so a copy made from an earlier host still serves. Each file crosses in memory
    (`read_file`), which suits checkpoints of up to a few GB."""
    listing = runner.run(target, remote_manifest_command_line(remote_dir), LIST_TIMEOUT_S)
    if not listing.ok:
        raise SshError(f"cannot list {remote_dir} on {target.label}: {listing.stderr.strip()}")
    files = {
        rel: st for rel, st in parse_remote_manifest(listing.stdout).items() if not _in_flight(rel)
    }
    if not files:
        return 0
    partial = local.with_name(local.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for rel, st in sorted(files.items()):
            parts = PurePosixPath(rel).parts
            if PurePosixPath(rel).is_absolute() or ".." in parts:
                raise SshError(f"refusing an odd checkpoint path {rel!r} on {target.label}")
            data = runner.read_file(target, posixpath.join(remote_dir, rel))
            if data is None:
                raise SshError(f"{rel} vanished from {remote_dir} while it was copied")
            if hashlib.sha256(data).hexdigest() != st.sha256:
                raise SshError(f"{rel} changed while it was copied from {target.label}")
            dest = partial.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            if st.executable:
                os.chmod(dest, 0o755)
        shutil.rmtree(local, ignore_errors=True)
        partial.rename(local)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return len(files)


def upload_checkpoints(
    runner: HostShell, target: SshTarget, resume_from: dict[str, Any], remote_dir: str
) -> int:
    """Puts the saved checkpoint into a new run dir before the run starts; returns how
    many files were sent (0: none saved, or the host already had them)."""
    local = resume_from.get("dir")
    if not local or not Path(local).is_dir():
        return 0
    sent = runner.upload_dir(target, local, remote_dir)
    return len(sent.uploaded)
