"""Budgets: set by admins, shown to their holder, checked before money is committed
(reservation request and grant, run submit and dispatch), one 80% DM per period, and
two simultaneous requests that only fit one at a time: exactly one refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.money.budgets import check_budget
from bot.app.service import Actor, GpuService
from bot.domain.commands import Release, Reserve, Run
from bot.domain.errors import UserError
from bot.faces.dispatch import handle_text
from db.models import Notification, Reservation, TrainingRun, UsageInterval, User
from db.session import transaction
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import HOUR, actor, host, make_service, runs_here

# $21.96 an hour for 8 GPUs: $2.745 per GPU-hour.
BOX = host("box", "A100", 8, hourly=21.96)


def say(svc: GpuService, who: Actor, line: str) -> str:
    return handle_text(svc, who, line).view.text


def set_budget(svc: GpuService, spec: str) -> None:
    reply = handle_text(svc, actor(svc, "root"), f"/gpu budget {spec}")
    assert not reply.error, reply.view.text


def dms(engine: Engine, like: str) -> list[Notification]:
    with Session(engine) as s:
        return list(
            s.exec(select(Notification).where(col(Notification.dedupe_key).like(like))).all()
        )


def test_only_an_admin_sets_or_clears_a_budget(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [BOX])
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    reply = handle_text(svc, alice, "/gpu budget @bob 200/week")
    assert reply.error and reply.view.text.startswith("Only an admin can set or clear a budget.")
    reply = handle_text(svc, alice, "/gpu budget @bob")
    assert reply.error and "Only an admin can see someone else's budget" in reply.view.text
    assert say(svc, actor(svc, "root"), "/gpu budget @bob 200/week").startswith(
        "Budget for bob set to $200.00 per week."
    )
    assert say(svc, bob, "/gpu budget") == (
        "Your GPU budget: $200.00 per week. Spent $0.00, committed $0.00, $200.00 left; "
        "it resets Mon 12 Jan 00:00 UTC."
    )
    reply = handle_text(svc, alice, "/gpu budget @bob off")
    assert reply.error and "Only an admin" in reply.view.text
    set_budget(svc, "@bob 800/month")
    assert "$800.00 per month" in say(svc, bob, "/gpu budget")
    assert "resets Sun 01 Feb 00:00 UTC" in say(svc, bob, "/gpu budget")
    set_budget(svc, "@bob off")
    assert say(svc, bob, "/gpu budget").startswith("Your GPU spend has no budget.")
    with Session(sqlite_engine) as s:
        assert s.exec(select(User).where(User.key == "bob")).one().budget_usd is None
    reply = handle_text(svc, actor(svc, "root"), "/gpu budget @nobody")
    assert reply.error and "I do not know `nobody` yet" in reply.view.text


def test_budget_shows_spent_and_committed(sqlite_engine: Engine) -> None:
    svc, clock = make_service(sqlite_engine, [BOX])
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 100/week")
    svc.reserve(bob, Reserve(count=2, duration=3 * HOUR))
    clock.advance(HOUR)
    # 2 GPUs x 1 h spent = $5.49; 2 GPUs x 2 h still to come = $10.98.
    assert say(svc, bob, "/gpu budget").startswith(
        "Your GPU budget: $100.00 per week. Spent $5.49, committed $10.98, $83.53 left;"
    )


def test_a_request_over_budget_is_refused_with_the_numbers(engine: Engine) -> None:
    svc, _ = make_service(engine, [BOX])
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 10/week")
    svc.reserve(bob, Reserve(count=1, duration=2 * HOUR))  # $5.49
    reply = handle_text(svc, bob, "/gpu reserve 1 a100 for 2h")
    assert reply.error
    assert reply.view.text == (
        "Reserving 1× A100 for 2h would take you over your weekly GPU budget of $10.00: "
        "you have spent $0.00 this week, $5.49 is committed to what you hold or queued, and "
        "this needs about $5.49. Your budget resets Mon 12 Jan 00:00 UTC. Release something, "
        "ask for less, or ask an admin to raise it."
    )
    with Session(engine) as s:  # refused, not queued
        assert len(s.exec(select(Reservation)).all()) == 1
    # Someone without a budget is never refused.
    assert not handle_text(svc, actor(svc, "alice"), "/gpu reserve 6 a100 for 3d").error


def test_a_request_is_counted_at_the_dearest_share_among_the_hosts_that_carry_its_model(
    engine: Engine,
) -> None:
    # A100 shares: $2.00 (8 for $16), $3.00 (4 for $12), and $5.00 on a host of two A100s
    # and two T4s for $20 (its price is split over all four GPUs, whatever their model).
    # The T4 host's $10.00 share does not count: it has no A100.
    mixed = host("mixed", "A100", 4, hourly=20.0)
    mixed = replace(
        mixed,
        gpus=mixed.gpus[:2] + tuple(replace(g, model="T4") for g in mixed.gpus[2:]),
    )
    fleet = [
        host("cheap", "A100", 8, hourly=16.0),
        host("dear", "A100", 4, hourly=12.0),
        mixed,
        host("t4box", "T4", 1, hourly=10.0),
    ]
    svc, _ = make_service(engine, fleet)
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 9/week")
    reply = handle_text(svc, bob, "/gpu reserve 1 a100 for 2h")
    assert reply.error
    assert "this needs about $10.00." in reply.view.text
    reply = handle_text(svc, bob, "/gpu reserve 1 t4 for 30m")  # $5.00 on the T4 box
    assert not reply.error, reply.view.text


def test_eighty_percent_warns_once_per_period(sqlite_engine: Engine) -> None:
    svc, clock = make_service(sqlite_engine, [BOX])
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 10/week")
    svc.reserve(bob, Reserve(count=1, duration=HOUR))  # $2.745: 27%, no DM
    assert dms(sqlite_engine, "budget-80:%") == []
    svc.reserve(bob, Reserve(count=1, duration=2 * HOUR))  # $8.235 in all: 82%
    svc.reserve(bob, Reserve(count=1, duration=HOUR / 2))  # $9.6075: 96%, no second DM
    [warning] = dms(sqlite_engine, "budget-80:%")
    assert warning.target == "bob"
    assert warning.text.startswith("Heads-up: you are at 82% of your weekly GPU budget ($8.24")
    # A new week is a new period: warned again.
    clock.set(datetime(2026, 1, 12, 9, tzinfo=UTC))
    svc.tick()
    svc.reserve(bob, Reserve(count=1, duration=3 * HOUR))
    assert len(dms(sqlite_engine, "budget-80:%")) == 2


def test_a_waiting_reservation_over_budget_at_grant_is_cancelled_with_a_dm(
    engine: Engine,
) -> None:
    svc, _ = make_service(engine, [host("one", "A100", 1, hourly=2.745)])
    alice, bob = actor(svc, "alice"), actor(svc, "bob")
    svc.reserve(alice, Reserve(count=1, duration=HOUR))
    set_budget(svc, "@bob 10/week")
    assert "waiting" in svc.reserve(bob, Reserve(count=1, duration=3 * HOUR)).view.text
    set_budget(svc, "@bob 5/week")  # lowered while bob waits
    svc.release(alice, Release())
    with Session(engine) as s:
        waited = s.get(Reservation, 2)
        assert waited is not None and waited.state == "cancelled"
        assert s.exec(select(UsageInterval).where(UsageInterval.reservation_id == 2)).all() == []
    [dm] = dms(engine, "budget-cancel:2")
    assert dm.target == "bob"
    assert dm.text.startswith(
        "Reservation #2 was cancelled, not granted: Granting reservation #2 would take you over "
        "your weekly GPU budget of $5.00"
    )


def priced_local(slots: int = 2, hourly: float = 4.0) -> Instance:
    """This machine as a host that costs money ($2 per slot-hour), so runs have a price."""
    return Instance(
        name="local",
        provider="local",
        state="ready",
        gpus=tuple(GpuDevice(index=i, model="cpu") for i in range(slots)),
        hourly_usd=hourly,
        market="ondemand",
    )


def test_runs_are_checked_at_submit_and_again_before_placing(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [priced_local()], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 3/week")
    runs.submit(bob, Run(recipe="digits", max_duration=HOUR))  # $2 committed
    with pytest.raises(UserError) as refused:
        runs.submit(bob, Run(recipe="digits"))  # no --max: counted as one hour, $2 more
    assert refused.value.reason.startswith(
        "This run (1 CPU slot, no --max: counted as 1h) would take you over your weekly GPU "
        "budget of $3.00: you have spent $0.00 this week, $2.00 is committed"
    )
    set_budget(svc, "@bob 1/week")
    assert runs.dispatch() == 0
    with Session(sqlite_engine) as s:
        run = s.exec(select(TrainingRun)).one()
        assert run.state == "cancelled" and run.started_at is None
        assert s.exec(select(UsageInterval)).all() == []
    [dm] = dms(sqlite_engine, "budget-cancel-run:%")
    assert dm.text.startswith("Run #1 was cancelled, not started: Starting run #1 would take you")


@contextmanager
def slow_inserts(engine: Engine, table: str, seconds: float) -> Iterator[None]:
    """Widens the window between a request's budget check and its commit (a pause right
    after its row is inserted), so that two requests checked without the user-row lock
    would both see the budget free. Instrumentation of SQLAlchemy, not of our code."""

    def pause(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(f"INSERT INTO {table.upper()}"):
            time.sleep(seconds)

    event.listen(engine, "after_cursor_execute", pause)
    try:
        yield
    finally:
        event.remove(engine, "after_cursor_execute", pause)


def test_two_runs_that_fit_alone_but_not_together_one_is_refused(
    engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(engine, [priced_local()], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 3/week")  # one $2 run fits, two do not
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def submit() -> None:
        barrier.wait(timeout=30)
        try:
            runs.submit(bob, Run(recipe="digits", max_duration=HOUR))
            outcomes.append("queued")
        except UserError as exc:
            outcomes.append(exc.reason)

    with slow_inserts(engine, "trainingrun", 0.5):
        threads = [threading.Thread(target=submit) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(o == "queued" for o in outcomes) == [False, True], outcomes
    assert any("over your weekly GPU budget of $3.00" in o for o in outcomes)
    with Session(engine) as s:
        assert len(s.exec(select(TrainingRun)).all()) == 1


def test_a_reservation_and_a_run_racing_one_is_refused(engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(engine, [priced_local()], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    bob = actor(svc, "bob")
    set_budget(svc, "@bob 3/week")
    barrier = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def go(kind: str) -> None:
        barrier.wait(timeout=30)
        try:
            if kind == "run":
                runs.submit(bob, Run(recipe="digits", max_duration=HOUR))
            else:
                svc.reserve(bob, Reserve(count=1, model="cpu", duration=HOUR))
            outcomes[kind] = "ok"
        except UserError as exc:
            outcomes[kind] = exc.reason

    with slow_inserts(engine, "trainingrun", 0.5), slow_inserts(engine, "reservation", 0.5):
        threads = [threading.Thread(target=go, args=(k,)) for k in ("run", "reservation")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(v == "ok" for v in outcomes.values()) == [False, True], outcomes


def test_check_budget_is_callable_by_the_fleet(sqlite_engine: Engine) -> None:
    """The launch path calls it with the instance's expected cost before launching."""
    svc, clock = make_service(sqlite_engine, [BOX])
    actor(svc, "bob")
    set_budget(svc, "@bob 50/week")
    with transaction(sqlite_engine) as s:
        bob = s.exec(select(User).where(User.key == "bob")).one()
        check_budget(s, bob, Decimal("40.00"), clock.now(), svc.settings)  # 80%: a DM
    with pytest.raises(UserError, match=r"needs about \$50\.01"), transaction(sqlite_engine) as s:
        bob = s.exec(select(User).where(User.key == "bob")).one()
        check_budget(s, bob, Decimal("50.01"), clock.now(), svc.settings, what="Launching")
    assert len(dms(sqlite_engine, "budget-80:%")) == 1


