"""The bot's side of the host agent (`training.agent`): renew the lease, read the reports.

The agent on each GPU host stops the host when the bot stops renewing its lease and
nothing runs there; so the worker must renew the lease on *every* poll of a host that it
still wants, listing what it holds there. A bot that dies (or loses the host) then stops
paying for it within ``--lease`` + ``--idle`` seconds, without any process of ours alive.

Where this plugs in (bot/app/runs/poll.py `Poller.poll`): once per host per poll, before the
per-run checks, call ``renew_lease(runner, target, host_holds(s, host.id), now)`` (the
host's active reservations and its runs with their ``placement["pgid"]``), then
``read_agent_report(runner, target)``: requeue the runs in ``report.lost_runs`` and, when
``report.interruption`` is set, the runs it names once their process has exited (75,
checkpointed); a ``heartbeat_age_s`` far above the agent's interval means the agent is
down and the host is unguarded.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session, col, select

from db.models import RES_ACTIVE, RUN_ON_HOST, Host, Reservation, TrainingRun
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget
from training.agent import (
    HEARTBEAT_NAME,
    INTERRUPTION_NAME,
    LEASE_NAME,
    LOST_NAME,
    SCHEMA_VERSION,
    Lease,
    ReservationHold,
    RunHold,
)

# Relative paths are the SSH user's home on the host (SFTP and the shell both start there),
# which is where bootstrap's default root ``~/.gpubot`` puts the agent's state directory.
DEFAULT_AGENT_DIR = ".gpubot/agent"
MAX_REPORT_BYTES = 1 << 20

__all__ = [
    "DEFAULT_AGENT_DIR",
    "AgentReport",
    "HostHolds",
    "LostRun",
    "ReservationHold",
    "RunHold",
    "holds_by_host",
    "host_holds",
    "read_agent_report",
    "renew_lease",
]


@dataclass(frozen=True)
class HostHolds:
    """What the bot holds on one host: it keeps the host from stopping while any is live."""

    reservations: tuple[ReservationHold, ...] = ()
    runs: tuple[RunHold, ...] = ()


# A run in these states has (or is about to have) a process on its host; the names are
# bot.app.runs' RUN_STARTING/RUN_RUNNING/RUN_CANCELLING, spelled out because runs imports us.


def host_holds(s: Session, host_id: int) -> HostHolds:
    """What the database says the bot holds on a host: active reservations, live runs."""
    return holds_by_host(s, [host_id]).get(host_id, HostHolds())


def holds_by_host(s: Session, host_ids: Collection[int]) -> dict[int, HostHolds]:
    """`host_holds` of each of these hosts, read in one pass: one host at a time read every
    live run once a host, 10,000 rows a poll with 200 runs on 50 hosts (issue 39)."""
    wanted = set(host_ids)
    if not wanted:
        return {}
    names = {
        host_id: name
        for host_id, name in s.exec(
            select(Host.id, Host.name).where(col(Host.id).in_(list(wanted)))
        ).all()
        if host_id is not None
    }
    by_name = {name: host_id for host_id, name in names.items()}
    reservations: dict[int, list[ReservationHold]] = {}
    for r in s.exec(
        select(Reservation)
        .where(col(Reservation.host_id).in_(list(wanted)), Reservation.state == RES_ACTIVE)
        .order_by(col(Reservation.id))
    ):
        assert r.host_id is not None
        until = r.ends_at.timestamp() if r.ends_at is not None else None
        reservations.setdefault(r.host_id, []).append(ReservationHold(str(r.id), until))
    # A run over several hosts is held on each of them (its row names node 0's host; the
    # other nodes are in its placement), each with that node's own process group.
    runs: dict[int, list[RunHold]] = {}
    for run in s.exec(
        select(TrainingRun)
        .where(col(TrainingRun.state).in_(RUN_ON_HOST))
        .order_by(col(TrainingRun.id))
    ):
        nodes = run.placement.get("nodes", [])[1:]
        on = {run.host_id} | {by_name.get(str(n.get("host"))) for n in nodes}
        for host_id in sorted(h for h in on if h is not None and h in wanted):
            node = next((n for n in nodes if n.get("host") == names.get(host_id)), None)
            pgid = (node or run.placement).get("pgid")
            runs.setdefault(host_id, []).append(
                RunHold(str(run.id), int(pgid) if pgid is not None else None)
            )
    return {
        host_id: HostHolds(
            reservations=tuple(reservations.get(host_id, ())),
            runs=tuple(runs.get(host_id, ())),
        )
        for host_id in wanted
    }


def node_hosts(placement: Mapping[str, Any]) -> set[str]:
    """The hosts a run's processes are on: node 0's, and every node's of a run over several."""
    names = {str(n.get("host")) for n in placement.get("nodes", [])}
    if placement.get("host"):
        names.add(str(placement["host"]))
    return names


