"""What everyone's GPU time cost, from usage intervals and the instances' own bills.

Pure on purpose: no database, no I/O, no clock. The service loads the intervals and
passes `now`, so the digest, budgets and the simulator all get the same numbers and
the tests can check them by hand.

How money is counted, and why:

* Every price is per hour; every interval is charged for the part of it that lies in
  the window and before `now` (an open interval, `end=None`, runs up to `now`; nothing
  is ever charged for time after `now`). Every datetime is normalised to UTC on entry,
  so wall-clock arithmetic never leaks in across a DST change.
* Money is kept in whole micro-dollars and handed out as `Decimal` with six places, so
  sums are exact; round to cents only when showing a number (`to_cents`).
* Each rate has a *meter*: its reading at instant t is `rate * (t - 1970) / 1h` rounded
  to the micro-dollar, and an interval costs the difference of the two readings. Like a
  utility meter, splitting an interval anywhere changes nothing (the readings
  telescope), so per-user costs plus idle overhead add up to the instances' bill
  exactly, and a week is exactly the sum of its days. Each interval is off the exact
  product by less than one micro-dollar.
* An instance is metered as its GPU slots, each at its share of the hourly price; the
  time a slot runs with nobody holding it is the team's idle overhead. A stopped
  instance costs only its storage, all of which is idle overhead.

The exact identity `sum(cost_by_user) + idle_overhead == host_cost` holds whenever each
usage is priced at its host's GPU share and lies inside a running period of that host,
and no GPU is held twice at once. A GPU share that is not a finite decimal (a price
split three ways) cannot be recorded exactly; AWS's 1-, 2-, 4- and 8-GPU prices can.
"""

from __future__ import annotations

import calendar
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from provisioning.costs import HOURS_PER_MONTH, gpu_share

UsageKind = Literal["reservation", "run"]
HostState = Literal["running", "stopped"]
Period = Literal["today", "week", "month"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_MICRO_USD = Decimal("0.000001")
_CENT = Decimal("0.01")


def _utc(t: datetime, what: str) -> datetime:
    if t.tzinfo is None or t.utcoffset() is None:
        raise ValueError(f"{what} must be an aware datetime (got naive {t.isoformat()})")
    return t.astimezone(UTC)


def _utc_or_none(t: datetime | None, what: str) -> datetime | None:
    return None if t is None else _utc(t, what)


def _check_rate(rate: Decimal, what: str) -> None:
    if not isinstance(rate, Decimal) or not rate.is_finite() or rate < 0:
        raise ValueError(f"{what} must be a finite, non-negative Decimal (got {rate!r})")


@dataclass(frozen=True)
class Usage:
    """One GPU held by one user, from `start` to `end` (None: still held)."""

    user: str  # the user's key (Slack id or shell name); costs are grouped by it
    gpu_id: int  # which GPU (db Gpu.id); a GPU is held by at most one usage at a time
    host_id: int  # the host that GPU is on, to match the host's periods
    start: datetime
    end: datetime | None
    usd_per_hour: Decimal  # this GPU's share of its host's hourly price, at its market
    kind: UsageKind
    ref_id: int  # the reservation's or the run's id

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _utc(self.start, "Usage.start"))
        object.__setattr__(self, "end", _utc_or_none(self.end, "Usage.end"))
        if self.end is not None and self.end < self.start:
            raise ValueError(f"usage of GPU {self.gpu_id} ends before it starts")
        _check_rate(self.usd_per_hour, "Usage.usd_per_hour")
        if self.kind not in ("reservation", "run"):
            raise ValueError(f"Usage.kind must be 'reservation' or 'run', not {self.kind!r}")


