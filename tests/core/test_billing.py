"""The instances' side of the bill (HostPeriod history on sync) and `/gpu cost team`:
people + idle overhead == what the instances cost, to the cent, on hand-computed
histories and on randomized ones built through the real service."""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.money.billing import host_periods, load_usages, shown_cents, team_bill, window_costs
from bot.app.money.rollups import (
    computed_rollups,
    day_sums,
    rebuild_rollups,
    stored_rollups,
)
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.commands import Release, Reserve
from bot.domain.errors import UserError
from bot.domain.metering import Window, cost_by_user, idle_overhead, period_window, to_cents
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from db.migrate import upgrade
from db.models import HostPeriod
from db.session import make_engine
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import HOUR, actor

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)  # a Monday
# 730 GB at $0.10 per GB-month on a 730-hour month: exactly $0.10 an hour while stopped.
EBS = {"ebs_gb": 730.0, "ebs_usd_gb_month": 0.1}


def aws(
    name: str, gpus: int, hourly: float, state: str = "ready", market: str = "ondemand"
) -> Instance:
    return Instance(
        name=name,
        provider="aws",
        state=state,
        gpus=tuple(GpuDevice(index=i, model="A100", memory_gb=40.0) for i in range(gpus)),
        instance_id=f"i-{name}",
        instance_type="p4d.24xlarge",
        market=market,
        hourly_usd=hourly,
        address=f"{name}.example",
        ssh_user="ubuntu",
    )


def service(engine: Engine, hosts: list[Instance]) -> tuple[GpuService, VirtualClock]:
    clock = VirtualClock(T0)
    svc = GpuService(engine, Settings(admins=("root",), **EBS), clock)  # type: ignore[arg-type]
    svc.sync_hosts(hosts)
    return svc, clock


def periods(engine: Engine) -> list[tuple[str, datetime, datetime | None, float, float, str]]:
    with Session(engine) as s:
        rows = s.exec(select(HostPeriod).order_by(col(HostPeriod.id))).all()
        return [
            (p.state, p.started_at, p.ended_at, p.usd_per_hour, p.storage_usd_per_hour, p.market)
            for p in rows
        ]


def test_host_history_follows_every_sync(engine: Engine) -> None:
    box = aws("box", 8, 21.96)
    svc, clock = service(engine, [box])
    t = [T0]
    for delta, inst in [
        (HOUR, replace(box, state="stopped")),
        (2 * HOUR, box),  # started again
        (HOUR, box),  # nothing changed: no new period
        (HOUR, replace(box, market="spot", hourly_usd=8.0)),  # price and market change
        (HOUR, replace(box, market="spot", hourly_usd=8.0, state="terminated")),
        (HOUR, replace(box, market="spot", hourly_usd=8.0, state="terminated")),
    ]:
        clock.advance(delta)
        t.append(clock.now())
        svc.sync_hosts([inst])
    # Each period carries the volume's rate; it is billed only while stopped.
    assert periods(engine) == [
        ("running", t[0], t[1], 21.96, 0.1, "ondemand"),
        ("stopped", t[1], t[2], 21.96, 0.1, "ondemand"),
        ("running", t[2], t[4], 21.96, 0.1, "ondemand"),
        ("running", t[4], t[5], 8.0, 0.1, "spot"),
    ]
    # 1 h + 2 h... = 3 h at $21.96, 2 h stopped at $0.10, 1 h at $8.
    window = period_window("week", clock.now(), "UTC")
    with Session(engine) as s:
        bill = team_bill(s, window, clock.now())
    assert bill.instances == Decimal("21.96") * 3 + Decimal("0.2") + Decimal("8")
    assert bill.idle == bill.instances and bill.users == {} and bill.balanced


def test_an_owned_machine_has_periods_but_no_bill(engine: Engine) -> None:
    owned = replace(aws("rack", 2, 0.0, market="owned"), provider="ssh", instance_id=None)
    svc, clock = service(engine, [owned])
    clock.advance(HOUR)
    svc.sync_hosts([replace(owned, state="stopped")])
    assert [(p[0], p[4]) for p in periods(engine)] == [("running", 0.0), ("stopped", 0.0)]


