"""GPU utilization: sampling busy hosts, the rolling history, `/gpu util`, channel posts.

Sampling runs the host's own probe (`python -m training.telemetry --json`, with the host's
interpreter from its `HostSeat`) through the host's `HostShell` — `LocalRunner` here,
`SshClient` elsewhere — so the bot never needs
pynvml itself and a remote host is read exactly like this one. Only busy hosts (a GPU
held or a run running) are sampled: an idle host's numbers are not worth an SSH round
trip every minute, and nobody is charged for them.

Each sample is attributed to whoever held the GPU then (the open usage interval), so
history can later say whose job was idle. The history is thinned with age (`thin`, a
pure function; `thin_db`, the pass the sampling job runs): minute samples for 6 h,
10-minute ones up to 7 days, hourly ones up to 90 days, then nothing. A merged sample's
`span_s` is the time it stands for, so averages over thinned history stay time-weighted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import delete, func, insert
from sqlmodel import Session, col, select

from bot.app.ports import HostSeat, seats_for
from bot.app.service import Actor, GpuService
from bot.app.watching.held import held_host_ids, who_holds
from bot.domain import timefmt, views
from bot.domain.commands import VERBS
from bot.domain.errors import UserError
from db.models import (
    HOST_READY,
    HOST_TERMINATED,
    RUN_ON_HOST,
    Gpu,
    GpuSample,
    Host,
    TrainingRun,
)
from db.session import transaction
from provisioning.ssh import SshError
from training.telemetry import NO_DRIVER, HostSnapshot, parse_snapshot

if TYPE_CHECKING:
    # matplotlib takes most of a second to import: only code that draws loads it.
    from bot.domain.charts import GpuSeries

log = logging.getLogger(__name__)

USAGE = VERBS["util"].usage
# A probe that has not answered in this long is treated as a host that did not answer.
PROBE_TIMEOUT_S = 30.0
# How far back /gpu util and the channel post draw the chart.
CHART_WINDOW = timedelta(hours=6)


# --- where the probe runs ---------------------------------------------------------------


class ProbeFailed(Exception):
    """The host did not give a snapshot (unreachable, timed out, an unreadable answer)."""


def probe(seat: HostSeat, timeout: float = PROBE_TIMEOUT_S) -> HostSnapshot:
    """One snapshot from the host, or ProbeFailed saying why in words. It runs with the
    host's interpreter (the bootstrapped venv and its code, on a remote host: the system
    python3 there has neither torch nor `training`)."""
    try:
        python = seat.interpreter()
        result = seat.runner.run(
            seat.target,
            python.module("training.telemetry", "--json"),
            timeout=timeout,
            env=python.env() or None,
        )
    except SshError as exc:
        raise ProbeFailed(str(exc)) from exc
    if not result.ok:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise ProbeFailed(f"telemetry exited {result.exit_code}: {said[-1][:200] if said else ''}")
    # The JSON is the last line; anything before it (a login banner, a warning) is noise.
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    snap = parse_snapshot(lines[-1]) if lines else None
    if snap is None:
        raise ProbeFailed("telemetry answered something this bot cannot read (another version?)")
    return snap


# --- collection -------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    user_id: int
    reservation_id: int | None
    run_id: int | None


@dataclass(frozen=True)
class CollectReport:
    hosts: int = 0  # busy hosts asked
    samples: int = 0  # rows stored
    failed: tuple[str, ...] = ()  # "host: why" for hosts that did not answer
    no_driver: tuple[str, ...] = ()  # hosts whose probe found no NVIDIA driver


def busy_hosts(s: Session) -> list[Host]:
    """Ready hosts where a GPU is held or a run is running."""
    held = held_host_ids(s)
    running = set(
        s.exec(
            select(TrainingRun.host_id).where(
                col(TrainingRun.state).in_(RUN_ON_HOST), col(TrainingRun.host_id).is_not(None)
            )
        ).all()
    )
    ids = {i for i in held | running if i is not None}
    if not ids:
        return []
    return list(
        s.exec(
            select(Host)
            .where(col(Host.id).in_(ids), Host.state == HOST_READY)
            .order_by(col(Host.id))
        )
    )


def holders(s: Session, host_id: int) -> dict[int, Holder]:
    """GPU index → who holds it now, from the open usage intervals."""
    return {
        h.gpu.index: Holder(h.interval.user_id, h.interval.reservation_id, h.interval.run_id)
        for h in who_holds(s, host_ids=[host_id])
    }


def samples_from(
    host_id: int,
    snap: HostSnapshot,
    held: dict[int, Holder],
    at: datetime,
    span_s: int,
) -> list[GpuSample]:
    """The rows one snapshot becomes: one per GPU, attributed to its holder.

    A GPU that did not report its utilization gets no row at all: stored as 0 it would
    look idle, and idle detection would take its holder's GPUs away over a missing
    sensor. Missing memory is stored as 0; missing temperature or power as None."""
    out = []
    for g in snap.gpus:
        if g.util_pct is None:
            continue
        who = held.get(g.index)
        out.append(
            GpuSample(
                host_id=host_id,
                gpu_index=g.index,
                at=at,
                span_s=span_s,
                util_pct=float(g.util_pct),
                mem_used_mb=float(g.mem_used_mb or 0),
                mem_total_mb=float(g.mem_total_mb or 0),
                temperature_c=None if g.temp_c is None else float(g.temp_c),
                power_w=g.power_w,
                user_id=who.user_id if who else None,
                reservation_id=who.reservation_id if who else None,
                run_id=who.run_id if who else None,
            )
        )
    return out


def collect(service: GpuService, *, timeout: float = PROBE_TIMEOUT_S) -> CollectReport:
    """Samples every busy host once. A host that fails is logged and skipped."""
    access = service.runs.access
    with transaction(service.engine, write=False) as s:
        hosts = busy_hosts(s)
    if not hosts:
        return CollectReport()
    span_s = max(1, round(service.settings.util_sample_s))
    stored = 0
    failed: list[str] = []
    no_driver: list[str] = []
    for host in hosts:
        assert host.id is not None
        seats = seats_for(access, host.name)
        if not seats:
            failed.append(f"{host.name}: no way to reach it")
            continue
        seen: set[int] = set()  # GPUs sampled this pass (unconstrained steps see them all)
        wanted = {i for seat in seats for i in seat.gpu_map}
        for seat in seats:
            if wanted and wanted <= seen:
                break  # one job's step saw the whole node: no step more (the controller's)
            try:
                snap = on_host(probe(seat, timeout), seat.gpu_map)
            except ProbeFailed as exc:
                log.warning("utilization: host %s did not answer: %s", host.name, exc)
                failed.append(f"{host.name}: {exc}")
                continue
            if not snap.gpus:
                if host.name not in no_driver:
                    no_driver.append(host.name)
                log.info("utilization: host %s has no GPU telemetry: %s", host.name, snap.error)
                continue
            snap = replace(snap, gpus=tuple(g for g in snap.gpus if g.index not in seen))
            seen.update(g.index for g in snap.gpus)
            with transaction(service.engine) as s:
                now = service.clock.now()
                rows = samples_from(host.id, snap, holders(s, host.id), now, span_s)
                s.add_all(rows)
                stored += len(rows)
    return CollectReport(len(hosts), stored, tuple(failed), tuple(no_driver))


def on_host(snap: HostSnapshot, gpu_map: Sequence[int]) -> HostSnapshot:
    """The snapshot in the host's GPU numbering. A probe inside a job on a cluster that
    constrains devices sees that job's GPUs alone, numbered from 0 (`gpu_map` gives each
    one's index on the node); one that sees as many GPUs as the job holds, numbered
    0..k-1, is read that way. Otherwise (the whole node seen) the indexes are the node's."""
    indexes = [g.index for g in snap.gpus]
    if not gpu_map or len(indexes) != len(gpu_map) or sorted(indexes) != list(range(len(indexes))):
        return snap
    return replace(snap, gpus=tuple(replace(g, index=gpu_map[g.index]) for g in snap.gpus))


