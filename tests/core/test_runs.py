"""Training runs through the service on this machine's local runner: submit, dispatch
with the scheduler, poll the real runner's status file, finish with a DM; cancel;
a failing command; dispatch exactly once with two workers racing."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.runs import LocalAccess, RunService
from bot.app.runs import poll as poll_module
from bot.app.runs.inputs import scheduler_inputs
from bot.app.service import GpuService
from bot.domain.commands import Cancel, Logs, Queue, Reserve, Run
from bot.domain.errors import UserError
from db.models import Notification, TrainingRun, UsageInterval
from provisioning.base import GpuDevice, Instance
from provisioning.catalog import Catalog
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from tests.core.helpers import actor, make_service, place, runs_here


def local_host(slots: int) -> Instance:
    return Instance(
        name="local",
        provider="local",
        state="ready",
        gpus=tuple(GpuDevice(index=i, model="cpu") for i in range(slots)),
    )


def run_until(runs: RunService, done: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "run did not finish in time"
        runs.poll()
        runs.dispatch()
        time.sleep(0.2)


def state(engine: Engine, run_id: int) -> TrainingRun:
    with Session(engine) as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        return run


def dms_to(engine: Engine, who: str) -> list[str]:
    with Session(engine) as s:
        rows = s.exec(
            select(Notification).where(Notification.target == who).order_by(col(Notification.id))
        )
        return [n.text for n in rows]


def test_a_user_command_runs_reports_and_finishes_with_a_dm(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    script = tmp_path / "train.py"
    script.write_text(
        "import training\nfor step in range(3):\n    training.report(step=step, loss=1.0/(step+1))\nprint('hello from train.py')\n"
    )
    reply = runs.submit(actor(svc, "alice"), Run(command=(sys.executable, str(script))))
    rid = reply.extra["run_id"]
    assert "queued (next in line)" in reply.view.text
    run_until(runs, lambda: state(sqlite_engine, rid).state == "succeeded")
    run = state(sqlite_engine, rid)
    assert run.exit_code == 0 and run.placement["gpu_indexes"] == [0]
    texts = dms_to(sqlite_engine, "alice")
    assert texts[0].startswith(f"Run #{rid} started on local, CPU slot 0")
    assert texts[-1].startswith(f"Run #{rid} (`") and "finished" in texts[-1]
    logs = runs.logs(actor(svc, "alice"), Logs(rid, 20))
    assert "hello from train.py" in logs.view.blocks[-1].text  # type: ignore[union-attr]
    with Session(sqlite_engine) as s:
        ivs = s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)).all()
    assert len(ivs) == 1 and ivs[0].ended_at is not None, (
        "the run's GPU-time is on record and closed"
    )


def test_watched_runs_are_read_within_a_budget_and_an_end_is_read_at_once(
    sqlite_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many runs live, a poll reads the status of at most LOOK_BUDGET of those a
    watcher waits on, the longest unread first (200 SSH reads a tick took 14 s: issue
    39); a run whose watcher saw it end is read at the next poll all the same."""
    monkeypatch.setattr(poll_module, "LOOK_BUDGET", 2)
    svc, _ = make_service(sqlite_engine, [local_host(5)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    sleep = (sys.executable, "-c", "import time; time.sleep(600)")
    rids = [runs.submit(a, Run(command=sleep)).extra["run_id"] for _ in range(5)]
    run_until(runs, lambda: all(state(sqlite_engine, r).state == "running" for r in rids))
    executor = runs.ctx.executor
    placements = {r: dict(state(sqlite_engine, r).placement) for r in rids}
    deadline = time.monotonic() + 60
    while not all(executor.watched(r, placements[r]) for r in rids):
        assert time.monotonic() < deadline, "the runs were never watched"
        runs.poll()
        time.sleep(0.1)
    looked: list[int] = []
    real_look = executor.look

    def counting(placement: dict[str, Any]) -> Any:
        looked.append(int(placement["pgid"]))
        return real_look(placement)

    monkeypatch.setattr(executor, "look", counting)
    by_pgid = {int(p["pgid"]): r for r, p in placements.items()}
    seen: list[set[int]] = []
    for _ in range(3):
        looked.clear()
        assert runs.poll() == 0
        seen.append({by_pgid[g] for g in looked})
    assert [len(s) for s in seen] == [2, 2, 2]
    assert seen[0] | seen[1] | seen[2] == set(rids)  # round robin: each read in turn

    # One ends: its watcher asks for a tick, and that poll reads and finishes it.
    unread = next(r for r in rids if r not in seen[2])
    os.killpg(int(placements[unread]["pgid"]), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while executor.ended_at(unread, placements[unread]) is None:
        assert time.monotonic() < deadline, "the watcher never saw the end"
        time.sleep(0.05)
    looked.clear()
    assert runs.poll() == 1
    assert state(sqlite_engine, unread).state == "failed"
    assert unread in {by_pgid[g] for g in looked}
    for r in rids:
        if r != unread:
            runs.cancel(a, Cancel(r))
    run_until(
        runs, lambda: all(state(sqlite_engine, r).state == "cancelled" for r in rids if r != unread)
    )


def test_a_failing_command_tells_the_owner_why(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    cmd = (sys.executable, "-c", "import sys; print('loading data'); sys.exit('disk full')")
    rid = runs.submit(actor(svc, "bob"), Run(command=cmd)).extra["run_id"]
    run_until(runs, lambda: state(sqlite_engine, rid).state == "failed")
    last = dms_to(sqlite_engine, "bob")[-1]
    assert f"Run #{rid}" in last and "failed (exit status 1)" in last
    with Session(sqlite_engine) as s:
        n = s.exec(
            select(Notification)
            .where(Notification.target == "bob")
            .order_by(col(Notification.id).desc())
        ).first()
    assert n is not None and "disk full" in str(n.view)


def test_cancel_stops_a_running_run_and_frees_its_slot(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    rid = runs.submit(a, Run(command=(sys.executable, "-c", "import time; time.sleep(600)"))).extra[
        "run_id"
    ]
    queued = runs.submit(a, Run(recipe="digits")).extra["run_id"]
    run_until(runs, lambda: state(sqlite_engine, rid).state == "running")
    assert "1 waiting, 1 running" in runs.queue(a, Queue()).view.text
    with pytest.raises(UserError, match="not yours"):
        runs.cancel(actor(svc, "mallory"), Cancel(rid))
    assert "cancelled before it started" in runs.cancel(a, Cancel(queued)).view.text
    assert "Stopping run" in runs.cancel(a, Cancel(rid)).view.text
    run_until(runs, lambda: state(sqlite_engine, rid).state == "cancelled", timeout=60)
    # The slot is free again: a reservation gets it at once.
    assert svc.reserve(a, Reserve()).view.text.startswith("Reserved")


def test_a_sweep_is_cancelled_as_one_by_its_name(sqlite_engine: Engine, tmp_path: Path) -> None:
    """`/gpu cancel SWEEP`: the variant that runs stops (SIGTERM: a recipe checkpoints),
    the ones that wait end at once; someone else's sweep, an unknown one and one already
    over are refused in words."""
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    sweep = Run(recipe="digits", options=(("epochs", 200.0),), sweep=("lr", (1e-3, 2e-3, 3e-3)))
    ids = [int(i) for i in runs.submit(a, sweep).extra["run_ids"]]
    label = str(state(sqlite_engine, ids[0]).sweep)
    run_until(runs, lambda: state(sqlite_engine, ids[0]).state == "running")
    with pytest.raises(UserError, match="not yours"):
        runs.cancel(actor(svc, "mallory"), Cancel(sweep=label))
    with pytest.raises(UserError, match="There is no sweep s000000"):
        runs.cancel(a, Cancel(sweep="s000000"))
    said = runs.cancel(a, Cancel(sweep=label)).view.text
    assert said.startswith(f"Sweep {label}: 2 that had not started cancelled; 1 started")
    assert f"(#{ids[0]})" in said and "saves a checkpoint" in said, said
    run_until(runs, lambda: all(state(sqlite_engine, i).finished_at for i in ids), timeout=60)
    assert [state(sqlite_engine, i).state for i in ids] == ["cancelled"] * 3
    with pytest.raises(UserError, match="already ended"):
        runs.cancel(a, Cancel(sweep=label))


def test_runs_wait_for_gpus_held_by_a_reservation(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    svc.reserve(actor(svc, "alice"), Reserve())
    rid = runs.submit(actor(svc, "bob"), Run(recipe="digits")).extra["run_id"]
    assert runs.dispatch() == 0 and state(sqlite_engine, rid).state == "queued"


def test_impossible_runs_are_refused_up_front(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(2)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    with pytest.raises(UserError, match="the most on one host is 2"):
        runs.submit(actor(svc, "a"), Run(recipe="digits", gpus=3))
    with pytest.raises(UserError, match="No host here has A100"):
        runs.submit(actor(svc, "a"), Run(recipe="digits", model="A100"))
    with pytest.raises(UserError, match="no recipe `mnist`"):
        runs.submit(actor(svc, "a"), Run(recipe="mnist"))


def test_a_run_naming_no_model_on_an_empty_cloud_pool_is_told_what_it_can_launch(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """A cloud pool with nothing running yet: "this pool has: none" taught nothing. A
    command (the bot cannot know what it needs) is refused with the models the cloud can
    launch; a recipe, which runs on any GPU, gets the cheapest per GPU-hour, and the reply
    says which and why. Naming a model queues the run on it."""
    from bot.app.config import Settings
    from bot.app.fleet import CatalogSupply
    from bot.domain.clock import VirtualClock

    catalog = Catalog.load()
    here = LocalAccess(LocalRunner(), LOCAL_TARGET, tmp_path / "runs")
    cloud = place("local", here, catalog=catalog, supply=CatalogSupply(catalog))
    svc = GpuService(sqlite_engine, Settings(), VirtualClock(), cloud)
    runs = svc.runs
    with pytest.raises(UserError) as refused:
        runs.submit(actor(svc, "a"), Run(command=("python", "train.py")))
    text = refused.value.text
    assert "this pool has: none; the cloud can launch: " in text
    assert all(m in text for m in catalog.models()) and "GPUBOT_DEFAULT_GPU" in text

    per_gpu = {
        m: min(t.ondemand_per_gpu_hr for t in catalog.for_model(m)) for m in catalog.models()
    }
    cheapest = min(per_gpu, key=lambda m: per_gpu[m])
    picked = runs.submit(actor(svc, "a"), Run(recipe="digits"))
    assert state(sqlite_engine, picked.extra["run_id"]).gpu_model == cheapest
    assert f"so {cheapest}: the cheapest the cloud can launch for this recipe" in picked.view.text
    assert f"${per_gpu[cheapest]:.2f} per GPU-hour" in picked.view.text

    model = catalog.models()[0]
    queued = runs.submit(actor(svc, "a"), Run(recipe="digits", model=model))
    assert state(sqlite_engine, queued.extra["run_id"]).gpu_model == model
    assert "cheapest" not in queued.view.text


def test_the_same_submission_delivered_twice_queues_once(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    first = runs.submit(actor(svc, "a"), Run(recipe="digits"), request_key="slack:t1")
    again = runs.submit(actor(svc, "a"), Run(recipe="digits"), request_key="slack:t1")
    assert first.extra["run_id"] == again.extra["run_id"]


@pytest.mark.postgres
def test_two_workers_dispatch_each_run_exactly_once(pg_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(pg_engine, [local_host(4)], places=runs_here(tmp_path / "runs"))
    runs_a = svc.runs
    svc_b = GpuService(pg_engine, svc.settings, svc.clock, runs_here(tmp_path / "runs"))
    runs_b = svc_b.runs
    ids = [
        runs_a.submit(actor(svc, f"u{i}"), Run(command=(sys.executable, "-c", "pass"))).extra[
            "run_id"
        ]
        for i in range(6)
    ]
    barrier = threading.Barrier(2)
    started: list[int] = []

    def worker(r: RunService) -> None:
        barrier.wait(timeout=30)
        started.append(r.dispatch())

    threads = [threading.Thread(target=worker, args=(r,)) for r in (runs_a, runs_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(started) == 4, started  # 4 slots, 6 runs: four start, once each
    with Session(pg_engine) as s:
        placed = s.exec(
            select(TrainingRun).where(col(TrainingRun.id).in_(ids), TrainingRun.state != "queued")
        ).all()
        ivs = s.exec(select(UsageInterval).where(col(UsageInterval.run_id).is_not(None))).all()
    assert len(placed) == 4 and len(ivs) == 4 and len({iv.gpu_id for iv in ivs}) == 4
    run_until(runs_a, lambda: all(state(pg_engine, i).state == "succeeded" for i in ids))


def set_spot(engine: Engine, run_id: int, spot: bool) -> None:
    with Session(engine) as s:
        row = s.get(TrainingRun, run_id)
        assert row is not None
        row.spot = spot
        s.add(row)
        s.commit()


def test_a_hog_is_preempted_with_a_checkpoint_and_resumes_after(
    engine: Engine, tmp_path: Path
) -> None:
    """The scheduler's Preempt through the worker: SIGTERM via the real local runner, the
    run requeued (not failed) with a DM saying why, the claimant started, and the
    preempted run back on the GPU once the claimant is done."""

    svc, clock = make_service(engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    hog = runs.submit(
        alice, Run(command=(sys.executable, "-c", "import time; time.sleep(600)"))
    ).extra["run_id"]
    run_until(runs, lambda: state(engine, hog).state == "running")
    # Marked as a --spot run (its owner said it resumes), which the local host, having no
    # spot market, would not have started; a recipe run is preemptible the same way.
    set_spot(engine, hog, True)
    late = runs.submit(bob, Run(command=(sys.executable, "-c", "print('bob was here')"))).extra[
        "run_id"
    ]
    runs.dispatch()
    assert state(engine, hog).state == "running"  # bob has not waited long enough
    clock.advance(timedelta(hours=1))  # alice has used the GPU for an hour; bob waited
    run_until(runs, lambda: state(engine, late).state == "succeeded", timeout=60)
    hog_row = state(engine, hog)
    assert hog_row.state in ("queued", "starting", "running")
    assert (
        hog_row.placement.get("resume_from", {})
        .get("reason", "")
        .startswith(f"preempted for run #{late} of bob")
    )
    assert any(
        f"Run #{hog} was interrupted" in t and "preempted" in t for t in dms_to(engine, "alice")
    )
    # bob is done, so alice gets the GPU back (as an on-demand run: no spot market here)
    set_spot(engine, hog, False)
    run_until(runs, lambda: state(engine, hog).state == "running", timeout=60)
    runs.cancel(alice, Cancel(hog))
    run_until(runs, lambda: state(engine, hog).state == "cancelled", timeout=60)


def test_runs_that_cannot_resume_are_never_preempted(sqlite_engine: Engine, tmp_path: Path) -> None:

    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    hog = runs.submit(
        alice, Run(command=(sys.executable, "-c", "import time; time.sleep(600)"))
    ).extra["run_id"]
    run_until(runs, lambda: state(sqlite_engine, hog).state == "running")
    late = runs.submit(bob, Run(command=(sys.executable, "-c", "pass"))).extra["run_id"]
    clock.advance(timedelta(hours=1))
    for _ in range(3):
        runs.dispatch()
        runs.poll()
    assert state(sqlite_engine, hog).state == "running"
    assert state(sqlite_engine, late).state == "queued"
    runs.cancel(alice, Cancel(hog))
    run_until(runs, lambda: state(sqlite_engine, hog).state == "cancelled", timeout=60)


def test_a_run_whose_owner_says_it_checkpoints_is_preempted_and_requeued(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """`--checkpoints`: a user's own command that saves on SIGTERM is movable like a
    recipe; it is requeued to resume, not failed."""

    engine = sqlite_engine
    svc, clock = make_service(engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        "time.sleep(600)\n"
    )
    hog = runs.submit(alice, Run(command=(sys.executable, "-c", script), checkpoints=True)).extra[
        "run_id"
    ]
    run_until(runs, lambda: state(engine, hog).state == "running")
    late = runs.submit(bob, Run(command=(sys.executable, "-c", "pass"))).extra["run_id"]
    clock.advance(timedelta(hours=1))
    run_until(runs, lambda: state(engine, late).state == "succeeded", timeout=60)
    assert (
        state(engine, hog)
        .placement.get("resume_from", {})
        .get("reason", "")
        .startswith(f"preempted for run #{late} of bob")
    )
    runs.cancel(alice, Cancel(hog))
    run_until(runs, lambda: state(engine, hog).state == "cancelled", timeout=60)


def test_the_worker_predicts_run_times_from_the_teams_finished_runs(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """No --max: the scheduler's estimates come from finished runs of the same user and
    size (`RunHistory`), as in `gpubot simulate --estimates none`, not from nothing."""

    from db.session import transaction

    engine = sqlite_engine
    svc, clock = make_service(engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    alice = actor(svc, "alice")
    with transaction(engine, write=False) as s:
        queue, fleet, _, _ = scheduler_inputs(runs.ctx, s, clock.now())
    assert queue == []
    # A run that does its work in 10 minutes of the bot's clock: it ends when told to.
    go = tmp_path / "go"
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    first = runs.submit(alice, Run(command=(sys.executable, "-c", wait))).extra["run_id"]
    run_until(runs, lambda: state(engine, first).state == "running")
    clock.advance(timedelta(minutes=10))
    go.touch()
    run_until(runs, lambda: state(engine, first).state == "succeeded", timeout=60)
    ended = state(engine, first)
    assert ended.finished_at is not None and ended.started_at is not None
    assert ended.finished_at - ended.started_at == timedelta(minutes=10)
    busy = runs.submit(
        alice, Run(command=(sys.executable, "-c", "import time; time.sleep(600)"))
    ).extra["run_id"]
    run_until(runs, lambda: state(engine, busy).state == "running")
    waiting = runs.submit(alice, Run(command=(sys.executable, "-c", "pass"))).extra["run_id"]
    with transaction(engine, write=False) as s:
        queue, fleet, _, _ = scheduler_inputs(runs.ctx, s, clock.now())
    assert [(r.run_id, r.est_duration_s) for r in queue] == [(str(waiting), 600.0)]
    held = [a for i in fleet for a in i.allocations if a.run_id == str(busy)]
    started = state(engine, busy).started_at
    assert started is not None
    assert held and held[0].est_end_s == pytest.approx(started.timestamp() + 600.0)
    runs.cancel(alice, Cancel(busy))
    run_until(runs, lambda: state(engine, busy).state == "cancelled", timeout=60)


def test_a_run_sent_back_in_line_carries_how_long_it_ran_to_the_scheduler(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The simulator's reclaim rules read a run's attained service (a resumed run queues
    behind ones that never ran and is not moved again before it has run that long once
    more); production keeps the same figure: each segment's length, summed as the run is
    requeued, and given to the scheduler for the waiting run."""

    from bot.domain import views
    from db.session import transaction

    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    alice = svc.actor("alice")
    with transaction(sqlite_engine) as s:
        row = TrainingRun(
            user_id=svc.user_row(s, alice.key).id,  # type: ignore[arg-type]
            command="",
            recipe="digits",
            gpu_count=1,
            gpu_model="cpu",
            state="running",
            submitted_at=clock.now(),
            started_at=clock.now(),
        )
        s.add(row)
        s.flush()
        run_id = row.id
    assert run_id is not None
    view = views.message("back in line").view
    for segment, total in ((600, 600.0), (900, 1500.0)):
        clock.advance(timedelta(seconds=segment))
        assert runs.requeue(run_id, {"count": 1}, view, f"t:{segment}")
        assert state(sqlite_engine, run_id).metrics["attained_s"] == total
        with transaction(sqlite_engine, write=False) as s:
            queue, _, _, _ = scheduler_inputs(runs.ctx, s, clock.now())
        assert [(q.run_id, q.attained_s) for q in queue] == [(str(run_id), total)]
        with transaction(sqlite_engine) as s:  # started again, as dispatch would
            again = s.get(TrainingRun, run_id)
            assert again is not None
            again.state, again.started_at = "running", clock.now()
            s.add(again)


def test_a_run_stopped_at_its_limit_keeps_its_checkpoint_and_resume_goes_on_from_it(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """A recipe run reaches its --max: the runner saves a checkpoint and exits 76; the bot
    keeps that checkpoint, its DM says the step and `/gpu run --resume ID`; the resumed
    run is run ID again (same recipe and settings) and starts from that step. Only its
    owner may resume it, only once it has ended, only from a checkpoint."""

    from training.status import parse_status

    engine = sqlite_engine  # the resume is the same on either database
    svc, _ = make_service(
        engine, [local_host(1)], home=str(tmp_path / "home"), places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    ask = Run(recipe="digits", options=(("epochs", 10000.0),), max_duration=timedelta(seconds=10))
    first = int(runs.submit(alice, ask).extra["run_id"])
    run_until(runs, lambda: state(engine, first).finished_at is not None, timeout=180)
    row = state(engine, first)
    assert row.state == "failed" and row.exit_code == 76, row.metrics
    saved = row.metrics["summary"]["resume_step"]
    assert isinstance(saved, int) and saved > 0, row.metrics
    said = [t for t in dms_to(engine, "alice") if f"Run #{first} (recipe digits) stopped" in t]
    assert len(said) == 1, dms_to(engine, "alice")
    assert f"checkpoint at step {saved}: `/gpu run --resume {first}`" in said[0], said

    with pytest.raises(UserError, match=f"no run #{first}"):
        runs.submit(bob, Run(resume=first))
    reply = runs.submit(alice, Run(resume=first, max_duration=timedelta(seconds=10)))
    second = int(reply.extra["run_id"])
    assert f"checkpoint at step {saved}" in reply.view.text, reply.view.text
    with pytest.raises(UserError, match="has not ended"):
        runs.submit(alice, Run(resume=second))
    again = state(engine, second)
    assert again.recipe == "digits" and again.options == {"epochs": 10000.0}
    assert again.max_seconds == 10
    run_until(runs, lambda: state(engine, second).finished_at is not None, timeout=180)
    done = state(engine, second)
    status = parse_status(Path(str(done.placement["status"])).read_text())
    assert status is not None and status.resumed_from_step == saved, status

    plain = int(runs.submit(alice, Run(command=(sys.executable, "-c", "pass"))).extra["run_id"])
    run_until(runs, lambda: state(engine, plain).finished_at is not None)
    with pytest.raises(UserError, match="no checkpoint to go on from"):
        runs.submit(alice, Run(resume=plain))
