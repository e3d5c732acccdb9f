"""Reading a window of cost: its whole UTC days and hours from the rollups
(bot.app.rollups keeps them), and the rest (open intervals, and the part of an edge that is
not on a UTC hour) raw, to be metered as before. `bot.app.billing` and `bot.app.digest` add
the two up; apart from the writer so that what is kept and how it is read are each one
file.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import bindparam, case, func, literal, union_all
from sqlmodel import Session, col, select

from bot.app.rollups import ceil_day, ceil_hour, floor_day, floor_hour
from bot.domain.metering import Usage, Window
from db.models import (
    Host,
    RunRollup,
    RunRollupDay,
    UsageInterval,
    UsageRollup,
    UsageRollupDay,
    User,
)
from db.types import UTCDateTime


@dataclass(frozen=True)
class RawUsage:
    """An interval (or the part of it in an edge of the window) still read raw."""

    usage: Usage
    market: str
    instance_type: str | None


@dataclass(frozen=True)
class RolledRow:
    """The rolled-up part of a window, summed per user, market and instance type."""

    user: str
    market: str
    instance_type: str | None
    micro_usd: int
    held_us: int
    covered_micro: int


@dataclass(frozen=True)
class WindowUsage:
    """A window's usage: closed history from the rollups (whole UTC days from the daily
    rows, other whole UTC hours from the hourly ones), the rest (open intervals, edges
    off the hour) as raw usages clipped to their part."""

    rolled: tuple[RolledRow, ...] = ()
    raw: tuple[RawUsage, ...] = field(default_factory=tuple)

    @property
    def covered_micro(self) -> int:
        return sum(r.covered_micro for r in self.rolled)


def _spans(window: Window) -> tuple[list[Window], list[Window], list[Window]]:
    """The window cut into whole UTC days, other whole UTC hours, and the rest."""
    hours_start, hours_end = ceil_hour(window.start), floor_hour(window.end)
    if hours_end <= hours_start:  # within an hour: all raw
        return [], [], [window]
    raw = [
        w
        for w in (Window(window.start, hours_start), Window(hours_end, window.end))
        if w.end > w.start
    ]
    days_start, days_end = ceil_day(hours_start), floor_day(hours_end)
    if days_end <= days_start:
        return [], [Window(hours_start, hours_end)], raw
    hours = [
        w for w in (Window(hours_start, days_start), Window(days_end, hours_end)) if w.end > w.start
    ]
    return [Window(days_start, days_end)], hours, raw


def whole_hours(window: Window) -> Window | None:
    """The part of the window made of whole UTC hours (what the hourly and daily rows
    answer), None when it has none: the rest is read raw."""
    start, end = ceil_hour(window.start), floor_hour(window.end)
    return Window(start, end) if end > start else None


def _rolled(table: type[UsageRollup] | type[UsageRollupDay], i: int, by_user: bool) -> Any:
    """The i-th span's rows (`b_start{i}` to `b_end{i}`) summed per user, market and
    instance type; one person's (`b_user`) when `by_user`."""
    at = col(UsageRollupDay.day) if table is UsageRollupDay else col(UsageRollup.hour)
    t: Any = table
    columns: tuple[Any, ...] = (
        User.key,
        t.market,
        t.instance_type,
        func.sum(t.micro_usd),
        func.sum(t.held_us),
        func.sum(t.covered_micro),
    )
    q: Any = (
        select(*columns)
        .join(User, col(User.id) == t.user_id)
        .where(
            at >= bindparam(f"b_start{i}", type_=UTCDateTime),
            at < bindparam(f"b_end{i}", type_=UTCDateTime),
        )
        .group_by(User.key, t.market, t.instance_type)
    )
    return q.where(t.user_id == bindparam("b_user")) if by_user else q


# The statements of a window, built once per shape (bound parameters): a budget check, App
# Home and every cost view read one, and building them was a good part of their CPU.


@functools.cache
def _rolled_stmt(days: int, hours: int, by_user: bool) -> Any:
    """The whole days' and the other whole hours' rows of a window, in one statement."""
    parts = [_rolled(UsageRollupDay, i, by_user) for i in range(days)]
    parts += [_rolled(UsageRollup, days + i, by_user) for i in range(hours)]
    return parts[0] if len(parts) == 1 else union_all(*parts)