def test_cost_team_adds_up_to_the_instances_bill(engine: Engine) -> None:
    box = aws("box", 8, 21.96)  # $2.745 per GPU-hour
    svc, clock = service(engine, [box])
    alice, bob, carol = actor(svc, "alice"), actor(svc, "bob"), actor(svc, "carol")
    svc.reserve(alice, Reserve(count=2, duration=3 * HOUR))  # 6 GPU-h = $16.47
    clock.advance(HOUR / 2)
    svc.reserve(bob, Reserve(count=1, duration=HOUR))  # 1 GPU-h = $2.745
    clock.advance(HOUR / 2 + 3 * HOUR)  # T0 + 4 h
    svc.tick()
    svc.sync_hosts([replace(box, state="stopped")])
    clock.advance(10 * HOUR)  # 10 h stopped at $0.10
    bill = svc.team_bill("week")
    # Instances: 4 h x $21.96 + 10 h x $0.10; idle: the 25 GPU-hours nobody held + storage.
    assert bill.users == {"alice": Decimal("16.47"), "bob": Decimal("2.745")}
    assert bill.instances == Decimal("87.84") + Decimal("1.00")
    assert bill.idle == 25 * Decimal("2.745") + Decimal("1.00")
    assert bill.held + bill.idle == bill.instances
    text = render(handle_text(svc, carol, "/gpu cost team").view)
    # Rounded on their own the rows would say 16.47 + 2.75 + 69.63 = 88.85 against 88.84;
    # the idle overhead gives the cent up, so the shown rows add up to the shown total.
    assert "alice  $16.47" in text and "bob    $2.75" in text
    assert "idle overhead   $69.62" in text and "instances       $88.84" in text
    assert "held by people  $19.22" in text
    assert "the instances cost $88.84: $19.22 held by 2 people + $69.62 idle overhead" in text


def test_cost_team_shows_spot_savings(sqlite_engine: Engine) -> None:
    svc, clock = service(sqlite_engine, [aws("sp", 8, 8.0, market="spot")])  # $1 per GPU-hour
    svc.reserve(actor(svc, "alice"), Reserve(count=2, duration=HOUR))
    clock.advance(2 * HOUR)
    svc.tick()
    text = render(handle_text(svc, actor(svc, "bob"), "/gpu cost team today").view)
    # On demand a p4d.24xlarge GPU is $21.957642 / 8 = $2.74470525 an hour (shipped catalog).
    saved = to_cents(2 * (Decimal("21.957642") / 8 - 1))
    assert saved == Decimal("3.49")
    assert "alice  $2.00  $3.49" in text and "Spot saved $3.49" in text


def test_shown_cents_keep_the_sum_and_give_way_on_ties() -> None:
    parts = {"a": Decimal("1.005"), "b": Decimal("1.005"), "idle": Decimal("1.005")}
    shown, total = shown_cents(parts, Decimal("3.015"), absorb="idle")
    assert total == Decimal("3.02") and sum(shown.values()) == total
    assert shown == {"a": Decimal("1.01"), "b": Decimal("1.01"), "idle": Decimal("1.00")}
    # Parts that do not add up are each rounded on their own: nothing papered over.
    shown, total = shown_cents({"a": Decimal("1.004")}, Decimal("2"))
    assert shown == {"a": Decimal("1.00")} and total == Decimal("2.00")


# --- randomized histories through the real service -------------------------------------

_PRICES = (21.96, 32.7726, 8.0, 3.06, 0.0)  # per-GPU shares that are finite decimals
_OPS = st.one_of(
    st.tuples(
        st.just("reserve"),
        st.sampled_from(["alice", "bob", "carol"]),
        st.integers(1, 4),
        st.integers(1, 300),
    ),
    st.tuples(st.just("release"), st.sampled_from(["alice", "bob", "carol"])),
    st.tuples(st.just("wait"), st.integers(1, 600)),
    st.tuples(st.just("stop"), st.integers(0, 1)),
    st.tuples(st.just("start"), st.integers(0, 1), st.sampled_from(_PRICES)),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(_OPS, min_size=1, max_size=25), gpus=st.sampled_from([(4, 8), (1, 2)]))
