"""The fault campaign's invariants (bench.invariants) on a real history: they hold for
runs and a reservation taken through the service on this machine, and each one reports
the case that breaks it when the database is made to break it."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bench import invariants
from bot.domain.commands import Cancel, Release, Reserve, Run
from db.models import Notification, Reservation, TrainingRun, UsageInterval
from tests.core.helpers import actor, make_service, runs_here
from tests.core.test_runs import local_host, run_until, state


def _history(engine: Engine, tmp_path: Path) -> dict[str, int]:
    """A reservation granted and released, and runs that succeed, fail, are cancelled
    while running and are cancelled in line."""
    svc, _ = make_service(engine, [local_host(2)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    assert svc.reserve(a, Reserve(1, "cpu")).view.text.startswith("Reserved")
    with Session(engine) as s:
        res = s.exec(select(Reservation.id)).one()
    assert res is not None
    svc.release(a, Release(res))
    ok = runs.submit(a, Run(command=(sys.executable, "-c", "print('ok')"))).extra["run_id"]
    bad = runs.submit(a, Run(command=(sys.executable, "-c", "raise SystemExit(3)"))).extra["run_id"]
    run_until(runs, lambda: state(engine, ok).state == "succeeded")
    run_until(runs, lambda: state(engine, bad).state == "failed")
    sleep = (sys.executable, "-c", "import time; time.sleep(600)")
    long = runs.submit(a, Run(command=sleep)).extra["run_id"]
    run_until(runs, lambda: state(engine, long).state == "running")
    runs.cancel(a, Cancel(long))
    run_until(runs, lambda: state(engine, long).state == "cancelled")
    other = runs.submit(a, Run(command=sleep, gpus=2)).extra["run_id"]
    hold = runs.submit(a, Run(command=sleep, gpus=2)).extra["run_id"]
    run_until(runs, lambda: state(engine, other).state == "running")
    runs.cancel(a, Cancel(hold))  # still in line: it never held anything
    runs.cancel(a, Cancel(other))
    run_until(runs, lambda: state(engine, other).state == "cancelled")
    return {"res": res, "ok": ok, "bad": bad, "long": long, "hold": hold}


def test_the_invariants_hold_for_a_real_history_and_each_names_what_breaks_it(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    ids = _history(sqlite_engine, tmp_path)
    report = invariants.check(sqlite_engine, instances=[], slurm_jobs=[], alive_groups={})
    assert all(report.held.values()), report.lines()
    assert len(report.held) == 7

    with Session(sqlite_engine) as s:
        ok_iv = s.exec(select(UsageInterval).where(UsageInterval.run_id == ids["ok"])).first()
        assert ok_iv is not None
        ok_pgid = int(state(sqlite_engine, ids["ok"]).placement["pgid"])
        # A second result DM would be refused by its key; a lost one is what can happen.
        lost = s.exec(
            select(Notification).where(Notification.dedupe_key == f"run-finished:{ids['ok']}")
        ).one()
        s.delete(lost)
        # The GPU of the succeeded run held by another at the same time.
        s.add(
            UsageInterval(
                gpu_id=ok_iv.gpu_id,
                host_id=ok_iv.host_id,
                user_id=ok_iv.user_id,
                reservation_id=ids["res"],
                started_at=ok_iv.started_at,
                ended_at=ok_iv.started_at + timedelta(hours=1),
            )
        )
        # An interval of the cancelled run left open.
        long_iv = s.exec(select(UsageInterval).where(UsageInterval.run_id == ids["long"])).one()
        long_iv.ended_at = None
        s.add(long_iv)
        reopened = long_iv.id
        # The failed run's row says it succeeded; its DM said it failed.
        bad = s.get(TrainingRun, ids["bad"])
        assert bad is not None
        bad.state = "succeeded"
        s.add(bad)
        s.commit()

    report = invariants.check(
        sqlite_engine,
        instances=["i-0abc"],
        slurm_jobs=["4242"],
        alive_groups={"local": {ok_pgid}},
    )
    assert not any(report.held.values()), report.lines()
    broken = report.broken
    assert broken["runs_ended_once"] == [f"run {ids['ok']} (succeeded) has 0 result DMs"]
    # The interval added over the run's GPU; the one left open holds its GPU over every
    # later use too (the clock here does not move, so every use starts at one instant).
    assert any(f"(reservation {ids['res']}) began" in c for c in broken["no_gpu_twice"])
    assert any(f"(run {ids['long']}) still held" in c for c in broken["no_gpu_twice"])
    assert broken["intervals_closed_or_live"] == [
        f"interval {reopened} is open for run {ids['long']} (cancelled)"
    ]
    assert broken["told_as_recorded"] == [
        f"run {ids['bad']}'s result DM says failed; its row says succeeded"
    ]
    assert broken["no_unknown_instance"] == ["instance i-0abc is not in the database"]
    assert broken["no_unknown_slurm_job"] == ["Slurm job 4242 is not in the database"]
    assert broken["no_process_of_an_ended_run"] == [
        f"run {ids['ok']} (succeeded) still has group {ok_pgid} on local"
    ]
    assert "runs_ended_once: BROKEN" in report.lines()


def test_a_run_cancelled_in_line_needs_no_result_dm(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    a = actor(svc, "alice")
    queued = svc.runs.submit(a, Run(command=("true",), gpus=1)).extra["run_id"]
    svc.runs.cancel(a, Cancel(queued))
    with Session(sqlite_engine) as s:
        assert (
            s.exec(select(Notification).where(col(Notification.dedupe_key).is_not(None))).all()
            == []
        )
    assert invariants.check(sqlite_engine).held == {
        "runs_ended_once": True,
        "no_gpu_twice": True,
        "intervals_closed_or_live": True,
        "told_as_recorded": True,
    }
