"""Closed usage kept summed, so costs and the scheduler read history in a few rows.

A usage interval is rolled up in the transaction that closes it (`bot.app.watching.held.end_held`):
it is cut at UTC hours and each piece is added to its (hour, user, market, instance type)
row in whole micro-dollars, by the same meter as `bot.domain.metering`, and the same sums are
kept per UTC day so that a month reads a row per person and day. A run's pieces are also
added to its own (hour, run) and (day, run) rows (`RunRollup`, `RunRollupDay`), which the
views of runs read: the team's rows stay a row per person however many runs it has.
Meter readings telescope, so the pieces of an interval add up exactly to what the whole
interval costs, and a window made of whole hours costs exactly the sum of its rows. The
hour rows also make any whole-hour time zone's days and weeks exact. What a window
needs beyond that (open intervals, and the part of a window edge that is not on a UTC
hour, as in a half-hour time zone) is read raw and metered as before: `bot.app.money.usage_window`
hands both back, and `bot.app.money.billing` and `bot.app.money.digest` add them up.

Beside the money, each user's decayed GPU-seconds (Slurm's fair-share usage) is kept
up to date the same way, so the scheduler's order costs one small read per tick.

`rebuild_rollups` recomputes everything from the raw intervals; the tests compare it
with what was maintained incrementally, start-up runs it once on a database upgraded
from before rollups (`backfill_rollups`), and `gpubot db rebuild-rollups` runs it on
demand.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any, NamedTuple, Protocol

from sqlalchemy import and_, bindparam, case, delete
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.runtimes import backfill_run_times, rebuild_run_times
from bot.domain.metering import epoch_us, reading
from bot.domain.scheduling.model import SchedulerConfig
from db.decay import decay, decayed
from db.models import (
    FairShareUsage,
    Host,
    HostPeriod,
    RunRollup,
    RunRollupDay,
    UsageInterval,
    UsageRollup,
    UsageRollupDay,
    User,
)
from db.session import insert_rows, lock_pool, transaction
from db.types import UTCDateTime
from provisioning.costs import gpu_share

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
# The fair-share counters decay at the scheduler's half-life (RunService uses the
# default config); a reader with another half-life recomputes from the intervals.
FAIR_SHARE_HALF_LIFE_S = SchedulerConfig().half_life_s

# A piece of closed usage, as it is cut and metered: hour, user, host, market, run (0: a
# reservation's). The tables keep it summed three ways (`Rolled`).
RollupKey = tuple[datetime, int, int, str, int]
HourKey = tuple[datetime, int, str, str]  # hour, user, market, instance type: UsageRollup
DayKey = tuple[datetime, int, str, str]  # UTC day, user, market, instance type: UsageRollupDay
RunKey = tuple[datetime, int]  # hour, run: RunRollup
RunDayKey = tuple[datetime, int]  # UTC day, run: RunRollupDay


@dataclass
class Sums:
    micro_usd: int = 0
    held_us: int = 0
    covered_micro: int = 0

    def add(self, other: Sums) -> None:
        self.micro_usd += other.micro_usd
        self.held_us += other.held_us
        self.covered_micro += other.covered_micro


def floor_hour(t: datetime) -> datetime:
    t = t.astimezone(UTC)
    return t.replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: datetime) -> datetime:
    f = floor_hour(t)
    return f if f == t else f + HOUR


def floor_day(t: datetime) -> datetime:
    return _floor_day(t)


@functools.lru_cache(maxsize=4096)
def _floor_day(t: datetime) -> datetime:
    """Cached: a rebuild asks it of every hourly row, a few hundred rows an hour."""
    return floor_hour(t).replace(hour=0)


def ceil_day(t: datetime) -> datetime:
    f = floor_day(t)
    return f if f == t else f + DAY


class ClosedUsage(Protocol):
    """What a rollup needs of a closed interval: a `db.models.UsageInterval`, or its
    columns read without building the ORM object (`computed_rollups` over a million)."""

    @property
    def started_at(self) -> datetime: ...
    @property
    def ended_at(self) -> datetime | None: ...
    @property
    def user_id(self) -> int: ...
    @property
    def host_id(self) -> int: ...
    @property
    def market(self) -> str: ...
    @property
    def run_id(self) -> int | None: ...
    @property
    def usd_per_hour(self) -> float: ...


class ClosedInterval(ClosedUsage, Protocol):
    """A closed interval with its id (the fair-share counters order ties by it): a
    `db.models.UsageInterval`, or a row `bot.app.watching.held.end_held` got back."""

    @property
    def id(self) -> int | None: ...


@functools.lru_cache(maxsize=1024)
def _exact(usd_per_hour: float) -> Fraction:
    """The stored float price as the exact decimal it was written as, once per price."""
    return Fraction(Decimal(str(usd_per_hour)))


def _rate(iv: ClosedUsage) -> Fraction:
    return _exact(iv.usd_per_hour)


@functools.lru_cache(maxsize=1024)
def _share(usd_per_hour: float, gpus: int) -> Fraction:
    return gpu_share(_exact(usd_per_hour), gpus)


class PeriodLike(Protocol):
    """What the meter reads of a billed period: a `HostPeriod`, or a row of its columns."""

    @property
    def state(self) -> str: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def ended_at(self) -> datetime | None: ...
    @property
    def gpus(self) -> int: ...
    @property
    def usd_per_hour(self) -> float: ...


def _period_share(p: PeriodLike) -> Fraction | None:
    """A running period's exact GPU share per hour, as `bot.domain.metering` takes it (None:
    stopped or GPU-less, so no usage covers any of it)."""
    if p.state != "running" or p.gpus == 0:
        return None
    return _share(p.usd_per_hour, p.gpus)


# A host's running periods as the meter reads them: (start, end or None, GPU share), in
# epoch microseconds.
_Spans = Sequence[tuple[int, int | None, Fraction]]
_HOUR_US = 3_600_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _running_spans(periods: Iterable[PeriodLike]) -> list[tuple[int, int | None, Fraction]]:
    out = []
    for p in periods:
        share = _period_share(p)
        if share is not None:
            end = None if p.ended_at is None else epoch_us(p.ended_at)
            out.append((epoch_us(p.started_at), end, share))
    return out


def _covered(
    spans: Sequence[tuple[int, int | None, Fraction, bool]], a: int, b: int, own: int
) -> int:
    """[a, b) of one GPU at each overlapping running period's share: what it takes off
    the idle overhead (bot.domain.metering.idle_overhead, cut the same way). `own` is
    what the piece itself costs: a period whose share is the interval's own rate
    (flagged True) and covers the whole piece meters exactly that, with no reading."""
    total = 0
    for start, end, share, same in spans:
        lo = max(a, start)
        hi = b if end is None else min(b, end)
        if hi > lo:
            if same and lo == a and hi == b:
                total += own
            else:
                total += reading(share, hi) - reading(share, lo)
    return total


@functools.lru_cache(maxsize=1 << 16)
def _hour(h_us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=h_us)


def _pieces(
    iv: ClosedUsage, spans: _Spans, t: int | None = None
) -> Iterable[tuple[int, RollupKey, Sums]]:
    """One closed interval, cut at UTC hours: (hour in epoch microseconds, key, sums) for
    each piece. In integer microseconds on the meter's own
    clock (`bot.domain.metering.reading`): the same sums as metering each piece's times,
    without the datetimes, which were most of a rebuild's time over a million intervals."""
    assert iv.ended_at is not None
    rate = _rate(iv)
    if t is None:  # the start in epoch microseconds, when the caller has not got it yet
        t = epoch_us(iv.started_at)
    end = epoch_us(iv.ended_at)
    tail = (iv.user_id, iv.host_id, iv.market, iv.run_id or 0)
    # The host's running periods that overlap the interval, each flagged when it meters
    # at the interval's own rate (a GPU's share of its host's price, as usual). Fractions
    # are kept in lowest terms, so equal ones have equal terms (Fraction.__eq__ was a
    # tenth of a rebuild).
    live = [
        (s, e, share, (share.numerator, share.denominator) == (rate.numerator, rate.denominator))
        for s, e, share in spans
        if s < end and (e is None or e > t)
    ]
    at = reading(rate, t)
    while t < end:
        h = t - t % _HOUR_US
        b = min(end, h + _HOUR_US)
        bt = reading(rate, b)
        yield h, (_hour(h), *tail), Sums(bt - at, b - t, _covered(live, t, b, bt - at))
        t, at = b, bt


