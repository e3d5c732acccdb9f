"""Runs start at once (issue 19): a queued run, GPUs given back and a cancel each ask the
worker in this process for a tick now; the interval tick (an hour here, so it never
fires during the test) stays the safety net. `gpubot submit` can tell whether any
worker is running to place what it queued."""

from __future__ import annotations

import secrets
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.adapters.leader import AdvisoryLeadership, LeaseLeadership, worker_running
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.faces.dispatch import handle_text
from bot.faces.worker import Worker
from db.models import Notification, TrainingRun, UsageInterval
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import actor, make_service, runs_here

WAIT_S = 120.0  # a guard against a hang, not a speed assertion


def one_slot(engine: Engine, tmp_path: Path) -> tuple[GpuService, Worker]:
    slot = Instance(
        name="local", provider="local", state="ready", gpus=(GpuDevice(index=0, model="cpu"),)
    )
    svc, _ = make_service(engine, [slot], places=runs_here(tmp_path / "runs"))
    worker = Worker(svc, None, interval_s=3600.0, extra_jobs=[])
    return svc, worker


def run_state(engine: Engine, run_id: int) -> str:
    with Session(engine) as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        return run.state


def test_a_queued_run_starts_without_waiting_for_the_tick(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, worker = one_slot(sqlite_engine, tmp_path)
    worker.start()
    try:
        done = worker.nudged_ticks
        reply = handle_text(svc, actor(svc, "alice"), f"/gpu run -- {sys.executable} -c pass")
        assert worker.wait_for_nudged_tick(done, WAIT_S)
        assert run_state(sqlite_engine, reply.extra["run_id"]) != "queued"
    finally:
        worker.stop()


def test_a_release_places_the_run_that_waited_for_its_gpu(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, worker = one_slot(sqlite_engine, tmp_path)
    handle_text(svc, actor(svc, "alice"), "/gpu reserve")
    worker.start()
    try:
        done = worker.nudged_ticks
        rid = handle_text(svc, actor(svc, "bob"), f"/gpu run -- {sys.executable} -c pass").extra[
            "run_id"
        ]
        assert worker.wait_for_nudged_tick(done, WAIT_S)
        assert run_state(sqlite_engine, rid) == "queued"  # the slot is alice's
        done = worker.nudged_ticks
        handle_text(svc, actor(svc, "alice"), "/gpu release")
        assert worker.wait_for_nudged_tick(done, WAIT_S)
        assert run_state(sqlite_engine, rid) != "queued"
    finally:
        worker.stop()


def _wait_ended(engine: Engine, run_id: int) -> str:
    deadline = time.monotonic() + WAIT_S  # a guard against a hang, not a speed assertion
    while (state := run_state(engine, run_id)) in ("queued", "starting", "running"):
        assert time.monotonic() < deadline, f"run {run_id} is still {state}"
        time.sleep(0.05)
    return state


def test_a_run_that_ends_is_finished_and_told_without_waiting_for_the_tick(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Its process's end asks for a tick (bot.app.runs.watch): the hour-long interval tick
    never fires, yet the run is finished, its owner told, and its GPUs free again."""
    svc, worker = one_slot(sqlite_engine, tmp_path)
    worker.start()
    try:
        code = "import time; time.sleep(1)"
        rid = handle_text(svc, actor(svc, "alice"), f"/gpu run -- {sys.executable} -c {code!r}")
        assert _wait_ended(sqlite_engine, rid.extra["run_id"]) == "succeeded"
        with Session(sqlite_engine) as s:
            texts = [n.text for n in s.exec(select(Notification))]
        assert any(f"Run #{rid.extra['run_id']}" in t and "finished" in t for t in texts)
        assert "0 of 1" not in handle_text(svc, actor(svc, "bob"), "/gpu status").view.text
    finally:
        worker.stop()


def test_a_run_is_billed_to_when_its_process_ended_not_to_when_it_was_polled(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, clock = make_service(
        sqlite_engine,
        [Instance(name="local", provider="local", state="ready", gpus=(GpuDevice(0, "cpu"),))],
        places=runs_here(tmp_path / "runs"),
    )
    runs = svc.runs
    rid = handle_text(svc, actor(svc, "alice"), f"/gpu run -- {sys.executable} -c pass").extra[
        "run_id"
    ]
    assert runs.dispatch() == 1
    ended_at = clock.now()
    deadline = time.monotonic() + WAIT_S
    while not runs.ctx.executor.ended_at(rid, _placement(sqlite_engine, rid)):
        assert time.monotonic() < deadline, "its watcher never saw it end"
        time.sleep(0.05)
    clock.advance(timedelta(minutes=10))  # the poll comes round much later
    assert runs.poll() == 1
    with Session(sqlite_engine) as s:
        run = s.get(TrainingRun, rid)
        assert run is not None and run.state == "succeeded"
        assert run.finished_at == ended_at
        [interval] = s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)).all()
        assert interval.ended_at == ended_at


def _placement(engine: Engine, run_id: int) -> dict[str, Any]:
    with Session(engine) as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        return dict(run.placement)


def test_a_refused_command_does_not_nudge(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = one_slot(sqlite_engine, tmp_path)
    heard: list[str] = []
    svc.on_work(lambda: heard.append("nudge"))
    handle_text(svc, actor(svc, "alice"), "/gpu release 99")
    handle_text(svc, actor(svc, "alice"), "/gpu status")
    assert heard == []
    handle_text(svc, actor(svc, "alice"), "/gpu run --recipe digits")
    assert heard == ["nudge"]


def test_submit_can_tell_whether_a_worker_runs_sqlite(sqlite_engine: Engine) -> None:
    clock = VirtualClock()
    assert not worker_running(sqlite_engine, clock)
    lease = LeaseLeadership(sqlite_engine, clock, timedelta(seconds=45))
    assert lease.hold()
    assert worker_running(sqlite_engine, clock)
    clock.advance(timedelta(minutes=1))  # the worker died: lapsed
    assert not worker_running(sqlite_engine, clock)
    assert lease.hold()
    lease.release()
    assert not worker_running(sqlite_engine, clock)


def test_submit_can_tell_whether_a_worker_runs_postgres(pg_engine: Engine) -> None:
    # A key of this test's own: advisory locks span the database other tests share.
    key = secrets.randbelow(2**40) + 1
    clock = VirtualClock()
    assert not worker_running(pg_engine, clock, key=key)
    leader = AdvisoryLeadership(pg_engine, key=key)
    assert leader.hold()
    try:
        assert worker_running(pg_engine, clock, key=key)
        assert leader.hold()  # asking did not take the lead away
    finally:
        leader.release()
    assert not worker_running(pg_engine, clock, key=key)
