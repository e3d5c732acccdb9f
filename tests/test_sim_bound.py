"""The packing bound (bot.sim.bound) on traces small enough to work out by hand."""

from __future__ import annotations

import pytest

from bot.sim.bound import packing_bound
from bot.sim.simulate import TraceJob, parse_trace, run_simulation
from bot.sim.tracegen import small_team_trace
from provisioning.catalog import Catalog, InstanceType

A100_HR = 21.957642  # p4d.24xlarge, 8 GPUs: the shipped catalog's only A100 type


def a100(job_id: str, submit: float, seconds: float, gpus: int) -> TraceJob:
    return TraceJob(job_id, "u", submit, seconds, gpus, "A100")


def test_one_instance_carries_two_overlapping_one_gpu_jobs() -> None:
    # busy: 1 GPU on [0, 1800), 2 on [1800, 3600), 1 on [3600, 5400): one instance for 1.5 h
    jobs = [a100("j1", 0, 3600, 1), a100("j2", 1800, 3600, 1)]
    b = packing_bound(jobs, Catalog.load())
    assert b.packed_cost_usd == pytest.approx(1.5 * A100_HR)
    assert b.ideal_cost_usd == pytest.approx(2 * A100_HR / 8)  # two GPU-hours
    assert b.efficiency_bound == pytest.approx((2 / 8) / 1.5)
    assert b.peak_gpus == 2


def test_a_second_instance_only_while_more_than_eight_are_busy() -> None:
    # j3 (8 GPUs, [1800, 2700)) makes 10 busy for 900 s: two instances then, one otherwise
    jobs = [a100("j1", 0, 3600, 1), a100("j2", 1800, 3600, 1), a100("j3", 1800, 900, 8)]
    b = packing_bound(jobs, Catalog.load(), max_gpus=8)
    assert b.packed_cost_usd == pytest.approx((5400 + 900) / 3600 * A100_HR)
    assert b.ideal_cost_usd == pytest.approx((2 + 8 * 0.25) * A100_HR / 8)
    assert b.efficiency_bound == pytest.approx(0.5 / 1.75)  # 2/7
    assert b.peak_gpus == 10
    assert b.over_quota_s == pytest.approx(900)


def _type(name: str, gpus: int, usd: float) -> InstanceType:
    return InstanceType(name, "X1", gpus, 16.0, 8, 64.0, usd, None, "test", "now")


def test_the_cover_buys_small_instances_where_a_big_one_would_cost_more() -> None:
    # 8 GPUs for $8/h (the cheapest per GPU) or 1 GPU for $1.5/h: one busy GPU costs $1.5/h,
    # not the $8/h of ceil(1 / 8) big instances; nine cost $8 + $1.5.
    catalog = Catalog((_type("big", 8, 8.0), _type("small", 1, 1.5)))
    one = packing_bound([TraceJob("a", "u", 0, 3600, 1, "X1")], catalog)
    assert one.packed_cost_usd == pytest.approx(1.5)
    assert one.efficiency_bound == pytest.approx(1.0 / 1.5)
    nine = packing_bound([TraceJob("a", "u", 0, 3600, 9, "X1")], catalog)
    assert nine.packed_cost_usd == pytest.approx(9.5)
    assert nine.ideal_cost_usd == pytest.approx(9.0)


def test_idle_gaps_and_zero_length_jobs_cost_nothing() -> None:
    jobs = [a100("j1", 0, 600, 8), a100("j2", 10_000, 600, 8), a100("j3", 5000, 0, 1)]
    b = packing_bound(jobs, Catalog.load())
    assert b.packed_cost_usd == pytest.approx(1200 / 3600 * A100_HR)
    assert b.efficiency_bound == pytest.approx(1.0)


def test_the_simulator_pays_at_least_the_packed_fleet_when_little_waits() -> None:
    # Its ideal is the simulator's. With a quota that never binds (peak 79 GPUs), jobs
    # wait mostly for boots, and the boots, idle tails and per-start minimums cost more
    # than any packing the waiting bought (not a theorem: see the module docstring).
    catalog = Catalog.load()
    jobs = parse_trace(small_team_trace(3).splitlines(), catalog, "A100")[:200]
    b = packing_bound(jobs, catalog)
    res = run_simulation(jobs, policy="fair", catalog=catalog, max_gpus=256)
    assert res.ideal_cost_usd == pytest.approx(b.ideal_cost_usd, abs=1e-3)
    assert res.total_cost_usd >= b.packed_cost_usd
    assert 0 < b.efficiency_bound < 1