def _periods_for(
    s: Session, ivs: Sequence[ClosedUsage]
) -> tuple[dict[int, list[PeriodLike]], dict[int, str]]:
    """The billed periods of the intervals' hosts that overlap them, and the hosts'
    instance types (as the day rows key them), in one query: a release ran one for each.
    Plain columns, not `HostPeriod` objects: the meter reads five of them, and building
    the objects was most of this step's time on every release."""
    if not ivs:
        return {}, {}
    rows = s.connection().execute(
        _periods_stmt(),
        {
            "b_start": min(iv.started_at for iv in ivs),
            "b_end": max(iv.ended_at or iv.started_at for iv in ivs),
            "b_hosts": sorted({iv.host_id for iv in ivs}),
        },
    )
    out: dict[int, list[PeriodLike]] = defaultdict(list)
    itype: dict[int, str] = {}
    for row in rows:
        itype[row.id] = row.instance_type or ""
        if row.state is not None:  # the outer join's empty side: no period overlaps
            out[row.id].append(row)
    return out, itype


@functools.cache
def _periods_stmt() -> Any:
    """_periods_for's query, built once (bound parameters): building it was a tenth of a
    release's CPU."""
    start = bindparam("b_start", type_=UTCDateTime)
    end = bindparam("b_end", type_=UTCDateTime)
    overlapping = and_(
        col(HostPeriod.host_id) == col(Host.id),
        col(HostPeriod.started_at) < end,
        col(HostPeriod.ended_at).is_(None) | (col(HostPeriod.ended_at) > start),
    )
    columns: tuple[Any, ...] = (
        Host.id,
        Host.instance_type,
        HostPeriod.state,
        HostPeriod.started_at,
        HostPeriod.ended_at,
        HostPeriod.gpus,
        HostPeriod.usd_per_hour,
    )
    return (
        select(*columns)
        .join(HostPeriod, overlapping, isouter=True)
        .where(col(Host.id).in_(bindparam("b_hosts", expanding=True)))
    )


