"""Who holds which GPU now: the one reading of the open usage intervals.

A GPU is held exactly while a usage interval on it has no end (`db.models.UsageInterval`;
a partial unique index keeps that to one per GPU). Reserving, a run's claim, the grant
pass, the fleet, budgets, idle detection, utilization and the status views all ask the
same question with a different filter or a different amount of context; they ask it
here, so "held now" means one thing everywhere.

These functions only read (and `end_held` only ends the open intervals it is pointed
at); they take no lock.
A transaction that changes who holds a GPU takes the pool first (`db.session.lock_pool`)
and reads through them after it, which makes what they return the latest committed
state (db.session's lock order); a read-only caller gets a consistent snapshot of its
own transaction, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Row, and_, bindparam, case, update
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key
from sqlmodel import Session, col, func, select

from bot.app.money.rollups import on_closed
from bot.app.runtimes import attained_s as attained_s  # re-exported: the runs read it here
from bot.domain.readmodels import FleetCounts
from db.models import (
    HOST_CHECKING,
    HOST_PENDING,
    HOST_READY,
    HOST_TERMINATED,
    Gpu,
    Host,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import core
from db.types import UTCDateTime


def _held(
    *,
    host_ids: Collection[int] | None = None,
    reservation_id: int | None = None,
    run_id: int | None = None,
) -> list[ColumnElement[bool]]:
    """The rule, with its filters: an interval with no end, narrowed as asked."""
    where: list[ColumnElement[bool]] = [col(UsageInterval.ended_at).is_(None)]
    if host_ids is not None:
        where.append(col(UsageInterval.host_id).in_(host_ids))
    if reservation_id is not None:
        where.append(col(UsageInterval.reservation_id) == reservation_id)
    if run_id is not None:
        where.append(col(UsageInterval.run_id) == run_id)
    return where


def _one(host_id: int | None) -> list[int] | None:
    return None if host_id is None else [host_id]


def held_gpu_ids(s: Session, *, host_id: int | None = None) -> set[int]:
    """The ids of the GPUs held now (on one host, if given): what is not free."""
    return set(s.exec(select(UsageInterval.gpu_id).where(*_held(host_ids=_one(host_id)))).all())


@dataclass(frozen=True)
class GpuCount:
    """One GPU model on one host: how many of its GPUs are present, and how many of
    those are free (held by nobody)."""

    host_id: int
    host_state: str
    model: str
    present: int
    free: int
    # The host's market: a cluster's node ("cluster") is granted by its own scheduler.
    market: str = "owned"
    # The host's price per hour, all of its GPUs together: a budget's estimate is the
    # dearest share among the hosts that carry the model (bot.app.money.budgets.gpu_rate).
    hourly_usd: float = 0.0


def gpu_counts(s: Session) -> list[GpuCount]:
    """Every host that is not terminated, per GPU model, with its present and free GPUs:
    in host id order, and a host's models in the order of their first GPU.

    One grouped query, the open intervals joined through their partial index: what a
    reserve needs to refuse the impossible and to choose a host (best fit needs only how
    many are free where), a row per host and model instead of a row per GPU. It was the
    GPUs of a hundred hosts, read twice, in every reserve."""
    return [
        GpuCount(host_id, state, model, int(n), int(n) - int(h), market, float(hourly))
        for host_id, state, market, hourly, model, n, h in core(s).execute(_gpu_counts_stmt()).all()
    ]


# The hot path's statements are built once (with bound parameters where they vary) and
# run through the connection (Core): building a statement and the ORM's execute path cost
# more CPU than the statement itself, in every reserve and release.


@functools.cache
def _gpu_counts_stmt() -> Any:
    # Held: through gpubot (an open interval), or outside it (a cluster job of another's).
    held = func.count(col(UsageInterval.id)) + func.count(col(Gpu.held_by))
    columns: tuple[Any, ...] = (
        Gpu.host_id,
        Host.state,
        Host.market,
        Host.hourly_usd,
        Gpu.model,
        func.count(),
        held,
    )
    return (
        select(*columns)
        .join(Host, col(Host.id) == col(Gpu.host_id))
        .join(
            UsageInterval,
            and_(col(UsageInterval.gpu_id) == col(Gpu.id), *_held()),
            isouter=True,
        )
        .where(col(Host.state) != HOST_TERMINATED, col(Gpu.present).is_(True))
        .group_by(
            col(Gpu.host_id),
            col(Host.state),
            col(Host.market),
            col(Host.hourly_usd),
            col(Gpu.model),
        )
        .order_by(col(Gpu.host_id), func.min(col(Gpu.index)))
    )


def fleet_counts(s: Session) -> FleetCounts:
    """The fleet summed up by host state, as `/gpu status` counts it in its first line
    (bot.domain.readmodels.FleetCounts): one grouped query, a row per host state, where
    the status reads a row per GPU. Hosts with no present GPU count as hosts too, so
    the outer joins (the GPUs' presence and the open intervals are join conditions)."""
    held = func.count(col(UsageInterval.id)) + func.count(col(Gpu.held_by))
    columns: tuple[Any, ...] = (
        Host.state,
        func.count(func.distinct(col(Host.id))),
        func.count(col(Gpu.id)),
        held,
    )
    stmt: Any = (
        select(*columns)
        .join(Gpu, and_(col(Gpu.host_id) == col(Host.id), col(Gpu.present).is_(True)), isouter=True)
        .join(
            UsageInterval,
            and_(col(UsageInterval.gpu_id) == col(Gpu.id), *_held()),
            isouter=True,
        )
        .where(col(Host.state) != HOST_TERMINATED)
        .group_by(col(Host.state))
    )
    ready_hosts = ready = free = starting = away = 0
    for state, hosts, present, busy in s.connection().execute(stmt).all():
        if state == HOST_READY:
            ready_hosts, ready, free = int(hosts), int(present), int(present) - int(busy)
        elif state in (HOST_PENDING, HOST_CHECKING):
            starting += int(present)
        else:
            away += int(present)
    return FleetCounts(ready_hosts, ready, free, starting, away)


# The host a grant goes to, as plain columns: what its usage is priced by (id, price,
# market) and what the grant's reply shows of it (bot.app.service.common.ShownHost).
_GRANT_HOST_COLUMNS: tuple[Any, ...] = tuple(
    getattr(Host, name)
    for name in (
        "id",
        "name",
        "provider",
        "state",
        "address",
        "ssh_user",
        "ssh_port",
        "market",
        "hourly_usd",
        "down_since",
        "down_reason",
    )
)


def free_gpus(
    s: Session, host_id: int, model: str
) -> tuple[Row[Any] | None, list[tuple[int, int]]]:
    """The host, and (id, index) of its present, free GPUs of this model, by index; the
    host is None when none is free. One query for both: the grant pass read the host
    (as an ORM object) and then its GPUs, two statements of every reserve."""
    rows = core(s).execute(_free_gpus_stmt(), {"host_id": host_id, "model": model}).all()
    return (rows[0] if rows else None), [(row[0], row[1]) for row in rows]


@functools.cache
def _free_gpus_stmt() -> Any:
    # The GPU's columns labelled, so that the row's `id` is the host's.
    gpu_cols: tuple[Any, ...] = (col(Gpu.id).label("gpu_id"), col(Gpu.index).label("gpu_index"))
    columns: tuple[Any, ...] = (*gpu_cols, *_GRANT_HOST_COLUMNS)
    return (
        select(*columns)
        .join(Host, col(Host.id) == col(Gpu.host_id))
        .join(
            UsageInterval,
            and_(col(UsageInterval.gpu_id) == col(Gpu.id), *_held()),
            isouter=True,
        )
        .where(
            col(Gpu.host_id) == bindparam("host_id"),
            col(Gpu.model) == bindparam("model"),
            col(Gpu.present).is_(True),
            col(UsageInterval.id).is_(None),
        )
        .order_by(col(Gpu.index))
    )


def held_host_ids(s: Session) -> set[int]:
    """The hosts where some GPU is held now."""
    return set(s.exec(select(UsageInterval.host_id).where(*_held())).all())


def held_intervals(
    s: Session,
    *,
    host_id: int | None = None,
    reservation_id: int | None = None,
    run_id: int | None = None,
) -> list[UsageInterval]:
    """The open intervals themselves, narrowed by each filter given, oldest first."""
    where = _held(host_ids=_one(host_id), reservation_id=reservation_id, run_id=run_id)
    return list(s.exec(select(UsageInterval).where(*where).order_by(col(UsageInterval.id))))


class EndedInterval(NamedTuple):
    """An interval `end_held` just ended, as the UPDATE returned it (plain columns)."""

    id: int
    gpu_id: int
    host_id: int
    user_id: int
    reservation_id: int | None
    run_id: int | None
    started_at: datetime
    ended_at: datetime
    usd_per_hour: float
    market: str


_ENDED_COLUMNS = tuple(UsageInterval.__table__.c[name] for name in EndedInterval._fields)  # type: ignore[attr-defined]


def end_held(
    s: Session,
    at: datetime,
    *,
    host_id: int | None = None,
    reservation_id: int | None = None,
    run_id: int | None = None,
) -> list[EndedInterval]:
    """Lets go of what a reservation, a run or a host holds: each open interval ends at
    `at`, or where it started if `at` is earlier (a clock step back never makes a
    negative interval). The caller holds the pool. The ended intervals are rolled up in
    the same transaction (bot.app.money.rollups), so costs never see one both raw and rolled up, or
    neither. Returns the intervals it ended, oldest first.

    One Core UPDATE … RETURNING, not a read of the intervals and an UPDATE of each: every
    release, expiry and finished run ends intervals here. Core, not the ORM: the ORM's
    UPDATE … RETURNING with session sync cost more CPU than the statement it saved. An
    interval this session has loaded is given its end as the committed value, so it
    reads as the database has it without a reload."""
    if host_id is None and reservation_id is None and run_id is None:
        raise ValueError("end_held needs a host, a reservation or a run")
    params: dict[str, Any] = {"b_end_at": at}  # not column names: an UPDATE reserves those
    if host_id is not None:
        params["b_host_id"] = host_id
    if reservation_id is not None:
        params["b_reservation_id"] = reservation_id
    if run_id is not None:
        params["b_run_id"] = run_id
    stmt = _end_held_stmt(host_id is not None, reservation_id is not None, run_id is not None)
    ended = sorted(
        # after what the session has pending, as the ORM's own execute would flush it
        (EndedInterval(*row) for row in core(s).execute(stmt, params)),
        key=lambda iv: iv.id,
    )
    for iv in ended:
        loaded = s.identity_map.get(identity_key(UsageInterval, iv.id))
        if loaded is not None:
            set_committed_value(loaded, "ended_at", iv.ended_at)
    on_closed(s, ended)
    return ended


@functools.cache
def _end_held_stmt(by_host: bool, by_reservation: bool, by_run: bool) -> Any:
    """end_held's UPDATE for one combination of filters, built once (bound parameters)."""
    table: Any = UsageInterval.__table__  # type: ignore[attr-defined]
    end = bindparam("b_end_at", type_=UTCDateTime)
    started = table.c.started_at
    where = [table.c.ended_at.is_(None)]
    if by_host:
        where.append(table.c.host_id == bindparam("b_host_id"))
    if by_reservation:
        where.append(table.c.reservation_id == bindparam("b_reservation_id"))
    if by_run:
        where.append(table.c.run_id == bindparam("b_run_id"))
    return (
        update(table)
        .where(*where)
        .values(ended_at=case((started > end, started), else_=end))
        .returning(*_ENDED_COLUMNS)
    )


@dataclass(frozen=True)
class Hold:
    """One held GPU with who holds it and why: a reservation or a run (one of the two)."""

    interval: UsageInterval
    gpu: Gpu
    user: User
    reservation: Reservation | None
    run: TrainingRun | None


def who_holds(
    s: Session,
    *,
    host_ids: Collection[int] | None = None,
    reservation_id: int | None = None,
) -> list[Hold]:
    """Every GPU held now (on these hosts, or for this reservation, if given) with its
    holder, in one query; by host, then GPU index."""
    # Five entities: past sqlmodel's typed `select` overloads, so typed by `Hold` below.
    entities: tuple[Any, ...] = (UsageInterval, Gpu, User, Reservation, TrainingRun)
    stmt: Any = (
        select(*entities)
        .join(Gpu, col(Gpu.id) == col(UsageInterval.gpu_id))
        .join(User, col(User.id) == col(UsageInterval.user_id))
        .join(Reservation, col(Reservation.id) == col(UsageInterval.reservation_id), isouter=True)
        .join(TrainingRun, col(TrainingRun.id) == col(UsageInterval.run_id), isouter=True)
        .where(*_held(host_ids=host_ids, reservation_id=reservation_id))
        .order_by(col(UsageInterval.host_id), col(Gpu.index), col(UsageInterval.id))
    )
    return [Hold(iv, gpu, user, res, run) for iv, gpu, user, res, run in s.exec(stmt).all()]


@dataclass(frozen=True)
class SchedulerHold:
    """A held GPU as the scheduler weighs it, in plain columns: where, by whom, and the
    reservation's end or the run's state (one of the two)."""

    host_id: int
    user_key: str
    started_at: datetime
    reservation_id: int | None
    reservation_ends_at: datetime | None
    run_id: int | None
    run_state: str | None
    run_started_at: datetime | None
    run_max_seconds: int | None
    run_gpu_count: int
    # A recipe, a --spot or a --checkpoints run: one that resumes when moved.
    run_movable: bool
    # The run was told to stop (a spot notice, a preemption) and has not yet.
    run_interrupted: bool
    # Seconds its earlier segments ran (attained_s).
    run_attained_s: float = 0.0


def held_for_scheduler(s: Session) -> list[SchedulerHold]:
    """Every GPU held now, as `who_holds` finds them but as plain columns (the dispatch
    reads them all whenever it has work, a row per held GPU of the fleet)."""
    columns: tuple[Any, ...] = (
        UsageInterval.host_id,
        User.key,
        UsageInterval.started_at,
        UsageInterval.reservation_id,
        Reservation.ends_at,
        UsageInterval.run_id,
        TrainingRun.state,
        TrainingRun.started_at,
        TrainingRun.max_seconds,
        TrainingRun.gpu_count,
        TrainingRun.recipe,
        TrainingRun.spot,
        TrainingRun.checkpoints,
        # The two figures the scheduler needs of a run's placement and metrics, taken out
        # in the database: the whole documents (a kilobyte of metrics) were parsed once
        # per GPU the run holds, every tick, about 300 of them with 36 runs running.
        col(TrainingRun.placement)["interrupted"].as_string().is_not(None),
        col(TrainingRun.metrics)["attained_s"].as_float(),
    )
    stmt: Any = (
        select(*columns)
        .join(Gpu, col(Gpu.id) == col(UsageInterval.gpu_id))
        .join(User, col(User.id) == col(UsageInterval.user_id))
        .join(Reservation, col(Reservation.id) == col(UsageInterval.reservation_id), isouter=True)
        .join(TrainingRun, col(TrainingRun.id) == col(UsageInterval.run_id), isouter=True)
        .where(*_held())
        .order_by(col(UsageInterval.host_id), col(Gpu.index), col(UsageInterval.id))
    )
    out = []
    for row in s.exec(stmt):
        host_id, key, started, res_id, ends, run_id, state, run_started, max_s = row[:9]
        gpus, recipe, spot, ckpt, interrupted, attained = row[9:]
        out.append(
            SchedulerHold(
                host_id=host_id,
                user_key=key,
                started_at=started,
                reservation_id=res_id,
                reservation_ends_at=ends,
                run_id=run_id,
                run_state=state,
                run_started_at=run_started,
                run_max_seconds=max_s,
                run_gpu_count=gpus or 0,
                run_movable=recipe is not None or bool(spot) or bool(ckpt),
                run_interrupted=bool(interrupted),
                run_attained_s=max(0.0, attained or 0.0),  # as attained_s reads it
            )
        )
    return out
