"""What the week's money was wasted on, and what one setting would have saved.

Why: a digest that only reports leaves the reader to guess what to change. This names the
week's largest wastes, each from the same records the bill is made of:

* idle instances: each rented host's idle overhead (its bill less the GPU time anybody
  held on it, metered by `bot.domain.metering.idle_overhead`, so they add up to the
  digest's idle overhead) and the hours it ran with nobody on any of its GPUs;
* reservations held idle: reservation samples under `idle_util_pct`, per reservation, at
  the held GPU's rate (the digest's "idle waste", by reservation instead of by person);
* runs that failed or were cancelled after a long stretch (`LOST_AFTER`): their GPU time;
* spot missed: on-demand GPU time of runs that checkpoint (`--checkpoints`, so they
  could have resumed after an interruption), priced at the catalog's spot share. This is
  a price, not a replay: the simulator has no spot market that interrupts.

and then computes, not guesses, what a setting would have saved: the week's runs
(`bot.app.money.history_trace.history_runs`, GPU time on rented instances) are replayed through
the scheduler on the simulated cloud (the `Replayer` port; the faces hand it the
simulator) under today's settings, and again with one setting changed at a time (idle
stop, the pool cap). A change is shown when the replay says it saves at
least `MIN_SAVING_USD` and `MIN_SAVING_FRACTION` of the replayed cost, with what it does
to the runs' waits; the text calls it a replay estimate and says when nothing would have
helped. Reservations are not replayed: a person, not the scheduler, decides when they end.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.money.billing import host_periods
from bot.app.money.history_trace import HistoryRun, history_runs
from bot.app.ports import Replayer, ReplayOutcome
from bot.app.runs.context import scheduler_config
from bot.domain import views
from bot.domain.durations import format_duration
from bot.domain.metering import HostPeriod as MeteredPeriod
from bot.domain.metering import Usage, Window, idle_overhead, metered_micro, money, to_cents
from bot.domain.scheduling import SchedulerConfig
from db.models import (
    RUN_CANCELLED,
    RUN_FAILED,
    Gpu,
    GpuSample,
    Host,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import transaction
from provisioning.catalog import Catalog
from provisioning.costs import gpu_share

TOP = 3  # rows per kind of waste: the largest, not an inventory
LOST_AFTER = timedelta(hours=1)  # a failed run that ran this long lost real time
MIN_SAVING_USD = 1.0
MIN_SAVING_FRACTION = 0.01
# Candidate values of each setting, tried one at a time against today's value.
# Each replay of a busy week costs a few tenths of a second, and the digest has 2 s: two
# values of the idle stop (a tight one and a loose one; today's is the third) and half
# the pool cap. Terminate-after is not tried: the replay ends every instance when the
# week's last run is done, so what a stopped volume costs after that is beyond it.
IDLE_STOP_CANDIDATES = (timedelta(minutes=5), timedelta(hours=1))
_ZERO = Decimal(0)
_RENTED = ("ondemand", "spot")


@dataclass(frozen=True)
class IdleHost:
    name: str
    instance_type: str
    empty_hours: float  # running with nobody on any of its GPUs
    usd: Decimal  # its idle overhead: running GPU time nobody held, and stopped storage


@dataclass(frozen=True)
class IdleHold:
    reservation_id: int
    user: str  # display name
    idle_gpu_hours: float
    usd: Decimal


@dataclass(frozen=True)
class LostRun:
    run_id: int
    user: str
    state: str  # failed | cancelled
    ran_hours: float  # wall clock from its start to its end
    gpu_hours: float
    usd: Decimal


@dataclass(frozen=True)
class MissedSpot:
    run_id: int
    user: str
    gpu_hours: float  # on demand
    usd: Decimal  # what the same GPU time would have cost less at the spot share


@dataclass(frozen=True)
class Wastes:
    idle_hosts: tuple[IdleHost, ...] = ()
    idle_holds: tuple[IdleHold, ...] = ()
    lost_runs: tuple[LostRun, ...] = ()
    missed_spot: tuple[MissedSpot, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.idle_hosts or self.idle_holds or self.lost_runs or self.missed_spot)


@dataclass(frozen=True)
class Change:
    """One setting changed in the replay, and what the replay said."""

    setting: str  # the environment variable
    label: str  # "idle stop 5m (now 15m)"
    outcome: ReplayOutcome

    def saved(self, base: ReplayOutcome) -> float:
        return round(base.usd - self.outcome.usd, 2)

    def extra_wait_s(self, base: ReplayOutcome) -> float:
        return self.outcome.avg_queue_s - base.avg_queue_s


@dataclass(frozen=True)
class Advice:
    runs: int  # runs replayed
    base: ReplayOutcome | None  # the replay under today's settings; None: not replayed
    best: tuple[Change, ...]  # at most TOP, largest saving first
    tried: tuple[str, ...]  # every change tried, in words
    why_not: str | None = None  # why there is no replay


@dataclass(frozen=True)
class EmptyTime:
    """The hours rented hosts ran with none of their GPUs held, by what kept them up."""

    hosts: int  # rented hosts that ran empty at some point of the window
    idle_stop: timedelta  # the setting the split is made by (GPUBOT_IDLE_STOP_AFTER)
    # Empty before their first use in the window: booting and set-up for a launch, or
    # nothing yet placed on a host that was up.
    before_use_h: float = 0.0
    # Empty after a use, up to the idle stop each time: what GPUBOT_IDLE_STOP_AFTER keeps.
    idle_stop_h: float = 0.0
    # The rest of longer empty stretches: up past the idle stop (not stopped in time).
    beyond_h: float = 0.0

    @property
    def total_h(self) -> float:
        return self.before_use_h + self.idle_stop_h + self.beyond_h


@dataclass(frozen=True)
class Totals:
    """The week's bill as the digest has it: what the rented instances cost, the GPU time
    people held on them, and the idle overhead (running GPUs nobody held, stopped storage)."""

    bill: Decimal
    held: Decimal
    idle: Decimal


@dataclass(frozen=True)
class WeekReport:
    wastes: Wastes
    advice: Advice
    # Where the bill and the replay of the week's runs part (issue 37): None when the
    # caller had no totals to hand.
    totals: Totals | None = None
    empty: EmptyTime | None = None


# --- the wastes --------------------------------------------------------------------------


def _usages(s: Session, window: Window) -> list[Usage]:
    """Every interval that overlaps the window, as idle overhead takes them (who held it
    does not matter here; only which GPU of which host, and when)."""
    rows = s.exec(
        select(
            UsageInterval.host_id,
            UsageInterval.gpu_id,
            UsageInterval.started_at,
            UsageInterval.ended_at,
        ).where(
            col(UsageInterval.started_at) < window.end,
            col(UsageInterval.ended_at).is_(None) | (col(UsageInterval.ended_at) > window.start),
        )
    ).all()
    return [
        Usage(
            user="", gpu_id=g, host_id=h, start=a, end=b, usd_per_hour=_ZERO, kind="run", ref_id=0
        )
        for h, g, a, b in rows
    ]


def _empty_seconds(
    periods: Sequence[MeteredPeriod], usages: Sequence[Usage], window: Window, now: datetime
) -> float:
    """Seconds a host ran (within the window, before now) with none of its GPUs held."""
    end_cap = min(window.end, now)
    merged = _merged(usages, window, end_cap)
    total = 0.0
    for p in periods:
        if p.state != "running":
            continue
        a, b = max(p.start, window.start), min(p.end or end_cap, end_cap)
        if b <= a:
            continue
        busy = sum(
            max(0.0, (min(b, y) - max(a, x)).total_seconds()) for x, y in merged if y > a and x < b
        )
        total += (b - a).total_seconds() - busy
    return total


@dataclass(frozen=True)
class _Rented:
    """The window's rented hosts, their billed periods and the intervals held on them:
    read once for the idle instances and the empty time."""

    hosts: dict[int, Host]
    periods: dict[int, list[MeteredPeriod]]
    usages: dict[int, list[Usage]]


def _rented(s: Session, window: Window) -> _Rented:
    periods: dict[int, list[MeteredPeriod]] = defaultdict(list)
    for p in host_periods(s, window):
        periods[p.host_id].append(p)
    if not periods:
        return _Rented({}, {}, {})
    hosts = {
        h.id: h
        for h in s.exec(select(Host).where(col(Host.id).in_(list(periods)))).all()
        if h.market in _RENTED and h.id is not None
    }
    by_host: dict[int, list[Usage]] = defaultdict(list)
    for u in _usages(s, window):
        if u.host_id in hosts:
            by_host[u.host_id].append(u)
    return _Rented(hosts, dict(periods), dict(by_host))


def _merged(
    usages: Sequence[Usage], window: Window, end_cap: datetime
) -> list[tuple[datetime, datetime]]:
    held = sorted((max(u.start, window.start), min(u.end or end_cap, end_cap)) for u in usages)
    merged: list[tuple[datetime, datetime]] = []
    for a, b in held:
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def empty_time(rented: _Rented, window: Window, now: datetime, idle_stop: timedelta) -> EmptyTime:
    """Every rented host's empty running time in the window, split by what kept it up:
    before its first use there (a launch's boot and set-up, or nothing placed yet), up to
    the idle stop after each use (the setting), and past it."""
    end_cap = min(window.end, now)
    stop_s = idle_stop.total_seconds()
    before = within = beyond = 0.0
    hosts = 0
    for hid in rented.hosts:
        busy = _merged(rented.usages.get(hid, ()), window, end_cap)
        first_use = busy[0][0] if busy else None
        gaps: list[tuple[datetime, datetime]] = []
        for p in rented.periods.get(hid, ()):
            if p.state != "running":
                continue
            a, b = max(p.start, window.start), min(p.end or end_cap, end_cap)
            cursor = a
            for x, y in busy:
                if y <= cursor:
                    continue
                if x >= b:
                    break
                if x > cursor:
                    gaps.append((cursor, x))
                cursor = max(cursor, y)
                if cursor >= b:
                    break
            if cursor < b:
                gaps.append((cursor, b))
        for g0, g1 in gaps:
            gap = (g1 - g0).total_seconds()
            if first_use is None or g0 < first_use:
                before += gap
            else:
                within += min(gap, stop_s)
                beyond += max(0.0, gap - stop_s)
        hosts += bool(gaps)
    return EmptyTime(hosts, idle_stop, before / 3600, within / 3600, beyond / 3600)


def idle_hosts(s: Session, window: Window, now: datetime) -> tuple[IdleHost, ...]:
    """The rented hosts with the most idle overhead in the window, dearest first."""
    return _idle_hosts(_rented(s, window), window, now)


def _idle_hosts(rented: _Rented, window: Window, now: datetime) -> tuple[IdleHost, ...]:
    hosts, periods, by_host = rented.hosts, rented.periods, defaultdict(list, rented.usages)
    out = []
    for hid, host in hosts.items():
        assert hid is not None
        usd = idle_overhead(periods[hid], by_host[hid], window, now)
        if usd <= 0:
            continue
        empty = _empty_seconds(periods[hid], by_host[hid], window, now)
        out.append(IdleHost(host.name, host.instance_type or "", empty / 3600, usd))
    out.sort(key=lambda h: (-h.usd, h.name))
    return tuple(out[:TOP])


def idle_holds(
    s: Session, window: Window, idle_pct: float, names: dict[int, str]
) -> tuple[IdleHold, ...]:
    """Reservations whose GPUs sampled under the idle threshold longest, in dollars."""
    columns: tuple[Any, ...] = (
        GpuSample.reservation_id,
        GpuSample.user_id,
        GpuSample.host_id,
        GpuSample.gpu_index,
        func.sum(GpuSample.span_s),
    )
    stmt: Any = (
        select(*columns)
        .where(
            col(GpuSample.at) >= window.start,
            col(GpuSample.at) < window.end,
            col(GpuSample.reservation_id).is_not(None),
            col(GpuSample.util_pct) < idle_pct,
            col(GpuSample.span_s) > 0,
        )
        .group_by(*columns[:4])
    )
    rows = s.exec(stmt).all()
    if not rows:
        return ()
    res_ids = {r[0] for r in rows}
    rates: dict[tuple[int, int, int], Decimal] = {}
    for rid, hid, index, rate in s.exec(
        select(
            UsageInterval.reservation_id,
            UsageInterval.host_id,
            Gpu.index,
            UsageInterval.usd_per_hour,
        )
        .join(Gpu, col(Gpu.id) == col(UsageInterval.gpu_id))
        .where(col(UsageInterval.reservation_id).in_(res_ids))
    ).all():
        if rid is not None:
            rates[(rid, hid, index)] = Decimal(str(rate))
    secs: dict[int, float] = defaultdict(float)
    usd: dict[int, Decimal] = defaultdict(Decimal)
    who: dict[int, str] = {}
    for rid, uid, hid, index, span in rows:
        assert rid is not None
        secs[rid] += float(span)
        usd[rid] += rates.get((rid, hid, index), _ZERO) * Decimal(str(float(span))) / 3600
        who[rid] = names.get(uid or -1, "?")
    out = [IdleHold(rid, who[rid], secs[rid] / 3600, usd[rid]) for rid in secs if usd[rid] > 0]
    out.sort(key=lambda h: (-h.usd, h.reservation_id))
    return tuple(out[:TOP])


def _run_time(
    s: Session, run_ids: Sequence[int], now: datetime
) -> dict[int, list[tuple[UsageInterval, str]]]:
    """Each run's usage intervals with the market they were on."""
    out: dict[int, list[tuple[UsageInterval, str]]] = defaultdict(list)
    if not run_ids:
        return out
    for iv in s.exec(select(UsageInterval).where(col(UsageInterval.run_id).in_(list(run_ids)))):
        if iv.run_id is not None:
            out[iv.run_id].append((iv, iv.market))
    return out


def _hours(iv: UsageInterval, now: datetime) -> float:
    return max(0.0, ((iv.ended_at or now) - iv.started_at).total_seconds()) / 3600


def lost_runs(
    s: Session, window: Window, now: datetime, names: dict[int, str]
) -> tuple[LostRun, ...]:
    """Runs that failed or were cancelled in the window after running `LOST_AFTER` or
    more: all their GPU time, at what it cost."""
    runs = s.exec(
        select(TrainingRun).where(
            col(TrainingRun.state).in_((RUN_FAILED, RUN_CANCELLED)),
            col(TrainingRun.finished_at) >= window.start,
            col(TrainingRun.finished_at) < window.end,
            col(TrainingRun.started_at).is_not(None),
        )
    ).all()
    long = [
        r
        for r in runs
        if r.started_at is not None
        and r.finished_at is not None
        and r.finished_at - r.started_at >= LOST_AFTER
    ]
    ivs = _run_time(s, [r.id for r in long if r.id is not None], now)
    out = []
    for r in long:
        assert r.id is not None and r.started_at is not None and r.finished_at is not None
        mine = ivs.get(r.id, [])
        gpu_h = sum(_hours(iv, now) for iv, _ in mine)
        micro = sum(
            metered_micro(Decimal(str(iv.usd_per_hour)), iv.started_at, iv.ended_at or now)
            for iv, _ in mine
        )
        if gpu_h <= 0:
            continue
        ran = (r.finished_at - r.started_at).total_seconds() / 3600
        out.append(
            LostRun(r.id, names.get(r.user_id, "?"), r.state, ran, gpu_h, Decimal(micro).scaleb(-6))
        )
    out.sort(key=lambda x: (-x.gpu_hours, x.run_id))
    return tuple(out[:TOP])


def missed_spot(
    s: Session, window: Window, now: datetime, names: dict[int, str], catalog: Catalog
) -> tuple[MissedSpot, ...]:
    """On-demand GPU time in the window of runs that checkpoint, and what the spot share of
    the same instance type would have saved on it (list prices; interruptions aside)."""
    rows = s.exec(
        select(UsageInterval, TrainingRun.user_id, Host.instance_type)
        .join(TrainingRun, col(TrainingRun.id) == col(UsageInterval.run_id))
        .join(Host, col(Host.id) == col(UsageInterval.host_id))
        .where(
            col(TrainingRun.checkpoints).is_(True),
            UsageInterval.market == "ondemand",
            col(UsageInterval.started_at) < window.end,
            col(UsageInterval.ended_at).is_(None) | (col(UsageInterval.ended_at) > window.start),
        )
    ).all()
    hours: dict[int, float] = defaultdict(float)
    saved: dict[int, int] = defaultdict(int)
    owner: dict[int, int] = {}
    end_cap = min(window.end, now)
    for iv, uid, itype in rows:
        t = catalog.get(itype) if itype else None
        if t is None or not t.spot_usd_hr or iv.run_id is None:
            continue
        a, b = max(iv.started_at, window.start), min(iv.ended_at or end_cap, end_cap)
        if b <= a:
            continue
        spot = gpu_share(Fraction(Decimal(str(t.spot_usd_hr))), t.gpus)
        paid = metered_micro(Decimal(str(iv.usd_per_hour)), a, b)
        saved[iv.run_id] += paid - metered_micro(spot, a, b)
        hours[iv.run_id] += (b - a).total_seconds() / 3600
        owner[iv.run_id] = uid
    out = [
        MissedSpot(rid, names.get(owner[rid], "?"), hours[rid], Decimal(m).scaleb(-6))
        for rid, m in saved.items()
        if m > 0
    ]
    out.sort(key=lambda x: (-x.usd, x.run_id))
    return tuple(out[:TOP])


def week_wastes(
    s: Session,
    window: Window,
    now: datetime,
    settings: Settings,
    catalog: Catalog,
    rented: _Rented | None = None,
) -> Wastes:
    names = {u.id or -1: u.display_name for u in s.exec(select(User)).all()}
    return Wastes(
        idle_hosts=_idle_hosts(rented or _rented(s, window), window, now),
        idle_holds=idle_holds(s, window, settings.idle_util_pct, names),
        lost_runs=lost_runs(s, window, now, names),
        missed_spot=missed_spot(s, window, now, names, catalog),
    )


# --- the replay --------------------------------------------------------------------------


def changes(settings: Settings, catalog: Catalog) -> list[tuple[str, str, SchedulerConfig]]:
    """(setting, label, config) for every one-at-a-time change the replay tries."""
    base = scheduler_config(settings, catalog)
    biggest = max((t.gpus for t in catalog.types), default=8)
    out: list[tuple[str, str, SchedulerConfig]] = []
    now_stop = settings.idle_stop_after
    for d in IDLE_STOP_CANDIDATES:
        if d != now_stop:
            out.append(
                (
                    "GPUBOT_IDLE_STOP_AFTER",
                    f"idle stop after {format_duration(d)} (now {format_duration(now_stop)})",
                    replace(base, idle_stop_s=d.total_seconds()),
                )
            )
    cap = settings.pool_max_instances
    for n in (math.ceil(cap / 2),):
        if 1 <= n < cap:
            out.append(
                (
                    "GPUBOT_POOL_MAX_INSTANCES",
                    f"pool cap {n} instances per type (now {cap})",
                    replace(base, max_gpus=n * biggest),
                )
            )
    return out


def replay_jobs(s: Session, window: Window, now: datetime) -> list[HistoryRun]:
    """The window's runs on rented instances, as they ran."""
    runs, _ = history_runs(s, window.start, min(window.end, now), now, rented_only=True)
    return runs


def advise(
    jobs: Sequence[HistoryRun],
    settings: Settings,
    catalog: Catalog,
    replay: Replayer,
) -> Advice:
    """Replays `jobs` under today's settings, then with each change of `changes`."""
    tried = changes(settings, catalog)
    labels = tuple(label for _, label, _ in tried)
    if not jobs:
        return Advice(0, None, (), labels, "no runs on rented instances to replay")
    world = {"ebs_gb": settings.ebs_gb, "ebs_usd_gb_month": settings.ebs_usd_gb_month}
    base = replay(jobs, scheduler_config(settings, catalog), **world)
    found = [Change(setting, label, replay(jobs, cfg, **world)) for setting, label, cfg in tried]
    floor = max(MIN_SAVING_USD, MIN_SAVING_FRACTION * base.usd)
    good = [c for c in found if c.saved(base) >= floor and c.outcome.jobs == base.jobs]
    good.sort(key=lambda c: (-c.saved(base), c.label))
    best: list[Change] = []
    for c in good:  # one per setting: the best value of each
        if all(b.setting != c.setting for b in best):
            best.append(c)
    return Advice(len(jobs), base, tuple(best[:TOP]), labels)


# --- what it looks like ------------------------------------------------------------------


def _wait(seconds: float) -> str:
    if abs(seconds) < 30:
        return "no longer"
    sign = "+" if seconds > 0 else "−"
    return f"{sign}{format_duration(timedelta(seconds=round(abs(seconds))))} on average"


def report_blocks(r: WeekReport) -> tuple[views.Block, ...]:
    """The largest wastes and the replay's advice, as blocks under the digest's totals."""
    w, a = r.wastes, r.advice
    out: list[views.Block] = [views.Text("*Largest wastes*")]
    if w.empty:
        out.append(views.Text("No idle instance, idle reservation, lost run or missed spot."))
    if w.idle_hosts:
        out.append(
            views.Table(
                ("idle instance", "type", "empty h", "idle $"),
                tuple(
                    (h.name, h.instance_type or "-", f"{h.empty_hours:,.1f}", money(h.usd))
                    for h in w.idle_hosts
                ),
            )
        )
    if w.idle_holds:
        out.append(
            views.Table(
                ("held idle", "who", "idle GPU-h", "cost"),
                tuple(
                    (
                        f"reservation #{h.reservation_id}",
                        h.user,
                        f"{h.idle_gpu_hours:,.1f}",
                        money(h.usd),
                    )
                    for h in w.idle_holds
                ),
            )
        )
    if w.lost_runs:
        out.append(
            views.Table(
                ("lost run", "who", "ended", "GPU-h lost", "cost"),
                tuple(
                    (
                        f"#{x.run_id}",
                        x.user,
                        f"{x.state} after {x.ran_hours:,.1f} h",
                        f"{x.gpu_hours:,.1f}",
                        money(x.usd),
                    )
                    for x in w.lost_runs
                ),
            )
        )
    if w.missed_spot:
        out.append(
            views.Table(
                ("spot missed", "who", "on-demand GPU-h", "spot would save"),
                tuple(
                    (f"run #{x.run_id}", x.user, f"{x.gpu_hours:,.1f}", money(x.usd))
                    for x in w.missed_spot
                ),
            )
        )
    out.append(views.Text("*What one setting would have saved* (replay estimate)"))
    out.append(views.Text(advice_text(a)))
    parting = parting_text(r)
    if parting is not None:
        out.append(views.Text("*Where the bill and the replay part*"))
        out.append(views.Text(parting))
    if a.base is not None and a.best:
        base = a.base
        out.append(
            views.Table(
                ("change", "saved", "replay cost", "runs' wait"),
                tuple(
                    (
                        c.label,
                        money(c.saved(base)),
                        money(c.outcome.usd),
                        _wait(c.extra_wait_s(base)),
                    )
                    for c in a.best
                ),
            )
        )
    notes = [
        "Idle instance: its idle overhead (running GPUs nobody held, stopped storage); empty h: "
        "hours it ran with none of its GPUs held.",
    ]
    if w.missed_spot:
        notes.append(
            "Spot missed: on-demand time of runs that checkpoint, at the catalog's spot price "
            "(a price, not a replay: interruptions not counted)."
        )
    if a.base is not None:
        notes.append(
            "Replay estimate: the week's runs on rented instances, through the scheduler on the "
            "simulated cloud, under today's settings and with one change at a time; reservations "
            "are not replayed."
        )
    out.append(views.Context(" ".join(notes)))
    return tuple(out)


def advice_text(a: Advice) -> str:
    if a.base is None:
        return f"Nothing replayed: {a.why_not}."
    head = (
        f"Replaying the week's {a.runs} run{'s' if a.runs != 1 else ''} under today's settings "
        f"costs {money(a.base.usd)}."
    )
    if not a.best:
        return (
            f"{head} Nothing would have helped: no single change saved "
            f"{money(max(MIN_SAVING_USD, MIN_SAVING_FRACTION * a.base.usd))} or more "
            f"(tried: {'; '.join(a.tried) or 'nothing to try'})."
        )
    top = a.best[0]
    return (
        f"{head} The most: {top.label} saves {money(top.saved(a.base))} "
        f"(the runs wait {_wait(top.extra_wait_s(a.base))})."
    )


REPORT_CSV_HEADER = ("week", "kind", "what", "who", "hours", "usd", "extra_wait_s", "detail")


def report_csv(week: str, r: WeekReport) -> str:
    """The wastes and the advice, one row each: the same figures as the digest's text."""
    out = io.StringIO()
    wr = csv.writer(out, lineterminator="\n")
    wr.writerow(REPORT_CSV_HEADER)
    for h in r.wastes.idle_hosts:
        wr.writerow(
            (
                week,
                "idle_instance",
                h.name,
                "",
                f"{h.empty_hours:.4f}",
                to_cents(h.usd),
                "",
                h.instance_type,
            )
        )
    for i in r.wastes.idle_holds:
        wr.writerow(
            (
                week,
                "idle_reservation",
                f"reservation {i.reservation_id}",
                i.user,
                f"{i.idle_gpu_hours:.4f}",
                to_cents(i.usd),
                "",
                "",
            )
        )
    for x in r.wastes.lost_runs:
        wr.writerow(
            (
                week,
                "lost_run",
                f"run {x.run_id}",
                x.user,
                f"{x.gpu_hours:.4f}",
                to_cents(x.usd),
                "",
                x.state,
            )
        )
    for m in r.wastes.missed_spot:
        wr.writerow(
            (
                week,
                "spot_missed",
                f"run {m.run_id}",
                m.user,
                f"{m.gpu_hours:.4f}",
                to_cents(m.usd),
                "",
                "",
            )
        )
    a = r.advice
    if a.base is None:
        wr.writerow((week, "replay", "", "", "", "", "", a.why_not or ""))
    else:
        base = a.base
        wr.writerow(
            (week, "replay", "today's settings", "", "", f"{base.usd:.2f}", "", f"{a.runs} runs")
        )
        for c in a.best:
            wr.writerow(
                (
                    week,
                    "saving",
                    c.label,
                    "",
                    "",
                    f"{c.saved(base):.2f}",
                    f"{c.extra_wait_s(base):.0f}",
                    c.setting,
                )
            )
        if not a.best:
            wr.writerow((week, "saving", "", "", "", "0.00", "", "nothing would have helped"))
    t, e = r.totals, r.empty
    if t is not None:
        for what, usd in (("instances", t.bill), ("held", t.held), ("idle_overhead", t.idle)):
            wr.writerow((week, "bill", what, "", "", to_cents(usd), "", ""))
    if e is not None and e.hosts:
        stop = f"GPUBOT_IDLE_STOP_AFTER={format_duration(e.idle_stop)}"
        for what, hours, why in (
            ("before_first_use", e.before_use_h, "booting, set-up, nothing placed yet"),
            ("within_idle_stop", e.idle_stop_h, stop),
            ("past_idle_stop", e.beyond_h, "not stopped in time"),
        ):
            wr.writerow((week, "empty_time", what, "", f"{hours:.4f}", "", "", why))
    return out.getvalue()


def report_for(
    engine: Engine,
    settings: Settings,
    window: Window,
    now: datetime,
    catalog: Catalog,
    replay: Replayer | None,
    totals: Totals | None = None,
) -> WeekReport:
    """The window's wastes and advice, and with the digest's `totals` where the bill and
    the replay part. What it needs is read in one read transaction and the replays run
    after it has closed: they take a second or so on a busy week, and a transaction held
    open that long would hold SQLite's writers back."""
    with transaction(engine, write=False) as s:
        rented = _rented(s, window)
        wastes = week_wastes(s, window, now, settings, catalog, rented)
        jobs = replay_jobs(s, window, now) if replay is not None else []
    empty = empty_time(rented, window, now, settings.idle_stop_after)
    if replay is None:
        advice = Advice(0, None, (), (), "no simulator here to replay the week")
    else:
        advice = advise(jobs, settings, catalog, replay)
    return WeekReport(wastes, advice, totals, empty)


def parting_text(r: WeekReport) -> str | None:
    """Where the week's bill and the replay of its runs part, in figures that add up to
    the bill: the GPU time people held (reservations are not replayed; runs as they ran,
    which the replay packs its own way) and the idle overhead, with the hours rented hosts
    ran empty and what kept them up. None without the digest's totals."""
    t, e = r.totals, r.empty
    if t is None or e is None:
        return None
    replayed = (
        f" Replaying the runs costs {money(r.advice.base.usd)}: only runs are replayed, and "
        "the replay places them its own way."
        if r.advice.base is not None
        else ""
    )
    head = (
        f"The rented instances cost {money(t.bill)}: {money(t.held)} of GPU time people held "
        f"(reservations and runs) and {money(t.idle)} of idle overhead (running GPUs nobody "
        f"held, stopped storage).{replayed}"
    )
    if not e.hosts:
        return head
    stop = format_duration(e.idle_stop)
    return (
        f"{head} {e.hosts} instance{'s' if e.hosts != 1 else ''} ran {e.total_h:,.1f} h with "
        f"nothing held: {e.before_use_h:,.1f} h before their first use this week (booting, "
        f"set-up, nothing placed yet), {e.idle_stop_h:,.1f} h within the idle stop after a use "
        f"(GPUBOT_IDLE_STOP_AFTER={stop}) and {e.beyond_h:,.1f} h past it (not stopped in time)."
    )