# The key columns of each rollup table, in the order of HourKey, DayKey and RunKey, and
# the sums each keeps.
_HOUR_KEY = ("hour", "user_id", "market", "instance_type")
_DAY_KEY = ("day", "user_id", "market", "instance_type")
_RUN_KEY = ("hour", "run_id")
_RUN_DAY_KEY = ("day", "run_id")
Rollup = UsageRollup | UsageRollupDay | RunRollup | RunRollupDay
_KEYS: dict[type[Rollup], tuple[str, ...]] = {
    UsageRollup: _HOUR_KEY,
    UsageRollupDay: _DAY_KEY,
    RunRollup: _RUN_KEY,
    RunRollupDay: _RUN_DAY_KEY,
}


_SUMMED = ("micro_usd", "held_us", "covered_micro")
_RUN_SUMMED = ("micro_usd", "held_us")


@dataclass
class Rolled:
    """Pieces of closed usage summed as the four tables keep them: per person (hours and
    days, each per market and instance type) and per run (hours and days)."""

    hours: dict[HourKey, Sums] = field(default_factory=dict)
    days: dict[DayKey, Sums] = field(default_factory=dict)
    runs: dict[RunKey, Sums] = field(default_factory=dict)
    run_days: dict[RunDayKey, Sums] = field(default_factory=dict)

    def add(self, itype: Mapping[int, str], pieces: Iterable[tuple[RollupKey, Sums]]) -> None:
        """Adds pieces, each host read as its instance type (`instance_types`)."""
        hours, days = self.hours, self.days
        for (hour, user, host, market, run), v in pieces:
            kind = itype.get(host, "")
            day = floor_day(hour)
            _add(hours, (hour, user, market, kind), v)
            _add(days, (day, user, market, kind), v)
            if run:
                _add_run(self.runs, (hour, run), v)
                _add_run(self.run_days, (day, run), v)