# --- thinning ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    max_age: timedelta  # samples younger than this belong to the tier
    bucket_s: int  # and are merged into buckets this long


TIERS: tuple[Tier, ...] = (
    Tier(timedelta(hours=6), 60),
    Tier(timedelta(days=7), 600),
    Tier(timedelta(days=90), 3600),
)


@dataclass(frozen=True)
class Sample:
    """A GpuSample as plain data, so thinning is a pure function."""

    id: int | None
    host_id: int
    gpu_index: int
    at: datetime
    span_s: int
    util_pct: float
    mem_used_mb: float
    mem_total_mb: float
    temperature_c: float | None = None
    power_w: float | None = None
    user_id: int | None = None
    reservation_id: int | None = None
    run_id: int | None = None

    def row(self) -> GpuSample:
        return GpuSample(
            host_id=self.host_id,
            gpu_index=self.gpu_index,
            at=self.at,
            span_s=self.span_s,
            util_pct=self.util_pct,
            mem_used_mb=self.mem_used_mb,
            mem_total_mb=self.mem_total_mb,
            temperature_c=self.temperature_c,
            power_w=self.power_w,
            user_id=self.user_id,
            reservation_id=self.reservation_id,
            run_id=self.run_id,
        )


@dataclass(frozen=True)
class ThinPlan:
    delete: tuple[int, ...]  # ids of rows to remove (merged away or too old)
    add: tuple[Sample, ...]  # merged rows to insert in their place


