"""The scheduler's promises, as properties over random queues and fleets, and examples."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.domain.scheduling import (
    LAYERS,
    Action,
    Allocation,
    FleetInstance,
    Launch,
    Place,
    Preempt,
    PreemptionPlanner,
    QueuedRun,
    SchedulerConfig,
    Start,
    Stop,
    Terminate,
    decay_usage,
    decide,
    fair_shares,
    fairshare_factors,
    next_wakeup,
    order_queue,
    preempt_slot,
    run_shape,
    split_hosts,
)
from provisioning.catalog import Catalog

CAT = Catalog.load()
P4D = CAT.get("p4d.24xlarge")
assert P4D is not None
NOW = 10_000.0


def inst(
    iid: str,
    allocs: tuple[Allocation, ...] = (),
    *,
    state: str = "running",
    ready: float = 0.0,
    idle_since: float | None = None,
    stopped_since: float | None = None,
) -> FleetInstance:
    assert P4D is not None
    return FleetInstance(
        instance_id=iid,
        instance_type=P4D.instance_type,
        gpu_model="A100",
        gpus=8,
        usd_hr=P4D.ondemand_usd_hr,
        market="ondemand",
        state=state,  # type: ignore[arg-type]
        ready_at_s=ready,
        allocations=allocs,
        idle_since_s=idle_since,
        stopped_since_s=stopped_since,
    )


def run(
    rid: str,
    user: str = "u",
    gpus: int = 1,
    submit: float = 0.0,
    dur: float | None = 3600.0,
    prio: int = 0,
) -> QueuedRun:
    return QueuedRun(rid, user, gpus, "A100", submit, dur, prio)


def cfg(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(**kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- strategies

alloc_st = st.builds(
    lambda i, g, end: Allocation(f"busy{i}", f"x{i % 3}", g, NOW + end),
    st.integers(0, 10_000),
    st.integers(1, 4),
    st.floats(1.0, 50_000.0),
)


@st.composite
def fleets(draw: st.DrawFn) -> list[FleetInstance]:
    out = []
    for n in range(draw(st.integers(0, 5))):
        allocs: list[Allocation] = []
        used = 0
        # one allocation per run and instance, as the worker and the simulator build them
        for a in draw(st.lists(alloc_st, max_size=4, unique_by=lambda a: a.run_id)):
            if used + a.gpus <= 8:
                allocs.append(
                    Allocation(
                        f"{a.run_id}-{n}",
                        a.user,
                        a.gpus,
                        a.est_end_s,
                        preemptible=draw(st.booleans()),
                        started_s=NOW - draw(st.sampled_from([0.0, 100.0, 10_000.0])),
                    )
                )
                used += a.gpus
        kind = draw(st.sampled_from(["running", "running", "pending", "stopped"]))
        if kind == "stopped":
            out.append(inst(f"i{n}", state="stopped", stopped_since=NOW - 10))
        elif kind == "pending":
            out.append(inst(f"i{n}", tuple(allocs), state="pending", ready=NOW + 100))
        else:
            out.append(inst(f"i{n}", tuple(allocs), idle_since=None if allocs else NOW - 5))
    return out


queues = st.lists(
    st.builds(
        lambda i, u, g, sub, d: run(f"r{i}", f"u{u}", g, NOW - sub, d),
        st.integers(0, 10**6),
        st.integers(0, 3),
        st.sampled_from([1, 1, 1, 2, 4, 8, 16]),
        st.floats(0, 5000),
        st.floats(10, 100_000),
    ),
    max_size=25,
    unique_by=lambda r: r.run_id,
)


def _capacity_after(fleet: list[FleetInstance], actions: list[Action]) -> dict[str, int]:
    """GPUs in use per instance (or Launch ref) once the actions are applied."""
    used = {i.instance_id: i.used_gpus for i in fleet}
    for a in actions:
        if isinstance(a, Launch):
            used[a.ref] = 0
        if isinstance(a, Preempt):
            for i in fleet:
                used[i.instance_id] -= sum(x.gpus for x in i.allocations if x.run_id == a.run_id)
        if isinstance(a, Place):
            for iid in a.instance_ids:
                used[iid] += a.gpus_per_instance
    return used


# ---------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(
    queue=queues,
    fleet=fleets(),
    policy=st.sampled_from(["fair", "per-job", "fifo"]),
    quota=st.sampled_from([8, 16, 64, 256]),
)
def test_no_instance_overcommitted_and_quota_kept(
    queue: list[QueuedRun], fleet: list[FleetInstance], policy: str, quota: int
) -> None:
    committed = sum(i.gpus for i in fleet if i.state != "stopped")
    c = cfg(policy=policy, max_gpus=max(quota, committed), fixed_fleet=(("p4d.24xlarge", 2),))
    actions = decide(queue, fleet, NOW, catalog=CAT, config=c)
    used = _capacity_after(fleet, actions)
    by_id = {i.instance_id: i for i in fleet}
    for iid, u in used.items():
        assert u <= 8, f"{iid} over-committed: {u}"
    placed = [a.run_id for a in actions if isinstance(a, Place)]
    assert len(placed) == len(set(placed)), "a run placed twice"
    queued = {r.run_id: r.gpus for r in queue}
    preempted: set[str] = set()
    for a in actions:
        if isinstance(a, Preempt):
            assert a.run_id not in preempted, "preempted twice"
            preempted.add(a.run_id)
            al = [x for i in fleet for x in i.allocations if x.run_id == a.run_id]
            assert al and all(x.preemptible for x in al), "preempted a run that cannot resume"
            assert all(x.started_s is None or NOW - x.started_s >= c.preempt_after() for x in al)
            queued[a.run_id] = sum(x.gpus for x in al)
        if isinstance(a, Place):
            # a queued run, or one this decision preempted (moved elsewhere)
            assert a.gpus_per_instance * len(a.instance_ids) == queued[a.run_id]
            for iid in a.instance_ids:
                if iid in by_id:
                    assert by_id[iid].state != "stopped" or any(
                        isinstance(b, Start) and b.instance_id == iid for b in actions
                    )
    # the quota: GPUs not stopped after the actions
    gone = {a.instance_id for a in actions if isinstance(a, Stop | Terminate)}
    started = {a.instance_id for a in actions if isinstance(a, Start)}
    after = sum(
        i.gpus
        for i in fleet
        if (i.state != "stopped" or i.instance_id in started) and i.instance_id not in gone
    )
    after += 8 * sum(1 for a in actions if isinstance(a, Launch))
    assert after <= c.max_gpus


def _earliest_start(
    need: int, fleet_allocs: dict[str, list[tuple[float, int]]], ready: dict[str, float], now: float
) -> float:
    """Independent: the first time one instance has `need` GPUs free, runs ending on time."""
    best = math.inf
    for iid, allocs in fleet_allocs.items():
        free = 8 - sum(g for _, g in allocs)
        t = max(now, ready[iid])
        if free >= need:
            best = min(best, t)
            continue
        for end, g in sorted(allocs):
            free += g
            if free >= need:
                best = min(best, max(t, end))
                break
    return best


@settings(max_examples=200, deadline=None)
@given(queue=queues, fleet=fleets())
def test_backfill_never_delays_the_head(queue: list[QueuedRun], fleet: list[FleetInstance]) -> None:
    queue = [r for r in queue if r.gpus <= 8]
    c = cfg(
        policy="fair",
        max_gpus=sum(i.gpus for i in fleet if i.state != "stopped"),
        peer_window_s=0.0,
        preempt=False,  # preemption is judged by its own properties below
    )
    actions = decide(queue, fleet, NOW, catalog=CAT, config=c)
    assert not any(isinstance(a, Launch | Start) for a in actions)  # no headroom
    placed = {a.run_id: a for a in actions if isinstance(a, Place)}
    order = order_queue(queue, NOW, {}, c)
    head_idx = next((k for k, r in enumerate(order) if r.run_id not in placed), None)
    if head_idx is None:
        return
    head = order[head_idx]
    warm = [i for i in fleet if i.state != "stopped"]
    ready = {i.instance_id: i.ready_at_s for i in warm}
    base = {i.instance_id: [(a.est_end_s or math.inf, a.gpus) for a in i.allocations] for i in warm}
    by_id = {r.run_id: r for r in queue}

    def with_runs(ids: list[str]) -> dict[str, list[tuple[float, int]]]:
        out = {k: list(v) for k, v in base.items()}
        for rid in ids:
            a = placed[rid]
            start = max([NOW] + [ready[i] for i in a.instance_ids])
            for iid in a.instance_ids:
                out[iid].append((start + (by_id[rid].est_duration_s or 0.0), a.gpus_per_instance))
        return out

    ahead = [r.run_id for r in order[:head_idx] if r.run_id in placed]
    everyone = list(placed)
    t_ahead = _earliest_start(head.gpus, with_runs(ahead), ready, NOW)
    t_all = _earliest_start(head.gpus, with_runs(everyone), ready, NOW)
    assert t_all <= t_ahead + 1e-6, f"backfill moved the head from {t_ahead} to {t_all}"


@settings(max_examples=100, deadline=None)
@given(
    ua=st.floats(0, 1e7),
    ub=st.floats(0, 1e7),
    sub=st.floats(0, 1000),
    others=st.dictionaries(st.sampled_from(["c", "d"]), st.floats(0, 1e7), max_size=2),
)
def test_less_recent_usage_goes_first_among_equals(
    ua: float, ub: float, sub: float, others: dict[str, float]
) -> None:
    if ua == ub:
        return
    a, b = run("ra", "a", submit=NOW - sub), run("rb", "b", submit=NOW - sub)
    usage = {"a": ua, "b": ub, **others}
    first = order_queue([b, a], NOW, usage, cfg())[0]
    assert first.user == ("a" if ua < ub else "b")
    # and with one free GPU, the less-used user's run is the one placed
    fleet = [inst("i0", (Allocation("x", "x", 7, NOW + 99),))]
    actions = decide([a, b], fleet, NOW, catalog=CAT, config=cfg(max_gpus=8), usage=usage)
    placed = [p.run_id for p in actions if isinstance(p, Place)]
    assert placed == [first.run_id]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.floats(0, 30_000),
            st.floats(1, 20_000),
            st.sampled_from([1, 1, 2, 4, 8, 16]),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=30,
    ),
    policy=st.sampled_from(["fair", "per-job", "fifo"]),
)
def test_simulated_schedules_are_feasible(
    rows: list[tuple[float, float, int, int]], policy: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """End to end through the simulator, judged by the independent checker."""
    from bot.sim.output import write_instances, write_schedule
    from bot.sim.simulate import TraceJob, run_simulation
    from tests.sim_checker import check

    d = tmp_path_factory.mktemp("sim")
    trace = d / "t.csv"
    lines = ["job_id,user,submit_time,duration_s,gpus,gpu_type"]
    jobs = []
    for k, (sub, dur, g, u) in enumerate(rows):
        lines.append(f"j{k},u{u},{sub!r},{dur!r},{g},")
        jobs.append(TraceJob(f"j{k}", f"u{u}", sub, dur, g, "A100"))
    trace.write_text("\n".join(lines) + "\n")
    res = run_simulation(jobs, policy=policy, catalog=CAT, max_gpus=24)
    write_schedule(d / "s.csv", res.schedule)
    write_instances(d / "i.csv", res.instances)
    verdict = check(trace, d / "s.csv", d / "i.csv", max_gpus=24, claimed=res.figures())
    assert verdict.ok, verdict.errors
    assert all(s.start_s >= s.submit_s for s in res.schedule)


# ---------------------------------------------------------------- examples


def test_eight_users_share_one_p4d() -> None:
    queue = [run(f"r{k}", f"user{k}", submit=NOW - 10) for k in range(8)]
    actions = decide(queue, [], NOW, catalog=CAT, config=cfg())
    launches = [a for a in actions if isinstance(a, Launch)]
    places = [a for a in actions if isinstance(a, Place)]
    assert len(launches) == 1 and launches[0].instance_type == "p4d.24xlarge"
    assert len(places) == 8
    assert {p.instance_ids for p in places} == {(launches[0].ref,)}


def test_packs_onto_a_partly_used_instance_before_an_empty_one() -> None:
    busy = inst("busy", (Allocation("x", "x", 4, NOW + 50_000),))
    empty = inst("empty", idle_since=NOW - 1)
    actions = decide([run("r", dur=3600)], [empty, busy], NOW, catalog=CAT, config=cfg())
    assert actions == [Place("r", ("busy",), 1)]


def test_reuse_order_running_then_stopped_then_new() -> None:
    running = inst("warm", idle_since=NOW - 1)
    stopped = inst("cold", state="stopped", stopped_since=NOW - 100)
    q = [run("r")]
    assert decide(q, [stopped, running], NOW, catalog=CAT, config=cfg()) == [
        Place("r", ("warm",), 1)
    ]
    acts = decide(q, [stopped], NOW, catalog=CAT, config=cfg())
    assert acts == [Start("cold", "r"), Place("r", ("cold",), 1)]
    acts = decide(q, [], NOW, catalog=CAT, config=cfg())
    assert [type(a) for a in acts] == [Launch, Place]


def test_backfill_lets_a_short_run_through_but_not_a_long_one() -> None:
    # 7 of 8 GPUs busy until NOW+1000; the head wants all 8; quota allows no launch.
    fleet = [inst("i0", (Allocation("x", "x", 7, NOW + 1000),))]
    head = run("head", "a", gpus=8, submit=NOW - 100)
    short = run("short", "b", submit=NOW - 50, dur=500)
    long = run("long", "c", submit=NOW - 50, dur=5000)
    c = cfg(max_gpus=8)
    acts = decide([head, long, short], fleet, NOW, catalog=CAT, config=c)
    assert acts == [Place("short", ("i0",), 1)]
    acts = decide([head, long], fleet, NOW, catalog=CAT, config=c)
    assert acts == []


def test_waits_rather_than_launching_when_a_slot_frees_soon() -> None:
    # A GPU frees in 10 minutes: booting a new p4d (7 min, 8 GPUs billed) is not worth it.
    fleet = [inst("i0", (Allocation("x", "x", 8, NOW + 600),))]
    acts = decide([run("r", dur=3600)], fleet, NOW, catalog=CAT, config=cfg())
    assert acts == []
    # Nothing frees for two days: launching is cheaper than the wait.
    fleet = [inst("i0", (Allocation("x", "x", 8, NOW + 2 * 86400),))]
    queue = [run(f"r{k}", f"u{k}", dur=3600) for k in range(6)]
    acts = decide(queue, fleet, NOW, catalog=CAT, config=cfg())
    assert sum(isinstance(a, Launch) for a in acts) == 1


def test_multi_host_run_spans_instances_of_one_type() -> None:
    acts = decide([run("big", gpus=16)], [], NOW, catalog=CAT, config=cfg())
    launches = [a for a in acts if isinstance(a, Launch)]
    assert len(launches) == 2
    place = next(a for a in acts if isinstance(a, Place))
    assert place.gpus_per_instance == 8 and len(place.instance_ids) == 2


def _bought(model: str, sizes: list[int]) -> list[str]:
    """The instance types decide launches for runs of these sizes, nothing warm."""
    queue = [QueuedRun(f"r{k}", "u", g, model, NOW, 3600.0) for k, g in enumerate(sizes)]
    acts = decide(queue, [], NOW, catalog=CAT, config=cfg())
    return sorted(a.instance_type for a in acts if isinstance(a, Launch))


def test_the_size_bought_is_the_one_the_queue_fills() -> None:
    """Where the catalog has a model in several sizes, the waiting GPUs are served at the
    least cost per GPU: a lone 1-GPU A10G run gets the 1-GPU g5.xlarge ($1.01/h), not the
    4-GPU g5.12xlarge ($5.67/h), whose GPUs are also dearer one by one; four such runs get
    four of the small ones ($4.02/h); runs of 2 or 4 GPUs get the 4-GPU size, the only one
    that holds them. V100 GPUs cost the same in either size: three 1-GPU runs do not buy
    a 4-GPU p3.8xlarge with a GPU left empty, four fill one."""
    assert _bought("A10G", [1]) == ["g5.xlarge"]
    assert _bought("A10G", [1, 1, 1, 1]) == ["g5.xlarge"] * 4
    assert _bought("A10G", [2]) == ["g5.12xlarge"]
    assert _bought("A10G", [4]) == ["g5.12xlarge"]
    assert _bought("V100", [1]) == ["p3.2xlarge"]
    assert _bought("V100", [1, 1, 1]) == ["p3.2xlarge"] * 3
    assert _bought("V100", [1, 1, 1, 1]) == ["p3.8xlarge"]
    assert _bought("V100", [1, 3]) == ["p3.8xlarge"]
    # one size only: what it always bought
    assert _bought("A100", [1, 1, 1]) == ["p4d.24xlarge"]


def test_idle_instance_is_stopped_then_terminated() -> None:
    c = cfg()
    idle = c.idle_stop_after()
    assert idle == pytest.approx(120.0)  # 60 s min billing + 60 s of a run's restart wait
    assert decide([], [inst("i", idle_since=NOW - idle + 1)], NOW, catalog=CAT, config=c) == []
    assert decide([], [inst("i", idle_since=NOW - idle)], NOW, catalog=CAT, config=c) == [Stop("i")]
    term = c.terminate_after(P4D.ondemand_usd_hr)  # type: ignore[union-attr]
    assert 24 * 3600 < term < 14 * 24 * 3600  # storage is cheap: keep for days, not forever
    cold = inst("i", state="stopped", stopped_since=NOW - term)
    assert decide([], [cold], NOW, catalog=CAT, config=c) == [Terminate("i")]
    assert next_wakeup([inst("i", idle_since=NOW)], c) == pytest.approx(NOW + idle)


def test_per_job_launches_for_each_run_and_terminates_after() -> None:
    c = cfg(policy="per-job")
    acts = decide([run("a"), run("b")], [], NOW, catalog=CAT, config=c)
    assert sum(isinstance(a, Launch) for a in acts) == 2
    done = inst("i", idle_since=NOW)
    assert decide([], [done], NOW, catalog=CAT, config=c) == [Terminate("i")]


def test_fifo_never_overtakes_a_blocked_head() -> None:
    c = cfg(policy="fifo", max_gpus=8, fixed_fleet=(("p4d.24xlarge", 1),))
    fleet = [inst("i0", (Allocation("x", "x", 7, NOW + 1000),))]
    acts = decide(
        [run("head", gpus=8, submit=1), run("small", submit=2, dur=1)],
        fleet,
        NOW,
        catalog=CAT,
        config=c,
    )
    assert acts == []
    assert [type(a) for a in decide([], [], NOW, catalog=CAT, config=c)] == [Launch]


def test_decay_halves_usage_over_a_half_life() -> None:
    h = 3600.0
    u = decay_usage({"a": 100.0}, {}, h, h)
    assert u["a"] == pytest.approx(50.0)
    # one GPU for a very long time converges to h / ln 2 GPU-seconds
    u = decay_usage({}, {"b": 1}, 100 * h, h)
    assert u["b"] == pytest.approx(h / math.log(2), rel=1e-6)
    f = fairshare_factors(["a", "b"], {"a": 0.0, "b": 10.0})
    assert f["a"] == 1.0 and f["b"] < f["a"]


def test_age_lets_an_old_run_overtake_a_light_user() -> None:
    c = cfg()
    old = run("old", "heavy", submit=NOW - 7 * 86400)
    new = run("new", "light", submit=NOW)
    # heavy has all the usage: factor 2^-2 = 0.25 vs 1.0; a week of age adds w_age=0.5
    usage = {"heavy": 100.0, "light": 0.0}
    assert order_queue([new, old], NOW, usage, c)[0].run_id == "new"
    assert order_queue([new, old], NOW, {"heavy": 10.0, "light": 9.0}, c)[0].run_id == "old"


def test_shapes() -> None:
    assert split_hosts(16, 8) == 2
    assert split_hosts(12, 8) == 2
    assert split_hosts(9, 8) == 3
    assert split_hosts(11, 8) == 11
    shape = run_shape(CAT, "A100", 32)
    assert shape is not None and shape[0].instance_type == "p4d.24xlarge" and shape[1:] == (4, 8)
    shape = run_shape(CAT, "A10G", 2)
    assert shape is not None and shape[0].instance_type == "g5.12xlarge"
    assert run_shape(CAT, "nope", 1) is None


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        decide([], [], NOW, catalog=CAT, config=cfg(policy="lottery"))


# ---------------------------------------------------------------- preemption

LONG_AGO = NOW - 50_000.0


def held(
    user: str, n: int, gpus: int = 1, end: float = NOW + 90_000, **kw: object
) -> list[Allocation]:
    return [
        Allocation(f"{user}-{k}", user, gpus, end, preemptible=True, started_s=LONG_AGO, **kw)  # type: ignore[arg-type]
        for k in range(n)
    ]


def test_fair_shares_water_fill() -> None:
    assert fair_shares({"a": 2, "b": 100, "c": 100}, 10) == {"a": 2, "b": 4, "c": 4}
    assert fair_shares({"a": 3, "b": 3}, 10) == {"a": 3, "b": 3}
    # weights: a user with little recent usage is entitled to more now
    w = fair_shares({"a": 100, "b": 100}, 30, {"a": 2.0, "b": 1.0})
    assert w == pytest.approx({"a": 20.0, "b": 10.0})
    assert fair_shares({}, 8) == {}


def test_a_user_below_their_share_takes_gpus_from_one_above() -> None:
    fleet = [inst("i0", tuple(held("heavy", 8)))]
    waiting = run("light-1", "light", submit=NOW - 1000, dur=7200)
    usage = {"heavy": 1e7, "light": 0.0}
    actions = decide([waiting], fleet, NOW, catalog=CAT, config=cfg(max_gpus=8), usage=usage)
    pre = [a for a in actions if isinstance(a, Preempt)]
    assert len(pre) == 1 and pre[0].run_id.startswith("heavy-") and pre[0].for_run == "light-1"
    assert Place("light-1", ("i0",), 1) in actions
    assert actions.index(pre[0]) < actions.index(Place("light-1", ("i0",), 1))


@pytest.mark.parametrize(
    "why",
    ["not waited long enough", "not preemptible", "ends soon", "just started", "room to launch"],
)
def test_no_preemption_when_something_else_serves(why: str) -> None:
    allocs = held("heavy", 8)
    submit, quota = NOW - 1000, 8
    if why == "not waited long enough":
        submit = NOW - 10
    elif why == "not preemptible":
        allocs = [Allocation(a.run_id, a.user, 1, a.est_end_s) for a in allocs]
    elif why == "ends soon":
        allocs = held("heavy", 8, end=NOW + 60)
    elif why == "just started":
        allocs = [
            Allocation(a.run_id, a.user, 1, a.est_end_s, True, False, NOW - 5) for a in allocs
        ]
    else:
        quota = 16
    fleet = [inst("i0", tuple(allocs))]
    usage = {"heavy": 1e7}
    actions = decide(
        [run("l", "light", submit=submit)],
        fleet,
        NOW,
        catalog=CAT,
        config=cfg(max_gpus=quota),
        usage=usage,
    )
    assert not any(isinstance(a, Preempt) for a in actions), why


def test_nobody_is_pushed_below_their_own_share() -> None:
    # two users with equal recent usage, 8 GPUs: 4 each is fair, and each holds 4
    fleet = [inst("i0", tuple(held("heavy", 4)) + tuple(held("light", 4)))]
    queue = [run("l9", "light", submit=NOW - 5000)]
    usage = {"heavy": 1e6, "light": 1e6}
    actions = decide(queue, fleet, NOW, catalog=CAT, config=cfg(max_gpus=8), usage=usage)
    assert not any(isinstance(a, Preempt) for a in actions)
    # with far more recent usage, the heavy user's weighted share shrinks below 4
    usage = {"heavy": 1e9, "light": 0.0}
    actions = decide(queue, fleet, NOW, catalog=CAT, config=cfg(max_gpus=8), usage=usage)
    assert any(isinstance(a, Preempt) and a.run_id.startswith("heavy") for a in actions)


def test_big_run_gets_a_whole_instance_by_moving_small_ones() -> None:
    # 4 + 4 GPUs idle, but on two instances: the 8-GPU run waits for a whole one
    fleet = [
        inst("i0", tuple(held("a", 4))),
        inst(
            "i1",
            tuple(
                Allocation(f"b-{k}", "b", 1, NOW + 80_000, True, False, LONG_AGO) for k in range(4)
            ),
        ),
    ]
    big = run("big", "c", gpus=8, submit=NOW - 1000, dur=50_000)
    actions = decide([big], fleet, NOW, catalog=CAT, config=cfg(max_gpus=16))
    moved = [a.run_id for a in actions if isinstance(a, Preempt)]
    assert len(moved) == 4
    target = next(a for a in actions if isinstance(a, Place) and a.run_id == "big")
    emptied = target.instance_ids[0]
    other = "i1" if emptied == "i0" else "i0"
    for rid in moved:
        assert Place(rid, (other,), 1) in actions
    used = _capacity_after(fleet, actions)
    assert used == {"i0": 8, "i1": 8}


def test_only_settled_checkpointing_runs_not_ending_soon_may_move() -> None:
    """The planner's movable-run test, at its edges: with the defaults a run must have run
    preempt_exempt() (3000 s) since it started and not end within preempt_after() (420 s)."""
    planner = PreemptionPlanner([], [], NOW, CAT, cfg())
    assert cfg().preempt_exempt() == 3000.0 and cfg().preempt_after() == 420.0

    def movable(**kw: object) -> bool:
        fields: dict[str, object] = {"preemptible": True, **kw}
        return planner.movable(Allocation("r", "u", 1, **fields))  # type: ignore[arg-type]

    assert movable(est_end_s=None)
    assert not movable(est_end_s=None, preemptible=False)
    assert not movable(est_end_s=None, stopping=True)
    assert not movable(est_end_s=None, started_s=NOW - 2999)
    assert movable(est_end_s=None, started_s=NOW - 3000)
    assert not movable(est_end_s=NOW + 420)
    assert movable(est_end_s=NOW + 421)


def test_a_draining_fleet_is_consolidated_so_an_instance_can_stop() -> None:
    fleet = [
        inst("i0", tuple(held("a", 2, end=NOW + 40_000))),
        inst(
            "i1",
            tuple(
                Allocation(f"b-{k}", "b", 1, NOW + 50_000, True, False, LONG_AGO) for k in range(3)
            ),
        ),
    ]
    actions = decide([], fleet, NOW, catalog=CAT, config=cfg(max_gpus=16))
    moves = [a for a in actions if isinstance(a, Preempt)]
    assert [m.run_id for m in moves] == ["a-0", "a-1"] or [m.run_id for m in moves] == [
        "a-1",
        "a-0",
    ]
    assert all(m.for_run == "consolidate:i0" for m in moves)
    assert _capacity_after(fleet, actions) == {"i0": 0, "i1": 5}
    # not worth it for runs about to end, nor with preemption off
    short = [inst("i0", tuple(held("a", 2, end=NOW + 300))), fleet[1]]
    assert not any(
        isinstance(a, Preempt) for a in decide([], short, NOW, catalog=CAT, config=cfg())
    )
    assert decide([], fleet, NOW, catalog=CAT, config=cfg(preempt=False)) == []


def test_consolidation_moves_nothing_onto_an_instance_being_emptied() -> None:
    """An instance whose runs were all told to stop (an earlier decision emptying it) is
    about to stop: a run moved there would only be sent back in line, losing its work."""
    fleet = [
        inst("i0", tuple(held("a", 2, end=NOW + 40_000))),
        # the tightest gap, the one best fit would choose
        inst("i1", tuple(held("b", 5, end=NOW + 50_000, stopping=True))),
        inst("i2", tuple(held("c", 4, end=NOW + 50_000))),
    ]
    actions = decide([], fleet, NOW, catalog=CAT, config=cfg(max_gpus=24))
    onto = {iid for a in actions if isinstance(a, Place) for iid in a.instance_ids}
    assert "i1" not in onto
    # i2 has the room for i0's two runs: emptying i0 there is still worth it
    assert onto == {"i2"}
    assert {a.run_id for a in actions if isinstance(a, Preempt)} == {"a-0", "a-1"}
    # without the stopping runs, i1 is an ordinary target (the test is about them)
    calm = [fleet[0], inst("i1", tuple(held("b", 5, end=NOW + 50_000))), fleet[2]]
    calm_actions = decide([], calm, NOW, catalog=CAT, config=cfg(max_gpus=24))
    assert "i1" in {iid for a in calm_actions if isinstance(a, Place) for iid in a.instance_ids}


@settings(max_examples=150, deadline=None)
@given(
    heavy=st.integers(0, 8),
    light=st.integers(0, 8),
    waiting=st.lists(st.sampled_from(["heavy", "light", "new"]), max_size=10),
    usage=st.dictionaries(st.sampled_from(["heavy", "light", "new"]), st.floats(0, 1e8)),
)
def test_preemption_respects_shares(
    heavy: int, light: int, waiting: list[str], usage: dict[str, float]
) -> None:
    """Across random holdings: GPUs are taken only from a user above their weighted share,
    only for a user below theirs, and a user never preempts itself."""
    light = min(light, 16 - heavy if heavy <= 8 else 0)
    a0 = held("heavy", heavy)
    a1 = held("light", min(light, 8))
    fleet = [inst("i0", tuple(a0)), inst("i1", tuple(a1))]
    queue = [run(f"w{k}-{u}", u, submit=NOW - 5000) for k, u in enumerate(waiting)]
    actions = decide(queue, fleet, NOW, catalog=CAT, config=cfg(max_gpus=16), usage=usage)
    by_run = {a.run_id: a for i in fleet for a in i.allocations}
    demand = {"heavy": heavy, "light": len(a1)}
    for r in queue:
        demand[r.user] = demand.get(r.user, 0) + r.gpus
    demand = {u: d for u, d in demand.items() if d}
    shares = fair_shares(demand, 16, fairshare_factors(demand, usage))
    moved = {a.run_id for a in actions if isinstance(a, Place)}  # moves lose nobody GPUs
    have = {u: sum(x.gpus for x in by_run.values() if x.user == u) for u in demand}
    for r in queue:
        if r.run_id in moved:  # placed by this decision before any preemption
            have[r.user] = have.get(r.user, 0) + r.gpus
    for a in actions:
        if isinstance(a, Preempt) and a.run_id not in moved:
            victim = by_run[a.run_id]
            claimant = next(r for r in queue if r.run_id == a.for_run)
            assert claimant.user != victim.user
            # only from a user above their share, for one below theirs
            assert have[victim.user] > shares[victim.user] + 1e-9, (victim, have, shares)
            assert have[claimant.user] - claimant.gpus < shares[claimant.user] - 1e-9
    assert all(v <= 8 for v in _capacity_after(fleet, actions).values())


def test_preemption_only_when_due() -> None:
    fleet = [inst("i0", tuple(held("heavy", 8)))]
    waiting = run("light-1", "light", submit=NOW - 1000, dur=7200)
    usage = {"heavy": 1e7}
    c = cfg(max_gpus=8)
    off = decide([waiting], fleet, NOW, catalog=CAT, config=c, usage=usage, preempt_due=False)
    on = decide([waiting], fleet, NOW, catalog=CAT, config=c, usage=usage)
    assert not any(isinstance(a, Preempt) for a in off)
    assert any(isinstance(a, Preempt) for a in on)
    # one look per period: the slot changes every preempt_period_s
    p = c.preempt_period_s
    assert preempt_slot(0.0, c) == preempt_slot(p - 1, c) != preempt_slot(p, c)


def test_scheduling_modules_import_only_the_layers_before_them() -> None:
    """The package's one-way arrows (`bot.domain.scheduling.LAYERS`): a module that reached up
    (placement importing preemption, say) would fail here, before it became a cycle."""
    pkg = Path(__file__).resolve().parents[1] / "bot" / "domain" / "scheduling"
    assert sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__") == sorted(LAYERS)
    for rank, name in enumerate(LAYERS):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        imported = {
            n.module.removeprefix("bot.domain.scheduling.")
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            and n.module
            and n.module.startswith("bot.domain.scheduling")
        } | {
            a.name.removeprefix("bot.domain.scheduling.")
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
            if a.name.startswith("bot.domain.scheduling")
        }
        assert imported <= set(LAYERS[:rank]), (name, imported - set(LAYERS[:rank]))


# ---------------------------------------------------------------- without an oracle


def test_a_run_in_the_long_queue_makes_way_for_one_that_never_ran() -> None:
    """Least attained service: one user's long-running checkpointing run yields to the
    same user's new run (fair share alone would never move it), and only past
    las_after_s; a run that resumed after such a move waits behind those that did not."""
    long_runner = Allocation("old", "u", 8, None, preemptible=True, started_s=NOW - 7200)
    fleet = [inst("i0", (long_runner,))]
    waiting = run("new", "u", gpus=8, submit=NOW - 1000, dur=None)
    on = cfg(max_gpus=8, las_after_s=3600.0)
    actions = decide([waiting], fleet, NOW, catalog=CAT, config=on)
    assert Preempt("old", "new") in actions and Place("new", ("i0",), 8) in actions
    # off (the clairvoyant scheduler), or not run long enough: nothing moves
    assert not decide([waiting], fleet, NOW, catalog=CAT, config=cfg(max_gpus=8))
    assert not decide(
        [waiting], fleet, NOW, catalog=CAT, config=cfg(max_gpus=8, las_after_s=3 * 3600.0)
    )
    # a resumed run (attained an hour) goes after its user's runs that never ran
    resumed = QueuedRun("back", "u", 1, "A100", 0.0, None, attained_s=4000.0)
    fresh = QueuedRun("fresh", "u", 1, "A100", 500.0, None)
    assert [r.run_id for r in order_queue([resumed, fresh], NOW, {}, on)] == ["fresh", "back"]
    assert [r.run_id for r in order_queue([resumed, fresh], NOW, {}, cfg())] == ["back", "fresh"]
    # and it does not take GPUs back by the same rule
    back8 = QueuedRun("back8", "u", 8, "A100", NOW - 1000, None, attained_s=4000.0)
    assert not [
        a for a in decide([back8], fleet, NOW, catalog=CAT, config=on) if isinstance(a, Preempt)
    ]


def test_a_run_sent_back_in_line_runs_at_least_as_long_as_before_it_moves_again() -> None:
    """Tiresias-style spacing against thrash: reclaim (least attained service, fair share)
    moves a run back in line only once this segment has run as long as all its earlier
    ones, so each such move at least doubles its attained service; a move into a gap
    elsewhere (consolidation, defragmentation) keeps the plain exempt time."""
    planner = PreemptionPlanner([], [], NOW, CAT, cfg())
    ran_before = 20_000.0

    def movable(started_ago: float, *, to_wait: bool) -> bool:
        al = Allocation("r", "u", 1, None, True, False, NOW - started_ago, attained_s=ran_before)
        return planner.movable(al, to_wait=to_wait)

    assert movable(3000.0, to_wait=False)
    assert not movable(3000.0, to_wait=True)
    assert not movable(ran_before - 1, to_wait=True)
    assert movable(ran_before, to_wait=True)
    # in a decision: the resumed long runner keeps its GPUs until it has doubled
    on = cfg(max_gpus=8, las_after_s=3600.0)
    waiting = run("new", "v", gpus=8, submit=NOW - 1000, dur=None)

    def resumed(started_ago: float) -> list[FleetInstance]:
        al = Allocation("old", "u", 8, None, True, False, NOW - started_ago, ran_before)
        return [inst("i0", (al,))]

    assert not [
        a
        for a in decide([waiting], resumed(7200.0), NOW, catalog=CAT, config=on)
        if isinstance(a, Preempt)
    ]
    assert Preempt("old", "new") in decide(
        [waiting], resumed(ran_before + 1), NOW, catalog=CAT, config=on
    )


def test_a_run_that_cannot_move_joins_one_that_cannot_either() -> None:
    """Pinning: a run without checkpoints goes beside another such run, leaving the
    instance of movable runs free to be emptied by consolidation."""
    movable = Allocation("m", "a", 4, None, preemptible=True, started_s=NOW - 100)
    fixed = Allocation("f", "b", 4, None, preemptible=False, started_s=NOW - 100)
    fleet = [inst("i0", (movable,)), inst("i1", (fixed,))]
    pinned = QueuedRun("p", "c", 2, "A100", NOW, 3600.0, preemptible=False)
    free = QueuedRun("q", "c", 2, "A100", NOW, 3600.0, preemptible=True)
    got = decide([pinned], fleet, NOW, catalog=CAT, config=cfg(max_gpus=16))
    assert got == [Place("p", ("i1",), 2)]
    off = decide([pinned], fleet, NOW, catalog=CAT, config=cfg(max_gpus=16, pin_cost=0.0))
    assert off == [Place("p", ("i0",), 2)]  # by name among equals, without the rule
    assert decide([free], fleet, NOW, catalog=CAT, config=cfg(max_gpus=16)) == [
        Place("q", ("i0",), 2)
    ]


def test_among_a_sweeps_equals_movable_runs_take_unpinned_room_first() -> None:
    """A sweep of one user's runs, half that checkpoint and half that cannot, meets an
    empty instance with room for half: the movable runs take it, whichever the user
    queued first. The runs that cannot move, put there, would pin it for as long as they
    run; waiting, they are bundled onto an instance of their own, and the movable runs
    stay where consolidation can empty their instance."""
    fleet = [inst("i0", idle_since=NOW - 1)]
    fixed = [
        QueuedRun(f"p{k}", "c", 1, "A100", NOW - 20 + k, 3600.0, preemptible=False)
        for k in range(8)
    ]
    free = [
        QueuedRun(f"q{k}", "c", 1, "A100", NOW - 10 + k, 3600.0, preemptible=True) for k in range(8)
    ]

    def placed(config: SchedulerConfig) -> dict[tuple[str, ...], set[str]]:
        got = decide([*fixed, *free], fleet, NOW, catalog=CAT, config=config)
        out: dict[tuple[str, ...], set[str]] = {}
        for a in got:
            if isinstance(a, Place):
                out.setdefault(a.instance_ids, set()).add(a.run_id)
        return out

    got = placed(cfg(max_gpus=16))
    assert got.pop(("i0",)) == {r.run_id for r in free}
    # the ones that cannot move, together on the one instance bought for them
    assert list(got.values()) == [{r.run_id for r in fixed}]
    # Without the pinning rule the user's order stands.
    assert placed(cfg(max_gpus=16, pin_cost=0.0))[("i0",)] == {r.run_id for r in fixed}
    # So it does on a host the team owns: never stopped, it costs nothing to pin.
    fleet[0] = dataclasses.replace(fleet[0], usd_hr=0.0)
    assert placed(cfg(max_gpus=16))[("i0",)] == {r.run_id for r in fixed}


# ---------------------------------------------------------------- the worker's world


def test_a_booting_instance_is_waited_for_not_launched_again() -> None:
    """Two runs queued while an instance boots: with the booting host in its view (as the
    worker now passes it, `bot.app.runs.host_view`) the scheduler places the second run on it
    instead of launching another instance."""
    from bot.app.runs import host_view

    config = cfg(max_gpus=64)
    first = decide([run("1", dur=None)], [], NOW, catalog=CAT, config=config)
    launch = next(a for a in first if isinstance(a, Launch))
    assert launch.for_run == "1"
    booting = host_view(
        name="i-boot",
        state="pending",
        instance_type=launch.instance_type,
        market="ondemand",
        usd_hr=0.0,
        since_s=NOW,
        restarted=False,
        now=NOW + 60,
        catalog=CAT,
        config=config,
    )
    assert booting is not None and booting.state == "pending"
    assert booting.ready_at_s == NOW + config.boot_s + config.setup_s
    queue = [run("1", dur=None), run("3", dur=None, submit=NOW + 30)]
    # what the worker used to pass: ready hosts only, so it launched a second instance
    blind = decide(queue, [], NOW + 60, catalog=CAT, config=config)
    assert any(isinstance(a, Launch) for a in blind)
    seen = decide(queue, [booting], NOW + 60, catalog=CAT, config=config)
    assert not any(isinstance(a, Launch) for a in seen)
    assert {a.run_id for a in seen if isinstance(a, Place)} == {"1", "3"}
    # a stopped host is restarted rather than a new one launched
    stopped = host_view(
        name="i-stop",
        state="stopped",
        instance_type=launch.instance_type,
        market="ondemand",
        usd_hr=0.0,
        since_s=NOW - 600,
        restarted=True,
        now=NOW,
        catalog=CAT,
        config=config,
    )
    assert stopped is not None
    again = decide(queue, [stopped], NOW + 60, catalog=CAT, config=config)
    assert any(isinstance(a, Start) for a in again)
    assert not any(isinstance(a, Launch) for a in again)


def test_a_restarting_instance_is_booting_until_start_s_after_its_restart() -> None:
    """A stopped instance started again is usable `start_s` after its restart (the
    simulator's cloud: no bootstrap on a set-up instance), not at once because it was
    launched long ago, and not boot + setup after the restart either."""
    from bot.app.runs import host_view

    config = cfg(max_gpus=64)
    view = host_view(
        name="i-again",
        state="pending",
        instance_type="p4d.24xlarge",
        market="ondemand",
        usd_hr=0.0,
        since_s=NOW - 20,
        restarted=True,
        now=NOW,
        catalog=CAT,
        config=config,
    )
    assert view is not None and view.state == "pending"
    assert view.ready_at_s == NOW - 20 + config.start_s


def test_the_workers_scheduler_knobs_come_from_settings() -> None:
    from datetime import timedelta

    from bot.app.config import Settings
    from bot.app.runs import scheduler_config
    from bot.domain.scheduling import IDLE_STOP_S, LAS_AFTER_S

    # one default idle stop for the worker and the simulator (bot.sim defaults to it)
    assert Settings().idle_stop_after.total_seconds() == IDLE_STOP_S
    settings = Settings(idle_stop_after=timedelta(minutes=20), pool_max_instances=2)
    c = scheduler_config(settings, CAT)
    assert c.idle_stop_after() == 1200.0
    assert c.terminate_after(30.0) == settings.terminate_after.total_seconds()
    assert c.max_gpus == 2 * max(t.gpus for t in CAT.types)
    assert c.las_after_s == LAS_AFTER_S
