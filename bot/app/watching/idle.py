"""Idle GPUs: ask the holder "Keep or Release?", and release when nobody answers.

A reservation is idle when every GPU it holds stayed under `idle_util_pct` for the
whole `idle_window`, judged from the samples attributed to it (bot.app.watching.utilization). GPU
memory does not count as use: a process that holds 30 GiB at 0% keeps others out and
computes nothing (squatting), so it is idle too. The window must be covered by samples
end to end: a gap (the worker was down, the host did not answer, a host without an
NVIDIA driver) is not evidence of idleness, and nobody loses GPUs over missing data.

The holder is asked once (`idle_prompted_at`), with what the idle time has cost. Keep
(`/gpu util keep N`) silences the question for one more window; activity clears it
silently; no answer within `idle_grace`, still idle, releases the reservation through
the service's own end path, with a DM that says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.service import Actor, GpuService
from bot.app.service.common import end_reservation, owned_reservation
from bot.app.watching.held import who_holds
from bot.app.watching.utilization import USAGE
from bot.domain import timefmt, views
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from db.models import (
    RES_ACTIVE,
    RES_RELEASED,
    Gpu,
    GpuSample,
    Host,
    Reservation,
    UsageInterval,
    User,
)
from db.session import lock_pool, locked, retrying, transaction

log = logging.getLogger(__name__)

ACTION_KEEP = "gpubot_idle_keep"
ACTION_RELEASE = "gpubot_idle_release"
# How far back the idle stretch (for its cost) is traced.
_LOOKBACK = timedelta(hours=24)


# --- the judgement (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    at: datetime
    span_s: int
    util_pct: float
    mem_used_mb: float


@dataclass(frozen=True)
class Assessment:
    covered: bool  # the samples cover the window end to end (within the tolerance)
    idle: bool  # covered, and every sample in it under the threshold
    mem_used_mb: float  # the most memory held in the window (squatting shows here)


def coverage_s(points: Sequence[Point], start: datetime, end: datetime) -> float:
    """Seconds of [start, end) that the samples stand for; a sample at `at` stands for
    [at, at + span_s). Overlaps (a merged sample beside a raw one) count once."""
    spans = sorted((max(p.at, start), min(p.at + timedelta(seconds=p.span_s), end)) for p in points)
    total = 0.0
    cur_start: datetime | None = None
    cur_end: datetime | None = None
    for a, b in spans:
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_start is not None and cur_end is not None:
                total += (cur_end - cur_start).total_seconds()
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_start is not None and cur_end is not None:
        total += (cur_end - cur_start).total_seconds()
    return total


def assess(
    points: Sequence[Point],
    start: datetime,
    end: datetime,
    threshold_pct: float,
    tolerance: timedelta,
) -> Assessment:
    inside = [p for p in points if p.at < end and p.at + timedelta(seconds=p.span_s) > start]
    need = (end - start - tolerance).total_seconds()
    covered = bool(inside) and coverage_s(inside, start, end) >= need
    idle = covered and all(p.util_pct < threshold_pct for p in inside)
    return Assessment(covered, idle, max((p.mem_used_mb for p in inside), default=0.0))


def idle_since(points: Sequence[Point], threshold_pct: float, tolerance: timedelta) -> datetime:
    """Where the trailing unbroken run of idle samples starts (points non-empty, all of
    the last window idle): a busy sample or a gap in the sampling ends it."""
    ordered = sorted(points, key=lambda p: p.at, reverse=True)
    since = ordered[0].at
    for p in ordered:
        if p.util_pct >= threshold_pct:
            break
        if p.at + timedelta(seconds=p.span_s) + tolerance < since:
            break  # a gap: what came before it is not known to be idle
        since = min(since, p.at)
    return since


# --- the job ----------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleReport:
    prompted: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    cleared: tuple[int, ...] = ()


def idle_job(service: GpuService) -> IdleReport:
    """The worker's job (every util_sample_s) over active reservations."""
    with transaction(service.engine, write=False) as s:
        ids = list(
            s.exec(
                select(Reservation.id)
                .where(Reservation.state == RES_ACTIVE)
                .order_by(col(Reservation.id))
            ).all()
        )
    prompted: list[int] = []
    released: list[int] = []
    cleared: list[int] = []
    for res_id in ids:
        if res_id is None:
            continue
        try:
            outcome = _check(service, res_id)
        except Exception as exc:  # one reservation's failure must not stop the others
            log.error("idle check of reservation %s failed", res_id, exc_info=exc)
            continue
        if outcome == "prompted":
            prompted.append(res_id)
        elif outcome == "released":
            released.append(res_id)
        elif outcome == "cleared":
            cleared.append(res_id)
    report = IdleReport(tuple(prompted), tuple(released), tuple(cleared))
    if prompted or released:
        log.info("idle: %s", report)
    return report


