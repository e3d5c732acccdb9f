"""History stays cheap to read: the fair-share counters kept as intervals close equal the
decayed sum over the intervals, every window and queue query is answered by an index
(EXPLAIN on both databases), and the views and the tick issue the same number of
statements whatever the number of hosts."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, col, select

from bot.app.money.digest import digest_for
from bot.app.money.rollups import (
    FAIR_SHARE_HALF_LIFE_S,
    backfill_rollups,
    fair_share_usage,
    stored_rollups,
)
from bot.app.runtimes import keep_estimates, note_run_ended
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.commands import Queue, Release, Reserve, Run, Status
from bot.domain.errors import UserError
from bot.faces.slack.home import home_view
from bot.faces.worker import tick_job
from db.models import (
    FairShareUsage,
    Gpu,
    GpuSample,
    Host,
    TrainingRun,
    UsageInterval,
    UsageRollup,
    User,
)
from db.session import lock_pool, transaction
from tests.core.helpers import HOUR, actor, host, make_service, runs_here, statements


def _history(svc: GpuService, clock: VirtualClock) -> None:
    """Three people reserving and releasing over two weeks, some overlapping."""
    people = [actor(svc, n) for n in ("alice", "bob", "carol")]
    for day in range(14):
        for i, who in enumerate(people):
            if (day + i) % 3 == 2:
                continue
            svc.reserve(who, Reserve(count=1 + i, duration=timedelta(hours=2 + i)))
        clock.advance(timedelta(hours=1, minutes=17))
        with contextlib.suppress(UserError):  # alice's turn to sit out
            svc.release(people[0], Release(all=True))
        clock.advance(timedelta(hours=22, minutes=43))
        svc.tick()  # the rest expire
    svc.reserve(people[1], Reserve(count=1, duration=HOUR))  # held now


def _decayed_from_intervals(engine: Engine, now: datetime, half_life_s: float) -> dict[str, float]:
    """The scheduler's fair-share usage as it was computed before counters: every
    interval's GPU-seconds, halved for each half-life since it ended (open: now)."""
    out: dict[str, float] = {}
    with Session(engine) as s:
        for iv, user in s.exec(select(UsageInterval, User).join(User)).all():
            end = iv.ended_at or now
            secs = max(0.0, (end - iv.started_at).total_seconds())
            age = max(0.0, (now - end).total_seconds())
            out[user.key] = out.get(user.key, 0.0) + secs * math.pow(0.5, age / half_life_s)
    return out


def test_fair_share_counters_equal_the_decayed_intervals(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("a", "A100", 4), host("b", "A100", 4)])
    _history(svc, clock)
    clock.advance(timedelta(minutes=30))
    expected = _decayed_from_intervals(engine, clock.now(), FAIR_SHARE_HALF_LIFE_S)
    with Session(engine) as s:
        kept = fair_share_usage(s, clock.now(), FAIR_SHARE_HALF_LIFE_S)
        assert kept is not None and kept.keys() == expected.keys()
        for key, value in expected.items():
            assert kept[key] == pytest.approx(value, rel=1e-9), key
        # Counters kept at another half-life are not used (the caller recomputes).
        assert fair_share_usage(s, clock.now(), FAIR_SHARE_HALF_LIFE_S / 2) is None


# --- EXPLAIN -------------------------------------------------------------------------------

# Tables that grow with history or traffic: every query on them must use an index.
_WATCHED = ("usageinterval", "usagerollup", "hostperiod", "notification", "gpusample")


