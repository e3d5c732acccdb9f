"""Runs in the rollups: the team's rows are per person, a run's own rows are kept beside
them (bot.app.money.rollups.RunRollup), and what they say is what metering the raw intervals
says: the kept rows equal a rebuild from the intervals, and the dearest runs of a window
(the digest's) are those of the raw intervals, also over windows whose edges are off the
hour and with runs still going."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.money.billing import dearest_runs, load_usages, team_bill, window_costs
from bot.app.money.digest import build_digest, last_complete_week
from bot.app.money.rollups import computed_rollups, rebuild_rollups, stored_rollups
from bot.app.service import GpuService
from bot.app.watching.held import end_held, held_gpu_ids
from bot.domain.clock import VirtualClock
from bot.domain.commands import Reserve
from bot.domain.metering import Window, cost_by_ref, cost_by_user
from db.models import Gpu, Host, TrainingRun, User
from db.session import lock_pool, transaction
from tests.core.helpers import actor, host, make_service

PEOPLE = ("alice", "bob", "carol")


def _history(engine: Engine, seed: int) -> tuple[GpuService, VirtualClock, datetime]:
    """Ten days of runs of 1 to 4 GPUs on two priced hosts (one spot), opened and closed
    as dispatch and poll do (usage intervals opened at the claim, ended through
    `end_held`, which rolls them up), beside people's reservations; some runs still going."""
    svc, clock = make_service(
        engine,
        [
            host("h0", "A100", 4, hourly=21.96),
            host("h1", "A100", 4, hourly=32.7726),
        ],
    )
    for p in PEOPLE:
        actor(svc, p)
    rng = random.Random(seed)
    start = clock.now()
    going: list[tuple[int, datetime]] = []  # run id, when it ends
    for _ in range(160):
        clock.advance(timedelta(minutes=rng.uniform(10, 170)))
        now = clock.now()
        with transaction(engine) as s:
            lock_pool(s)
            for run_id, ends in [g for g in going if g[1] <= now]:
                end_held(s, ends, run_id=run_id)
                going.remove((run_id, ends))
            h = rng.choice(s.exec(select(Host).order_by(col(Host.id))).all())
            held = held_gpu_ids(s, host_id=h.id)
            free = [
                g
                for g in s.exec(select(Gpu).where(Gpu.host_id == h.id).order_by(col(Gpu.index)))
                if g.id not in held
            ]
            want = rng.choice((1, 1, 2, 4))
            if len(free) < want:
                continue
            who = s.exec(select(User).where(User.key == rng.choice(PEOPLE))).one()
            assert who.id is not None
            run = TrainingRun(
                user_id=who.id,
                recipe="digits" if rng.random() < 0.5 else None,
                command="python train.py",
                gpu_count=want,
                state="running",
                submitted_at=now,
                started_at=now,
            )
            s.add(run)
            s.flush()
            assert run.id is not None
            svc.open_usage(s, h, free[:want], who.id, now, run_id=run.id)
            going.append((run.id, now + timedelta(minutes=rng.expovariate(1 / 300))))
        if rng.random() < 0.3:  # someone at a keyboard, in line if nothing is free
            svc.reserve(
                actor(svc, rng.choice(PEOPLE)),
                Reserve(count=1, duration=timedelta(minutes=rng.uniform(20, 200))),
            )
        svc.tick()  # reservations end, the line is granted
    return svc, clock, start


def _truth(s: Session, w: Window, now: datetime, n: int) -> list[tuple[int, Decimal]]:
    """The dearest runs of the window from metering each run's raw intervals."""
    runs = [m.usage for m in load_usages(s, w) if m.usage.kind == "run"]
    costs = {run_id: usd for (_, run_id), usd in cost_by_ref(runs, w, now).items()}
    return sorted(costs.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def test_runs_rolled_up_are_what_the_raw_intervals_say(engine: Engine) -> None:
    _, clock, start = _history(engine, seed=30)
    now = clock.now()
    with Session(engine) as s:
        kept, _ = stored_rollups(s)
        made, _ = computed_rollups(s)
        assert kept == made and len(made.runs) > 50
        # Per person, whatever the runs: a row per person, market and instance type a day.
        assert len(made.days) <= len(PEOPLE) * 2 * 11
        windows = [
            Window(start, now),
            Window(start + timedelta(days=2), start + timedelta(days=5)),
            # edges off the hour, as a half-hour time zone's days have them
            Window(start + timedelta(days=1, minutes=30), start + timedelta(days=6, minutes=30)),
            Window(now - timedelta(hours=20, minutes=15), now + timedelta(hours=1)),
            Window(now - timedelta(minutes=40), now),
        ]
        for w in windows:
            costs = window_costs(s, w, now)
            raw = [m.usage for m in load_usages(s, w)]
            assert costs.users() == cost_by_user(raw, w, now), w
            for n in (1, 5, 1_000):
                assert dearest_runs(s, costs, n) == _truth(s, w, now, n), (w, n)
        assert rebuild_rollups(s) == len(made.hours)
        s.commit()
        assert stored_rollups(s)[0] == made
        assert team_bill(s, windows[0], now).balanced


def test_the_digests_dearest_runs_are_the_raw_intervals(engine: Engine) -> None:
    svc, clock, _ = _history(engine, seed=7)
    # Into the next week, with runs still going, then the digest of the last full week.
    clock.advance(timedelta(days=3))
    now = clock.now()
    year, week = last_complete_week(now, "Asia/Kolkata")
    settings = svc.settings.model_copy(update={"timezone": "Asia/Kolkata"})
    with Session(engine) as s:
        d = build_digest(s, year, week, now, settings)
        truth = _truth(s, d.window, now, 5)
        owner = {
            r.id: u.display_name for r, u in s.exec(select(TrainingRun, User).join(User)).all()
        }
        assert truth
        assert [(r.run_id, r.user, r.usd) for r in d.top_runs] == [
            (run_id, owner[run_id], usd) for run_id, usd in truth
        ]


def test_a_run_with_an_edge_off_the_hour_counts_whole(engine: Engine) -> None:
    """Run 1 held a GPU 10:00-13:00, run 2 09:00-13:00; the window starts at 09:30. Their
    rolled-up hours tie (10:00-13:00), and run 2's half hour before 10:00 is read raw: it
    is the dearer of the two, which only its rolled-up part and its raw part together say."""
    svc, clock = make_service(engine, [host("h0", "A100", 2, hourly=8.0)])
    actor(svc, "alice")
    day = clock.now().replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    with transaction(engine) as s:
        lock_pool(s)
        who = s.exec(select(User).where(User.key == "alice")).one()
        h = s.exec(select(Host)).one()
        gpus = list(s.exec(select(Gpu).order_by(col(Gpu.index))))
        assert who.id is not None
        for gpu, begins in ((gpus[0], 10), (gpus[1], 9)):
            run = TrainingRun(
                user_id=who.id, command="python train.py", state="running", submitted_at=day
            )
            s.add(run)
            s.flush()
            assert run.id is not None
            svc.open_usage(s, h, [gpu], who.id, day + timedelta(hours=begins), run_id=run.id)
            end_held(s, day + timedelta(hours=13), run_id=run.id)
    now = day + timedelta(hours=14)
    w = Window(day + timedelta(hours=9, minutes=30), day + timedelta(hours=14))
    with Session(engine) as s:
        got = dearest_runs(s, window_costs(s, w, now), 1)
        assert got == _truth(s, w, now, 1) and got[0][0] == 2
        assert got[0][1] == Decimal("14.00")  # 3.5 GPU-hours at $4
