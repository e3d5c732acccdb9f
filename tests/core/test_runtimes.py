"""Run-time estimates kept as runs end (bot.app.runtimes): the predictions the tick reads
from a handful of kept rows are exactly those the finished runs themselves give, whenever
it asks (after runs end, after the oldest leave the 30 days, with the clock set back), and
the kept run times are what a rebuild from the runs makes."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.money.rollups import backfill_rollups
from bot.app.runtimes import estimates, note_run_ended, rebuild_run_times
from bot.domain.clock import VirtualClock
from bot.domain.scheduling import RunHistory
from db.models import RunTime, TrainingRun, User
from db.session import transaction
from tests.core.helpers import actor, host, make_service, statements

USERS = ("alice", "bob", "carol", "dave")
SIZES = (1, 2, 8)


def from_the_runs(s: Session, now: datetime) -> RunHistory:
    """The estimator as the worker made it before the times were kept: every run that
    succeeded or failed in the 30 days before `now`, read from the runs themselves (its
    last segment and the earlier ones in its metrics), added in the order they finished."""
    history = RunHistory()
    rows = s.exec(
        select(
            User.key,
            TrainingRun.gpu_count,
            TrainingRun.started_at,
            TrainingRun.finished_at,
            TrainingRun.metrics,
        )  # type: ignore[call-overload]
        .join(User, col(User.id) == col(TrainingRun.user_id))
        .where(
            col(TrainingRun.state).in_(("succeeded", "failed")),
            col(TrainingRun.started_at).is_not(None),
            col(TrainingRun.finished_at).is_not(None),
            col(TrainingRun.finished_at) > now - timedelta(days=30),
        )
        .order_by(col(TrainingRun.finished_at), col(TrainingRun.id))
    )
    for key, gpus, started, finished, metrics in rows:
        earlier = metrics.get("attained_s", 0.0)
        history.add(key, gpus, (finished - started).total_seconds() + earlier)
    return history


def end_runs(
    engine: Engine, ids: dict[str, int], n: int, first: datetime, rng: random.Random
) -> None:
    """`n` runs that ended between `first` and 40 days later, as RunRecords.finish ends a
    run: succeeded, failed or cancelled, some resumed once (their earlier segment in their
    metrics), a few never started; each user's sizes with their own typical length."""
    with transaction(engine) as s:
        for _ in range(n):
            user = rng.choice(USERS)
            gpus = rng.choice(SIZES)
            ran = rng.expovariate(1 / (600.0 * (1 + USERS.index(user)) * gpus))
            finished = first + timedelta(seconds=rng.uniform(0, 40 * 86400))
            started = finished - timedelta(seconds=ran)
            metrics: dict[str, Any] = {"loss": 0.1}
            if rng.random() < 0.2:
                metrics["attained_s"] = rng.uniform(1, 5000)
            state = rng.choice(("succeeded", "succeeded", "failed", "cancelled"))
            run = TrainingRun(
                user_id=ids[user],
                command="python train.py",
                gpu_count=gpus,
                state=state,
                submitted_at=started,
                started_at=None if rng.random() < 0.05 else started,
                finished_at=finished,
                metrics=metrics,
            )
            s.add(run)
            s.flush()
            note_run_ended(s, run)


def assert_same(engine: Engine, now: datetime) -> None:
    """The kept predictions at `now` equal the runs' own, for every key, start and end."""
    keys = {(u, g) for u in (*USERS, "nobody") for g in SIZES}
    with transaction(engine, write=False) as s:
        kept = estimates(engine, s, now, keys)
        truth = from_the_runs(s, now)
    t = now.timestamp()
    for user, gpus in sorted(keys):
        assert kept.predict_duration(user, gpus) == truth.predict_duration(user, gpus)
        for ago in (0.0, 30.0, 600.0, 3_600.0, 7_200.0, 86_400.0, 5 * 86_400.0):
            assert kept.predict_end(user, gpus, t - ago, t) == truth.predict_end(
                user, gpus, t - ago, t
            ), (user, gpus, ago)


def _team(engine: Engine) -> tuple[VirtualClock, dict[str, int]]:
    """A host, the four people, and their user ids by key."""
    svc, clock = make_service(engine, [host("a", "A100", 8)])
    for u in USERS:
        actor(svc, u)
    with Session(engine) as s:
        return clock, {u.key: u.id for u in s.exec(select(User)).all() if u.id is not None}


