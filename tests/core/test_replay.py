"""One world, two clocks (issue 17): the real worker on a virtual clock, driven through a
small trace against a simulated cloud and runner (tests/core/replay_world.py), takes the
same actions at the same times as `gpubot simulate` on that trace and those settings.

The worker is wired as the runtime wires a cloud (`bot.faces.runtime._cloud_wiring`:
RemoteAccess, RunService, Fleet attached) on SQLite, and driven as `bot.faces.worker`
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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.config import Settings
from bot.app.fleet import CatalogSupply, Fleet, attach, fleet_job
from bot.app.remote import PreparedHost, RemoteAccess
from bot.app.runs import RunService, scheduler_config
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.domain.scheduling import Action, Preempt
from bot.faces.dispatch import handle_text
from bot.faces.worker import tick_job
from bot.sim.simulate import SimResult, TraceJob, checkpointable, run_simulation
from db.models import TrainingRun
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS
from provisioning.ssh import SshRunner, SshTarget
from tests.core.replay_world import ReplayCloud, ReplayRunner

TICK_S = 60.0  # the worker's tick here: a minute keeps the test short; the grid is the point
CHECKPOINTABLE = 0.5  # the contract's share of jobs that checkpoint (`checkpointable`)
RESUME_S = 300.0  # SchedulerConfig's default resume cost, charged by both worlds


@dataclass(frozen=True)
class NamedResolver:
    """Every instance → a target named after it; ReplayRunner never dials anything."""

    def resolve(self, instance: Instance | str) -> SshTarget:
        name = instance.name if isinstance(instance, Instance) else instance
        return SshTarget(host=f"{name}.replay.invalid", port=22, user="ubuntu", name=name)


def prepared(runner: SshRunner, target: SshTarget) -> PreparedHost:
    return PreparedHost(root="/home/ubuntu/.gpubot", python="python3")


def job(job_id: str, user: str, submit: float, minutes: float, gpus: int) -> TraceJob:
    return TraceJob(job_id, user, submit, minutes * 60.0, gpus, "A100")


# A small team on one model. Job ids are picked so that the contract's hash rule at 0.5
# makes both of alice's big runs checkpoint (preemptible) and leaves the rest pinned.
TRACE = (
    job("a2", "alice", 0.0, 150, 8),  # launches the first instance, waits for its boot
    job("c1", "bob", 600.0, 30, 2),
    job("d1", "carol", 1200.0, 20, 1),
    job("a4", "alice", 1800.0, 60, 4),
    job("c2", "bob", 4200.0, 45, 1),
)


def simulated(settings: Settings, catalog: Catalog) -> tuple[SimResult, list[tuple[float, str]]]:
    preempts: list[tuple[float, str]] = []

    def seen(now: float, actions: list[Action]) -> None:
        preempts.extend((now, a.run_id) for a in actions if isinstance(a, Preempt))

    cfg = scheduler_config(settings, catalog)
    res = run_simulation(
        list(TRACE),
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
    return res, preempts


def sim_actions(res: SimResult, preempts: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """The simulator's schedule and instances as the worker's actions on the world."""
    out: list[tuple[float, str, str]] = []
    for r in res.instances:
        out.append((r.launch_s, "launch", f"{r.instance_id} {r.instance_type}"))
        for a, b in r.stopped:
            out.append((a, "stop", r.instance_id))
            if b != r.end_s:
                out.append((b, "restart", r.instance_id))
    for s in res.schedule:
        out.append((s.start_s, "start", f"{s.job_id} {';'.join(s.instance_ids)}"))
    out.extend((t, "preempt", job_id) for t, job_id in preempts)
    last: dict[str, float] = {}
    for s in res.schedule:
        last[s.job_id] = max(last.get(s.job_id, 0.0), s.end_s)
    out.extend((t, "end", job_id) for job_id, t in last.items())
    return sorted(out)


def test_the_worker_takes_the_simulators_actions_at_the_simulators_times(
    sqlite_engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    catalog = Catalog.load()
    settings = Settings(
        admins=("root",),
        home=tmp_path / "home",
        tick_seconds=TICK_S,
        pool_max_instances=1,  # the quota: one 8-GPU instance (scheduler_config's max_gpus)
    )
    eligible = {j.job_id for j in TRACE if checkpointable(j.job_id, CHECKPOINTABLE)}
    assert eligible == {"a2", "a4"}, "the trace's ids were picked for this split"
    res, preempts = simulated(settings, catalog)
    expected = sim_actions(res, preempts)
    assert res.preemptions == 1 and any(k == "stop" for _, k, _ in expected)

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
    work = {j.job_id: j.duration_s for j in TRACE}
    runner = ReplayRunner(clock, t0, lambda run_id: work[job_of[run_id]], RESUME_S)
    # The runtime's cloud wiring (bot.faces.runtime._cloud_wiring), with this world's ports.
    svc = GpuService(sqlite_engine, settings, clock, CatalogSupply(catalog))
    access = RemoteAccess(sqlite_engine, runner, NamedResolver(), prepare=prepared)
    svc.runs = RunService(svc, access, catalog)
    fleet = Fleet(svc, cloud, access, catalog=catalog)
    attach(svc, fleet)

    horizon = max(t for t, kind, _ in expected if kind != "terminate") + 2 * TICK_S
    arrivals = sorted(TRACE, key=lambda j: (j.submit_s, j.job_id))
    t = 0.0
    with caplog.at_level(logging.ERROR):
        while t <= horizon:
            clock.set(clock.now() + timedelta(seconds=t - (clock.now().timestamp() - t0)))
            fleet_job(svc)
            while arrivals and arrivals[0].submit_s <= t:
                j = arrivals.pop(0)
                assert j.submit_s == t, "the trace keeps submissions on the tick grid"
                flag = " --checkpoints" if j.job_id in eligible else ""
                line = f"/gpu run --gpus {j.gpus} --gpu a100{flag} -- python train.py"
                reply = handle_text(svc, svc.actor(j.user), line)
                assert not reply.error, reply.view.text
                job_of[str(reply.extra["run_id"])] = j.job_id
                tick_job(svc, None)  # the nudged tick (faces.dispatch asks for one)
            tick_job(svc, None)
            t += TICK_S
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert runner.unknown == []

    got = sorted(cloud.log + runner.log)
    got = [(t, kind, _job_named(what, job_of)) for t, kind, what in got]
    with Session(sqlite_engine) as s:
        for run in s.exec(select(TrainingRun)):
            assert run.finished_at is not None and run.state == "succeeded", run
            end = run.finished_at.replace(tzinfo=clock.now().tzinfo).timestamp() - t0
            got.append((end, "end", job_of[str(run.id)]))
    got.sort()
    expected = [a for a in expected if a[0] <= horizon and a[1] != "terminate"]
    assert got == expected


def _job_named(what: str, job_of: dict[str, str]) -> str:
    """A runner's log names runs by their database id; the simulator by the trace's."""
    head, _, rest = what.partition(" ")
    if head in job_of:
        return f"{job_of[head]} {rest}".strip()
    return what