@functools.cache
def _raw_stmt(edge: bool, by_user: bool) -> Any:
    """Intervals read raw (`_RAW_COLUMNS`): the open ones that started before `b_end`, or
    (`edge`) the closed ones that overlap [`b_start`, `b_end`)."""
    where: list[Any] = [col(UsageInterval.started_at) < bindparam("b_end", type_=UTCDateTime)]
    if edge:
        where.append(col(UsageInterval.ended_at) > bindparam("b_start", type_=UTCDateTime))
    else:
        where.append(col(UsageInterval.ended_at).is_(None))
    if by_user:
        where.append(col(UsageInterval.user_id) == bindparam("b_user"))
    return (
        select(*_RAW_COLUMNS)
        .join(User, col(User.id) == col(UsageInterval.user_id))
        .join(Host, col(Host.id) == col(UsageInterval.host_id))
        .where(*where)
    )


# An interval read raw, as plain columns (a window reads every open one: building them as
# objects was a good part of a team month's time with a fleet busy with runs).
_RAW_COLUMNS: tuple[Any, ...] = (
    UsageInterval.gpu_id,
    UsageInterval.host_id,
    UsageInterval.started_at,
    UsageInterval.ended_at,
    UsageInterval.usd_per_hour,
    UsageInterval.run_id,
    UsageInterval.reservation_id,
    UsageInterval.market,
    User.key,
    Host.instance_type,
)


def window_usage(s: Session, window: Window, user_id: int | None = None) -> WindowUsage:
    days, hours, edges = _spans(window)
    by_user = user_id is not None
    conn = s.connection()
    rolled: list[RolledRow] = []
    if days or hours:  # the whole days and the other whole hours in one statement
        params: dict[str, Any] = {"b_user": user_id} if by_user else {}
        for i, w in enumerate(days + hours):
            params[f"b_start{i}"], params[f"b_end{i}"] = w.start, w.end
        rolled = [
            RolledRow(key, market, itype or None, int(m), int(us), int(c))
            for key, market, itype, m, us, c in conn.execute(
                _rolled_stmt(len(days), len(hours), by_user), params
            )
        ]
    who: dict[str, Any] = {"b_user": user_id} if by_user else {}
    raw = [
        _raw(iv, iv.started_at, None)
        for iv in conn.execute(_raw_stmt(False, by_user), {"b_end": window.end, **who})
    ]
    for edge in edges:
        params = {"b_start": edge.start, "b_end": edge.end, **who}
        for iv in conn.execute(_raw_stmt(True, by_user), params):
            raw.append(_raw(iv, max(iv.started_at, edge.start), min(iv.ended_at, edge.end)))
    raw.sort(key=lambda r: (r.usage.start, r.usage.gpu_id))
    return WindowUsage(tuple(rolled), tuple(raw))


def _raw(iv: Any, start: datetime, end: datetime | None) -> RawUsage:
    """An interval read by `_RAW_COLUMNS`, clipped to [start, end)."""
    return RawUsage(
        usage=Usage(
            user=iv.key,
            gpu_id=iv.gpu_id,
            host_id=iv.host_id,
            start=start,
            end=end,
            usd_per_hour=Decimal(str(iv.usd_per_hour)),
            kind="run" if iv.run_id is not None else "reservation",
            ref_id=iv.run_id or iv.reservation_id or 0,
        ),
        market=iv.market,
        instance_type=iv.instance_type,
    )


def rolled_run_costs(
    s: Session, window: Window, *, top: int, runs: Collection[int] = ()
) -> list[tuple[int, int]]:
    """(run, micro-dollars) of the window's whole UTC days and other whole UTC hours from
    the runs' own rows: the runs named in `runs` (the caller's raw parts) whatever their
    place, and the `top` dearest of the others (by cost, then run id). One statement, the
    runs' rows summed in the database, the whole days' from an index that holds the cost
    (a week of a busy team is 7,500 runs); the team's rows do not say which run held what."""
    days, hours, _ = _spans(window)
    if not days and not hours:
        return []
    parts: list[Any] = [
        select(RunRollupDay.run_id, RunRollupDay.micro_usd).where(
            col(RunRollupDay.day) >= w.start, col(RunRollupDay.day) < w.end
        )
        for w in days
    ]
    parts += [
        select(RunRollup.run_id, RunRollup.micro_usd).where(
            col(RunRollup.hour) >= w.start, col(RunRollup.hour) < w.end
        )
        for w in hours
    ]
    both: Any = parts[0] if len(parts) == 1 else union_all(*parts)
    rows: Any = both.subquery()
    named = sorted(set(runs))
    cost = func.sum(rows.c.micro_usd)
    first = rows.c.run_id.in_(named) if named else literal(False)
    q = (
        select(rows.c.run_id, cost)
        .group_by(rows.c.run_id)
        .order_by(case((first, 0), else_=1), cost.desc(), rows.c.run_id)
        .limit(len(named) + top)
    )
    return [(run, int(m)) for run, m in s.connection().execute(q)]
