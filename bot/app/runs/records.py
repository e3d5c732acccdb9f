"""A run's row after it started: its placement and figures updated, back in line with
its checkpoint, or finished with its GPUs given back and its owner told. Dispatch
(a run that could not start) and poll (a run that ended) both end runs here, and the
host agents' watch (bot.app.hosts.agentwatch.WatchedRuns) requeues through it."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from bot.app.outbox import enqueue
from bot.app.ports import Core, HostAccess
from bot.app.runs.context import RunContext
from bot.app.runtimes import note_run_ended
from bot.app.watching import runwatch
from bot.app.watching.held import attained_s, end_held
from bot.domain import views
from db.models import (
    RUN_OPEN_STATES,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    Gpu,
    Host,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import lock_pool, locked, retrying, transaction
from training.status import RunStatus

log = logging.getLogger(__name__)


class RunRecords:
    """The run row's transitions after its start, each one transaction."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    # agentwatch.WatchedRuns: the clock, settings and hosts the watch needs
    @property
    def core(self) -> Core:
        return self.ctx.core

    @property
    def access(self) -> HostAccess:
        return self.ctx.access

    @property
    def engine(self) -> Any:
        return self.ctx.engine

    def tell_started(
        self, s: Session, run: TrainingRun, host_names: list[str], now: datetime
    ) -> None:
        """The owner's "started" DM, which becomes the run's live message (bot.app.watching.runwatch
        edits it in place while it runs), in the caller's transaction."""
        assert run.id is not None
        placement = run.placement
        owner = s.get(User, run.user_id)
        assert owner is not None
        unit = "CPU slot" if placement.get("cpu") else "GPU"
        indexes = list(placement.get("gpu_indexes") or [])
        count = len(indexes)
        if len(host_names) > 1:
            where = (
                f"{len(host_names)} hosts ({', '.join(host_names)}), "
                f"{count} {unit}{'s' if count != 1 else ''} on each"
            )
        else:
            where = (
                f"{host_names[0]}, {unit}"
                + ("s " if count != 1 else " ")
                + ", ".join(map(str, indexes))
            )
        text = (
            f"Run #{run.id} started on {where}. This message shows its progress: its "
            f"{runwatch.cadence(runwatch.live_period(1))}. `/gpu logs {run.id}` shows its log."
        )
        message = enqueue(
            s,
            "dm",
            owner.key,
            views.View(text=text, blocks=(views.Text(text), views.cancel_run_button(run.id))),
            now,
            # A resumed run says it started again (bot.app.hosts.agentwatch's resume count, or
            # the times a cluster put it back in its queue).
            dedupe=f"run-started:{run.id}"
            + (f":{placement['resume_from']['count']}" if "resume_from" in placement else "")
            + (f":q{placement['requeued']}" if placement.get("requeued") else ""),
        )
        runwatch.started_live(s, run, message)
        s.add(run)

    @retrying
    def mark_running(
        self,
        run_id: int,
        where: tuple[tuple[str, tuple[int, ...]], ...],
        usd_per_gpu_hour: float | None,
        started_at: datetime | None = None,
    ) -> bool | None:
        """A run a cluster's scheduler has just started (its look says where): its GPUs
        metered from its start by the cluster's clock (`started_at`; now when unknown, and
        never later than now), on the nodes' GPU rows, and its owner told. False when it
        is no longer waiting to start (cancelled meanwhile, or marked by an earlier poll);
        None when one of its GPUs' last use is still open (asked again at the next poll)."""
        now = self.ctx.core.clock.now()
        if started_at is not None:
            now = min(now, started_at)
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs are taken: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_STARTING or "host" in run.placement:
                return False
            hosts = []
            for name, indexes in where:
                host = s.exec(select(Host).where(Host.name == name)).first()
                if host is None:
                    log.warning("run %s runs on %s, which is not listed yet", run_id, name)
                    return False
                gpus = list(
                    s.exec(select(Gpu).where(Gpu.host_id == host.id, col(Gpu.index).in_(indexes)))
                )
                held = s.exec(
                    select(UsageInterval.id).where(
                        col(UsageInterval.gpu_id).in_([g.id for g in gpus]),
                        col(UsageInterval.ended_at).is_(None),
                    )
                ).first()
                if held is not None:
                    # The cluster gave a GPU on to this run while the bot has not yet
                    # seen its last holder end (a sweep's next task starts the moment
                    # one ends): metered once that end is recorded, from this start.
                    log.info("run %s started on a GPU whose last use is still open", run_id)
                    return None
                self.ctx.core.open_usage(
                    s,
                    host,
                    gpus,
                    run.user_id,
                    now,
                    run_id=run_id,
                    usd_per_gpu_hour=usd_per_gpu_hour,
                )
                hosts.append(host)
            first, indexes = where[0]
            run.placement = {
                **run.placement,
                "host": first,
                "gpu_indexes": list(indexes),
                "cpu": False,
            }
            run.placement.pop("stage", None)
            run.host_id = hosts[0].id
            run.started_at = now
            run.state = RUN_RUNNING
            s.add(run)
            self.tell_started(s, run, [name for name, _ in where], now)
        return True

    @retrying
    def back_in_cluster_queue(self, run_id: int, waiting: str) -> None:
        """A running run its cluster put back in its queue (preempted, requeued): its GPUs
        metered no more until the cluster starts it again (it resumes from its checkpoint
        in its own directory), its owner told once per requeue."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_RUNNING:
                return
            self.close_intervals(s, run_id, now)
            if run.started_at is not None:  # the segment it ran, for the scheduler's rules
                ran = max(0.0, (now - run.started_at).total_seconds())
                run.metrics = {**run.metrics, "attained_s": attained_s(run.metrics) + ran}
            count = int(run.placement.get("requeued") or 0) + 1
            placement = {
                k: v for k, v in run.placement.items() if k not in ("host", "gpu_indexes", "cpu")
            }
            run.placement = {**placement, "requeued": count, "stage": waiting}
            run.state = RUN_STARTING
            run.host_id = None
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            text = (
                f"Run #{run_id} was put back in the cluster's queue ({waiting}); it resumes "
                "from its checkpoint when the cluster starts it again."
            )
            self.ctx.core.notify_dm(
                s,
                owner.key,
                views.message(text).view,
                now,
                dedupe=f"run-requeued:{run_id}:q{count}",
            )

    @retrying
    def update_placement(self, run_id: int, **changes: Any) -> None:
        with transaction(self.ctx.engine) as s:
            run = locked(s, TrainingRun, run_id)  # one row, nothing after it (db.session)
            if run is not None:
                run.placement = {**run.placement, **changes}
                s.add(run)

    @retrying
    def update_metrics(self, run_id: int, status: RunStatus, live_runs: int = 1) -> None:
        """Stores the run's latest figures and watches it (bot.app.watching.runwatch: health alerts
        to its owner, once each; its live message edited about once a minute)."""
        with transaction(self.ctx.engine) as s:
            run = locked(s, TrainingRun, run_id)  # one row, nothing after it (db.session)
            if run is not None and run.state in RUN_OPEN_STATES:
                run.metrics = {**run.metrics, **runwatch.metrics_of(status)}
                owner = s.get(User, run.user_id)
                if run.state == RUN_RUNNING and owner is not None:
                    runwatch.watch(s, run, owner, status, self.ctx.core.clock.now(), live_runs)
                s.add(run)

    @retrying
    def requeue(
        self, run_id: int, resume_from: dict[str, Any], view: views.View, dedupe: str
    ) -> bool:
        """Back in line with its checkpoint (bot.app.hosts.agentwatch): a stop for a resume is not a
        failure. Its GPUs go back, its place in line is its old one (submitted_at)."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False  # cancelled meanwhile, or already moved on
            self.close_intervals(s, run_id, now)
            if run.started_at is not None:  # the segment it ran, for the scheduler's rules
                ran = max(0.0, (now - run.started_at).total_seconds())
                run.metrics = {**run.metrics, "attained_s": attained_s(run.metrics) + ran}
            run.state = RUN_QUEUED
            run.placement = {"resume_from": resume_from}
            run.host_id = None
            run.started_at = None
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            self.ctx.core.notify_dm(s, owner.key, view, now, dedupe=f"run-requeued:{dedupe}")
            self.ctx.core.grant_pass(s, now)
        return True

    @staticmethod
    def close_intervals(s: Session, run_id: int, at: datetime) -> float:
        cost = 0.0
        end_held(s, at, run_id=run_id)
        for iv in s.exec(select(UsageInterval).where(UsageInterval.run_id == run_id)):
            if iv.ended_at is not None:
                cost += iv.usd_per_hour * (iv.ended_at - iv.started_at).total_seconds() / 3600
        return cost

    @retrying
    def finish(
        self,
        run_id: int,
        state: str,
        exit_code: int | None,
        summary: dict[str, Any],
        log_tail: str,
        status: RunStatus | None = None,
        ended_at: datetime | None = None,
    ) -> None:
        """`ended_at`: when its process was seen gone (bot.app.runs.watch), which is what
        its GPUs are billed to; the time of this call when nobody saw it end."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in RUN_OPEN_STATES:
                return
            end = now
            if ended_at is not None:
                end = min(now, max(ended_at, run.started_at or ended_at))
            cost = self.close_intervals(s, run_id, end)
            run.state = state
            run.finished_at = end
            run.exit_code = exit_code
            run.metrics = {**run.metrics, "summary": summary, "cost_usd": round(cost, 4)}
            note_run_ended(s, run)  # its time, for the run-time estimates (bot.app.runtimes)
            owner = s.get(User, run.user_id)
            assert owner is not None
            # bot.app.watching.runwatch: metrics, precision and batch and why, GPU-hours, cost, the
            # health summary and the loss curve; for a failure the exit status in words.
            outcome = runwatch.Outcome(state, exit_code, status, log_tail, summary.get("error"))
            view, chart = runwatch.result_view(s, run, outcome, now)
            runwatch.close_live(s, run, owner, now)
            self.ctx.core.notify_dm(
                s, owner.key, view, now, dedupe=f"run-finished:{run_id}", attachment=chart
            )
            s.add(run)
            if run.sweep is not None:
                done = runwatch.sweep_done(s, run.sweep)
                if done is not None:
                    param = next(iter(set(done[0][0].options) - set(_base_options(done))), "lr")
                    self.ctx.core.notify_dm(
                        s,
                        owner.key,
                        runwatch.sweep_view(run.sweep, param, done),
                        now,
                        dedupe=f"sweep-finished:{run.sweep}",
                    )
            self.ctx.core.grant_pass(s, now)


def _base_options(rows: list[tuple[TrainingRun, float]]) -> set[str]:
    """The settings every variant of a sweep shares (same name and value): the swept
    one is the other."""
    first = rows[0][0].options
    return {k for k, v in first.items() if all(r.options.get(k) == v for r, _ in rows)}


def back_in_line(run: TrainingRun) -> None:
    """A claimed run back in line as it was: queued, on no host, its resume point kept
    (a start its place could not make, a cluster job withdrawn for the cloud)."""
    resume = run.placement.get("resume_from")
    run.placement = {"resume_from": resume} if resume else {}
    run.state = RUN_QUEUED
    run.host_id = None
    run.started_at = None