def _weighted(values: Iterable[tuple[float | None, int]]) -> float | None:
    total = weight = 0.0
    for v, w in values:
        if v is not None:
            total += v * w
            weight += w
    return None if weight == 0 else total / weight


def _merge(group: Sequence[Sample], at: datetime) -> Sample:
    spans = [max(1, g.span_s) for g in group]
    first = group[0]

    def avg(get: Callable[[Sample], float | None]) -> float | None:
        return _weighted((get(g), w) for g, w in zip(group, spans, strict=True))

    return replace(
        first,
        id=None,
        at=at,
        span_s=sum(spans),
        util_pct=avg(lambda g: g.util_pct) or 0.0,
        mem_used_mb=avg(lambda g: g.mem_used_mb) or 0.0,
        mem_total_mb=avg(lambda g: g.mem_total_mb) or 0.0,
        temperature_c=avg(lambda g: g.temperature_c),
        power_w=avg(lambda g: g.power_w),
    )


def thin(samples: Iterable[Sample], now: datetime, tiers: Sequence[Tier] = TIERS) -> ThinPlan:
    """What to delete and add so that each sample sits in its age tier's resolution.

    Samples are grouped per GPU, per holder (a merge never blurs who held it) and per
    bucket of their tier (aligned to the epoch, so repeated passes agree); a bucket of two
    or more becomes one sample at the bucket's start whose values are span-weighted
    means and whose span is the sum. Only finished buckets are merged. Anything older than
    the last tier is dropped. A sample alone in its bucket is left as it is.

    A merged sample sits at its bucket's start, which can be old enough for the next
    tier; so the steps repeat until nothing changes, and a second pass over the result
    has nothing to do.
    """
    current = list(samples)
    dropped: list[int] = []
    made: list[Sample] = []
    for _ in range(2 * len(tiers) + 2):  # each step moves samples up a tier, at most
        removed, added = _thin_step(current, now, tiers)
        if not removed and not added:
            break
        dropped.extend(gone for i in removed if (gone := current[i].id) is not None)
        current = [smp for i, smp in enumerate(current) if i not in removed] + added
        made.extend(added)
    kept = {id(smp) for smp in current}
    return ThinPlan(tuple(sorted(dropped)), tuple(smp for smp in made if id(smp) in kept))


def _thin_step(
    samples: Sequence[Sample], now: datetime, tiers: Sequence[Tier]
) -> tuple[set[int], list[Sample]]:
    """One round: the positions to remove and the merged samples to add."""
    oldest = tiers[-1].max_age
    removed: set[int] = set()
    groups: dict[tuple[int, int, int | None, int | None, int | None, int, int], list[int]] = {}
    for pos, smp in enumerate(samples):
        age = now - smp.at
        if age >= oldest:
            removed.add(pos)
            continue
        tier = next(t for t in tiers if age < t.max_age)
        start = math.floor(smp.at.timestamp() / tier.bucket_s) * tier.bucket_s
        if start + tier.bucket_s > now.timestamp():
            continue  # the bucket is still filling
        key = (
            smp.host_id,
            smp.gpu_index,
            smp.user_id,
            smp.reservation_id,
            smp.run_id,
            tier.bucket_s,
            start,
        )
        groups.setdefault(key, []).append(pos)
    added: list[Sample] = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        group = sorted((samples[p] for p in members), key=lambda g: g.at)
        added.append(_merge(group, datetime.fromtimestamp(key[-1], UTC)))
        removed.update(members)
    return removed, added