@dataclass(frozen=True)
class HostPeriod:
    """A stretch of one instance's own bill in one state at one price.

    A host's history is a sequence of these: a new one starts whenever it is stopped,
    started again, or changes price (a spot price is per period).
    """

    host_id: int
    gpus: int  # GPU slots the price is split over (0: no GPUs; all of it is idle)
    usd_per_hour: Decimal  # the whole instance while running (on-demand or spot price)
    state: HostState
    start: datetime
    end: datetime | None  # None: still in this state
    storage_usd_per_hour: Decimal = Decimal(0)  # its volumes while stopped

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _utc(self.start, "HostPeriod.start"))
        object.__setattr__(self, "end", _utc_or_none(self.end, "HostPeriod.end"))
        if self.end is not None and self.end < self.start:
            raise ValueError(f"period of host {self.host_id} ends before it starts")
        if self.gpus < 0:
            raise ValueError(f"HostPeriod.gpus must be >= 0 (got {self.gpus})")
        _check_rate(self.usd_per_hour, "HostPeriod.usd_per_hour")
        _check_rate(self.storage_usd_per_hour, "HostPeriod.storage_usd_per_hour")
        if self.state not in ("running", "stopped"):
            raise ValueError(f"HostPeriod.state must be 'running' or 'stopped', not {self.state!r}")

    @property
    def gpu_share_usd_per_hour(self) -> Fraction:
        """Exact, so that a share that is no finite decimal still adds up to the price."""
        return gpu_share(Fraction(self.usd_per_hour), self.gpus)