def _add_run(into: dict[Any, Sums], key: Any, v: Sums) -> None:
    """A run's rows keep the money and the time, not what the idle overhead reads."""
    got = into.get(key)
    if got is None:
        into[key] = Sums(v.micro_usd, v.held_us)
    else:
        got.micro_usd += v.micro_usd
        got.held_us += v.held_us


def _add(into: dict[Any, Sums], key: Any, v: Sums) -> None:
    got = into.get(key)
    if got is None:
        into[key] = Sums(v.micro_usd, v.held_us, v.covered_micro)
    else:
        got.add(v)


@functools.cache
def _upsert(
    dialect: str, table: type[Rollup], fields: tuple[str, ...], summed: tuple[str, ...]
) -> Any:
    """INSERT ... ON CONFLICT (the key) DO UPDATE adding the sums, built once per dialect
    and table: building it was most of a release's time in rollups."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(table)
    c = stmt.table.c
    return stmt.on_conflict_do_update(
        index_elements=list(fields),
        set_={name: c[name] + getattr(stmt.excluded, name) for name in summed},
    )


def _add_rows(
    s: Session,
    table: type[Rollup],
    fields: tuple[str, ...],
    sums: Mapping[tuple[Any, ...], Sums],
    summed: tuple[str, ...] = _SUMMED,
) -> None:
    """Adds to existing rows or makes new ones, of any rollup table: `fields` name the
    key's columns in order (the table's unique key), `summed` the sums it keeps. One
    upsert (INSERT ... ON CONFLICT DO UPDATE, on SQLite as on PostgreSQL) instead of
    reading the rows and writing each back: closing a reservation ran four statements
    more for two tables. The caller holds the pool (db.session.lock_pool), so nobody else
    adds to the same rows meanwhile."""
    if not sums:
        return
    rows = [
        {
            **dict(zip(fields, key, strict=True)),
            **{name: getattr(add, name) for name in summed},
        }
        for key, add in sums.items()
    ]
    # Through the connection (Core): the Session would run it through the ORM's bulk
    # insert path, about as much CPU again as the statement itself.
    conn = s.connection()
    conn.execute(_upsert(conn.dialect.name, table, fields, summed), rows)


def day_sums(hours: Mapping[HourKey, Sums]) -> dict[DayKey, Sums]:
    """Hourly rows gathered by UTC day (what the day rows must hold)."""
    days: dict[DayKey, Sums] = {}
    for (hour, user, market, kind), v in hours.items():
        _add(days, (floor_day(hour), user, market, kind), v)
    return days


def _sums(
    ivs: Sequence[ClosedUsage], periods: dict[int, list[PeriodLike]]
) -> dict[RollupKey, Sums]:
    sums: dict[RollupKey, Sums] = defaultdict(Sums)
    spans = {h: _running_spans(ps) for h, ps in periods.items()}
    for iv in ivs:
        for _, key, piece in _pieces(iv, spans.get(iv.host_id, [])):
            sums[key].add(piece)
    return sums


@functools.cache
def _fair_share_upsert(dialect: str) -> Any:
    """INSERT ... ON CONFLICT (user) DO UPDATE that brings the kept counter and the
    addition to the later of their two instants and adds them (`db.decay.decayed`, in
    SQL), built once per dialect: the counter is never read back first."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(FairShareUsage)
    kept, new = stmt.table.c, stmt.excluded
    later = case((new.as_of > kept.as_of, new.as_of), else_=kept.as_of)
    return stmt.on_conflict_do_update(
        index_elements=["user_id"],
        set_={
            "decayed_s": decayed(kept.decayed_s, kept.as_of, later, new.half_life_s)
            + decayed(new.decayed_s, new.as_of, later, new.half_life_s),
            "as_of": later,
        },
    )