def test_the_arrival_window_leaves_out_the_drain_after_the_last_submission() -> None:
    """One 8-GPU instance from 0 to 20 h. j1 (1 GPU) runs 0-10 h; j2 arrives at 4 h and
    runs alone on one GPU from 4 h to 20 h (the drain after the last submission: 4-20 h).
    Whole trace: 26 GPU-hours on 160 paid. Window [0, 4 h]: j1's 4 GPU-hours on 32 paid
    (j2 starts only as the window ends). A stopped stretch costs storage."""
    from bot.sim.bound import arrival_window_efficiency
    from bot.sim.simulate import ScheduledJob, SimResult
    from provisioning.costs import DEFAULT_COSTS
    from provisioning.simulated import InstanceRecord

    h = 3600.0
    jobs = [a100("j1", 0, 10 * h, 1), a100("j2", 4 * h, 16 * h, 1)]
    schedule = (
        ScheduledJob("j1", "u", ("i1",), 0, 0, 10 * h, 1),
        ScheduledJob("j2", "u", ("i1",), 4 * h, 4 * h, 20 * h, 1),
    )

    def result(stopped: tuple[tuple[float, float], ...]) -> SimResult:
        inst = InstanceRecord("i1", "p4d.24xlarge", "ondemand", 8, 0, 0, 20 * h, stopped, 0.0)
        return SimResult("fair", 2, 0, 0, 26 / 160, 0, 0, 0, 0, 0, schedule, (inst,))

    catalog = Catalog.load()
    # j1's four GPU-hours in the window, on 4 instance-hours (32 GPU-hours paid)
    assert arrival_window_efficiency(result(()), jobs, catalog) == pytest.approx(4 / 32)
    # stopped for the first hour (j1 could not have run then, but the arithmetic is what
    # is tested): 3 paid running hours and one hour of storage
    got = arrival_window_efficiency(result(((0.0, h),)), jobs, catalog)
    cost = 3 * A100_HR + h * DEFAULT_COSTS.storage_usd_per_s
    assert got == pytest.approx(4 * A100_HR / 8 / cost)


def test_paid_gpu_time_splits_what_was_paid_into_busy_idle_beside_a_job_and_empty() -> None:
    """One 8-GPU instance launched at 0, ready at 0.5 h, stopped 3-4 h, terminated at 6 h.
    j1 (2 GPUs) ran 0.5-2.5 h; j2 (1 GPU) ran 1-2 h, was preempted, and ran again 4.5-5.5
    h after its resume, so one of its hours is done again. Paid: 5 running hours x 8 GPUs."""
    from bot.sim.bound import paid_gpu_time
    from bot.sim.simulate import ScheduledJob, SimResult
    from provisioning.simulated import InstanceRecord

    h = 3600.0
    jobs = [a100("j1", 0, 2 * h, 2), a100("j2", h, h, 1), a100("never", 0, h, 1)]
    schedule = (
        ScheduledJob("j1", "u", ("i1",), 0, 0.5 * h, 2.5 * h, 2),
        ScheduledJob("j2", "u", ("i1",), h, h, 2 * h, 1),
        ScheduledJob("j2", "u", ("i1",), h, 4.5 * h, 5.5 * h, 1),
    )
    inst = InstanceRecord(
        "i1", "p4d.24xlarge", "ondemand", 8, 0, 0.5 * h, 6 * h, ((3 * h, 4 * h),), 0.0
    )
    res = SimResult("fair", 3, 0, 0, 0, 0, 0, 0, 0, 0, schedule, (inst,))
    got = paid_gpu_time(res, jobs)
    assert got.paid_gpu_s == pytest.approx(5 * 8 * h)
    assert got.busy_gpu_s == pytest.approx((2 * 2 + 1 + 1) * h)
    # busy GPUs: 0.5-1 h 2, 1-2 h 3, 2-2.5 h 2, 4.5-5.5 h 1; none at 0-0.5, 2.5-3, 4-4.5, 5.5-6
    partial = (0.5 * 6 + 1 * 5 + 0.5 * 6 + 1 * 7) * h
    assert got.partial_idle_gpu_s == pytest.approx(partial)
    assert got.empty_gpu_s == pytest.approx((0.5 + 0.5 + 0.5 + 0.5) * 8 * h)
    assert got.busy_gpu_s + got.partial_idle_gpu_s + got.empty_gpu_s == pytest.approx(
        got.paid_gpu_s
    )
    # j2's second hour is work done again; "never" did not run, so it is not counted
    assert got.redone_gpu_s == pytest.approx(h)
    assert got.figures()["idle_with_no_job"] == pytest.approx(16 / 40, abs=1e-4)


def test_paid_gpu_time_adds_up_on_a_simulated_team_week() -> None:
    from bot.sim.bound import paid_gpu_time
    from bot.sim.simulate import parse_trace, run_simulation
    from bot.sim.tracegen import small_team_trace

    catalog = Catalog.load()
    jobs = parse_trace(small_team_trace(3).splitlines(), catalog, "A100")
    res = run_simulation(jobs, catalog=catalog, max_gpus=16, checkpointable_fraction=0.5)
    got = paid_gpu_time(res, jobs)
    parts = got.busy_gpu_s + got.partial_idle_gpu_s + got.empty_gpu_s
    assert parts == pytest.approx(got.paid_gpu_s, rel=1e-9)
    assert 0 < got.redone_gpu_s < got.busy_gpu_s
    # the simulator's efficiency is the jobs' own GPU time over what was paid, in money
    # (plus storage and the per-start minimum): the same order as busy minus done again
    own = (got.busy_gpu_s - got.redone_gpu_s) / got.paid_gpu_s
    assert res.cost_efficiency == pytest.approx(own, abs=0.05)
