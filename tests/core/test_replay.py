"""One world, two clocks (issue 17): the real worker on a virtual clock, driven through a
small trace against a simulated cloud and runner (tests/core/replay_world.py), takes the
same actions at the same times as `gpubot simulate` on that trace and those settings.

The worker is wired as the runtime wires a cloud (bot.providers.aws's `connect`: one
place with its RemoteAccess, runs and Fleet) on SQLite, and driven as `bot.faces.worker`
drives it: every `tick_seconds` the fleet job (`fleet_job`: refresh, provision, idle
stop) and the tick (`tick_job`: reservations, poll, dispatch); a submission is followed
at once by a nudged tick, as `faces.dispatch` asks for one.

Times agree exactly, not within a tolerance, because the trace keeps every event on the
worker's tick grid: submissions, run times and boot + setup are whole ticks. What is
left of tick granularity is the preemption: the worker signals at a tick, the run
checkpoints and exits within it, and the next tick's poll requeues it and frees its
GPUs; the simulator is told exactly that (`stop_s` = one tick). Off the grid each event
would be seen up to one tick later by the worker than by the event-driven simulator,
and the differences would add up along a chain of runs; that is the simulator's
`--stop-s` default of two ticks (a decision between ticks, signalled at the next).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.config import Settings
from bot.app.fleet import CatalogSupply, Fleet, fleet_job
from bot.app.hosts.remote import PreparedHost, RemoteAccess
from bot.app.money.history_trace import history_trace
from bot.app.places import RunParts, Wiring
from bot.app.runs import scheduler_config
from bot.app.runs.inputs import scheduler_inputs
from bot.app.runtimes import history_of_kept
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.scheduling import Action, FleetInstance, Preempt
from bot.faces.dispatch import handle_text
from bot.faces.worker import tick_job
from bot.sim.simulate import SimResult, TraceJob, checkpointable, parse_trace, run_simulation
from db.models import TrainingRun
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS
from provisioning.hostshell import HostShell
from provisioning.ssh import SshTarget
from tests.core.replay_world import ReplayCloud, ReplayRunner

TICK_S = 60.0  # the worker's tick here: a minute keeps the test short; the grid is the point
CHECKPOINTABLE = 0.5  # the contract's share of jobs that checkpoint (`checkpointable`)
RESUME_S = 300.0  # SchedulerConfig's default resume cost, charged by both worlds

Act = tuple[float, str, str]  # (seconds since the trace's start, kind, what)


@dataclass(frozen=True)
class NamedResolver:
    """Every instance → a target named after it; ReplayRunner never dials anything."""

    def resolve(self, instance: Instance | str) -> SshTarget:
        name = instance.name if isinstance(instance, Instance) else instance
        return SshTarget(host=f"{name}.replay.invalid", port=22, user="ubuntu", name=name)


def prepared(runner: HostShell, target: SshTarget) -> PreparedHost:
    return PreparedHost(root="/home/ubuntu/.gpubot", python="python3")


def job(job_id: str, user: str, submit: float, minutes: float, gpus: int) -> TraceJob:
    return TraceJob(job_id, user, submit, minutes * 60.0, gpus, "A100")


# A small team on one model. Job ids are picked so that the contract's hash rule at 0.5
# makes alice's runs checkpoint (preemptible) and leaves bob's and carol's pinned.
TRACE = (
    job("a2", "alice", 0.0, 150, 8),  # launches the first instance, waits for its boot
    job("c1", "bob", 600.0, 30, 2),
    job("d1", "carol", 1200.0, 20, 1),
    job("a4", "alice", 1800.0, 60, 4),
    job("c2", "bob", 4200.0, 45, 1),
)


@dataclass(frozen=True)
class Scenario:
    trace: tuple[TraceJob, ...]
    pool_max_instances: int  # the quota: this many 8-GPU instances
    kinds: frozenset[str]  # the actions it must contain, so that it tests them
    preemptions: int = 0


SCENARIOS = {
    # One instance: bob's and carol's runs wait behind alice's 8 GPUs until the scheduler
    # preempts it (SIGTERM, checkpoint, exit, the next poll requeues it), and it resumes
    # from its checkpoint once they are done; then the idle instance is stopped.
    "preemption": Scenario(
        TRACE, 1, frozenset({"launch", "start", "preempt", "stop", "end"}), preemptions=1
    ),
    # Two instances: the second is launched for a bundle of waiting runs, stopped when
    # idle, and restarted for a later run (the scheduler must see it as restarted, not
    # as idle since before it was stopped).
    "restart": Scenario(
        (*TRACE, job("d2", "carol", 9000.0, 30, 4)),
        2,
        frozenset({"launch", "start", "stop", "restart", "end"}),
    ),
    # Two instances full of alice's runs, three pinned runs waiting: the scheduler looks
    # again at each preemption slot though nothing else happens, and preempts both.
    "slot with no other event": Scenario(
        (
            job("a2", "alice", 0.0, 180, 8),
            job("a4", "alice", 0.0, 180, 8),
            job("c1", "bob", 900.0, 40, 4),
            job("d1", "carol", 960.0, 40, 4),
            job("c2", "bob", 1020.0, 30, 8),
        ),
        2,
        frozenset({"launch", "start", "preempt", "stop", "end"}),
        preemptions=2,
    ),
    # Runs queued while the first instance boots wait for it; the instance launched for
    # bob's 8-GPU run goes to carol's smaller one by fair share once it is ready, and bob's
    # waits (the fleet buys for a run once while what it bought exists).
    "queued while booting": Scenario(
        (
            job("a2", "alice", 0.0, 60, 4),
            job("c1", "bob", 60.0, 30, 4),
            job("d1", "carol", 120.0, 20, 2),
            job("c2", "bob", 180.0, 40, 8),
        ),
        3,
        frozenset({"launch", "start", "stop", "end"}),
    ),
    # An instance launched for bob's run is still booting when alice's frees the first
    # one; bob's run goes there, and the new instance is never used: both worlds stop it
    # an idle-stop period after it became ready, not after it was launched.
    "never used": Scenario(
        (job("a2", "alice", 0.0, 60, 8), job("c1", "bob", 3720.0, 30, 8)),
        2,
        frozenset({"launch", "start", "stop", "end"}),
    ),
}


def simulated(
    trace: Sequence[TraceJob], settings: Settings, catalog: Catalog
) -> tuple[SimResult, list[Act]]:
    """`gpubot simulate` on the trace with the worker's settings, and its actions."""
    preempts: list[tuple[float, str]] = []

    def seen(now: float, actions: list[Action]) -> None:
        preempts.extend((now, a.run_id) for a in actions if isinstance(a, Preempt))

    cfg = scheduler_config(settings, catalog)
    res = run_simulation(
        list(trace),
        catalog=catalog,
        max_gpus=cfg.max_gpus,
        config=cfg,
        resume_s=RESUME_S,
        estimates="none",
        checkpointable_fraction=CHECKPOINTABLE,
        checkpoint_every_s=0.0,  # the runner checkpoints on the signal
        stop_s=TICK_S,  # signal, exit within the tick, the next tick's poll frees the GPUs
        on_decision=seen,
    )
    return res, sim_actions(res, preempts)