def _add_fair_share(s: Session, ivs: Sequence[ClosedInterval]) -> None:
    """Adds each closed interval's GPU-seconds to its user's decayed counter, weighed as
    the scheduler weighs it: by how long ago it ended. One upsert for all the users, with
    the decay in SQL: every release ran a read of the counters and a write of each.
    Core, not the ORM: a counter this session has loaded is not refreshed (nothing that
    closes intervals reads one)."""
    # Each user's GPU-seconds here decayed to the last of their ends, as the rebuild
    # keeps a counter (`fair_share_of`); the upsert then meets the kept counter at the
    # later of the two instants.
    ends = sorted(
        (iv.ended_at, iv.id or 0, iv.started_at, iv.user_id)
        for iv in ivs
        if iv.ended_at is not None
    )
    added = fair_share_of((ended, started, user) for ended, _, started, user in ends)
    if not added:
        return
    rows = [
        {"user_id": u, "decayed_s": value, "as_of": as_of, "half_life_s": FAIR_SHARE_HALF_LIFE_S}
        for u, (value, as_of) in added.items()
    ]
    conn = s.connection()
    conn.execute(_fair_share_upsert(conn.dialect.name), rows)


def on_closed(s: Session, ivs: Sequence[ClosedInterval]) -> None:
    """Rolls up intervals just closed, in the caller's transaction (the one that closed
    them, with the pool held)."""
    closed = [iv for iv in ivs if iv.ended_at is not None]
    if not closed:
        return
    s.info[_CLOSED] = closed_in(s) + len(closed)
    periods, itype = _periods_for(s, closed)
    rolled = Rolled()
    rolled.add(itype, _sums(closed, periods).items())
    _add_rows(s, UsageRollup, _HOUR_KEY, rolled.hours)
    _add_rows(s, UsageRollupDay, _DAY_KEY, rolled.days)
    _add_rows(s, RunRollup, _RUN_KEY, rolled.runs, _RUN_SUMMED)
    _add_rows(s, RunRollupDay, _RUN_DAY_KEY, rolled.run_days, _RUN_SUMMED)
    _add_fair_share(s, closed)


_CLOSED = "gpubot.closed"  # Session.info: how many intervals this transaction closed


def closed_in(s: Session) -> int:
    """How many intervals this session's transaction has closed so far: a reader that
    keeps a figure for the transaction keys it by this (bot.app.money.budgets)."""
    return int(s.info.get(_CLOSED, 0))


# --- rebuild and compare ------------------------------------------------------------------

# Rows fetched at a time when streaming the intervals.
_BATCH = 5000


class ClosedRow(NamedTuple):
    """A closed interval's columns (`ClosedUsage`), as a plain row (a tuple: a rebuild
    makes a million of them)."""

    started_at: datetime
    ended_at: datetime | None
    user_id: int
    host_id: int
    market: str
    run_id: int | None
    usd_per_hour: float


class HourlyRollups:
    """Hourly rollup rows of closed intervals given in the order they started, each
    hour's rows handed out as soon as no interval still to come can add to it (each
    starts no earlier than the last one given). Memory stays that of the hours still
    open, not that of a million intervals and their rollups (a rebuild, the bench)."""

    def __init__(self, periods: Iterable[HostPeriod]) -> None:
        by_host: dict[int, list[HostPeriod]] = defaultdict(list)
        for p in periods:
            by_host[p.host_id].append(p)
        self._spans = {h: _running_spans(ps) for h, ps in by_host.items()}
        # Hour (epoch microseconds) -> its rows so far.
        self._open: dict[int, dict[RollupKey, Sums]] = {}
        self._oldest: int | None = None  # the earliest hour in _open

    def add(self, iv: ClosedUsage) -> list[tuple[RollupKey, Sums]]:
        """Adds one interval; returns the rows of the hours now final."""
        done: list[tuple[RollupKey, Sums]] = []
        t = epoch_us(iv.started_at)
        first = t - t % _HOUR_US
        if self._oldest is not None and self._oldest < first:
            for hour in sorted(h for h in self._open if h < first):
                done += self._open.pop(hour).items()
            self._oldest = min(self._open, default=None)
        if self._oldest is None or first < self._oldest:
            self._oldest = first
        opened = self._open
        for h, key, piece in _pieces(iv, self._spans.get(iv.host_id, ()), t):
            bucket = opened.get(h)
            if bucket is None:
                bucket = opened[h] = {}
            got = bucket.get(key)
            if got is None:
                bucket[key] = piece
            else:
                got.add(piece)
        return done

    def rest(self) -> list[tuple[RollupKey, Sums]]:
        """The rows of the hours still open, once every interval was given."""
        done: list[tuple[RollupKey, Sums]] = []
        for hour in sorted(self._open):
            done += self._open.pop(hour).items()
        self._oldest = None
        return done


