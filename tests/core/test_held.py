"""bot.app.watching.held: "held now" is an interval with no end, narrowed by host, reservation or run,
on both databases; an ended interval never counts, and ending a holder's GPUs touches
only that holder's intervals."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from bot.app.watching.held import (
    attained_s,
    end_held,
    held_for_scheduler,
    held_gpu_ids,
    held_host_ids,
    held_intervals,
    who_holds,
)
from db.models import Gpu, Host, Reservation, TrainingRun, UsageInterval, User
from db.session import core, transaction

T0 = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)


def _setup(s: Session) -> dict[str, int]:
    """Two hosts of two GPUs. Alice's reservation holds both of h2's (recorded index 1
    first); Bob's run holds h1's GPU 0; h1's GPU 1 was held by Bob once and let go."""
    alice = User(key="alice", display_name="Alice", created_at=T0)
    bob = User(key="bob", display_name="Bob", created_at=T0)
    h1 = Host(name="h1", provider="ssh", hourly_usd=2.0, created_at=T0, updated_at=T0)
    h2 = Host(name="h2", provider="ssh", hourly_usd=4.0, created_at=T0, updated_at=T0)
    s.add_all([alice, bob, h1, h2])
    s.flush()
    assert alice.id and bob.id and h1.id and h2.id
    hosts = {"h1": h1.id, "h2": h2.id}
    gpus = {(n, i): Gpu(host_id=h, index=i, model="A100") for n, h in hosts.items() for i in (0, 1)}
    s.add_all(gpus.values())
    res = Reservation(
        user_id=alice.id, gpu_count=2, duration_s=3600, state="active", requested_at=T0
    )
    run = TrainingRun(user_id=bob.id, state="running", host_id=h1.id, submitted_at=T0)
    s.add_all([res, run])
    s.flush()
    ids = {f"{h}g{i}": g.id for (h, i), g in gpus.items() if g.id is not None}
    ids.update(alice=alice.id, bob=bob.id, h1=h1.id, h2=h2.id, res=res.id or 0, run=run.id or 0)

    def iv(
        gpu: str,
        host: int,
        user: int,
        reservation_id: int | None = None,
        run_id: int | None = None,
        ended_at: datetime | None = None,
    ) -> UsageInterval:
        return UsageInterval(
            gpu_id=ids[gpu],
            host_id=host,
            user_id=user,
            reservation_id=reservation_id,
            run_id=run_id,
            started_at=T0,
            ended_at=ended_at,
            usd_per_hour=1.0,
        )

    s.add_all(
        [
            iv("h2g1", h2.id, alice.id, reservation_id=res.id),
            iv("h2g0", h2.id, alice.id, reservation_id=res.id),
            iv("h1g0", h1.id, bob.id, run_id=run.id),
            iv("h1g1", h1.id, bob.id, run_id=run.id, ended_at=T0 + timedelta(minutes=5)),
        ]
    )
    return ids


def test_only_open_intervals_are_held_and_each_filter_narrows(engine: Engine) -> None:
    with transaction(engine) as s:
        ids = _setup(s)
    with transaction(engine, write=False) as s:
        assert held_gpu_ids(s) == {ids["h1g0"], ids["h2g0"], ids["h2g1"]}
        assert held_gpu_ids(s, host_id=ids["h1"]) == {ids["h1g0"]}
        assert held_host_ids(s) == {ids["h1"], ids["h2"]}
        by_res = held_intervals(s, reservation_id=ids["res"])
        assert sorted(iv.gpu_id for iv in by_res) == sorted([ids["h2g0"], ids["h2g1"]])
        assert [iv.gpu_id for iv in held_intervals(s, run_id=ids["run"])] == [ids["h1g0"]]
        assert [iv.gpu_id for iv in held_intervals(s, host_id=ids["h1"])] == [ids["h1g0"]]


def test_who_holds_brings_the_holder_by_host_then_gpu_index(engine: Engine) -> None:
    with transaction(engine) as s:
        ids = _setup(s)
    with transaction(engine, write=False) as s:
        rows = [
            (
                h.gpu.id,
                h.user.key,
                h.reservation.id if h.reservation else None,
                h.run.id if h.run else None,
            )
            for h in who_holds(s)
        ]
        assert rows == [
            (ids["h1g0"], "bob", None, ids["run"]),
            (ids["h2g0"], "alice", ids["res"], None),
            (ids["h2g1"], "alice", ids["res"], None),
        ]
        mine = who_holds(s, reservation_id=ids["res"])
        assert [h.gpu.index for h in mine] == [0, 1]
        assert [h.gpu.id for h in who_holds(s, host_ids=[ids["h1"]])] == [ids["h1g0"]]
        assert who_holds(s, host_ids=[]) == []