def sim_actions(res: SimResult, preempts: list[tuple[float, str]]) -> list[Act]:
    """The simulator's schedule and instances as the worker's actions on the world."""
    out: list[Act] = []
    for r in res.instances:
        out.append((r.launch_s, "launch", f"{r.instance_id} {r.instance_type}"))
        for a, b in r.stopped:
            out.append((a, "stop", r.instance_id))
            if b != r.end_s:
                out.append((b, "restart", r.instance_id))
        if r.end_s is not None:
            out.append((r.end_s, "terminate", r.instance_id))
    for s in res.schedule:
        out.append((s.start_s, "start", f"{s.job_id} {';'.join(s.instance_ids)}"))
    out.extend((t, "preempt", job_id) for t, job_id in preempts)
    last: dict[str, float] = {}
    for s in res.schedule:
        last[s.job_id] = max(last.get(s.job_id, 0.0), s.end_s)
    out.extend((t, "end", job_id) for job_id, t in last.items())
    return sorted(out)


# What the worker's scheduler was told at one tick: (trace seconds, the fleet it saw).
Watch = Callable[[float, list[FleetInstance]], None]


def worker_actions(
    engine: Engine,
    settings: Settings,
    catalog: Catalog,
    trace: Sequence[TraceJob],
    until: float,
    watch: Watch | None = None,
) -> list[Act]:
    """The real worker through `trace` up to `until` (trace seconds), and its actions;
    `watch` sees the scheduler's inputs (`scheduler_inputs`) after every tick, with its
    times in trace seconds."""
    clock = VirtualClock()
    t0 = clock.now().timestamp()
    cloud = ReplayCloud(
        catalog,
        clock,
        t0,
        boot_s=DEFAULT_COSTS.boot_s,
        setup_s=DEFAULT_COSTS.setup_s,
        start_s=DEFAULT_COSTS.start_s,
    )
    job_of: dict[str, str] = {}  # run id -> job id
    work = {j.job_id: j.duration_s for j in trace}
    runner = ReplayRunner(clock, t0, lambda run_id: work[job_of[run_id]], RESUME_S)
    # The runtime's cloud wiring (bot.faces.runtime._cloud_wiring), with this world's ports.
    access = RemoteAccess(engine, runner, NamedResolver(), prepare=prepared)

    def wire(core: GpuService) -> list[Wiring]:
        fleet = Fleet(core, cloud, access, catalog=catalog)
        return [
            Wiring(
                "aws", supply=CatalogSupply(catalog), runs=RunParts(access, catalog), fleet=fleet
            )
        ]

    svc = GpuService(engine, settings, clock, wire)
    starts = svc.runs.ctx.starts
    fleet = svc.fleet
    assert isinstance(fleet, Fleet)

    arrivals = sorted(trace, key=lambda j: (j.submit_s, j.job_id))
    t = 0.0
    while t <= until:
        clock.set(datetime.fromtimestamp(t0 + t, UTC))
        fleet_job(svc)  # the fleet's periodic job: readiness, provisioning, idle stop
        while arrivals and arrivals[0].submit_s <= t:
            j = arrivals.pop(0)
            assert j.submit_s == t, "the trace keeps submissions on the tick grid"
            flag = " --checkpoints" if checkpointable(j.job_id, CHECKPOINTABLE) else ""
            line = f"/gpu run --gpus {j.gpus} --gpu a100{flag} -- python train.py"
            reply = handle_text(svc, svc.actor(j.user), line)
            assert not reply.error, reply.view.text
            job_of[str(reply.extra["run_id"])] = j.job_id
            tick_job(svc, None)  # the nudged tick (faces.dispatch asks for one)
            starts.wait()
        tick_job(svc, None)
        # A start that uploads (a resumed run's checkpoint) runs off the tick
        # (bot.app.runs.starts); on a host it takes seconds, well inside a tick, so the
        # clock moves on only once it is done.
        starts.wait()
        if watch is not None:
            with Session(engine) as s:
                seen = scheduler_inputs(svc.runs.ctx, s, clock.now())[1]
            watch(t, [_shifted(f, t0) for f in seen])
        t += TICK_S
    assert runner.unknown == [], "the worker asked the host for what the runner double lacks"

    got = [(t, kind, _job_named(what, job_of)) for t, kind, what in cloud.log + runner.log]
    with Session(engine) as s:
        for run in s.exec(select(TrainingRun)):
            if run.finished_at is not None:
                assert run.state == "succeeded", (run.id, run.state, run.metrics)
                end = run.finished_at.replace(tzinfo=UTC).timestamp() - t0
                got.append((end, "end", job_of[str(run.id)]))
    return sorted(got)