def iter_computed_rollups(s: Session) -> Iterator[tuple[RollupKey, Sums]]:
    """Every hourly rollup row as the raw closed intervals say it should be, in hour
    order, streamed (`HourlyRollups`): the intervals are read once, by start, as plain
    rows."""
    rollups = HourlyRollups(s.exec(select(HostPeriod)).all())
    columns: tuple[Any, ...] = (
        UsageInterval.started_at,
        UsageInterval.ended_at,
        UsageInterval.user_id,
        UsageInterval.host_id,
        UsageInterval.market,
        UsageInterval.run_id,
        UsageInterval.usd_per_hour,
    )
    stmt: Any = (
        select(*columns)
        .where(col(UsageInterval.ended_at).is_not(None))
        .order_by(col(UsageInterval.started_at), col(UsageInterval.id))
        .execution_options(yield_per=_BATCH)
    )
    for row in s.exec(stmt):
        yield from rollups.add(ClosedRow(*row))
    yield from rollups.rest()


def computed_fair_share(s: Session) -> dict[int, tuple[float, datetime]]:
    """Each user's fair-share counter as the raw closed intervals say it should be: the
    intervals streamed in the order they ended (then by id), as the counters are kept."""
    columns: tuple[Any, ...] = (
        UsageInterval.ended_at,
        UsageInterval.started_at,
        UsageInterval.user_id,
    )
    stmt: Any = (
        select(*columns)
        .where(col(UsageInterval.ended_at).is_not(None))
        .order_by(col(UsageInterval.ended_at), col(UsageInterval.id))
        .execution_options(yield_per=_BATCH)
    )
    return fair_share_of(s.exec(stmt))


def fair_share_of(
    ends: Iterable[tuple[datetime, datetime, int]],
) -> dict[int, tuple[float, datetime]]:
    """The counters for closed intervals given as (ended, started, user) in the order
    they ended."""
    counters = FairShareCounters()
    for ended_at, started_at, user_id in ends:
        counters.add(ended_at, started_at, user_id)
    return counters.fair


class FairShareCounters:
    """The counters built one closed interval at a time, in the order they ended
    (`fair_share_of`; the history bench feeds it as it generates)."""

    def __init__(self) -> None:
        self.fair: dict[int, tuple[float, datetime]] = {}

    def add(self, ended_at: datetime, started_at: datetime, user_id: int) -> None:
        secs = max(0.0, (ended_at - started_at).total_seconds())
        prev = self.fair.get(user_id)
        if prev is None:
            self.fair[user_id] = (secs, ended_at)
        else:
            value, as_of = prev
            h = FAIR_SHARE_HALF_LIFE_S
            self.fair[user_id] = (
                decay(value, (ended_at - as_of).total_seconds(), h) + secs,
                ended_at,
            )


def computed_rollups(s: Session) -> tuple[Rolled, dict[int, tuple[float, datetime]]]:
    """Every rollup row and fair-share counter as the raw closed intervals say they should
    be (what the tests compare with what was kept)."""
    rolled = Rolled()
    rolled.add(instance_types(s), iter_computed_rollups(s))
    return rolled, computed_fair_share(s)


