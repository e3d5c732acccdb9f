"""The scheduler's inputs as the worker assembles them from the database: the queued
runs, the fleet (ready hosts with who holds which GPUs until when, booting and
stopped instances, idle times), and each user's decayed usage. `gpubot simulate`
feeds bot.domain.scheduling.decide the same shapes from its own world."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, true
from sqlmodel import Session, col, select

from bot.app.burst.state import on_cloud
from bot.app.money.rollups import fair_share_usage
from bot.app.runs.context import RunContext, host_view
from bot.app.runtimes import estimates
from bot.app.watching.held import attained_s, held_for_scheduler
from bot.domain.scheduling import Allocation, FleetInstance, QueuedRun
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    MARKET_CLUSTER,
    RES_WAITING,
    RUN_CANCELLING,
    RUN_QUEUED,
    RUN_RUNNING,
    Gpu,
    Host,
    HostPeriod,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)

log = logging.getLogger(__name__)


def anything_to_decide(s: Session) -> bool:
    """Whether a run is queued or one that could be preempted is running: without
    either the scheduler has nothing to place or move (dispatch's own test below),
    so an idle tick need not load the fleet and the usage."""
    movable = or_(
        col(TrainingRun.state) == RUN_QUEUED,
        and_(
            col(TrainingRun.state) == RUN_RUNNING,
            or_(col(TrainingRun.recipe).is_not(None), col(TrainingRun.spot).is_(True)),
        ),
    )
    return s.exec(select(TrainingRun.id).where(movable).limit(1)).first() is not None


def scheduler_inputs(
    ctx: RunContext, s: Session, now: datetime
) -> tuple[list[QueuedRun], list[FleetInstance], set[str], dict[str, float]]:
    """(queued runs, fleet, names of the ready hosts runs can be placed on, decayed usage).

    Plain columns throughout, no ORM objects: a dispatch with work to do read every ready
    host and its GPUs, the open intervals with five objects each, and the runs as objects,
    which grew with the fleet (800 GPU objects at a hundred hosts)."""
    waiting_models = set(
        s.exec(select(Reservation.gpu_model).where(Reservation.state == RES_WAITING).distinct())
    )
    queue = []
    run_cols: tuple[Any, ...] = (
        TrainingRun.id,
        User.key,
        TrainingRun.gpu_count,
        TrainingRun.gpu_model,
        TrainingRun.submitted_at,
        TrainingRun.max_seconds,
        TrainingRun.priority,
        TrainingRun.spot,
        TrainingRun.recipe,
        TrainingRun.checkpoints,
        TrainingRun.metrics,
    )
    queued: Any = (
        select(*run_cols)
        .join(User, col(User.id) == col(TrainingRun.user_id))
        .where(TrainingRun.state == RUN_QUEUED)
        .order_by(col(TrainingRun.id))
    )
    # Someone waiting for a reservation of this model goes first: people at a keyboard
    # before batch work.
    placeable = [
        row for row in s.exec(queued) if row[3] not in waiting_models and None not in waiting_models
    ]
    if ctx.cluster is not None and placeable:
        # Beside a cluster, gpubot places only the runs taken out of its queue for the
        # cloud (bot.app.burst); the cluster's own scheduler places the rest.
        elsewhere = on_cloud(s)
        placeable = [row for row in placeable if row[0] in elsewhere]
    holds = held_for_scheduler(s)
    # What the team's finished runs predict (bot.app.runtimes: kept as runs end), for the
    # runs with no --max: those queued, and those holding GPUs.
    asked = {(row[1], row[2]) for row in placeable if not row[5]} | {
        (h.user_key, h.run_gpu_count)
        for h in holds
        if h.run_state is not None and not h.run_max_seconds
    }
    history = estimates(ctx.engine, s, now, asked) if asked else None
    for row in placeable:
        run_id, user_key, gpus, model, submitted, max_s, priority, spot, recipe, ckpt = row[:10]
        queue.append(
            QueuedRun(
                run_id=str(run_id),
                user=user_key,
                gpus=gpus,
                gpu_model=model or "",
                submit_s=submitted.timestamp(),
                # the user's --max, else what the team's finished runs predict
                est_duration_s=float(max_s)
                if max_s or history is None
                else history.predict_duration(user_key, gpus),
                priority=priority,
                spot=spot,
                preemptible=recipe is not None or spot or ckpt,
                # how long its earlier segments ran (RunRecords.requeue keeps the sum): a
                # resumed run queues behind ones that never ran, and is not moved again
                # before it has run that long once more (the simulator's rule)
                attained_s=attained_s(row[10]),
            )
        )
    fleet = []
    now_s = now.timestamp()
    # Booting and stopped instances too: the scheduler must see what is on its way. Each
    # is dated by its open billed period: a booting one has been booting since it was
    # launched or restarted, a stopped one stopped since it was stopped (the host row's
    # own times move with every refresh of the cloud's listing).
    period_start: Any = (
        select(HostPeriod.started_at)
        .where(col(HostPeriod.host_id) == col(Host.id), col(HostPeriod.ended_at).is_(None))
        .limit(1)
        .scalar_subquery()
    )
    away_cols: tuple[Any, ...] = (
        Host.name,
        Host.state,
        Host.instance_type,
        Host.market,
        Host.hourly_usd,
        Host.created_at,
        Host.updated_at,
        Host.ready_at,
        period_start,
    )
    # Where several places are routed, only their hosts (a place that refuses runs, a
    # cluster's nodes, are not the scheduler's to place on).
    places = ctx.run_places
    anywhere: Any = col(Host.provider).in_(sorted(places)) if places is not None else true()
    away: Any = (
        select(*away_cols)
        .where(col(Host.state).in_((HOST_PENDING, HOST_STOPPED)), anywhere)
        .order_by(col(Host.id))
    )
    for name, state, itype, market, usd_hr, created, updated, was_ready, since in s.exec(away):
        view = host_view(
            name=name,
            state=state,
            instance_type=itype,
            market=market,
            usd_hr=usd_hr,
            since_s=_aware(since or (created if state == HOST_PENDING else updated)).timestamp(),
            restarted=was_ready is not None,
            now=now_s,
            catalog=ctx.catalog,
            config=ctx.config,
        )
        if view is not None:
            fleet.append(view)
    # Who holds what now, per host: run -> (user, GPUs, expected end), and per run the
    # flags Allocation takes (preemptible, stopping, started_s, attained_s).
    by_host: dict[int, dict[str, tuple[str, int, float | None]]] = {}
    flags: dict[str, tuple[bool, bool, float | None, float]] = {}
    for h in holds:
        if h.reservation_id is not None:
            key = f"res:{h.reservation_id}"
            end = h.reservation_ends_at.timestamp() if h.reservation_ends_at else None
        else:
            started = h.run_started_at or h.started_at
            limit = h.run_max_seconds
            key, end = f"{h.run_id}", (started.timestamp() + limit) if limit else None
            if h.run_state is not None:
                if end is None and history is not None:
                    end = history.predict_end(
                        h.user_key, h.run_gpu_count, started.timestamp(), now_s
                    )
                # Recipes checkpoint on SIGTERM (training.loop); a --spot or
                # --checkpoints run's owner said it resumes. Nothing else moves.
                flags[key] = (
                    h.run_state == RUN_RUNNING and h.run_movable,
                    h.run_state == RUN_CANCELLING or h.run_interrupted,
                    started.timestamp(),
                    h.run_attained_s,
                )
        holders = by_host.setdefault(h.host_id, {})
        _, n, _ = holders.get(key, (h.user_key, 0, end))
        holders[key] = (h.user_key, n + 1, end)
    # Each ready host with its present GPUs counted (and its first model), one grouped
    # query; a host without GPUs is not offered.
    ready_cols: tuple[Any, ...] = (
        Host.id,
        Host.name,
        Host.instance_type,
        Host.provider,
        Host.hourly_usd,
        Host.market,
        Host.created_at,
        func.count(col(Gpu.id)),
        func.min(col(Gpu.model)),
    )
    ready: Any = (
        select(*ready_cols)
        .join(Gpu, col(Gpu.host_id) == col(Host.id))
        # A cluster's nodes are placed on by its own scheduler, not this one.
        .where(
            Host.state == HOST_READY,
            col(Host.market) != MARKET_CLUSTER,
            col(Gpu.present).is_(True),
            anywhere,
        )
        .group_by(
            col(Host.id),
            col(Host.name),
            col(Host.instance_type),
            col(Host.provider),
            col(Host.hourly_usd),
            col(Host.market),
            col(Host.created_at),
        )
        .order_by(col(Host.id))
    )
    rows = s.exec(ready).all()
    # Since when an unheld host has been idle: the latest of its last interval's end, the
    # start of its billed period (a restart) and when it became ready (its boot done),
    # which is the fleet's idle-stop rule (bot.app.fleet.idlestop) and the simulator's,
    # so the scheduler does not count a restarted instance as idle since before it was
    # stopped (it then asked to stop it and launch another), nor a new one as idle while
    # it booted.
    # Asked only for hosts nobody holds anything on now (asked even when there are none,
    # so that a dispatch costs the same statements whatever the fleet: tests/core/test_history).
    # One subquery per host, each the last entry of the host's range in the (host_id,
    # ended_at) index; a GROUP BY over the intervals read every interval the idle hosts
    # ever had, a million rows after a busy year.
    idle_ids = [row[0] for row in rows if row[0] not in by_host]
    last_end: Any = (
        select(func.max(UsageInterval.ended_at))
        .where(col(UsageInterval.host_id) == col(Host.id))
        .scalar_subquery()
    )
    last: Any = select(Host.id, last_end, period_start, Host.ready_at).where(
        col(Host.id).in_(idle_ids)
    )
    last_use: dict[int, datetime] = {}
    for host_id, ended, paid, ready in s.exec(last):
        seen = [_aware(t) for t in (ended, paid, ready) if t is not None]
        if seen:
            last_use[host_id] = max(seen)
    names: set[str] = set()
    for host_id, name, itype, provider, usd_hr, market, created, n, model in rows:
        names.add(name)
        holders = by_host.get(host_id, {})
        fleet.append(
            FleetInstance(
                instance_id=name,
                instance_type=itype or provider,
                gpu_model=model,
                gpus=int(n),
                usd_hr=usd_hr,
                market="spot" if market == "spot" else "ondemand",
                state="running",
                ready_at_s=created.timestamp(),
                owned=market == "owned",
                allocations=tuple(
                    Allocation(k, u, c, e, *flags.get(k, (False, False, None, 0.0)))
                    for k, (u, c, e) in holders.items()
                ),
                # idle since its last GPU was let go (or since it came up)
                idle_since_s=None
                if holders
                else _ts_or(last_use.get(host_id), created).timestamp(),
            )
        )
    held = [(h.user_key, h.started_at) for h in holds]
    return queue, fleet, names, fair_usage(ctx, s, now, held)


def fair_usage(
    ctx: RunContext, s: Session, now: datetime, held: list[tuple[str, datetime]] | None = None
) -> dict[str, float]:
    """Each user's GPU-seconds, decayed with the scheduler's half-life (Slurm's fair
    share): the counters kept as intervals close (bot.app.money.rollups), plus what is held now
    (`held`, when read already). Only a half-life other than the counters' reads the
    intervals themselves."""
    kept = fair_share_usage(s, now, ctx.config.half_life_s, held)
    if kept is not None:
        return kept
    horizon = now - timedelta(seconds=ctx.config.half_life_s * 8)
    usage: dict[str, float] = {}
    for iv, user in s.exec(
        select(UsageInterval, User)
        .join(User)
        .where((col(UsageInterval.ended_at).is_(None)) | (col(UsageInterval.ended_at) > horizon))
    ):
        end = iv.ended_at or now
        secs = max(0.0, (end - iv.started_at).total_seconds())
        age = max(0.0, (now - end).total_seconds())
        usage[user.key] = usage.get(user.key, 0.0) + secs * math.pow(
            0.5, age / ctx.config.half_life_s
        )
    return usage


def _ts_or(value: datetime | None, default: datetime) -> datetime:
    return value if value is not None else default


def _aware(when: datetime) -> datetime:
    """SQLite hands back naive UTC datetimes; PostgreSQL aware ones."""
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