def renew_lease(
    runner: HostShell,
    target: SshTarget,
    holds: HostHolds,
    now: datetime,
    *,
    agent_dir: str = DEFAULT_AGENT_DIR,
) -> None:
    """Write the host's lease atomically (write_file writes beside it, then renames);
    raises SshError.

    `now` must be aware. The agent measures the lease's age on its own clock from the
    moment it sees a new ``renewed_at``, so bot/host clock skew does not matter, but the
    value must change on every renewal (it does, as long as time moves).
    """
    if now.tzinfo is None:
        raise ValueError("renew_lease needs an aware datetime")
    lease = Lease(renewed_at=now.timestamp(), reservations=holds.reservations, runs=holds.runs)
    final = posixpath.join(agent_dir, LEASE_NAME)
    runner.write_file(target, final, lease.to_json().encode() + b"\n")


@dataclass(frozen=True)
class LostRun:
    run_id: str
    status: str | None  # what its status file last said before the reboot (None: nothing)
    lost_at: float  # unix seconds, the host's clock


@dataclass(frozen=True)
class AgentReport:
    """What the host agent says, for the worker to act on."""

    heartbeat_at: float | None  # the agent's last check (host clock); None: no agent seen
    heartbeat_age_s: float | None  # now - heartbeat_at; large: the agent is not running
    agent_version: str | None
    interruption: dict[str, Any] | None  # this boot's spot notice and the runs it signalled
    interrupted_runs: tuple[str, ...]  # run ids sent SIGTERM for the notice
    lost_runs: tuple[LostRun, ...]  # active before a reboot, gone after it
    stop: dict[str, Any] | None  # the dead-man switch's stop record, when it fired
    seen: dict[str, Any] = field(default_factory=dict)  # the heartbeat's view of the host


def _doc(runner: HostShell, target: SshTarget, path: str) -> dict[str, Any] | None:
    raw = runner.read_file(target, path, max_bytes=MAX_REPORT_BYTES)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None  # caught mid-write by a foreign tool; the next poll reads it again
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        return None
    return doc


def read_agent_report(
    runner: HostShell,
    target: SshTarget,
    now: datetime | None = None,
    *,
    agent_dir: str = DEFAULT_AGENT_DIR,
) -> AgentReport:
    """Read the agent's heartbeat and reports over SSH; raises SshError when unreachable."""
    heartbeat = _doc(runner, target, posixpath.join(agent_dir, HEARTBEAT_NAME)) or {}
    interruption = _doc(runner, target, posixpath.join(agent_dir, INTERRUPTION_NAME))
    lost_doc = _doc(runner, target, posixpath.join(agent_dir, LOST_NAME)) or {}
    beat = heartbeat.get("time")
    beat_at = float(beat) if isinstance(beat, (int, float)) else None
    now = now or datetime.now(UTC)
    age = None if beat_at is None else max(0.0, now.timestamp() - beat_at)
    lost = tuple(
        LostRun(
            run_id=str(e.get("id")),
            status=e.get("status") if isinstance(e.get("status"), str) else None,
            lost_at=float(e.get("lost_at") or 0.0),
        )
        for e in lost_doc.get("runs", [])
        if isinstance(e, dict) and e.get("id") is not None
    )
    if interruption is not None and interruption.get("boot_id") != heartbeat.get("boot_id"):
        # A notice from before the host's last boot: those runs ended (status file says
        # how) or are in lost_runs; acting on it again would requeue them twice.
        interruption = None
    interrupted: tuple[str, ...] = ()
    if interruption is not None:
        interrupted = tuple(
            str(r["id"])
            for r in interruption.get("runs", [])
            if isinstance(r, dict) and r.get("id") is not None
        )
    seen = heartbeat.get("seen")
    version = heartbeat.get("version")
    stop = heartbeat.get("stop")
    return AgentReport(
        heartbeat_at=beat_at,
        heartbeat_age_s=age,
        agent_version=str(version) if version is not None else None,
        interruption=interruption,
        interrupted_runs=interrupted,
        lost_runs=lost,
        stop=stop if isinstance(stop, dict) else None,
        seen=seen if isinstance(seen, dict) else {},
    )
