"""Reading a window of cost: its whole UTC days and hours from the rollups
(bot.app.money.rollups keeps them), and the rest (open intervals, and the part of an edge that is
not on a UTC hour) raw, to be metered as before. `bot.app.money.billing` and `bot.app.money.digest` add
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

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    bindparam,
    case,
    cast,
    func,
    literal,
    null,
    union_all,
)
from sqlmodel import Session, col, select

from bot.app.money.rollups import ceil_day, ceil_hour, floor_day, floor_hour
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


# A window is read in one statement: its rolled-up spans and its raw intervals as the
# branches of one UNION ALL, each row saying which part it is (`part`: -1 a rolled-up sum,
# 0 an open interval, i + 1 an interval closed within edge i). Every cost view, App Home
# and each budget check reads a window; they were two to four statements each. A branch
# fills the columns of its kind and leaves the others NULL, typed as the others are.
_ROLLED, _OPEN = -1, 0


# The raw columns: (label, type) of each, so that the rolled-up branches' NULLs carry the
# same names and types.
_RAW: tuple[tuple[str, Any], ...] = (
    ("gpu_id", Integer),
    ("host_id", Integer),
    ("started_at", UTCDateTime),
    ("ended_at", UTCDateTime),
    ("usd_per_hour", Float),
    ("run_id", Integer),
    ("reservation_id", Integer),
)
_SUMS = ("micro_usd", "held_us", "covered_micro")


def _null(label: str, type_: Any) -> Any:
    return cast(null(), type_).label(label)


def _rolled(table: type[UsageRollup] | type[UsageRollupDay], i: int, by_user: bool) -> Any:
    """The i-th span's rows (`b_start{i}` to `b_end{i}`) summed per user, market and
    instance type; one person's (`b_user`) when `by_user`."""
    at = col(UsageRollupDay.day) if table is UsageRollupDay else col(UsageRollup.hour)
    t: Any = table
    columns: tuple[Any, ...] = (
        literal(_ROLLED, Integer).label("part"),
        col(User.key).label("key"),
        t.market.label("market"),
        t.instance_type.label("instance_type"),
        func.sum(t.micro_usd).label("micro_usd"),
        func.sum(t.held_us).label("held_us"),
        func.sum(t.covered_micro).label("covered_micro"),
        *(_null(label, t) for label, t in _RAW),
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


def _raw_part(part: int, by_user: bool) -> Any:
    """Intervals read raw: the open ones that started before `b_open_end` (`part` 0), or
    the closed ones that overlap edge i, [`b_edge_start{i}`, `b_edge_end{i}`) (`part`
    i + 1)."""
    if part == _OPEN:
        where: list[Any] = [
            col(UsageInterval.started_at) < bindparam("b_open_end", type_=UTCDateTime),
            col(UsageInterval.ended_at).is_(None),
        ]
    else:
        i = part - 1
        where = [
            col(UsageInterval.started_at) < bindparam(f"b_edge_end{i}", type_=UTCDateTime),
            col(UsageInterval.ended_at) > bindparam(f"b_edge_start{i}", type_=UTCDateTime),
        ]
    if by_user:
        where.append(col(UsageInterval.user_id) == bindparam("b_user"))
    columns: tuple[Any, ...] = (
        literal(part, Integer).label("part"),
        col(User.key).label("key"),
        col(UsageInterval.market).label("market"),
        col(Host.instance_type).label("instance_type"),
        *(_null(label, BigInteger) for label in _SUMS),
        *(getattr(UsageInterval, label).label(label) for label, _ in _RAW),
    )
    return (
        select(*columns)
        .join(User, col(User.id) == col(UsageInterval.user_id))
        .join(Host, col(Host.id) == col(UsageInterval.host_id))
        .where(*where)
    )


@functools.cache
def _window_stmt(days: int, hours: int, edges: int, by_user: bool) -> Any:
    """A window of `days` whole-day spans, `hours` whole-hour spans and `edges` raw
    edges, in one statement built once per shape (bound parameters): building them was a
    good part of a budget check's and every cost view's CPU. The rolled-up branches come
    first: a UNION's columns take their types from its first branch, and the raw
    branches' typed NULLs match them."""
    parts = [_rolled(UsageRollupDay, i, by_user) for i in range(days)]
    parts += [_rolled(UsageRollup, days + i, by_user) for i in range(hours)]
    parts += [_raw_part(part, by_user) for part in range(edges + 1)]
    return parts[0] if len(parts) == 1 else union_all(*parts)


def window_usage(s: Session, window: Window, user_id: int | None = None) -> WindowUsage:
    days, hours, edges = _spans(window)
    by_user = user_id is not None
    params: dict[str, Any] = {"b_open_end": window.end}
    if by_user:
        params["b_user"] = user_id
    for i, w in enumerate(days + hours):
        params[f"b_start{i}"], params[f"b_end{i}"] = w.start, w.end
    for i, edge in enumerate(edges):
        params[f"b_edge_start{i}"], params[f"b_edge_end{i}"] = edge.start, edge.end
    rolled: list[RolledRow] = []
    raw: list[RawUsage] = []
    stmt = _window_stmt(len(days), len(hours), len(edges), by_user)
    for row in s.connection().execute(stmt, params):
        if row.part == _ROLLED:
            rolled.append(
                RolledRow(
                    row.key,
                    row.market,
                    row.instance_type or None,
                    int(row.micro_usd),
                    int(row.held_us),
                    int(row.covered_micro),
                )
            )
        elif row.part == _OPEN:
            raw.append(_raw(row, row.started_at, None))
        else:
            edge = edges[row.part - 1]
            raw.append(_raw(row, max(row.started_at, edge.start), min(row.ended_at, edge.end)))
    raw.sort(key=lambda r: (r.usage.start, r.usage.gpu_id))
    return WindowUsage(tuple(rolled), tuple(raw))


def _raw(iv: Any, start: datetime, end: datetime | None) -> RawUsage:
    """An interval read by `_raw_part`, clipped to [start, end)."""
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