def _points(s: Session, res: Reservation, host_id: int, index: int, since: datetime) -> list[Point]:
    rows = s.exec(
        select(GpuSample)
        .where(
            GpuSample.host_id == host_id,
            GpuSample.gpu_index == index,
            GpuSample.reservation_id == res.id,
            col(GpuSample.at) >= since,
        )
        .order_by(col(GpuSample.at))
    ).all()
    return [Point(r.at, r.span_s, r.util_pct, r.mem_used_mb) for r in rows]


@retrying
def _check(service: GpuService, res_id: int) -> str | None:
    """Judges one reservation on a read; only when something is to be done does it take
    the write lock, judge again under it (a Keep or a release may have landed meanwhile)
    and act. Most reservations, most minutes, need nothing, and a write transaction per
    reservation per minute would queue behind every command on SQLite."""
    if _judge(service, res_id, act=False) is None:
        return None
    return _judge(service, res_id, act=True)


def _judge(service: GpuService, res_id: int, *, act: bool) -> str | None:
    cfg = service.settings
    with transaction(service.engine, write=act) as s:
        if act:
            # Acting may release (and so grant): the pool first, then the row under its
            # lock, judged again as it is now (db.session's lock order).
            lock_pool(s)
            res = locked(s, Reservation, res_id)
        else:
            res = s.get(Reservation, res_id)
        if res is None or res.state != RES_ACTIVE:
            return None
        now = service.clock.now()
        if res.idle_keep_until is not None and now < res.idle_keep_until:
            return None
        held = [(h.interval, h.gpu) for h in who_holds(s, reservation_id=res.id)]
        if not held:
            return None
        tolerance = timedelta(seconds=max(cfg.util_sample_s, 1.0))
        start = now - cfg.idle_window
        lookback = max(now - _LOOKBACK, res.granted_at or now)
        per_gpu = [_points(s, res, iv.host_id, g.index, min(lookback, start)) for iv, g in held]
        verdicts = [assess(p, start, now, cfg.idle_util_pct, tolerance) for p in per_gpu]
        idle = all(v.idle for v in verdicts)

        if res.idle_prompted_at is not None:
            asked = res.idle_prompted_at
            busy_since_asked = any(
                p.at >= asked and p.util_pct >= cfg.idle_util_pct for pts in per_gpu for p in pts
            )
            if busy_since_asked:
                if act:
                    res.idle_prompted_at = None  # back at work: forget the question quietly
                    s.add(res)
                return "cleared"
            if idle and now >= asked + cfg.idle_grace:
                if act:
                    _release_idle(service, s, res, held, now)
                return "released"
            return None

        if not idle:
            return None
        if not act:
            return "prompted"
        since = min(idle_since(p, cfg.idle_util_pct, tolerance) for p in per_gpu)
        since = max(since, res.idle_keep_until or since)
        rate = sum(iv.usd_per_hour for iv, _ in held)
        res.idle_prompted_at = now
        s.add(res)
        user = s.get(User, res.user_id)
        host = s.get(Host, held[0][0].host_id)
        assert user is not None and res.id is not None
        view = prompt_view(
            res.id,
            _what(held, host),
            idle_for=now - since,
            usd_per_hour=rate,
            mem_used_mb=sum(v.mem_used_mb for v in verdicts),
            threshold_pct=cfg.idle_util_pct,
            release_at=now + cfg.idle_grace,
            now=now,
            tz=service.settings.timezone,
        )
        service.notify_dm(s, user.key, view, now, dedupe=f"idle-prompt:{res.id}:{now.isoformat()}")
        return "prompted"


