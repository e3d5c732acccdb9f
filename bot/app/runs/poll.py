"""The worker's poll: read every running run's status file on its host, keep its
figures, and end it — finished, failed (with one retry at half the batch after an
out-of-memory exit), requeued with its checkpoint, or adopted/requeued when the
worker that started it died."""

from __future__ import annotations

import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlmodel import col, select

from bot.app.burst import state as burst_state
from bot.app.hosts import room
from bot.app.hosts.agentwatch import (
    checkpoint_dir,
    requeue_resumable,
    resumable_stop,
    save_for_resume,
)
from bot.app.runs.context import STARTING_GRACE, RunContext
from bot.app.runs.executor import GroupSignals, Look
from bot.app.runs.records import RunRecords
from bot.app.runs.routed import RoutedExecutor, group_of
from bot.domain import views
from db.models import (
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    RUN_SUCCEEDED,
    TrainingRun,
    User,
)
from db.session import lock_pool, locked, retrying, transaction
from provisioning.ssh import SshError
from training.exitcodes import EXIT_FAILED, EXIT_OOM

log = logging.getLogger(__name__)


# How many watched runs (a watcher waits on their end: `RunExecutor.watched`) have their
# status read in one poll, the longest unread first; every other run is read each poll.
# A watched run's end asks for a tick and is read then, so the budget only paces its
# figures: with 200 runs live each is read every fourth tick (a minute at 15 s) instead
# of 200 SSH reads a tick, which took 14 s (bench `live_runs`, issue 39).
LOOK_BUDGET = 50
# Hosts looked at in parallel in one poll (each host's runs one after another, on its
# one connection).
LOOK_THREADS = 8