def replay(
    engine: Engine, home: Path, trace: Sequence[TraceJob], pool_max_instances: int
) -> tuple[SimResult, list[Act], list[Act]]:
    """(the simulation, its actions, the worker's) over the simulation's active time."""
    catalog = Catalog.load()
    settings = Settings(
        admins=("root",),
        home=home,
        tick_seconds=TICK_S,
        # the quota: this many 8-GPU instances (scheduler_config's max_gpus, the fleet's cap)
        pool_max_instances=pool_max_instances,
    )
    res, expected = simulated(trace, settings, catalog)
    # Up to the last action before the terminations of stopped instances (days later).
    until = max(t for t, kind, _ in expected if kind != "terminate") + 2 * TICK_S
    got = worker_actions(engine, settings, catalog, trace, until)
    return res, [a for a in expected if a[0] <= until], got


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_worker_takes_the_simulators_actions_at_the_simulators_times(
    name: str, sqlite_engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scenario = SCENARIOS[name]
    eligible = {j.job_id for j in scenario.trace if checkpointable(j.job_id, CHECKPOINTABLE)}
    assert eligible == {j.job_id for j in scenario.trace if j.user == "alice"}
    with caplog.at_level(logging.ERROR):
        res, expected, got = replay(
            sqlite_engine, tmp_path / "home", scenario.trace, scenario.pool_max_instances
        )
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert res.preemptions == scenario.preemptions
    assert scenario.kinds <= {kind for _, kind, _ in expected}
    assert got == expected


def _job_named(what: str, job_of: dict[str, str]) -> str:
    """A runner's log names runs by their database id; the simulator by the trace's."""
    head, _, rest = what.partition(" ")
    if head in job_of:
        return f"{job_of[head]} {rest}".strip()
    return what


def _shifted(f: FleetInstance, t0: float) -> FleetInstance:
    """An instance's times in trace seconds."""

    def sh(x: float | None) -> float | None:
        return None if x is None else x - t0

    return replace(
        f,
        ready_at_s=f.ready_at_s - t0,
        idle_since_s=sh(f.idle_since_s),
        stopped_since_s=sh(f.stopped_since_s),
    )


def test_the_worker_sees_booting_restarting_and_stopped_instances_as_the_simulator_does(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The scheduler's view of an instance on its way, in the worker, at every tick: a
    launched one is usable boot + setup after its launch, a restarted one `start_s` after
    its restart (not at once: it was launched long ago), and a stopped one stopped since
    it was stopped (not since the last refresh of the cloud's listing), each as the
    simulator's records have it."""
    scenario = SCENARIOS["restart"]
    catalog = Catalog.load()
    settings = Settings(
        admins=("root",),
        home=tmp_path / "home",
        tick_seconds=TICK_S,
        pool_max_instances=scenario.pool_max_instances,
    )
    res, expected = simulated(scenario.trace, settings, catalog)
    until = max(t for t, kind, _ in expected if kind != "terminate") + 2 * TICK_S
    costs = DEFAULT_COSTS
    # what the simulator's instances did: their boots (from, usable at) and stops
    boots: dict[str, list[tuple[float, float]]] = {}
    stops: dict[str, list[tuple[float, float]]] = {}
    for r in res.instances:
        boots[r.instance_id] = [(r.launch_s, r.launch_s + costs.boot_s + costs.setup_s)]
        boots[r.instance_id] += [(b, b + costs.start_s) for _, b in r.stopped if b != r.end_s]
        stops[r.instance_id] = list(r.stopped)
    seen: list[tuple[float, str, str, float]] = []

    def watch(t: float, fleet: list[FleetInstance]) -> None:
        for f in fleet:
            if f.state == "pending":
                seen.append((t, f.instance_id, "pending", f.ready_at_s))
            elif f.state == "stopped":
                assert f.stopped_since_s is not None
                seen.append((t, f.instance_id, "stopped", f.stopped_since_s))

    worker_actions(sqlite_engine, settings, catalog, scenario.trace, until, watch)
    restarting = 0
    for t, iid, state, when in seen:
        if state == "pending":
            # the boot under way at t, as the simulator had it
            booted = [
                (k, usable) for k, (begun, usable) in enumerate(boots[iid]) if begun <= t < usable
            ]
            assert [usable for _, usable in booted] == [when], (t, iid, when, boots[iid])
            restarting += booted[0][0] > 0  # a boot after the first is a restart
        else:
            assert [a for a, b in stops[iid] if a <= t < b] == [when], (t, iid, when)
    assert restarting >= 1, "the scenario restarts an instance while the worker looks"
    assert any(state == "stopped" for _, _, state, _ in seen)


def test_a_resumed_runs_history_is_all_its_segments(sqlite_engine: Engine, tmp_path: Path) -> None:
    """After the worker preempted and resumed alice's 8-GPU run, what the team's history
    says it ran is every segment, as the simulator's schedule has them: `gpubot simulate
    --history` (`history_trace`, from the usage intervals) and the run-time predictor the
    scheduler reads (the run times kept as runs end, bot.app.runtimes, which learnt only
    the last segment before)."""
    scenario = SCENARIOS["preemption"]
    res, expected, got = replay(sqlite_engine, tmp_path / "home", scenario.trace, 1)
    assert got == expected
    segments = [s for s in res.schedule if s.job_id == "a2"]
    assert len(segments) == 2
    ran = sum(s.end_s - s.start_s for s in segments)
    with Session(sqlite_engine) as s:
        runs = list(s.exec(select(TrainingRun)))
        resumed = next(r for r in runs if r.gpu_count == 8)
        assert resumed.finished_at is not None and resumed.started_at is not None
        end = max(r.finished_at for r in runs if r.finished_at is not None).replace(tzinfo=UTC)
        # the last segment alone is what the predictor learnt before
        last = (resumed.finished_at - resumed.started_at).total_seconds()
        assert last < ran
        # a2 is the trace's longest run: only its whole length outlives ran - 1 s
        learnt, _, _ = history_of_kept(s, end)
        assert learnt.expected_remaining("alice", 8, ran - 1.0) == pytest.approx(1.0)
    text, _ = history_trace(sqlite_engine, datetime(2026, 1, 1, tzinfo=UTC), end)
    jobs = parse_trace(text.splitlines(), Catalog.load(), "A100")
    assert [j.duration_s for j in jobs if j.gpus == 8] == [pytest.approx(ran, abs=1e-3)]