def _full_scans(
    engine: Engine, statement: str, params: Any, watched: tuple[str, ...] = _WATCHED
) -> list[str]:
    """The watched tables the plan reads without an index."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")  # tiny tables still show indexes
            plan = [r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}", params)]
            pattern = re.compile(r"Seq Scan on (\w+)")
        else:
            plan = [r[3] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)]
            pattern = re.compile(r"^SCAN (\w+)$")
        bad = []
        for line in plan:
            m = pattern.search(line.strip())
            if m and m.group(1) in watched:
                bad.append(line.strip())
        return bad


def _busy_service(engine: Engine, tmp_path: Path) -> tuple[GpuService, VirtualClock]:
    svc, clock = make_service(
        engine,
        [host("a", "A100", 4, hourly=8.0), host("b", "A100", 4, hourly=8.0)],
        places=runs_here(tmp_path / "runs"),
    )
    _history(svc, clock)
    with transaction(engine) as s:
        alice = s.exec(select(User).where(User.key == "alice")).one()
        for h in range(48):
            s.add(
                GpuSample(
                    host_id=1,
                    gpu_index=0,
                    at=clock.now() - timedelta(hours=h),
                    span_s=3600,
                    util_pct=50.0,
                    user_id=alice.id,
                    reservation_id=1,
                )
            )
    return svc, clock


def test_every_window_and_queue_query_uses_an_index(engine: Engine, tmp_path: Path) -> None:
    svc, _ = _busy_service(engine, tmp_path)
    assert svc.runs is not None
    asks: list[Callable[[], object]] = [
        lambda: svc.team_bill("month"),
        lambda: svc.team_bill("week"),
        lambda: svc.costs("week", "alice"),
        lambda: digest_for(svc),
        lambda: svc.pending_notifications(),
        lambda: svc.tick(),
        lambda: svc.runs.dispatch() if svc.runs else None,
        lambda: svc.status(actor(svc, "alice"), Status()),
        lambda: home_view(svc, actor(svc, "alice")),
        lambda: svc.runs.queue(actor(svc, "alice"), Queue()) if svc.runs else None,
    ]
    svc.runs.submit(actor(svc, "carol"), Run(command=("true",), model="A100", gpus=4))
    assert _indexed(engine, asks, _WATCHED) > 10


def _indexed(engine: Engine, asks: list[Callable[[], object]], watched: tuple[str, ...]) -> int:
    """Runs each ask; every SELECT it issues on a watched table must read it through an
    index. Returns how many were checked."""
    checked = 0
    for ask in asks:
        with statements(engine) as seen:
            ask()
        for statement, params in seen:
            if not statement.lstrip().upper().startswith("SELECT"):
                continue
            if not any(re.search(rf"\b{t}\b", statement) for t in watched):
                continue
            checked += 1
            assert _full_scans(engine, statement, params, watched) == [], statement
    return checked


def _plan(engine: Engine, statement: str, params: Any) -> list[str]:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")
            return [r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}", params)]
        return [r[3] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)]


def test_an_idle_hosts_last_use_is_read_from_the_host_ended_index(
    engine: Engine, tmp_path: Path
) -> None:
    """Dispatch asks each idle host's last use (the latest end of its intervals): read
    from (host_id, ended_at), where it is one entry per host, not from the host's rows
    (a million after a busy year)."""
    svc, clock = make_service(
        engine,
        [host("a", "A100", 4, hourly=8.0), host("b", "A100", 4, hourly=8.0)],
        places=runs_here(tmp_path / "runs"),
    )
    runs = svc.runs
    bob = actor(svc, "bob")
    svc.reserve(bob, Reserve(count=4, duration=HOUR))
    svc.reserve(bob, Reserve(count=4, duration=HOUR))
    clock.advance(timedelta(minutes=30))
    svc.release(bob, Release(all=True))
    # Something to decide (a queued run that cannot start here), so dispatch reads the
    # fleet, both hosts idle.
    runs.submit(bob, Run(command=("true",), model="A100", gpus=1))
    with statements(engine) as seen:
        runs.dispatch()
    asked = [
        (statement, params)
        for statement, params in seen
        if re.search(r"max\(usageinterval\.ended_at\)", statement)
    ]
    assert len(asked) == 1
    plan = " | ".join(_plan(engine, *asked[0]))
    assert "ix_usageinterval_host_ended" in plan, plan
    assert _full_scans(engine, *asked[0]) == [], plan


# --- statements per view, whatever the number of hosts --------------------------------------


def _count(engine: Engine, ask: Callable[[], object]) -> int:
    with statements(engine) as seen:
        ask()
    return len(seen)


def _counts(engine: Engine, tmp_path: Path, hosts: int) -> dict[str, int]:
    svc, clock = make_service(
        engine,
        [host(f"h{i:02d}", "A100", 4, hourly=8.0) for i in range(hosts)],
        places=runs_here(tmp_path / "runs"),
    )
    runs = svc.runs
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    svc.reserve(alice, Reserve(count=2, duration=HOUR))
    svc.reserve(bob, Reserve(count=1, duration=HOUR))
    # Queued: dispatch places it on a free GPU (of h00 at least), and cannot reach the
    # host to start it, so it stays queued and the same happens on every tick.
    runs.submit(bob, Run(command=("true",), model="A100", gpus=1))
    clock.advance(timedelta(minutes=1))
    return {
        "status": _count(engine, lambda: svc.status(alice, Status())),
        "queue": _count(engine, lambda: runs.queue(alice, Queue())),
        "home": _count(engine, lambda: home_view(svc, alice)),
        "tick": _count(engine, lambda: (svc.tick(), runs.dispatch())),
        "reserve+release": _count(
            engine,
            lambda: (
                svc.reserve(bob, Reserve(count=1, duration=HOUR)),
                svc.release(bob, Release(all=True)),
            ),
        ),
    }


def _empty(engine: Engine) -> None:
    """Every row gone (the schema stays), so a second fleet starts from nothing."""
    with engine.begin() as conn:
        for table in reversed(SQLModel.metadata.sorted_tables):
            conn.execute(table.delete())


def test_views_and_the_tick_do_not_grow_with_hosts(engine: Engine, tmp_path: Path) -> None:
    one = _counts(engine, tmp_path / "one", 1)
    _empty(engine)
    many = _counts(engine, tmp_path / "many", 20)
    assert many == one


def test_start_up_backfills_rollups_once_after_the_upgrade(engine: Engine) -> None:
    svc, clock = make_service(engine, [host("a", "A100", 4, hourly=8.0)])
    _history(svc, clock)
    with Session(engine) as s:
        kept = stored_rollups(s)
    with engine.begin() as conn:  # as a database upgraded from before rollups has it
        conn.execute(UsageRollup.__table__.delete())  # type: ignore[attr-defined]
        conn.execute(FairShareUsage.__table__.delete())  # type: ignore[attr-defined]
    assert backfill_rollups(engine) == len(kept[0].hours) > 0
    with Session(engine) as s:
        assert stored_rollups(s)[0] == kept[0]
    assert backfill_rollups(engine) is None  # rollups there: nothing to do


def _busy_with_runs(engine: Engine, tmp_path: Path, n: int) -> tuple[GpuService, VirtualClock]:
    """`n` hosts of 4 GPUs, each held whole by a running recipe (movable: the tick weighs
    it) with a few minutes of GPU samples, after 10 * n finished runs."""
    svc, clock = make_service(
        engine,
        [host(f"h{i:02d}", "A100", 4, hourly=8.0) for i in range(n)],
        places=runs_here(tmp_path / "runs"),
    )
    for who in ("alice", "bob"):
        actor(svc, who)
    now = clock.now()
    with transaction(engine) as s:
        lock_pool(s)
        users = list(s.exec(select(User).order_by(col(User.id))))
        for i in range(10 * n):
            ended = TrainingRun(
                user_id=users[i % 2].id,  # type: ignore[arg-type]
                command="python train.py",
                gpu_count=4,
                state="succeeded",
                submitted_at=now - timedelta(hours=i + 2),
                started_at=now - timedelta(hours=i + 2),
                finished_at=now - timedelta(hours=i + 1),
                metrics={"loss": 0.1},
            )
            s.add(ended)
            s.flush()
            note_run_ended(s, ended)
        for i, h in enumerate(s.exec(select(Host).order_by(col(Host.id))).all()):
            gpus = list(s.exec(select(Gpu).where(Gpu.host_id == h.id)))
            run = TrainingRun(
                user_id=users[i % 2].id,  # type: ignore[arg-type]
                recipe="digits",
                gpu_count=4,
                state="running",
                host_id=h.id,
                placement={"host": h.name, "pgid": 1000 + i},
                submitted_at=now - timedelta(minutes=30),
                started_at=now - timedelta(minutes=20),
                metrics={"step": 10, "total_steps": 100, "loss": 0.5},
            )
            s.add(run)
            s.flush()
            svc.open_usage(s, h, gpus, run.user_id, now - timedelta(minutes=20), run_id=run.id)
            for minute in range(5):
                for g in gpus:
                    s.add(
                        GpuSample(
                            host_id=h.id,  # type: ignore[arg-type]
                            gpu_index=g.index,
                            at=now - timedelta(minutes=minute),
                            util_pct=90.0,
                            mem_used_mb=1000.0,
                            mem_total_mb=40_000.0,
                            user_id=run.user_id,
                            run_id=run.id,
                        )
                    )
    clock.advance(timedelta(minutes=1))
    return svc, clock


def _run_counts(engine: Engine, tmp_path: Path, n: int) -> dict[str, int]:
    svc, _ = _busy_with_runs(engine, tmp_path, n)
    alice = actor(svc, "alice")
    assert svc.runs is not None
    runs = svc.runs
    tick_job(svc, None)  # the run-time estimates made once (bot.app.runtimes)
    return {
        "status": _count(engine, lambda: svc.status(alice, Status())),
        "queue": _count(engine, lambda: runs.queue(alice, Queue())),
        "home": _count(engine, lambda: home_view(svc, alice)),
        "tick": _count(engine, lambda: tick_job(svc, None)),
    }


def test_views_and_the_tick_do_not_grow_with_running_runs(engine: Engine, tmp_path: Path) -> None:
    """The queue, the status, App Home and an idle tick issue as many statements with two
    runs going (after 20 finished) as with twelve (after 120) on six times the hosts:
    each running run's cost, GPU line and predicted end is read with the others'."""
    two = _run_counts(engine, tmp_path / "two", 2)
    _empty(engine)
    twelve = _run_counts(engine, tmp_path / "twelve", 12)
    assert twelve == two


def test_every_query_of_runs_uses_an_index(engine: Engine, tmp_path: Path) -> None:
    """With runs going and finished: the queue (each run's cost and GPU line), the
    digest (the dearest runs), the tick (the kept run-time estimates) and a remaking of
    the estimates read the growing tables through their indexes."""
    svc, clock = _busy_with_runs(engine, tmp_path, 3)
    clock.advance(timedelta(days=8))  # the runs' week is the digest's last full week
    alice = actor(svc, "alice")
    asks: list[Callable[[], object]] = [
        lambda: svc.runs.queue(alice, Queue()) if svc.runs else None,
        lambda: digest_for(svc),
        lambda: tick_job(svc, None),
        lambda: keep_estimates(engine, clock.now()),
        lambda: tick_job(svc, None),
    ]
    assert _indexed(engine, asks, (*_WATCHED, "runrollup", "runtime", "trainingrun")) > 5