class Poller:
    """Running runs to their end."""

    def __init__(self, ctx: RunContext, records: RunRecords) -> None:
        self.ctx = ctx
        self.records = records
        self._polls = 0
        self._looked: dict[int, int] = {}  # run id -> the poll that last read its status

    def _to_look(self, rows: list[TrainingRun]) -> set[int]:
        """The runs this poll reads: every one that is starting or stopping, or that no
        watcher waits on, or whose watcher has something (its end, its first figures:
        bot.app.runs.watch); and of the rest, the `LOOK_BUDGET` read longest ago."""
        executor = self.ctx.executor
        must: set[int] = set()
        optional: list[TrainingRun] = []
        for run in rows:
            assert run.id is not None
            placement = run.placement
            if (
                run.state == RUN_RUNNING
                and "interrupted" not in placement
                and executor.started(placement)
                and executor.watched(run.id, placement)
            ):
                optional.append(run)
            else:
                must.add(run.id)
        optional.sort(key=lambda r: (self._looked.get(r.id or 0, -1), r.id or 0))
        return must | {r.id for r in optional[:LOOK_BUDGET] if r.id is not None}

    def _places_itself(self, placement: dict[str, Any]) -> bool:
        """A run on a place whose own scheduler places runs (a cluster): its looks share
        one read of the controller, which must not be asked from eight threads at once."""
        executor = self.ctx.executor
        if isinstance(executor, RoutedExecutor):
            return executor.of(placement).places
        return executor.places

    def _look_ahead(self, rows: list[TrainingRun]) -> dict[int, Look | SshError]:
        """Reads the runs' statuses on their hosts in parallel, a host's runs in turn:
        one by one, 200 live runs' reads took about 70 ms each. Only runs the poll will
        not signal first (a signal before the read is the order that matters there)."""
        executor = self.ctx.executor
        by_host: dict[str, list[TrainingRun]] = {}
        for run in rows:
            by_host.setdefault(str(run.placement.get("host", "")), []).append(run)
        if len(by_host) < 2:
            return {}

        def looks(runs: list[TrainingRun]) -> list[tuple[int, Look | SshError]]:
            out: list[tuple[int, Look | SshError]] = []
            for run in runs:
                assert run.id is not None
                try:
                    out.append((run.id, executor.look(dict(run.placement))))
                except SshError as exc:
                    out.append((run.id, exc))
            return out

        found: dict[int, Look | SshError] = {}
        threads = min(LOOK_THREADS, len(by_host))
        with ThreadPoolExecutor(threads, thread_name_prefix="poll-look") as pool:
            for part in pool.map(looks, by_host.values()):
                found.update(part)
        return found

    def _signal_groups(self, rows: list[TrainingRun]) -> set[int]:
        """Cancelled runs that started as one group (a sweep's job array) told at once,
        in the executor's one call (`GroupSignals`): a sweep cancelled as one is one
        scancel, not one a run. Returns the runs told."""
        executor = self.ctx.executor
        groups: dict[tuple[str, str], list[TrainingRun]] = {}
        for run in rows:
            group = group_of(run.placement)
            if group is not None and executor.started(run.placement):
                groups.setdefault(group, []).append(run)
        told: set[int] = set()
        for members in groups.values():
            # Only a group cancelled whole (every open run of it, none told yet): a run
            # cancelled alone is signalled alone, below.
            if len(members) < 2 or any(
                r.state != RUN_CANCELLING or r.placement.get("term_sent") for r in members
            ):
                continue
            placements = [dict(r.placement) for r in members]
            target = (
                executor.of(placements[0]) if isinstance(executor, RoutedExecutor) else executor
            )
            if not isinstance(target, GroupSignals):
                continue
            try:
                if not target.signal_group(placements, "TERM"):
                    continue
            except SshError as exc:
                log.warning("signal of runs %s failed: %s", [r.id for r in members], exc)
                continue
            for run in members:
                assert run.id is not None
                self.records.update_placement(run.id, term_sent=True)
                told.add(run.id)
        return told

    def poll(self) -> int:
        """Reads every running run's status; finishes those that ended. Returns how many."""
        executor = self.ctx.executor
        # The executor's own upkeep first (host agents, bot.app.hosts.agentwatch: lease renewal,
        # spot notices, runs lost in a reboot), so a lost run is requeued, not failed below.
        executor.tend(self.records)
        with transaction(self.ctx.engine, write=False) as s:
            rows = list(
                s.exec(
                    select(TrainingRun).where(
                        col(TrainingRun.state).in_((RUN_STARTING, RUN_RUNNING, RUN_CANCELLING))
                    )
                )
            )
            # A run whose cluster job is being withdrawn for the cloud (bot.app.burst) is
            # the offers' to settle: its job's cancel is not the run's end.
            moving = burst_state.moving(s) if self.ctx.bursting else set()
        rows = [r for r in rows if r.id not in moving]
        self._watch(rows)
        signalled = self._signal_groups(rows)
        finished = 0
        now = self.ctx.core.clock.now()
        self._polls += 1
        to_look = self._to_look(rows)
        live = {r.id for r in rows}
        self._looked = {k: v for k, v in self._looked.items() if k in live}
        ahead = self._look_ahead(
            [
                r
                for r in rows
                if r.id in to_look
                and r.state == RUN_RUNNING
                and "interrupted" not in r.placement
                and not r.placement.get("nodes")
                and executor.started(r.placement)
                and not self._places_itself(r.placement)
            ]
        )
        for run in rows:
            assert run.id is not None
            if run.id not in to_look:
                continue  # watched, and read on an earlier poll: its end asks for a tick
            self._looked[run.id] = self._polls
            placement = dict(run.placement)
            if not executor.started(placement):
                if self.ctx.starts.in_flight(run.id):
                    continue  # its code is on its way (bot.app.runs.starts), not orphaned
                if run.started_at is not None and now - run.started_at > STARTING_GRACE:
                    self._requeue_orphan(run.id)
                continue
            several = bool(placement.get("nodes"))  # a run over several hosts
            interrupted = "interrupted" in placement
            try:
                stopping = run.state == RUN_CANCELLING or (interrupted and several)
                if stopping and not placement.get("term_sent") and run.id not in signalled:
                    # Cancelled, or one node's host got a spot notice: every node is told
                    # (each checkpoints and exits), the run stops as one.
                    executor.signal(placement, "TERM")
                    self.records.update_placement(run.id, term_sent=True)
                early = ahead.get(run.id)
                if isinstance(early, SshError):
                    raise early
                look = early if early is not None else executor.look(placement)
            except SshError as exc:
                log.warning("poll of run %s on %s failed: %s", run.id, placement.get("host"), exc)
                continue
            if look.waiting is not None:
                if run.state == RUN_RUNNING:
                    # The cluster put it back in its queue (a preemption, a requeue):
                    # its GPUs go back until the cluster starts it again.
                    self.records.back_in_cluster_queue(run.id, look.waiting)
                elif placement.get("stage") != look.waiting:
                    # A cluster's scheduler has not started it: `/gpu queue` says why, and
                    # when it expects to (what an offer of the cloud weighs: bot.app.burst).
                    expected = look.expected_start
                    self.records.update_placement(
                        run.id,
                        stage=look.waiting,
                        expected=expected.isoformat() if expected is not None else None,
                    )
                continue
            if look.where and run.state == RUN_STARTING:
                # A cluster's scheduler started it: its GPUs are metered from now.
                marked = self.records.mark_running(
                    run.id, look.where, look.usd_per_gpu_hour, look.started_at
                )
                if look.alive or marked is None:
                    continue  # (None: metered once its GPUs' last holder's end is seen)
                placement = {**placement, "host": look.where[0][0]}
            # Node 0 holds rank 0: its status file is the run's (one result, one DM).
            status, alive = look.status, look.alive
            if status is not None:
                self.records.update_metrics(run.id, status, live_runs=len(rows))
            if several and alive and "node_failed" not in placement and not interrupted:
                # (An interrupted run's nodes end on purpose: not a node failing.)
                failed = executor.failed_node(placement)
                if failed is not None:
                    # One node failing ends them all: the rest would wait in a collective.
                    log.warning("run %s: %s; stopping its other nodes", run.id, failed)
                    self.records.update_placement(run.id, node_failed=failed)
                    with contextlib.suppress(SshError):
                        executor.signal(placement, "TERM")
                    continue
            if alive:
                continue  # still running, or its final status is written and it is exiting
            # Node 0 has ended: a node still running cannot go on alone.
            node_failed = placement.get("node_failed")
            if several:
                executor.signal(placement, "KILL" if node_failed else "TERM", others_only=True)
            # Stopped for a resume (exit 75) or reclaimed: back in line with its checkpoint.
            if (
                run.state != RUN_CANCELLING
                and node_failed is None
                and resumable_stop(placement, status)
                and requeue_resumable(
                    self.records,
                    run.id,
                    placement,
                    functools.partial(executor.save_checkpoint, placement),
                    status,
                )
            ):
                continue
            tail = ""
            with contextlib.suppress(SshError):
                tail = executor.tail(placement, 15)
            if run.state == RUN_CANCELLING:
                state = RUN_CANCELLED
            elif status is not None and status.state == "done" and node_failed is None:
                state = RUN_SUCCEEDED
            else:
                state = RUN_FAILED
            summary: dict[str, Any] = {}
            exit_code = None
            if status is not None:
                exit_code = status.exit_code
                summary = {
                    "state": status.state,
                    "precision": status.precision,
                    "error": status.error,
                }
                if status.summary is not None:
                    summary.update(
                        final_metrics=status.summary.final_metrics,
                        final_loss=status.summary.final_loss,
                        wall_s=status.summary.wall_s,
                    )
            elif state == RUN_FAILED:
                summary = {
                    "error": look.ended or "the process ended without writing a final status"
                }
            if look.ended and status is not None and state != RUN_CANCELLED:
                # The place ended it (a cluster's time limit, memory, node): said too.
                said = summary.get("error")
                summary["error"] = f"{said}; {look.ended}" if said else look.ended
            if node_failed is not None and state == RUN_FAILED:
                summary["error"] = node_failed
                exit_code = exit_code or EXIT_FAILED
            full = self._disk_full(placement) if state == RUN_FAILED and not several else None
            if full is not None:
                # Said first: whatever the program made of its ENOSPC comes after.
                said = summary.get("error")
                summary["error"] = f"{full}; {said}" if said else full
                exit_code = exit_code or EXIT_FAILED
            # Out of GPU memory (exit 77): once more with half the batch; then the advice.
            if state == RUN_FAILED and exit_code == EXIT_OOM and node_failed is None:
                if self._retry_oom(run.id, status, placement):
                    continue
                summary["error"] = f"{summary.get('error') or 'out of GPU memory'}. {OOM_ADVICE}"
            if status is not None and status.state == "time_limit" and node_failed is None:
                # Stopped at its limit with a checkpoint: kept here, so that
                # `/gpu run --resume ID` goes on from it wherever the next run lands.
                saved = save_for_resume(
                    checkpoint_dir(self.ctx.core.settings.home, run.id),
                    run.id,
                    functools.partial(executor.save_checkpoint, placement),
                    status,
                )
                if saved is not None:
                    summary["resume_step"] = saved
            ended = executor.ended_at(run.id, placement)
            self.records.finish(run.id, state, exit_code, summary, tail, status, ended)
            finished += 1
        return finished

    def _disk_full(self, placement: dict[str, Any]) -> str | None:
        """ "disk full on HOST: …" when the failed run's host has less room than
        `min_free_mb` where the run lived, and the host marked full (bot.app.hosts.room);
        None when it has room or cannot tell."""
        settings = self.ctx.core.settings
        try:
            free = self.ctx.executor.free_mb(placement)
        except SshError as exc:
            log.info("could not read the free disk on %s: %s", placement.get("host"), exc)
            return None
        if not room.is_full(free, settings):
            return None
        assert free is not None
        host = str(placement.get("host", ""))
        reason = room.full_reason(host, str(placement.get("dir", "")), free)
        room.mark_full(self.ctx.engine, settings, host, reason, self.ctx.core.clock.now())
        return reason

    def _watch(self, rows: list[TrainingRun]) -> None:
        """Every started run watched (bot.app.runs.executor), nothing else: after a restart,
        or for a run adopted from a worker that died, its end is learnt as it happens too,
        and its first figures when they are still to come."""
        executor = self.ctx.executor
        executor.keep_watching(run.id for run in rows if run.id is not None)
        for run in rows:
            if run.id is not None and executor.started(run.placement):
                figures_due = not (run.metrics.get("live") or {}).get("figures")
                executor.watch(run.id, dict(run.placement), figures_due)

    @retrying
    def _retry_oom(self, run_id: int, status: Any, placement: dict[str, Any]) -> bool:
        """Puts a run that ran out of GPU memory back in line with half the batch it used
        (from its status; `GPUBOT_BATCH_SCALE=0.5` tells a script that did not say), and
        tells its owner. False when it was retried already or the batch was 1: then it
        fails, with the advice."""
        used = getattr(status, "batch_size", None) if status is not None else None
        if used is None and status is not None:  # a script's training.report(batch_size=...)
            said = status.metrics.get("batch_size")
            used = int(said) if isinstance(said, int | float) and said >= 1 else None
        with transaction(self.ctx.engine, write=False) as s:
            run = s.get(TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False
            if run.metrics.get("oom_retry") or (isinstance(used, int) and used <= 1):
                return False
        # The old attempt's status and handle must not be read as the new one's.
        self.ctx.executor.forget_attempt(placement)
        half = used // 2 if isinstance(used, int) else None
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False
            self.records.close_intervals(s, run_id, now)
            run.metrics = {
                **run.metrics,
                "oom_retry": {"from_batch": used, "batch_size": half, "at": now.isoformat()},
            }
            run.state = RUN_QUEUED
            run.placement = {}
            run.host_id = None
            run.started_at = None
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            was = f"at batch {used}" if used else "(its batch size was not reported)"
            now_with = f"batch {half}" if half else "half the batch (GPUBOT_BATCH_SCALE=0.5)"
            text = (
                f"Run #{run_id} ran out of GPU memory {was}. It is back in line and will be "
                f"retried once with {now_with}."
            )
            self.ctx.core.notify_dm(
                s,
                owner.key,
                views.View(text=text, blocks=(views.Text(text), views.cancel_run_button(run_id))),
                now,
                dedupe=f"run-oom-retry:{run_id}",
            )
            self.ctx.core.grant_pass(s, now)
        return True

    @retrying
    def _requeue_orphan(self, run_id: int) -> None:
        with transaction(self.ctx.engine, write=False) as s:
            claimed = s.get(TrainingRun, run_id)
            placement = dict(claimed.placement) if claimed is not None else {}
        started = self.ctx.executor.orphan(placement)
        if started is False:
            return  # the host cannot say now: ask again next poll, never start twice
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_STARTING or self.ctx.executor.started(run.placement):
                return
            if isinstance(started, dict):
                run.placement = {**run.placement, **started}
                run.state = RUN_RUNNING
                s.add(run)
                log.warning("run %s was started by a worker that died; adopted it", run_id)
                return
            self.records.close_intervals(s, run_id, self.ctx.core.clock.now())
            run.state = RUN_QUEUED
            # A resumed run keeps where its checkpoint is (bot.app.hosts.agentwatch).
            resume = run.placement.get("resume_from")
            run.placement = {"resume_from": resume} if resume else {}
            run.started_at = None
            s.add(run)
            log.warning("run %s was claimed but never started (crash?); back in line", run_id)


OOM_ADVICE = (
    "It ran out of GPU memory again after a retry with half the batch: use a smaller "
    "`--batch-size` (or `--effective-batch` with gradient accumulation), `--precision bf16`, "
    "or a GPU with more memory (`--gpu h100`)"
)