def test_what_is_committed_is_everything_the_person_holds_waits_for_or_queued(
    engine: Engine,
) -> None:
    """Hand-computed at $2 an A100 and $4 an H100 per GPU-hour: 2 A100 held for 3 more
    hours ($12), 4 A100 waiting for an hour at the dearest A100 price ($8), 2 H100 running
    with a --max of 2 h after 30 minutes ($12), one running with no --max (an hour more:
    $4), 2 H100 queued with a --max of an hour ($8): $44. Bob's run is not Alice's."""
    from datetime import timedelta

    from bot.app.money.budgets import committed_usd
    from db.models import Gpu, Host

    svc, clock = make_service(
        engine, [host("a", "A100", 4, hourly=8.0), host("h", "H100", 4, hourly=16.0)]
    )
    alice = actor(svc, "alice")
    actor(svc, "bob")
    svc.reserve(alice, Reserve(count=2, model="A100", duration=3 * HOUR))
    svc.reserve(alice, Reserve(count=4, model="A100", duration=HOUR))  # waits
    now = clock.now()
    began = now - timedelta(minutes=30)
    with transaction(engine) as s:
        h100 = s.exec(select(Host).where(Host.name == "h")).one()
        gpus = list(s.exec(select(Gpu).where(Gpu.host_id == h100.id).order_by(col(Gpu.index))))
        ids = {u.key: u.id for u in s.exec(select(User)).all()}
        for who, taken, max_s, state in (
            ("alice", gpus[:2], 7200, "running"),
            ("alice", gpus[2:3], None, "running"),
            ("bob", gpus[3:4], None, "running"),
            ("alice", [], 3600, "queued"),
        ):
            run = TrainingRun(
                user_id=ids[who],  # type: ignore[arg-type]
                command="python train.py",
                gpu_count=len(taken) or 2,
                gpu_model="H100",
                max_seconds=max_s,
                state=state,
                submitted_at=began,
                started_at=began if taken else None,
            )
            s.add(run)
            s.flush()
            if taken:
                svc.open_usage(s, h100, taken, run.user_id, began, run_id=run.id)
    with transaction(engine, write=False) as s:
        assert committed_usd(s, ids["alice"], now) == Decimal("44")  # type: ignore[arg-type]
        assert committed_usd(s, ids["bob"], now) == Decimal("4")  # type: ignore[arg-type]