def _what(held: Sequence[tuple[UsageInterval, Gpu]], host: Host | None) -> str:
    models = sorted({g.model for _, g in held})
    indexes = ", ".join(str(g.index) for _, g in held)
    n = len(held)
    gpus = f"{n}× {'/'.join(models)}" if models else f"{n} GPUs"
    where = host.name if host is not None else "?"
    return f"{gpus} on {where} (GPU{'s' if n != 1 else ''} {indexes})"


def _release_idle(
    service: GpuService,
    s: Session,
    res: Reservation,
    held: Sequence[tuple[UsageInterval, Gpu]],
    now: datetime,
) -> None:
    """The same end as `/gpu release`: intervals closed, state released, the line granted."""
    assert res.id is not None
    what = _what(held, s.get(Host, held[0][0].host_id))
    end_reservation(s, res, RES_RELEASED, now)
    res.idle_prompted_at = None
    s.add(res)
    user = s.get(User, res.user_id)
    assert user is not None
    text = (
        f"Released reservation #{res.id} ({what}) because it was idle: its GPUs stayed "
        f"under {service.settings.idle_util_pct:g}% and nobody answered the idle question "
        f"within {format_duration(service.settings.idle_grace)}. `/gpu reserve` gets GPUs again."
    )
    service.notify_dm(
        s, user.key, views.View(text, (views.Text(text),)), now, dedupe=f"idle-release:{res.id}"
    )
    service.grant_pass(s, now)


def prompt_view(
    res_id: int,
    what: str,
    *,
    idle_for: timedelta,
    usd_per_hour: float,
    mem_used_mb: float,
    threshold_pct: float,
    release_at: datetime,
    now: datetime,
    tz: str,
) -> views.View:
    cost = usd_per_hour * idle_for.total_seconds() / 3600
    squat = (
        f", while holding {mem_used_mb / 1024:.1f} GiB of GPU memory" if mem_used_mb >= 1 else ""
    )
    money = (
        f"The idle time has cost ${cost:,.2f} so far (${usd_per_hour:,.2f}/h)."
        if usd_per_hour > 0
        else "These GPUs are owned, so no bill, but a teammate could be using them."
    )
    text = (
        f"Reservation #{res_id} ({what}) has been idle for {format_duration(idle_for)}: "
        f"under {threshold_pct:g}% utilization on every GPU{squat}. {money}"
    )
    keep = f"/gpu util keep {res_id}"
    release = f"/gpu release {res_id}"
    return views.View(
        text=text,
        blocks=(
            views.Text(text),
            views.Text(
                f"Keep it, or release it for the team? With no answer by "
                f"{timefmt.when(release_at, now, tz)} it is released."
            ),
            views.Actions(
                (
                    views.Button("Keep", ACTION_KEEP, keep, "primary", keep),
                    views.Button("Release", ACTION_RELEASE, release, "danger", release),
                )
            ),
        ),
    )


# --- Keep -------------------------------------------------------------------------------


@retrying
def keep(service: GpuService, actor: Actor, res_id: int) -> views.Reply:
    """`/gpu util keep N`: the holder (or an admin) says the idle GPUs are wanted.

    It changes no state and no GPU, so it does without the pool and locks one row,
    the reservation, with nothing after it (db.session): the user is only read (made
    first, before that lock, in the rare case it is new)."""
    with transaction(service.engine) as s:
        user = service.user_row(s, actor.key, actor.name)
        res = owned_reservation(s, actor, user, res_id, verb="keep", usage=USAGE)
        if res.state != RES_ACTIVE:
            raise UserError(
                f"Reservation #{res_id} is {res.state}; there is nothing to keep.", USAGE
            )
        now = service.clock.now()
        res.idle_keep_until = now + service.settings.idle_window
        res.idle_prompted_at = None
        s.add(res)
        if res.user_id != user.id:
            holder = s.get(User, res.user_id)
            audit(
                actor,
                "keep",
                f"reservation #{res_id} of {holder.key if holder else '?'}",
                session=s,
            )
        until = res.idle_keep_until
    return views.message(
        f"Keeping reservation #{res_id}. I won't ask about idle GPUs again before "
        f"{timefmt.when(until, service.clock.now(), service.settings.timezone)}."
    )