@pytest.mark.parametrize(
    ("placement", "metrics", "interrupted", "attained"),
    [
        ({}, {}, False, 0.0),
        ({"host": "h1"}, {"step": 3, "attained_s": 120.5}, False, 120.5),
        ({"interrupted": {"host": "h1", "reason": "spot"}}, {"attained_s": 60}, True, 60.0),
        ({"interrupted": {}}, {"attained_s": -5.0}, True, 0.0),
    ],
)
def test_the_scheduler_reads_a_runs_interruption_and_attained_time_from_the_database(
    engine: Engine,
    placement: dict[str, object],
    metrics: dict[str, object],
    interrupted: bool,
    attained: float,
) -> None:
    # Taken out of the JSON documents in SQL (JSON_EXTRACT, ->>), not parsed per held GPU:
    # the same answers as the runs' own readers give (`attained_s`, "interrupted" in it).
    with transaction(engine) as s:
        ids = _setup(s)
        run = s.get(TrainingRun, ids["run"])
        assert run is not None
        run.placement, run.metrics = placement, metrics
        s.add(run)
    with transaction(engine, write=False) as s:
        holds = {(h.reservation_id, h.run_id): h for h in held_for_scheduler(s)}
        mine = holds[(None, ids["run"])]
        assert (mine.run_interrupted, mine.run_attained_s) == (interrupted, attained)
        assert mine.run_attained_s == attained_s(metrics)
        theirs = holds[(ids["res"], None)]  # a reservation's GPUs: no run, nothing to read
        assert (theirs.run_interrupted, theirs.run_attained_s) == (False, 0.0)


def test_ending_a_run_lets_go_of_its_gpus_only_never_before_they_were_taken(
    engine: Engine,
) -> None:
    with transaction(engine) as s:
        ids = _setup(s)
    with transaction(engine) as s:
        # A clock behind the start (a step back) ends the interval where it began.
        ended = end_held(s, T0 - timedelta(minutes=1), run_id=ids["run"])
        assert [iv.gpu_id for iv in ended] == [ids["h1g0"]]
        ended_id = ended[0].id
    with transaction(engine, write=False) as s:
        assert held_gpu_ids(s) == {ids["h2g0"], ids["h2g1"]}
        closed = s.get(UsageInterval, ended_id)
        assert closed is not None and closed.ended_at == T0
    with transaction(engine) as s:
        end_held(s, T0 + timedelta(hours=1), host_id=ids["h2"])
    with transaction(engine, write=False) as s:
        assert held_gpu_ids(s) == set()
        assert held_intervals(s) == []


def test_ending_by_two_filters_ends_only_what_matches_both(engine: Engine) -> None:
    # end_held's UPDATE is built once per combination of filters: each combination must
    # still narrow by all of its filters.
    with transaction(engine) as s:
        ids = _setup(s)
    with transaction(engine) as s:
        assert (
            end_held(s, T0 + timedelta(hours=1), host_id=ids["h1"], reservation_id=ids["res"]) == []
        )
        assert end_held(s, T0 + timedelta(hours=1), host_id=ids["h2"], run_id=ids["run"]) == []
        ended = end_held(s, T0 + timedelta(hours=1), host_id=ids["h2"], reservation_id=ids["res"])
        assert sorted(iv.gpu_id for iv in ended) == sorted([ids["h2g0"], ids["h2g1"]])
        assert {iv.ended_at for iv in ended} == {T0 + timedelta(hours=1)}
    with transaction(engine, write=False) as s:
        assert held_gpu_ids(s) == {ids["h1g0"]}


def test_a_core_read_sees_what_the_session_has_pending_as_an_orm_read_would(
    engine: Engine,
) -> None:
    count_users = select(func.count()).select_from(User)
    with transaction(engine) as s:
        s.add(User(key="carol", display_name="Carol", created_at=T0))
        with s.no_autoflush:  # the grant pass's reads: nothing is written early
            assert core(s).execute(count_users).scalar_one() == 0
        assert core(s).execute(count_users).scalar_one() == 1
        assert not s.new


def test_ending_needs_a_holder(sqlite_engine: Engine) -> None:
    with transaction(sqlite_engine) as s, pytest.raises(ValueError, match="needs a host"):
        end_held(s, T0)


def test_a_grant_prices_and_records_the_host_it_chose(engine: Engine) -> None:
    """Grants by best fit over three hosts of different prices (GPU and host ids do not
    line up): each interval names its GPU's own host, at that host's share of the price,
    and the reply shows that host (the grant pass reads host and GPUs in one query)."""
    from bot.domain.commands import Reserve
    from tests.core.helpers import actor, host, make_service

    svc, _ = make_service(
        engine,
        [
            host("a", "A100", 4, hourly=8.0),
            host("b", "A100", 2, hourly=6.0),
            host("c", "H100", 8, hourly=40.0),
        ],
    )
    replies = [
        svc.reserve(actor(svc, "ann"), Reserve(count=2, model="A100")),  # best fit: b
        svc.reserve(actor(svc, "bob"), Reserve(count=3, model="A100")),  # a
        svc.reserve(actor(svc, "cy"), Reserve(count=1, model="H100")),  # c
    ]
    with Session(engine) as s:
        hosts = {h.id: h for h in s.exec(select(Host)).all()}
        gpus = {g.id: g for g in s.exec(select(Gpu)).all()}
        got = []
        for iv in s.exec(select(UsageInterval).order_by(col(UsageInterval.id))).all():
            assert iv.host_id == gpus[iv.gpu_id].host_id
            h = hosts[iv.host_id]
            assert iv.usd_per_hour == pytest.approx(
                h.hourly_usd / len([g for g in gpus.values() if g.host_id == h.id])
            )
            got.append(h.name)
    assert got == ["b", "b", "a", "a", "a", "c"]
    for reply, name in zip(replies, ["b", "a", "c"], strict=True):
        assert f"on *{name}*" in reply.view.text or f"on {name}" in reply.view.text, reply.view.text