def instance_types(s: Session, host_ids: Iterable[int] | None = None) -> dict[int, str]:
    """Each host's instance type ("" for machines without one), as the rows key it."""
    columns: tuple[Any, ...] = (Host.id, Host.instance_type)
    stmt: Any = select(*columns)
    if host_ids is not None:
        stmt = stmt.where(col(Host.id).in_(set(host_ids)))
    return {host_id: instance_type or "" for host_id, instance_type in s.exec(stmt)}


def stored_rollups(s: Session) -> tuple[Rolled, dict[int, tuple[float, datetime]]]:
    """The rollup rows and counters as kept, in the shape `computed_rollups` returns."""
    rolled = Rolled(
        hours={
            (r.hour, r.user_id, r.market, r.instance_type): Sums(
                r.micro_usd, r.held_us, r.covered_micro
            )
            for r in s.exec(select(UsageRollup)).all()
        },
        days={
            (r.day, r.user_id, r.market, r.instance_type): Sums(
                r.micro_usd, r.held_us, r.covered_micro
            )
            for r in s.exec(select(UsageRollupDay)).all()
        },
        runs={(r.hour, r.run_id): Sums(r.micro_usd, r.held_us) for r in s.exec(select(RunRollup))},
        run_days={
            (r.day, r.run_id): Sums(r.micro_usd, r.held_us) for r in s.exec(select(RunRollupDay))
        },
    )
    fair = {r.user_id: (r.decayed_s, r.as_of) for r in s.exec(select(FairShareUsage)).all()}
    return rolled, fair


def rebuild_rollups(s: Session) -> int:
    """Throws the rollups and counters away and recomputes them from the intervals (after
    an upgrade from before rollups, or a repair), and the finished runs' times with them
    (bot.app.runtimes). Returns how many hourly rollup rows it wrote. Run it with the
    pool held or the bot stopped, so nothing closes meanwhile. Streamed
    (`iter_computed_rollups`): the rows are written in batches as they are final."""
    s.execute(delete(UsageRollup))
    s.execute(delete(UsageRollupDay))
    s.execute(delete(RunRollup))
    s.execute(delete(RunRollupDay))
    s.execute(delete(FairShareUsage))
    written = write_rollups(s, iter_computed_rollups(s), computed_fair_share(s))
    rebuild_run_times(s)
    return written


# What writes many rows (db.session.insert_rows, or the history bench's loader, which
# does it on a thread of its own while the rows are being computed).
Inserter = Callable[[Session, Any, Sequence[str], Sequence[Sequence[Any]]], None]


def write_rollups(
    s: Session,
    pieces: Iterable[tuple[RollupKey, Sums]],
    fair: Mapping[int, tuple[float, datetime]],
    insert: Inserter = insert_rows,
) -> int:
    """Inserts the rows of pieces given an hour at a time, in hour order (as
    `HourlyRollups` hands them out), into empty tables, a UTC day at a time as each is
    complete (memory stays a day's rows, not a year's runs), in batches through `insert`;
    then the counters. Returns how many hourly rows. The rebuild's and the bench's."""
    itype = instance_types(s)
    batches: dict[type[Rollup], list[tuple[Any, ...]]] = {
        UsageRollup: [],
        UsageRollupDay: [],
        RunRollup: [],
        RunRollupDay: [],
    }
    written = 0
    day: Rolled | None = None
    today: datetime | None = None

    def send(table: type[Rollup], force: bool = False) -> None:
        # A batch is handed over whole (`insert` may write it on another thread, as the
        # history bench's does): the next rows go into a new list.
        rows = batches[table]
        if rows and (force or len(rows) >= _BATCH):
            person = table in (UsageRollup, UsageRollupDay)
            _insert_rows(s, table, _KEYS[table], rows, insert, _SUMMED if person else _RUN_SUMMED)
            batches[table] = []

    def done(rolled: Rolled) -> None:
        nonlocal written
        written += len(rolled.hours)
        for table, rows in (
            (UsageRollup, rolled.hours),
            (UsageRollupDay, rolled.days),
            (RunRollup, rolled.runs),
            (RunRollupDay, rolled.run_days),
        ):
            if table in (UsageRollup, UsageRollupDay):
                batches[table].extend((*k, *_values(v)) for k, v in rows.items())
            else:
                batches[table].extend((*k, v.micro_usd, v.held_us) for k, v in rows.items())
            send(table)

    for key, v in pieces:
        if day is None or floor_day(key[0]) != today:
            if day is not None:
                done(day)
            day, today = Rolled(), floor_day(key[0])
        day.add(itype, ((key, v),))
    if day is not None:
        done(day)
    for table in batches:
        send(table, force=True)
    if fair:
        insert(
            s,
            FairShareUsage.__table__,  # type: ignore[attr-defined]
            ("user_id", "decayed_s", "as_of", "half_life_s"),
            [(u, value, as_of, FAIR_SHARE_HALF_LIFE_S) for u, (value, as_of) in fair.items()],
        )
    return written