def test_the_kept_estimates_are_the_ones_the_runs_give(engine: Engine) -> None:
    clock, ids = _team(engine)
    rng = random.Random(30)
    t0 = clock.now()
    end_runs(engine, ids, 400, t0 - timedelta(days=40), rng)
    now = t0
    assert_same(engine, now)  # made and kept
    # Asked again: the kept rows of the keys asked about, one statement, nothing made.
    keys = {("alice", 1), ("bob", 8)}
    with transaction(engine, write=False) as s, statements(engine) as seen:
        estimates(engine, s, now, keys)
    asked = [q for q, _ in seen if q != "BEGIN"]
    assert len(asked) == 1 and "runestimate" in asked[0] and "trainingrun" not in asked[0]
    # Time passes: runs leave the 30 days (each day some do), and others end.
    for days in (1, 3, 9):
        now = t0 + timedelta(days=days)
        assert_same(engine, now)
        end_runs(engine, ids, 15, now - timedelta(days=39), rng)
        assert_same(engine, now)
    # The clock set back before the last predictions were made: runs they dropped count again.
    assert_same(engine, t0 - timedelta(days=2))
    # Every run left the 30 days: nothing to go on, and that is said too.
    assert_same(engine, t0 + timedelta(days=80))


def test_a_run_that_ends_makes_the_kept_estimates_stale_at_once(engine: Engine) -> None:
    """One run of carol's ends after the predictions were kept: the next read sees it
    (its end counted in the bookkeeping, in the transaction that ended it)."""
    clock, ids = _team(engine)
    now = clock.now()
    end_runs(engine, ids, 60, now - timedelta(days=39), random.Random(1))
    assert_same(engine, now)
    with transaction(engine) as s:
        run = TrainingRun(
            user_id=ids["carol"],
            command="python train.py",
            gpu_count=2,
            state="succeeded",
            submitted_at=now - timedelta(hours=9),
            started_at=now - timedelta(hours=9),
            finished_at=now,
            metrics={},
        )
        s.add(run)
        s.flush()
        note_run_ended(s, run)
    assert_same(engine, now)


def test_the_kept_run_times_are_what_a_rebuild_from_the_runs_makes(engine: Engine) -> None:
    clock, ids = _team(engine)
    end_runs(engine, ids, 120, clock.now() - timedelta(days=50), random.Random(7))

    def kept() -> list[tuple[int, int, int, datetime, float]]:
        with Session(engine) as s:
            return [
                (r.run_id, r.user_id, r.gpus, r.finished_at, r.ran_s)
                for r in s.exec(select(RunTime).order_by(col(RunTime.run_id))).all()
            ]

    as_kept = kept()
    assert len(as_kept) > 50
    with transaction(engine) as s:
        assert rebuild_run_times(s) == len(as_kept)
    assert kept() == as_kept
    # A database upgraded from before the times were kept: made once at start-up.
    with engine.begin() as conn:
        conn.execute(RunTime.__table__.delete())  # type: ignore[attr-defined]
    assert backfill_rollups(engine) is None
    assert kept() == as_kept
    assert_same(engine, clock.now())


@pytest.mark.parametrize("attained", [0.0, 1_800.0])
def test_a_finished_runs_time_is_all_its_segments(sqlite_engine: Engine, attained: float) -> None:
    svc, clock = make_service(sqlite_engine, [host("a", "A100", 8)])
    alice = actor(svc, "alice")
    now = clock.now()
    with transaction(sqlite_engine) as s:
        user = s.exec(select(User).where(User.key == alice.key)).one()
        run = TrainingRun(
            user_id=user.id,  # type: ignore[arg-type]
            command="python train.py",
            gpu_count=1,
            state="failed",
            submitted_at=now - timedelta(hours=2),
            started_at=now - timedelta(hours=1),
            finished_at=now,
            metrics={"attained_s": attained} if attained else {},
        )
        s.add(run)
        s.flush()
        note_run_ended(s, run)
    with Session(sqlite_engine) as s:
        assert s.exec(select(RunTime.ran_s)).one() == 3_600.0 + attained
