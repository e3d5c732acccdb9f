"""The scheduler's inputs as the worker assembles them from the database: the queued
runs, the fleet (ready hosts with who holds which GPUs until when, booting and
stopped instances, idle times), and each user's decayed usage. `gpubot simulate`
feeds bot.domain.scheduling.decide the same shapes from its own world."""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta

from sqlalchemy import and_, func, or_
from sqlmodel import Session, col, select

from bot.app.held import who_holds
from bot.app.rollups import fair_share_usage
from bot.app.runs.context import RunContext, host_view, hosts_with_gpus
from bot.domain.scheduling import Allocation, FleetInstance, QueuedRun, RunHistory
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    RES_WAITING,
    RUN_CANCELLING,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_SUCCEEDED,
    Host,
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
) -> tuple[list[QueuedRun], list[FleetInstance], dict[str, Host], dict[str, float]]:
    waiting_models = {
        r.gpu_model for r in s.exec(select(Reservation).where(Reservation.state == RES_WAITING))
    }
    history = run_history(s, now)
    queue = []
    for run, user in s.exec(
        select(TrainingRun, User)
        .join(User)
        .where(TrainingRun.state == RUN_QUEUED)
        .order_by(col(TrainingRun.id))
    ):
        # Someone waiting for a reservation of this model goes first: people at a
        # keyboard before batch work.
        if run.gpu_model in waiting_models or None in waiting_models:
            continue
        queue.append(
            QueuedRun(
                run_id=str(run.id),
                user=user.key,
                gpus=run.gpu_count,
                gpu_model=run.gpu_model or "",
                submit_s=run.submitted_at.timestamp(),
                # the user's --max, else what the team's finished runs predict
                est_duration_s=float(run.max_seconds)
                if run.max_seconds
                else history.predict_duration(user.key, run.gpu_count),
                priority=run.priority,
                spot=run.spot,
                preemptible=run.recipe is not None or run.spot or run.checkpoints,
            )
        )
    hosts: dict[str, Host] = {}
    fleet = []
    now_s = now.timestamp()
    # Booting and stopped instances too: the scheduler must see what is on its way.
    for host in s.exec(
        select(Host).where(col(Host.state).in_((HOST_PENDING, HOST_STOPPED))).order_by(col(Host.id))
    ):
        view = host_view(
            name=host.name,
            state=host.state,
            instance_type=host.instance_type,
            market=host.market,
            usd_hr=host.hourly_usd,
            created_s=host.created_at.timestamp(),
            updated_s=host.updated_at.timestamp(),
            now=now_s,
            catalog=ctx.catalog,
            config=ctx.config,
        )
        if view is not None:
            fleet.append(view)
    last_use = {
        host_id: ended
        for host_id, ended in s.exec(
            select(UsageInterval.host_id, func.max(UsageInterval.ended_at)).group_by(
                col(UsageInterval.host_id)
            )
        )
    }
    open_rows = who_holds(s)
    for host, gpus in hosts_with_gpus(s, Host.state == HOST_READY):
        if not gpus:
            continue
        hosts[host.name] = host
        by_holder: dict[str, tuple[str, int, float | None]] = {}
        # run -> (preemptible, stopping, started_s), as Allocation takes them
        flags: dict[str, tuple[bool, bool, float | None]] = {}
        for hold in open_rows:
            iv, user, res, held_by = hold.interval, hold.user, hold.reservation, hold.run
            if iv.host_id != host.id:
                continue
            if res is not None:
                key, end = f"res:{res.id}", res.ends_at.timestamp() if res.ends_at else None
            else:
                started = (
                    held_by.started_at
                    if held_by is not None and held_by.started_at
                    else iv.started_at
                )
                limit = held_by.max_seconds if held_by is not None else None
                key, end = f"{iv.run_id}", (started.timestamp() + limit) if limit else None
                if end is None and held_by is not None:
                    end = history.predict_end(
                        user.key, held_by.gpu_count, started.timestamp(), now_s
                    )
                if held_by is not None:
                    # Recipes checkpoint on SIGTERM (training.loop); a --spot or
                    # --checkpoints run's owner said it resumes. Nothing else moves.
                    flags[key] = (
                        held_by.state == RUN_RUNNING
                        and (held_by.recipe is not None or held_by.spot or held_by.checkpoints),
                        held_by.state == RUN_CANCELLING or "interrupted" in held_by.placement,
                        started.timestamp(),
                    )
            _, n, _ = by_holder.get(key, (user.key, 0, end))
            by_holder[key] = (user.key, n + 1, end)
        models = sorted({g.model for g in gpus})
        fleet.append(
            FleetInstance(
                instance_id=host.name,
                instance_type=host.instance_type or host.provider,
                gpu_model=models[0],
                gpus=len(gpus),
                usd_hr=host.hourly_usd,
                market="spot" if host.market == "spot" else "ondemand",
                state="running",
                ready_at_s=host.created_at.timestamp(),
                allocations=tuple(
                    Allocation(k, u, n, e, *flags.get(k, (False, False, None)))
                    for k, (u, n, e) in by_holder.items()
                ),
                # idle since its last GPU was let go (or since it came up)
                idle_since_s=None
                if by_holder
                else _ts_or(last_use.get(host.id or -1), host.created_at).timestamp(),
            )
        )
    return queue, fleet, hosts, fair_usage(ctx, s, now)


def run_history(s: Session, now: datetime) -> RunHistory:
    """The run times of the runs that finished in the last 30 days, per user and
    size: the same predictions the simulator makes under --estimates none."""
    history = RunHistory()
    since = now - timedelta(days=30)
    for run, user in s.exec(
        select(TrainingRun, User)
        .join(User)
        .where(
            col(TrainingRun.state).in_((RUN_SUCCEEDED, RUN_FAILED)),
            col(TrainingRun.finished_at).is_not(None),
            col(TrainingRun.started_at).is_not(None),
            TrainingRun.finished_at > since,  # type: ignore[operator]
        )
        .order_by(col(TrainingRun.finished_at), col(TrainingRun.id))
    ):
        if run.started_at is not None and run.finished_at is not None:
            took = (run.finished_at - run.started_at).total_seconds()
            history.add(user.key, run.gpu_count, took)
    return history


def fair_usage(ctx: RunContext, s: Session, now: datetime) -> dict[str, float]:
    """Each user's GPU-seconds, decayed with the scheduler's half-life (Slurm's fair
    share): the counters kept as intervals close (bot.app.rollups), plus what is held now.
    Only a half-life other than the counters' reads the intervals themselves."""
    kept = fair_share_usage(s, now, ctx.config.half_life_s)
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