def _insert_rows(
    s: Session,
    table: type[Rollup],
    key: tuple[str, ...],
    rows: list[tuple[Any, ...]],
    insert: Inserter,
    summed: tuple[str, ...] = _SUMMED,
) -> None:
    """Many rows, (*key, *summed) each, into a rollup table (db.session.insert_rows:
    the driver's executemany on SQLite, COPY on PostgreSQL)."""
    if rows:
        insert(s, table.__table__, (*key, *summed), rows)  # type: ignore[union-attr]


def _values(v: Sums) -> tuple[int, int, int]:
    return v.micro_usd, v.held_us, v.covered_micro


def backfill_rollups(engine: Engine) -> int | None:
    """On start: a database upgraded from before rollups has closed intervals and no
    rollups, and its costs would miss that history; rebuild once, under the pool.
    Returns the rows written, or None when nothing needed doing (one cheap query)."""
    with transaction(engine) as s:
        if s.exec(select(UsageRollup.id).limit(1)).first() is None:
            closed = select(UsageInterval.id).where(col(UsageInterval.ended_at).is_not(None))
            if s.exec(closed.limit(1)).first() is not None:
                lock_pool(s)
                return rebuild_rollups(s)
        # Upgraded from before the run times were kept (migration 0011): once, from the runs.
        backfill_run_times(s)
        return None


# --- fair share ---------------------------------------------------------------------------


def fair_share_usage(
    s: Session,
    now: datetime,
    half_life_s: float,
    held: Iterable[tuple[str, datetime]] | None = None,
) -> dict[str, float] | None:
    """Each user's decayed GPU-seconds at `now`: the kept counters decayed to now, plus
    what is held now at full weight. None when the counters were kept at another
    half-life (the caller then computes from the intervals). Unlike the old read of 56
    days of rows, nothing is cut off: usage older than eight half-lives still counts,
    at under 1/256 of its weight. `held`: (user key, start) of every open interval, when
    the caller read them already (the tick's dispatch does), sparing a query."""
    usage: dict[str, float] = {}
    conn = s.connection()
    columns: tuple[Any, ...] = (
        User.key,
        FairShareUsage.decayed_s,
        FairShareUsage.as_of,
        FairShareUsage.half_life_s,
    )
    for key, decayed_s, as_of, kept_half_life in conn.execute(
        select(*columns).join(User, col(User.id) == col(FairShareUsage.user_id))
    ):
        if kept_half_life != half_life_s:
            return None
        usage[key] = decay(decayed_s, (now - as_of).total_seconds(), half_life_s)
    if held is None:
        open_columns: tuple[Any, ...] = (User.key, UsageInterval.started_at)
        held = conn.execute(
            select(*open_columns)
            .join(User, col(User.id) == col(UsageInterval.user_id))
            .where(col(UsageInterval.ended_at).is_(None))
        ).all()
    for key, started in held:
        usage[key] = usage.get(key, 0.0) + max(0.0, (now - started).total_seconds())
    return usage