def thin_db(service: GpuService, now: datetime | None = None) -> ThinPlan:
    """The DB pass: loads only rows that may change (finer than their tier, or too old),
    applies `thin`, writes the result in one transaction. Most minutes there is nothing
    to do, and then it only reads (no SQLite write lock taken)."""
    now = now or service.clock.now()
    with transaction(service.engine, write=False) as s:
        plan = thin(_thin_candidates(s, now), now)
    if not plan.delete and not plan.add:
        return plan
    with transaction(service.engine) as s:
        plan = thin(_thin_candidates(s, now), now)  # again, under the write lock
        for i in range(0, len(plan.delete), 500):
            chunk = plan.delete[i : i + 500]
            s.exec(delete(GpuSample).where(col(GpuSample.id).in_(chunk)))
        if plan.add:
            # Core insert, not ORM objects: a first pass over a week of history merges
            # tens of thousands of rows, and model instances cost ~0.5 ms each.
            s.exec(insert(GpuSample), params=[_columns(m) for m in plan.add])
    return plan


_SAMPLE_COLUMNS = tuple(f.name for f in fields(Sample))


def _columns(smp: Sample) -> dict[str, object]:
    return {name: getattr(smp, name) for name in _SAMPLE_COLUMNS if name != "id"}


def _thin_candidates(s: Session, now: datetime) -> list[Sample]:
    """Plain tuples, not model instances: this can be most of the table once."""
    t0, t1, t2 = TIERS
    at, span = col(GpuSample.at), col(GpuSample.span_s)
    got = s.exec(
        select(*(col(getattr(GpuSample, name)) for name in _SAMPLE_COLUMNS)).where(
            (at < now - t2.max_age)
            | ((at < now - t1.max_age) & (span < t2.bucket_s))
            | ((at < now - t0.max_age) & (span < t1.bucket_s))
            | (span < t0.bucket_s)
        )
    ).all()
    return [Sample(*row) for row in got]


def sample_job(service: GpuService) -> CollectReport:
    """The worker's job (every util_sample_s): sample the busy hosts, then thin."""
    report = collect(service)
    if report.samples or report.failed:
        log.info(
            "utilization: %d samples from %d hosts; failed: %s",
            report.samples,
            report.hosts,
            "; ".join(report.failed) or "none",
        )
    thin_db(service)
    return report


# --- reading it back --------------------------------------------------------------------


@dataclass(frozen=True)
class Latest:
    host: str
    sample: GpuSample
    model: str
    holder: str | None


def latest_samples(s: Session, host_ids: Sequence[int]) -> list[Latest]:
    """Each GPU's newest sample on these hosts, with its model and current holder."""
    if not host_ids:
        return []
    newest = (
        select(
            GpuSample.host_id,
            GpuSample.gpu_index,
            func.max(GpuSample.at).label("at"),
        )
        .where(col(GpuSample.host_id).in_(host_ids))
        .group_by(col(GpuSample.host_id), col(GpuSample.gpu_index))
        .subquery()
    )
    rows = s.exec(
        select(GpuSample)
        .join(
            newest,
            (col(GpuSample.host_id) == newest.c.host_id)
            & (col(GpuSample.gpu_index) == newest.c.gpu_index)
            & (col(GpuSample.at) == newest.c.at),
        )
        .order_by(col(GpuSample.host_id), col(GpuSample.gpu_index), col(GpuSample.id))
    ).all()
    names = {h.id: h.name for h in s.exec(select(Host).where(col(Host.id).in_(host_ids)))}
    models = {
        (g.host_id, g.index): g.model
        for g in s.exec(select(Gpu).where(col(Gpu.host_id).in_(host_ids)))
    }
    held = {
        (h.interval.host_id, h.gpu.index): h.user.display_name
        for h in who_holds(s, host_ids=host_ids)
    }
    seen: set[tuple[int, int]] = set()
    out = []
    for r in rows:
        key = (r.host_id, r.gpu_index)
        if key in seen:  # two rows at the same instant (a merge and a raw one): take one
            continue
        seen.add(key)
        out.append(Latest(names.get(r.host_id, "?"), r, models.get(key, "?"), held.get(key)))
    return out


