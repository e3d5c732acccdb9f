"""`/gpu queue`'s estimated start and cost (bot.domain.estimates), against cases worked out by
hand, and as `/gpu queue` shows them from the database."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from bot.domain.commands import Queue, Reserve, Run
from bot.domain.estimates import (
    Estimate,
    Hold,
    HostPicture,
    WaitingRun,
    cost_phrase,
    estimate_queue,
    start_phrase,
)
from bot.domain.views import Table
from db.models import Gpu, Host, TrainingRun, UsageInterval
from db.session import transaction
from tests.core.helpers import actor, host, make_service, runs_here

NOW = 1_000_000.0
P4D = 32.77  # $/h for 8 × A100: $4.09625 per GPU-hour
PER_GPU = P4D / 8


def p4d(*holds: Hold, name: str = "gpu-a") -> HostPicture:
    return HostPicture(name, "A100", 8, PER_GPU, holds)


def test_the_line_is_laid_out_as_gpus_free_up() -> None:
    # Now: a run holds 4 GPUs for 1 more hour, a reservation 2 for 2 hours; 2 are free.
    hosts = [p4d(Hold(4, NOW + 3600), Hold(2, NOW + 7200))]
    waiting = [
        WaitingRun(1, 2, "A100", 3600),  # the 2 free GPUs, now, for 1h
        WaitingRun(2, 4, "A100", 7200),  # at +1h both the run and #1 end: 6 free
        WaitingRun(3, 8, "A100", None),  # all 8 only when #2 ends at +3h; length unknown
        WaitingRun(4, 1, "A100", 1800),  # at +1h, 2 GPUs are left beside #2: fits there
    ]
    got = estimate_queue(waiting, hosts, NOW)
    assert [(e.run_id, e.start_s, e.host) for e in got] == [
        (1, NOW, "gpu-a"),
        (2, NOW + 3600, "gpu-a"),
        (3, NOW + 3 * 3600, "gpu-a"),
        (4, NOW + 3600, "gpu-a"),
    ]
    # Cost: GPUs × $4.09625 × hours.
    assert got[0].cost_usd == 2 * PER_GPU * 1  # $8.1925
    assert got[1].cost_usd == 4 * PER_GPU * 2  # $32.77
    assert got[2].cost_usd is None and got[2].usd_per_hour == P4D
    assert got[3].cost_usd == 1 * PER_GPU * 0.5  # $2.048125
    assert [start_phrase(e, NOW) for e in got] == ["now", "in 1h", "in 3h", "in 1h"]
    assert [cost_phrase(e) for e in got] == [
        "$8.19",
        "$32.77",
        "$32.77/h, unknown length",
        "$2.05",
    ]


def test_waiting_reservations_go_first_and_hold_back_runs_of_their_model() -> None:
    hosts = [p4d(Hold(8, NOW + 3600))]
    got = estimate_queue(
        [WaitingRun("res:1", 8, "", 7200, holds_line=True), WaitingRun(1, 8, "A100", 3600)],
        hosts,
        NOW,
    )
    assert [(e.run_id, e.start_s) for e in got] == [("res:1", NOW + 3600), (1, NOW + 3 * 3600)]
    # 4 A100s are free now and run #1 would be done in 10 min, but while the reservation
    # for 8 waits no A100 run starts (as bot.app.runs dispatches); a T4 run is not held back.
    hosts = [p4d(Hold(4, NOW + 3600)), HostPicture("t4", "T4", 1, 0.5)]
    got = estimate_queue(
        [
            WaitingRun("res:1", 8, "A100", 3600, holds_line=True),
            WaitingRun(1, 2, "A100", 600),
            WaitingRun(2, 1, "T4", 600),
        ],
        hosts,
        NOW,
    )
    assert [e.start_s for e in got] == [NOW + 3600, NOW + 7200, NOW]
    never = estimate_queue(
        [WaitingRun("res:1", 16, "A100", 60, holds_line=True), WaitingRun(1, 1, "A100", 60)],
        hosts,
        NOW,
    )
    assert [e.start_s for e in never] == [None, None], "a reservation that never fits blocks"


def test_a_small_run_does_not_fit_into_a_gap_it_would_overrun() -> None:
    # 1 free GPU now, but #1 (waiting) takes all 8 at +1h: a 2h run cannot start now.
    hosts = [p4d(Hold(7, NOW + 3600))]
    got = estimate_queue(
        [
            WaitingRun(1, 8, "A100", 3600),
            WaitingRun(2, 1, "A100", 7200),
            WaitingRun(3, 1, "A100", 600),
        ],
        hosts,
        NOW,
    )
    assert [e.start_s for e in got] == [NOW + 3600, NOW + 7200, NOW]


def test_unknown_lengths_give_unknown_starts_never_made_up_ones() -> None:
    hosts = [HostPicture("box", "RTX4090", 1, 0.0, (Hold(1, None),))]
    got = estimate_queue(
        [WaitingRun(1, 1, "RTX4090", 3600), WaitingRun(2, 1, "H100", 3600)], hosts, NOW
    )
    assert got[0] == Estimate(1, None, None, 0.0, 0.0)
    assert (start_phrase(got[0], NOW), cost_phrase(got[0])) == ("unknown", "$0 (owned)")
    assert got[1] == Estimate(2, None, None, None, None), "no host has H100s"
    assert cost_phrase(got[1]) == "unknown"


def test_the_earliest_host_wins_and_an_overdue_holder_is_about_to_go() -> None:
    a = p4d(Hold(8, NOW + 600), name="gpu-a")
    b = p4d(Hold(8, NOW - 300), name="gpu-b")  # past its --max: it ends any moment
    got = estimate_queue([WaitingRun(1, 8, "A100", 60), WaitingRun(2, 8, "A100", 60)], [a, b], NOW)
    assert [(e.host, e.start_s) for e in got] == [("gpu-b", NOW), ("gpu-b", NOW + 60)]
    third = estimate_queue(
        [WaitingRun(1, 8, "A100", 600), WaitingRun(2, 8, "A100", 60)], [a, b], NOW
    )
    assert [(e.host, e.start_s) for e in third] == [("gpu-b", NOW), ("gpu-a", NOW + 600)]
    assert start_phrase(Estimate(9, NOW + 90_000, "x", None, 1.0), NOW) == "in 1d1h"
    assert start_phrase(Estimate(9, NOW + 5400, "x", None, 1.0), NOW) == "in 1h30m"
    assert start_phrase(Estimate(9, NOW + 59, "x", None, 1.0), NOW) == "now"


def test_gpu_queue_shows_the_estimates(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, clock = make_service(
        sqlite_engine, [host("gpu-a", "A100", 8, hourly=P4D)], places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    svc.reserve(actor(svc, "alice"), Reserve(count=2, model="A100", duration=timedelta(hours=2)))
    now = clock.now()
    with transaction(sqlite_engine) as s:  # bob's run holds 4 GPUs; its status says 1h left
        bob = svc.user_row(s, "bob")
        gpu_host = s.exec(select(Host).where(Host.name == "gpu-a")).one()
        held = set(
            s.exec(select(UsageInterval.gpu_id).where(col(UsageInterval.ended_at).is_(None)))
        )
        free = [g for g in s.exec(select(Gpu).order_by(col(Gpu.index))) if g.id not in held][:4]
        run = TrainingRun(
            user_id=bob.id,  # type: ignore[arg-type]
            command="python long.py",
            gpu_count=4,
            gpu_model="A100",
            state="running",
            submitted_at=now,
            started_at=now,
            metrics={"eta_s": 3600.0},
            placement={"host": "gpu-a"},
        )
        s.add(run)
        s.flush()
        svc.open_usage(s, gpu_host, free, bob.id, now, run_id=run.id)  # type: ignore[arg-type]
    for who, gpus, hours in (
        ("carol", 2, 1.0),
        ("dave", 4, 2.0),
        ("erin", 8, None),
        ("fred", 1, 0.5),
    ):
        cmd = Run(
            command=("python", "t.py"),
            gpus=gpus,
            model="A100",
            max_duration=timedelta(hours=hours) if hours else None,
        )
        runs.submit(actor(svc, who), cmd)
    reply = runs.queue(actor(svc, "carol"), Queue())
    table = reply.view.blocks[-1]
    assert isinstance(table, Table)
    assert table.columns[5] == "est. start" and table.columns[-1] == "est. cost"
    rows = {r[1]: (r[4], r[5], r[-1]) for r in table.rows}
    assert rows == {
        "bob": ("running on gpu-a", "started", "$16.39/h"),  # 4 × $4.09625
        "carol": ("#1 in line", "now", "$8.19"),
        "dave": ("#2 in line", "in 1h", "$32.77"),
        "erin": ("#3 in line", "in 3h", "$32.77/h, unknown length"),
        "fred": ("#4 in line", "in 1h", "$2.05"),
    }
    mine = runs.queue(actor(svc, "fred"), Queue(mine_only=True)).view.blocks[-1]
    assert isinstance(mine, Table)
    assert [(r[4], r[5]) for r in mine.rows] == [("#4 in line", "in 1h")], (
        "the runs ahead count even when only yours are shown"
    )
    # gina waits for all 8 for 1h: granted when alice's 2h end, ahead of every run.
    svc.reserve(actor(svc, "gina"), Reserve(count=8, model="A100", duration=timedelta(hours=1)))
    table = runs.queue(actor(svc, "carol"), Queue()).view.blocks[-1]
    assert isinstance(table, Table)
    assert {r[1]: r[5] for r in table.rows} == {
        "bob": "started",
        "carol": "in 3h",  # no A100 run starts while gina waits; she has all 8 from 2h to 3h
        "dave": "in 3h",  # beside carol
        "erin": "in 5h",  # all 8, once dave is done
        "fred": "in 3h",  # the 2 left beside carol and dave
    }
