"""The worker's poll: read every running run's status file on its host, keep its
figures, and end it — finished, failed (with one retry at half the batch after an
out-of-memory exit), requeued with its checkpoint, or adopted/requeued when the
worker that started it died."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from sqlmodel import col, select

from bot.app.agentwatch import requeue_resumable, resumable_stop, watch_hosts
from bot.app.runs.context import STARTING_GRACE, RunContext
from bot.app.runs.records import RunRecords
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
from provisioning import shell
from provisioning.ssh import SshError, SshRunner, SshTarget
from training.exitcodes import EXIT_FAILED, EXIT_OOM
from training.status import TERMINAL_STATES, parse_status

log = logging.getLogger(__name__)


class Poller:
    """Running runs to their end."""

    def __init__(self, ctx: RunContext, records: RunRecords) -> None:
        self.ctx = ctx
        self.records = records

    def poll(self) -> int:
        """Reads every running run's status; finishes those that ended. Returns how many."""
        # Host agents (bot.app.agentwatch): lease renewal, spot notices, runs lost in a reboot —
        # before the runs are read, so a lost run is requeued rather than failed below.
        try:
            watched = watch_hosts(self.records)
            if watched.interrupted or watched.requeued or watched.draining:
                log.info("host agents: %s", watched)
        except Exception:  # never fatal: the runs are still polled
            log.exception("host agent watch failed")
        with transaction(self.ctx.engine, write=False) as s:
            rows = list(
                s.exec(
                    select(TrainingRun).where(
                        col(TrainingRun.state).in_((RUN_STARTING, RUN_RUNNING, RUN_CANCELLING))
                    )
                )
            )
        self._watch(rows)
        finished = 0
        now = self.ctx.core.clock.now()
        for run in rows:
            assert run.id is not None
            placement = dict(run.placement)
            if "pgid" not in placement:
                if self.ctx.starts.in_flight(run.id):
                    continue  # its code is on its way (bot.app.runs.starts), not orphaned
                if run.started_at is not None and now - run.started_at > STARTING_GRACE:
                    self._requeue_orphan(run.id)
                continue
            seat = self.ctx.access.runner_for(placement["host"])
            if seat is None:
                continue
            runner, target = seat.runner, seat.target
            others = placement.get("nodes", [])[1:]  # a run over several hosts: node 1…
            interrupted = "interrupted" in placement
            try:
                stopping = run.state == RUN_CANCELLING or (interrupted and bool(others))
                if stopping and not placement.get("term_sent"):
                    # Cancelled, or one node's host got a spot notice: every node is told
                    # (each checkpoints and exits), the run stops as one.
                    runner.kill_group(target, int(placement["pgid"]), "TERM")
                    self._signal_nodes(others, "TERM")
                    self.records.update_placement(run.id, term_sent=True)
                # Alive first, then the status: a process seen gone wrote its last status
                # before it went, so what is read after is final. Read the other way
                # round, a run that ended between the two reads looked like one that
                # died without a final status, and was failed instead of finished.
                alive = runner.is_alive(target, int(placement["pgid"]))
                raw = runner.read_file(target, placement["status"])
            except SshError as exc:
                log.warning("poll of run %s on %s failed: %s", run.id, placement["host"], exc)
                continue
            # Node 0 holds rank 0: its status file is the run's (one result, one DM).
            status = parse_status(raw.decode("utf-8", "replace")) if raw else None
            if status is not None:
                self.records.update_metrics(run.id, status, live_runs=len(rows))
            if others and alive and "node_failed" not in placement and not interrupted:
                # (An interrupted run's nodes end on purpose: not a node failing.)
                failed = self._failed_node(others)
                if failed is not None:
                    # One node failing ends them all: the rest would wait in a collective.
                    log.warning("run %s: %s; stopping its other nodes", run.id, failed)
                    self.records.update_placement(run.id, node_failed=failed)
                    with contextlib.suppress(SshError):
                        runner.kill_group(target, int(placement["pgid"]), "TERM")
                    self._signal_nodes(others, "TERM")
                    continue
            if alive and (status is None or status.state not in TERMINAL_STATES):
                continue
            if alive:
                continue  # final status written; the process is exiting
            # Node 0 has ended: a node still running cannot go on alone.
            self._signal_nodes(others, "KILL" if "node_failed" in placement else "TERM")
            node_failed = placement.get("node_failed")
            # Stopped for a resume (exit 75) or reclaimed: back in line with its checkpoint.
            if (
                run.state != RUN_CANCELLING
                and node_failed is None
                and resumable_stop(placement, status)
                and requeue_resumable(self.records, run.id, placement, runner, target, status)
            ):
                continue
            tail = ""
            with contextlib.suppress(SshError):
                tail = runner.tail(target, placement["log"], 15)
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
                summary = {"error": "the process ended without writing a final status"}
            if node_failed is not None and state == RUN_FAILED:
                summary["error"] = node_failed
                exit_code = exit_code or EXIT_FAILED
            # Out of GPU memory (exit 77): once more with half the batch; then the advice.
            if state == RUN_FAILED and exit_code == EXIT_OOM and node_failed is None:
                if self._retry_oom(run.id, status, runner, target, placement):
                    continue
                summary["error"] = f"{summary.get('error') or 'out of GPU memory'}. {OOM_ADVICE}"
            ended = self.ctx.watchers.exited_at(run.id, placement["host"], int(placement["pgid"]))
            self.records.finish(run.id, state, exit_code, summary, tail, status, ended)
            finished += 1
        return finished

    def _watch(self, rows: list[TrainingRun]) -> None:
        """A watcher on every process of every running run (bot.app.runs.watch), none on
        anything else: after a restart, or for a run adopted from a worker that died,
        its end is learnt as it happens too."""
        keys: list[tuple[int, str, int]] = []
        status: dict[tuple[int, str, int], str] = {}
        for run in rows:
            assert run.id is not None
            placement = run.placement
            nodes = placement.get("nodes") or [placement]
            for rank, node in enumerate(nodes):
                if "pgid" not in node or "host" not in node:
                    continue
                key = (run.id, str(node["host"]), int(node["pgid"]))
                keys.append(key)
                shown = (run.metrics.get("live") or {}).get("figures")
                if rank == 0 and not shown and "status" in placement:
                    status[key] = str(placement["status"])  # its first figures still to come
        self.ctx.watchers.keep_only(keys)
        for key in keys:
            self.ctx.watchers.ensure(*key, status.get(key))

    def _failed_node(self, nodes: list[dict[str, Any]]) -> str | None:
        """Why the first of these nodes that ended without finishing did, or None while
        each runs or finished well (node 1 may exit a moment before node 0 writes the
        result). A host that cannot be asked now is asked again at the next poll."""
        for rank, node in enumerate(nodes, start=1):
            seat = self.ctx.access.runner_for(str(node.get("host", "")))
            if seat is None or "pgid" not in node:
                continue
            try:
                if seat.runner.is_alive(seat.target, int(node["pgid"])):
                    continue
                raw = seat.runner.read_file(seat.target, node["status"])
            except SshError as exc:
                log.warning("poll of node %s on %s failed: %s", rank, node["host"], exc)
                continue
            status = parse_status(raw.decode("utf-8", "replace")) if raw else None
            if status is not None and status.state == "done":
                continue
            why = (status.error if status is not None else None) or (
                f"exit code {status.exit_code}"
                if status is not None and status.exit_code is not None
                else "it ended without writing a final status"
            )
            return f"node {rank} on {node['host']} failed: {why}"
        return None

    def _signal_nodes(self, nodes: list[dict[str, Any]], signal: str) -> None:
        """Signals the process group of each of these nodes that still runs."""
        for node in nodes:
            seat = self.ctx.access.runner_for(str(node.get("host", "")))
            if seat is None or "pgid" not in node:
                continue
            try:
                seat.runner.kill_group(seat.target, int(node["pgid"]), signal)
            except SshError as exc:
                log.warning("could not stop node on %s: %s", node["host"], exc)

    @retrying
    def _retry_oom(
        self,
        run_id: int,
        status: Any,
        runner: SshRunner,
        target: SshTarget,
        placement: dict[str, Any],
    ) -> bool:
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
        # The old attempt's status and group id must not be read as the new one's.
        with contextlib.suppress(SshError):
            old = [placement.get("status"), placement.get("pgid_file")]
            runner.run(
                target, shell.join(["rm", "-f", "--", *(str(p) for p in old if p)]), timeout=30
            )
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

    def _started_by_the_dead(self, placement: dict[str, Any]) -> int | bool | None:
        """The group id the runner wrote when the worker that claimed the run died after
        launching it; None when it never launched; False when the host cannot say now."""
        path = placement.get("pgid_file")
        seat = self.ctx.access.runner_for(str(placement.get("host", "")))
        if not path or seat is None:
            return None
        runner, target = seat.runner, seat.target
        try:
            raw = runner.read_file(target, str(path), max_bytes=64)
        except SshError as exc:
            log.warning("cannot check whether run on %s started: %s", placement["host"], exc)
            return False
        text = (raw or b"").decode(errors="replace").strip()
        return int(text) if text.isdigit() else None

    @retrying
    def _requeue_orphan(self, run_id: int) -> None:
        with transaction(self.ctx.engine, write=False) as s:
            claimed = s.get(TrainingRun, run_id)
            placement = dict(claimed.placement) if claimed is not None else {}
        started = self._started_by_the_dead(placement)
        if started is False:
            return  # the host is unreachable: ask again next poll, never start twice
        nodes: list[dict[str, Any]] = list(placement.get("nodes", []))
        if isinstance(started, int) and nodes:
            # A run over several hosts is adopted whole or not at all: every node's group.
            pgids: list[int | None] = [started]
            for node in nodes[1:]:
                found = self._started_by_the_dead(node)
                if found is False:
                    return  # ask again next poll
                pgids.append(found)
            if any(pgid is None for pgid in pgids):
                # Some node never started, so the rest cannot finish: stop them, requeue.
                for node, pgid in zip(nodes, pgids, strict=True):
                    seat = self.ctx.access.runner_for(str(node.get("host", "")))
                    if pgid is not None and seat is not None:
                        with contextlib.suppress(SshError):
                            seat.runner.kill_group(seat.target, pgid, "KILL")
                started = None
            else:
                nodes = [{**n, "pgid": pgid} for n, pgid in zip(nodes, pgids, strict=True)]
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_STARTING or "pgid" in run.placement:
                return
            if isinstance(started, int):
                run.placement = {**run.placement, "pgid": started}
                if nodes:
                    run.placement = {**run.placement, "nodes": nodes}
                run.state = RUN_RUNNING
                s.add(run)
                log.warning("run %s was started by a worker that died; adopted it", run_id)
                return
            self.records.close_intervals(s, run_id, self.ctx.core.clock.now())
            run.state = RUN_QUEUED
            # A resumed run keeps where its checkpoint is (bot.app.agentwatch).
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