@dataclass(frozen=True)
class Window:
    """The half-open stretch of time [start, end) being costed."""

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _utc(self.start, "Window.start"))
        object.__setattr__(self, "end", _utc(self.end, "Window.end"))
        if self.end < self.start:
            raise ValueError("Window.end is before Window.start")

    @property
    def hours(self) -> Decimal:
        return Decimal((self.end - self.start) // _MICROSECOND) / Decimal(3_600_000_000)


# --- the meter ----------------------------------------------------------------------


def _us(t: datetime) -> int:
    return (t - _EPOCH) // _MICROSECOND


def _reading(rate: Fraction, t_us: int) -> int:
    # usd/h * us / (3.6e9 us/h) * 1e6 micro-usd/usd = rate * t_us / 3600, rounded half to
    # even (as round() of that Fraction), in integers: building the Fractions was most of
    # the time of a rollup rebuild over a million intervals.
    den = rate.denominator * 3600
    q, r = divmod(rate.numerator * t_us, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    return q


def epoch_us(t: datetime) -> int:
    """Microseconds since the epoch of an aware time: the meter's own clock. A time in
    UTC, as the database hands them back, skips the check and the conversion (a rollup
    rebuild asks this twice per interval)."""
    if t.tzinfo is UTC:
        return (t - _EPOCH) // _MICROSECOND
    return _us(_utc(t, "t"))


# The meter at `t_us` (epoch microseconds) for `rate` per hour: what [a, b) costs is
# `reading(b) - reading(a)`, exactly as `metered_micro` says. For callers that cut many
# pieces (rollups) and keep their times as integers; the function itself, not a wrapper.
reading = _reading


def _metered(rate: Fraction, a_us: int, b_us: int) -> int:
    """Micro-dollars for [a, b) at `rate` per hour: the difference of two readings."""
    if b_us <= a_us or rate == 0:
        return 0
    return _reading(rate, b_us) - _reading(rate, a_us)


def metered_micro(rate: Decimal | Fraction, start: datetime, end: datetime) -> int:
    """Micro-dollars for [start, end) at `rate` per hour, by the same meter as every cost
    here: pieces cut anywhere add up to the whole exactly (what rollups rely on)."""
    exact = rate if isinstance(rate, Fraction) else Fraction(rate)
    return _metered(exact, _us(_utc(start, "start")), _us(_utc(end, "end")))


def _clip(
    start: datetime, end: datetime | None, window: Window, now: datetime
) -> tuple[int, int] | None:
    """The part of [start, end or now) inside the window and before now, in microseconds."""
    a = max(start, window.start)
    b = min(now if end is None else end, window.end, now)
    if b <= a:
        return None
    return _us(a), _us(b)


def _usd(micro: int) -> Decimal:
    return Decimal(micro).scaleb(-6)


# --- costs --------------------------------------------------------------------------


def cost_by_user(usages: Iterable[Usage], window: Window, now: datetime) -> dict[str, Decimal]:
    """Each user's cost in the window. Users whose usages all fall outside it are absent."""
    now = _utc(now, "now")
    micro: dict[str, int] = defaultdict(int)
    for u in usages:
        span = _clip(u.start, u.end, window, now)
        if span is not None:
            micro[u.user] += _metered(Fraction(u.usd_per_hour), *span)
    return {user: _usd(m) for user, m in sorted(micro.items())}


def cost_by_ref(
    usages: Iterable[Usage], window: Window, now: datetime
) -> dict[tuple[UsageKind, int], Decimal]:
    """Cost per reservation or run, for "what did this job cost" replies."""
    now = _utc(now, "now")
    micro: dict[tuple[UsageKind, int], int] = defaultdict(int)
    for u in usages:
        span = _clip(u.start, u.end, window, now)
        if span is not None:
            micro[(u.kind, u.ref_id)] += _metered(Fraction(u.usd_per_hour), *span)
    return {ref: _usd(m) for ref, m in sorted(micro.items())}


def _period_micro(p: HostPeriod, span: tuple[int, int]) -> int:
    if p.state == "stopped":
        return _metered(Fraction(p.storage_usd_per_hour), *span)
    slots = max(p.gpus, 1)
    return slots * _metered(p.gpu_share_usd_per_hour, *span)


def host_cost(host_periods: Iterable[HostPeriod], window: Window, now: datetime) -> Decimal:
    """What the instances cost in the window: running at their price, stopped at storage."""
    now = _utc(now, "now")
    total = 0
    for p in host_periods:
        span = _clip(p.start, p.end, window, now)
        if span is not None:
            total += _period_micro(p, span)
    return _usd(total)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of spans, so that time on a GPU held twice is still only covered once."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def idle_overhead(
    host_periods: Iterable[HostPeriod], usages: Iterable[Usage], window: Window, now: datetime
) -> Decimal:
    """The team's cost that nobody holds: idle running GPU slots plus stopped storage.

    It is computed from the hosts' side (running GPU time not covered by any usage, at
    the host's GPU share), not as a remainder, so that the invariant with
    `cost_by_user` is a real check on both.
    """
    now = _utc(now, "now")
    covered: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for u in usages:
        span = _clip(u.start, u.end, window, now)
        if span is not None:
            covered[u.host_id][u.gpu_id].append(span)
    merged = {
        host: {gpu: _merged(spans) for gpu, spans in gpus.items()} for host, gpus in covered.items()
    }
    total = 0
    for p in host_periods:
        span = _clip(p.start, p.end, window, now)
        if span is None:
            continue
        total += _period_micro(p, span)
        if p.state != "running" or p.gpus == 0:
            continue
        pa, pb = span
        share = p.gpu_share_usd_per_hour
        for spans in merged.get(p.host_id, {}).values():
            for a, b in spans:
                total -= _metered(share, max(a, pa), min(b, pb))
    return _usd(total)


def storage_usd_per_hour(volume_gb: Decimal, usd_per_gb_month: Decimal) -> Decimal:
    """The hourly rate of a volume priced per GB-month (`provisioning.costs`'s month).

    Kept to 12 decimal places (a pico-dollar an hour): a month of it is then off by
    under a billionth of a dollar, and the rate stays a plain Decimal.
    """
    rate = volume_gb * usd_per_gb_month / HOURS_PER_MONTH
    return rate.quantize(Decimal("1E-12"))


def to_cents(usd: Decimal) -> Decimal:
    """For display only: sums are made from the unrounded values."""
    return usd.quantize(_CENT, rounding=ROUND_HALF_UP)


def money(usd: Decimal | float) -> str:
    """A sum as the replies show it: dollars to the cent (`to_cents`), thousands apart."""
    exact = usd if isinstance(usd, Decimal) else Decimal(str(usd))
    return f"${to_cents(exact):,.2f}"


# --- calendar windows ---------------------------------------------------------------


def period_window(period: Period, now: datetime, tz: str) -> Window:
    """The calendar day, ISO week (from Monday 00:00) or month containing `now`, in `tz`.

    Boundaries are local midnights, so a week with a DST change is 167 or 169 hours long
    and a day 23 or 25. A local midnight that a DST jump skips maps to the first instant
    after the gap (zoneinfo's reading of a non-existent time with fold=0).
    """
    try:
        zone = ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {tz!r} (use an IANA name like Europe/Berlin)") from exc
    local = _utc(now, "now").astimezone(zone)
    day = local.date()
    if period == "today":
        first = day
        after = day + timedelta(days=1)
    elif period == "week":
        first = day - timedelta(days=day.weekday())
        after = first + timedelta(days=7)
    elif period == "month":
        first = day.replace(day=1)
        after = first + timedelta(days=calendar.monthrange(day.year, day.month)[1])
    else:
        raise ValueError(f"period must be 'today', 'week' or 'month', not {period!r}")
    return Window(_midnight(first, zone), _midnight(after, zone))


def _midnight(d: date, zone: ZoneInfo) -> datetime:
    return datetime(d.year, d.month, d.day, tzinfo=zone)