def history(s: Session, host_ids: Sequence[int], start: datetime) -> list[GpuSeries]:
    """Each GPU's samples since `start`, as chart series."""
    from bot.domain.charts import GpuSeries

    if not host_ids:
        return []
    names = {h.id: h.name for h in s.exec(select(Host).where(col(Host.id).in_(host_ids)))}
    models = {
        (g.host_id, g.index): g.model
        for g in s.exec(select(Gpu).where(col(Gpu.host_id).in_(host_ids)))
    }
    rows = s.exec(
        select(GpuSample)
        .where(col(GpuSample.host_id).in_(host_ids), col(GpuSample.at) >= start)
        .order_by(col(GpuSample.host_id), col(GpuSample.gpu_index), col(GpuSample.at))
    ).all()
    by_gpu: dict[tuple[int, int], list[GpuSample]] = {}
    for r in rows:
        by_gpu.setdefault((r.host_id, r.gpu_index), []).append(r)
    out = []
    for (host_id, index), got in by_gpu.items():
        gap = timedelta(seconds=3 * max(g.span_s for g in got))
        out.append(
            GpuSeries(
                label=f"{names.get(host_id, '?')}:{index} {models.get((host_id, index), '')}".strip(),
                times=[g.at for g in got],
                util_pct=[g.util_pct for g in got],
                mem_pct=[
                    100.0 * g.mem_used_mb / g.mem_total_mb if g.mem_total_mb else 0.0 for g in got
                ],
                max_gap=max(gap, timedelta(minutes=3)),
            )
        )
    return out


# --- views ------------------------------------------------------------------------------


def _num(value: float | None, unit: str, fmt: str = ".0f") -> str:
    return "–" if value is None else f"{value:{fmt}}{unit}"


def _ago(at: datetime, now: datetime) -> str:
    return timefmt.relative(at, now)


def util_table(latest: Sequence[Latest], now: datetime) -> views.Table:
    rows = []
    for item in latest:
        smp = item.sample
        mem = f"{smp.mem_used_mb / 1024:.1f}/{smp.mem_total_mb / 1024:.0f} GiB"
        rows.append(
            (
                item.host,
                str(smp.gpu_index),
                item.model,
                f"{smp.util_pct:.0f}%",
                mem,
                _num(smp.temperature_c, "°C"),
                _num(smp.power_w, " W"),
                item.holder or "free",
                _ago(smp.at, now),
            )
        )
    return views.Table(
        ("host", "gpu", "model", "util", "memory", "temp", "power", "held by", "sampled"),
        tuple(rows),
    )


def util_view(
    latest: Sequence[Latest], now: datetime, chart_note: str | None, tz: str
) -> views.View:
    newest = max(x.sample.at for x in latest)
    oldest = min(x.sample.at for x in latest)
    busy = [x for x in latest if x.sample.util_pct >= 1]
    summary = (
        f"GPU utilization: {len(busy)} of {len(latest)} GPUs busy, "
        f"as of {timefmt.when(newest, now, tz)}"
    )
    blocks: list[views.Block] = [views.Header("GPU utilization"), util_table(latest, now)]
    age = (
        f"Latest samples from {_ago(newest, now)}"
        if newest - oldest < timedelta(minutes=2)
        else f"Samples from {_ago(newest, now)} (newest) to {_ago(oldest, now)} (oldest)"
    )
    blocks.append(
        views.Context(age + "; hosts are sampled only while GPUs on them are held or running.")
    )
    if chart_note:
        blocks.append(views.Context(chart_note))
    return views.View(text=summary, blocks=tuple(blocks))


def _chart(s: Session, host_ids: Sequence[int], now: datetime, title: str, tz: str) -> bytes | None:
    from bot.domain.charts import utilization_chart

    series = history(s, host_ids, now - CHART_WINDOW)
    if not any(len(x.times) >= 2 for x in series):
        return None
    return utilization_chart(series, start=chart_start(series, now), end=now, title=title, tz=tz)


def chart_start(series: Sequence[GpuSeries], now: datetime) -> datetime:
    """Where the chart's time axis starts: the window's start, or the first sample when the
    data is shorter than the window (a fresh install, a host added an hour ago), with a
    twentieth of its span before it, so the lines fill the chart instead of its last pixel."""
    first = min(t for x in series for t in x.times)
    start = now - CHART_WINDOW
    if first <= start:
        return start
    return max(start, first - max((now - first) / 20, timedelta(seconds=30)))


def _hosts_named(s: Session, name: str | None) -> list[Host]:
    hosts = list(s.exec(select(Host).where(Host.state != HOST_TERMINATED).order_by(col(Host.id))))
    if name is None:
        return hosts
    found = [h for h in hosts if h.name.lower() == name.lower()]
    if not found:
        known = ", ".join(h.name for h in hosts) or "none"
        raise UserError(f"There is no host `{name}`; hosts: {known}.", USAGE)
    return found