def test_people_plus_idle_is_the_instances_bill(ops: list[tuple], gpus: tuple[int, int]) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'bill.db'}")
        upgrade(engine)
        try:
            _replay(engine, ops, gpus)
        finally:
            engine.dispose()


def _replay(engine: Engine, ops: list[tuple], gpus: tuple[int, int]) -> None:  # type: ignore[type-arg]
    hosts = [aws("h0", gpus[0], 21.96), aws("h1", gpus[1], 32.7726, market="spot")]
    svc, clock = service(engine, hosts)
    people = {name: actor(svc, name) for name in ("alice", "bob", "carol")}
    for op in ops:
        if op[0] == "reserve":
            _, who, count, minutes = op
            # More GPUs than one host has is refused, and changes nothing.
            with contextlib.suppress(UserError):
                svc.reserve(people[who], Reserve(count=count, duration=timedelta(minutes=minutes)))
        elif op[0] == "release":
            with contextlib.suppress(UserError):  # holds nothing
                svc.release(people[op[1]], Release(all=True))
        elif op[0] == "wait":
            clock.advance(timedelta(minutes=op[1]))
            svc.tick()
        else:
            # An instance is stopped or re-priced only with nobody on it (as the fleet
            # does): everyone lets go first.
            for p in people.values():
                with contextlib.suppress(UserError):
                    svc.release(p, Release(all=True))
            i = op[1]
            if op[0] == "stop":
                hosts[i] = replace(hosts[i], state="stopped")
            else:
                hosts[i] = replace(hosts[i], state="ready", hourly_usd=op[2])
            svc.sync_hosts(hosts)
    clock.advance(timedelta(minutes=7))
    for period in ("today", "week", "month"):
        bill = svc.team_bill(period)
        assert bill.held + bill.idle == bill.instances, (period, bill)
        assert bill.balanced
        parts = {f"user:{k}": v for k, v in bill.users.items()} | {"idle": bill.idle}
        shown, total = shown_cents(parts, bill.instances, absorb="idle")
        assert sum(shown.values()) == total == to_cents(bill.instances)
    _rollups_agree_with_the_raw_intervals(engine, clock.now())


def _rollups_agree_with_the_raw_intervals(engine: Engine, now: datetime) -> None:
    """What was rolled up as intervals closed is what a rebuild from the raw intervals
    makes, and costs read through the rollups equal metering every raw interval, also
    over windows whose edges are off the hour (a half-hour time zone's midnight)."""
    with Session(engine) as s:
        kept_rows, kept_fair = stored_rollups(s)
        rows, fair = computed_rollups(s)
        assert kept_rows == rows
        assert kept_rows.days == day_sums(rows.hours)
        assert kept_fair.keys() == fair.keys()
        for user_id, (value, as_of) in fair.items():
            assert kept_fair[user_id][1] == as_of
            assert kept_fair[user_id][0] == pytest.approx(value, rel=1e-12)
        windows = [
            Window(T0, now),
            Window(min(T0 + timedelta(minutes=30), now), now),
            Window(T0 + timedelta(minutes=7), T0 + timedelta(minutes=50)),
            Window(T0 - timedelta(days=1), T0 + timedelta(days=1, minutes=45)),
            Window(T0 - timedelta(days=1, hours=5), now + timedelta(days=2, hours=1)),
        ]
        for w in windows:
            raw = [m.usage for m in load_usages(s, w)]
            periods = host_periods(s, w)
            costs = window_costs(s, w, now)
            assert costs.users() == cost_by_user(raw, w, now), w
            assert costs.idle(periods) == idle_overhead(periods, raw, w, now), w
        assert rebuild_rollups(s) == len(rows.hours)
        s.commit()
        assert stored_rollups(s)[0] == rows