def util_reply(
    service: GpuService,
    actor: Actor,
    host: str | None,
    request_key: str | None = None,
) -> views.Reply:
    """`/gpu util [HOST]`: the latest samples as a table; the chart follows in a DM
    (a slash command's reply cannot carry a file). With no sample yet, say why."""
    now = service.clock.now()
    with transaction(service.engine, write=False) as s:
        hosts = _hosts_named(s, host)
        ids = [h.id for h in hosts if h.id is not None]
        latest = latest_samples(s, ids)
        busy = {h.name for h in busy_hosts(s) if h.id in ids}
        chart = _chart(
            s,
            ids,
            now,
            f"GPU utilization ({host})" if host else "GPU utilization",
            service.settings.timezone,
        )
    if not latest:
        return views.message(_why_nothing(service, hosts, busy))
    note = "The chart of the last 6 h follows in a DM." if chart else None
    view = util_view(latest, now, note, service.settings.timezone)
    if chart is not None:
        with transaction(service.engine) as s:
            service.notify_dm(
                s,
                actor.key,
                views.View(
                    text=f"GPU utilization over the last 6 h ({len(latest)} GPUs)",
                    blocks=(
                        views.Text(
                            f"GPU utilization over the last 6 h, up to {timefmt.clock(now, service.settings.timezone)}."
                        ),
                    ),
                ),
                now,
                dedupe=f"util-chart:{actor.key}:{request_key or now.isoformat()}",
                attachment=(f"gpu-util-{now:%Y%m%d-%H%M}.png", chart),
            )
    return views.Reply(view)


def _why_nothing(service: GpuService, hosts: Sequence[Host], busy: set[str]) -> str:
    """No sample at all: ask the hosts now, so the answer names the real reason (nothing
    busy yet, no driver, unreachable) rather than guessing."""
    if not hosts:
        return "No utilization yet: there are no GPU hosts."
    where = hosts[0].name if len(hosts) == 1 else "any host"
    idle = "" if busy else " nothing has been held or run there yet, and"
    lines = [
        f"No utilization samples for {where} yet:{idle} hosts are sampled only while a GPU "
        "on them is held or a run is running."
    ]
    access = service.runs.access
    for h in hosts[:8]:
        seat = access.runner_for(h.name)
        if seat is None:
            continue
        try:
            snap = probe(seat, timeout=15)
        except ProbeFailed as exc:
            lines.append(f"{h.name}: did not answer ({exc}).")
            continue
        this = service.display.called(h.name, h.provider)
        if not snap.gpus:
            # The probe's own words usually start with "no NVIDIA driver"; say it once.
            reason = (snap.error or "").removeprefix(NO_DRIVER).strip(" :()")
            detail = f" ({reason})" if reason else ""
            lines.append(f"{h.name}: {NO_DRIVER} on {this}, so there is nothing to sample{detail}.")
        else:
            working = sum(1 for g in snap.gpus if (g.util_pct or 0) >= 1)
            when = "with the next sample" if h.name in busy else "when one is held"
            lines.append(
                f"{h.name}: {len(snap.gpus)} GPUs answer now, {working} working; "
                f"samples start {when}."
            )
    return "\n".join(lines)


# --- the channel snapshot ---------------------------------------------------------------


def snapshot_job(service: GpuService) -> bool:
    """Posts the table and chart to the team channel every util_post_interval, only while
    something runs or is held; the dedupe key is the interval slot, so a retry or a second
    worker never posts one slot twice. Returns whether it queued a post."""
    interval = service.settings.util_post_interval
    if interval <= timedelta(0):
        return False
    now = service.clock.now()
    slot = math.floor(now.timestamp() / interval.total_seconds())
    with transaction(service.engine, write=False) as s:
        hosts = busy_hosts(s)
        ids = [h.id for h in hosts if h.id is not None]
        fresh = [x for x in latest_samples(s, ids) if now - x.sample.at <= interval]
        if not fresh:
            return False  # nothing busy, or nothing sampled (no driver): nothing to say
        chart = _chart(s, ids, now, "GPU utilization", service.settings.timezone)
    view = util_view(fresh, now, None, service.settings.timezone)
    service.notify_channel(
        view,
        dedupe=f"util-post:{int(interval.total_seconds())}:{slot}",
        attachment=(f"gpu-util-{now:%Y%m%d-%H%M}.png", chart) if chart else None,
    )
    return True
