"""`gpubot simulate`: a trace of jobs through the real scheduler on a simulated cloud.

Why: the scheduler's choices (pack, reuse, wait or launch, stop) are where the team's
money goes, and a trace replay is the only way to see that before paying for it. The
loop calls the very `bot.domain.scheduling.decide` the worker calls, on a virtual clock
(`provisioning.simulated.SimulatedCloud`), jumping from event to event through a heap —
arrivals, run starts and ends, instances becoming ready, idle timers — so 100,000 jobs
take seconds, not the trace's months.

Figures (all over the jobs that ran; a job that can never run is reported as rejected):

* ``jobs``: jobs that ran.
* ``total_cost_usd``: the sum of every instance's bill (running per second with a 60 s
  minimum per start, stopped at storage price, see `provisioning.simulated`).
* ``ideal_cost_usd``: every job's GPU-seconds at the cheapest on-demand per-GPU price of
  an instance type of its GPU model: no idle, no boot, perfect packing; the floor.
* ``cost_efficiency``: ideal / total (1.0 is the floor, higher is impossible).
* ``avg_jct_s``: mean of (last) end − submit.
* ``avg_queue_s``, ``p95_queue_s``: mean and 95th percentile (nearest rank) of the time
  a job spent not running: start − submit, plus, for a preempted job, every gap between
  its segments.
* ``gpu_utilization``: busy GPU-seconds (jobs' GPUs × duration) / paid running
  GPU-seconds (each instance's GPUs × its time not stopped, launch to end).
* ``makespan_s``: last end − first submit.

Rejected jobs: a job needing more GPUs than `--max-gpus` allows at once (after rounding
up to whole instances), or, under ``fifo``, more than its model's part of the fixed
fleet, can never start. It is left out of the schedule and the figures and named on
stderr (and in ``SimResult.rejected``), rather than run at a fraction of its size, which
would change its duration and thus the figures.

Preemption (``fair`` only, ``--no-preempt`` turns it off): the scheduler may stop a
running job with a checkpoint and start it again later or elsewhere (fair-share
preemption, defragmentation, consolidation; see `bot.domain.scheduling`). What the scheduler
knows and what a preemption costs is the simulator's contract (`World`, docs/SIMULATOR.md):
``--estimates none`` (default) hides every run time from it, as production knows none
without a user's --max; ``--checkpointable F`` picks the jobs that may be preempted by
a hash of their id; a preempted segment keeps whole multiples of ``--checkpoint-every``
of its work, holds its GPUs ``--stop-s`` after the signal (the worker's SIGTERM,
checkpoint, exit, poll), and the job owes ``--resume-s`` more on each resume. Its
schedule has one row per segment, in time order, each on the instances it used then.
Spot runs are not in the trace format, so every job of a trace file is on-demand; a
replay of the team's own runs (`TraceJob.spot`) puts a run that ran on spot on spot
capacity, at its spot price, and is never interrupted there (the simulated cloud has no
spot market to take it back).
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bot.domain.scheduling import (
    IDLE_STOP_S,
    LAS_AFTER_S,
    POLICIES,
    Action,
    Allocation,
    BurstGate,
    FleetInstance,
    Launch,
    Place,
    Preempt,
    QueuedRun,
    RunHistory,
    SchedulerConfig,
    Start,
    Stop,
    Terminate,
    decay_usage,
    decide,
    fifo_fleet,
    next_wakeup,
    preempt_slot,
    run_shape,
)
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS
from provisioning.simulated import InstanceRecord, SimulatedCloud

TRACE_HEADER = ("job_id", "user", "submit_time", "duration_s", "gpus", "gpu_type")
FIGURE_KEYS = (
    "policy",
    "jobs",
    "total_cost_usd",
    "ideal_cost_usd",
    "cost_efficiency",
    "avg_jct_s",
    "avg_queue_s",
    "p95_queue_s",
    "gpu_utilization",
    "makespan_s",
)
# What `--json` adds with `--owned-gpus` (SimResult's burst figures).
BURST_KEYS = ("owned_gpus", "burst_after_s", "burst_jobs", "cloud_gpu_h")


# From the signal to free GPUs in the worker: the run checkpoints and exits within a
# tick, the next tick's poll requeues it, and that tick's dispatch places what waits.
DEFAULT_STOP_S = 2 * 15.0  # two worker ticks (Settings.tick_seconds)

DecisionHook = Callable[[float, list[Action]], None]


class SimInputError(ValueError):
    """Bad input to the simulator; its text is the whole message for the user."""


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    user: str
    submit_s: float
    duration_s: float
    gpus: int
    gpu_model: str  # canonical, the default filled in
    # Whether the job checkpoints and may be preempted; None: the contract's hash rule
    # (`--checkpointable F`). A replay of the team's own runs sets it from each run's
    # `--checkpoints`, which is what the worker's scheduler is told.
    checkpoints: bool | None = None
    spot: bool = False  # runs on spot capacity, as a run submitted with --spot does


@dataclass(frozen=True)
class ScheduledJob:
    job_id: str
    user: str
    instance_ids: tuple[str, ...]
    submit_s: float
    start_s: float
    end_s: float
    gpus: int


@dataclass(frozen=True)
class SimResult:
    policy: str
    jobs: int
    total_cost_usd: float
    ideal_cost_usd: float
    cost_efficiency: float
    avg_jct_s: float
    avg_queue_s: float
    p95_queue_s: float
    gpu_utilization: float
    makespan_s: float
    schedule: tuple[ScheduledJob, ...] = ()
    instances: tuple[InstanceRecord, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()  # (job_id, why)
    wall_s: float = 0.0
    preemptions: int = 0  # checkpoint-and-requeue events (each a new schedule row)
    # With the team's own GPUs (`--owned-gpus`): how many, the burst threshold (None:
    # never), the jobs that ran on the cloud, and the cloud GPU-hours bought.
    owned_gpus: int = 0
    burst_after_s: float | None = None
    burst_jobs: int = 0
    cloud_gpu_h: float = 0.0

    def figures(self) -> dict[str, object]:
        """Exactly the `--json` object of DESIGN.md; with `--owned-gpus`, the burst
        figures too (docs/SIMULATOR.md)."""
        out = {k: getattr(self, k) for k in FIGURE_KEYS}
        if self.owned_gpus:
            out.update({k: getattr(self, k) for k in BURST_KEYS})
        return out


# ---------------------------------------------------------------- input


def load_trace(path: Path, catalog: Catalog, default_model: str) -> list[TraceJob]:
    """Reads and validates a trace; any problem is one SimInputError line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SimInputError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    return parse_trace(text.splitlines(), catalog, default_model, str(path))


def parse_trace(
    lines: Sequence[str], catalog: Catalog, default_model: str, name: str = "trace"
) -> list[TraceJob]:
    rows = csv.reader(lines)
    header = next(rows, None)
    if header is None or tuple(h.strip() for h in header) != TRACE_HEADER:
        raise SimInputError(f"{name}: header must be {','.join(TRACE_HEADER)}")
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for lineno, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(TRACE_HEADER):
            raise SimInputError(f"{name} line {lineno}: expected {len(TRACE_HEADER)} fields")
        job_id, user, submit, dur, gpus, gtype = (c.strip() for c in row)
        try:
            submit_s = float(submit)
            duration_s = float(dur)
            n = int(gpus)
        except ValueError:
            raise SimInputError(
                f"{name} line {lineno}: submit_time, duration_s and gpus must be numbers"
            ) from None
        if not job_id or not user:
            raise SimInputError(f"{name} line {lineno}: job_id and user must not be empty")
        if job_id in seen:
            raise SimInputError(f"{name} line {lineno}: job_id {job_id} appears twice")
        if (
            not (math.isfinite(submit_s) and math.isfinite(duration_s))
            or submit_s < 0
            or duration_s < 0
            or n < 1
        ):
            raise SimInputError(
                f"{name} line {lineno}: need submit_time >= 0, duration_s >= 0, gpus >= 1"
            )
        model = catalog.normalize_model(gtype) if gtype else default_model
        if model is None:
            raise SimInputError(
                f"{name} line {lineno}: unknown gpu_type {gtype!r} "
                f"(known: {', '.join(catalog.models())})"
            )
        seen.add(job_id)
        jobs.append(TraceJob(job_id, user, submit_s, duration_s, n, model))
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return jobs


# ---------------------------------------------------------------- the loop

_ARRIVE, _READY, _START, _END, _WAKE, _RELEASE, _REEST = 0, 1, 2, 3, 4, 5, 6

ESTIMATES = ("none", "exact")


def checkpointable(job_id: str, fraction: float) -> bool:
    """The contract's eligibility rule, exactly: anyone can recompute it from a job id."""
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) < fraction * 2**32


def kept_work(done_s: float, every_s: float) -> float:
    """Work a preempted segment keeps: whole checkpoint periods, all of it at 0."""
    done = max(0.0, done_s)
    if every_s <= 0:
        return done
    return math.floor(done / every_s + 1e-9) * every_s


@dataclass
class _Inst:
    """The loop's mutable view of one instance; `snap` caches its FleetInstance."""

    iid: str
    type_name: str
    model: str
    gpus: int
    usd_hr: float
    market: str
    state: str  # pending | running | stopped
    ready_at: float
    allocs: dict[str, Allocation] = field(default_factory=dict)
    idle_since: float | None = None
    stopped_since: float | None = None
    snap: FleetInstance | None = None

    def snapshot(self) -> FleetInstance:
        if self.snap is None:
            self.snap = FleetInstance(
                instance_id=self.iid,
                instance_type=self.type_name,
                gpu_model=self.model,
                gpus=self.gpus,
                usd_hr=self.usd_hr,
                market="spot" if self.market == "spot" else "ondemand",
                state="pending"
                if self.state == "pending"
                else ("running" if self.state == "running" else "stopped"),
                ready_at_s=self.ready_at,
                allocations=tuple(self.allocs.values()),
                idle_since_s=self.idle_since,
                stopped_since_s=self.stopped_since,
                owned=self.type_name == OWNED_TYPE,
            )
        return self.snap


def run_simulation(
    trace: Path | Sequence[TraceJob],
    *,
    policy: str = "fair",
    prices: Path | None = None,
    catalog: Catalog | None = None,
    gpu_type: str = "A100",
    max_gpus: int = 256,
    boot_s: float = DEFAULT_COSTS.boot_s,
    setup_s: float = DEFAULT_COSTS.setup_s,
    start_s: float = DEFAULT_COSTS.start_s,
    ebs_gb: float = DEFAULT_COSTS.ebs_gb,
    ebs_usd_gb_month: float = DEFAULT_COSTS.ebs_usd_gb_month,
    config: SchedulerConfig | None = None,
    preempt: bool | None = None,
    resume_s: float | None = None,
    estimates: str = "none",
    checkpointable_fraction: float = 0.0,
    checkpoint_every_s: float = 1800.0,
    stop_s: float = DEFAULT_STOP_S,
    idle_stop_s: float | None = IDLE_STOP_S,
    on_decision: DecisionHook | None = None,
    owned_gpus: int = 0,
    burst: BurstGate | None = None,
) -> SimResult:
    """Replays `trace` (a file or parsed jobs) under `policy`; raises SimInputError.

    `idle_stop_s`: how long an empty instance is kept before it is stopped, when no
    `config` is given; the worker's default (IDLE_STOP_S), so both run the same fleet.
    None: the ski-rental break-even (`SchedulerConfig.idle_stop_after`).

    `on_decision(now, actions)` sees every non-empty decision (tests of what the
    scheduler knew when).

    `owned_gpus`: the team's own GPUs of the trace's model, on hosts of the catalog's
    largest size for it, always up and billed at $0 (paid already); the cloud (`max_gpus`
    more, at the catalog's prices) is bought for a run only once `burst` lets it, by how
    long the run has waited (`BurstGate`, the worker's rule; default the bot's 15 minutes).
    Fair only: it is the worker's scheduler."""
    t_wall = time.perf_counter()
    if policy not in POLICIES:
        raise SimInputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if estimates not in ESTIMATES:
        raise SimInputError(f"--estimates must be one of {', '.join(ESTIMATES)}")
    if not (math.isfinite(checkpointable_fraction) and 0.0 <= checkpointable_fraction <= 1.0):
        raise SimInputError("--checkpointable must be a fraction between 0 and 1")
    if catalog is None:
        try:
            catalog = Catalog.load(prices)
        except ValueError as exc:
            raise SimInputError(str(exc)) from None
    model = catalog.normalize_model(gpu_type)
    if model is None:
        raise SimInputError(f"unknown GPU type {gpu_type!r} (known: {', '.join(catalog.models())})")
    if max_gpus < 1:
        raise SimInputError("--max-gpus must be at least 1")
    if owned_gpus < 0:
        raise SimInputError("--owned-gpus must be 0 or more")
    if burst is not None and not owned_gpus:
        raise SimInputError(
            "--burst-after needs --owned-gpus: without GPUs of its own a team buys at once"
        )
    if owned_gpus and policy != "fair":
        raise SimInputError("--owned-gpus works with --policy fair, the worker's scheduler")
    if (
        burst is not None
        and burst.after_s is not None
        and not (math.isfinite(burst.after_s) and burst.after_s >= 0)
    ):
        raise SimInputError("--burst-after must be a duration >= 0, or never")
    if owned_gpus and burst is None:
        burst = BurstGate()
    for name, v in (
        ("--boot-s", boot_s),
        ("--setup-s", setup_s),
        ("--start-s", start_s),
        ("--ebs-gb", ebs_gb),
        ("--ebs-usd-gb-month", ebs_usd_gb_month),
        ("--resume-s", 0.0 if resume_s is None else resume_s),
        ("--checkpoint-every", checkpoint_every_s),
        ("--stop-s", stop_s),
    ):
        if not (math.isfinite(v) and v >= 0):
            raise SimInputError(f"{name} must be a number >= 0")
    # Zero is refused as the worker's Settings refuse it: an instance idle "for 0 s" the
    # moment it is ready is stopped before anything is placed on it, and the run it was
    # bought for restarts another, forever (decide stops one, starts the other, each tick).
    if idle_stop_s is not None and not (math.isfinite(idle_stop_s) and idle_stop_s > 0):
        raise SimInputError("idle stop must be a number of seconds > 0")
    jobs = load_trace(trace, catalog, model) if isinstance(trace, Path) else list(trace)
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))

    cloud = SimulatedCloud(
        catalog,
        max_gpus=max_gpus,
        boot_s=boot_s,
        setup_s=setup_s,
        start_s=start_s,
        ebs_gb=ebs_gb,
        ebs_usd_gb_month=ebs_usd_gb_month,
    )
    # Without estimates the scheduler runs as the worker does: least attained service
    # on (LAS_AFTER_S); with exact ones it is the first simulator's scheduler.
    base = config or SchedulerConfig(
        las_after_s=LAS_AFTER_S if estimates == "none" else None, idle_stop_s=idle_stop_s
    )
    cfg = SchedulerConfig(
        **{
            **base.__dict__,
            "policy": policy,
            # The quota counts warm instances: the team's own do not use the cloud's.
            "max_gpus": max_gpus + owned_gpus,
            "boot_s": boot_s,
            "setup_s": setup_s,
            "start_s": start_s,
            "ebs_usd_s": cloud.ebs_usd_s,
            "preempt": base.preempt if preempt is None else preempt,
            "resume_s": base.resume_s if resume_s is None else resume_s,
        }
    )
    rejected: list[tuple[str, str]] = []
    runnable: list[TraceJob] = []
    cap: dict[str, int] = {}
    if policy == "fifo":
        demand: dict[str, float] = {}
        biggest: dict[str, int] = {}
        for j in jobs:
            demand[j.gpu_model] = demand.get(j.gpu_model, 0.0) + j.gpus * j.duration_s
            biggest[j.gpu_model] = max(biggest.get(j.gpu_model, 0), j.gpus)
        plan = fifo_fleet(catalog, demand, biggest, max_gpus)
        cfg = SchedulerConfig(**{**cfg.__dict__, "fixed_fleet": plan})
        for type_name, count in plan:
            t = catalog.get(type_name)
            if t is not None:
                cap[t.gpu_model] = cap.get(t.gpu_model, 0) + count * t.gpus
    owned = owned_hosts(catalog, model, owned_gpus)
    never = burst is not None and burst.after_s is None
    for j in jobs:
        shape = run_shape(catalog, j.gpu_model, j.gpus)
        if never and (j.gpu_model != model or j.gpus > owned_gpus):
            rejected.append(
                (
                    j.job_id,
                    f"needs {j.gpus} {j.gpu_model} > the {owned_gpus} owned; the cloud is never offered",
                )
            )
        elif shape is None:
            rejected.append((j.job_id, f"no instance type carries {j.gpu_model}"))
        elif shape[1] * shape[0].gpus > max_gpus:
            rejected.append(
                (
                    j.job_id,
                    f"needs {shape[1]} x {shape[0].instance_type} "
                    f"({shape[1] * shape[0].gpus} GPUs) > --max-gpus {max_gpus}",
                )
            )
        elif policy == "fifo" and j.gpus > cap.get(j.gpu_model, 0):
            rejected.append(
                (
                    j.job_id,
                    f"needs {j.gpus} GPUs > the fixed fleet's "
                    f"{cap.get(j.gpu_model, 0)} {j.gpu_model}",
                )
            )
        else:
            runnable.append(j)

    world = World(
        estimates=estimates,
        checkpointable=checkpointable_fraction,
        checkpoint_every_s=checkpoint_every_s,
        stop_s=stop_s,
    )
    loop = _Loop(runnable, cloud, catalog, cfg, world, on_decision, owned=owned, burst=burst)
    loop.run()
    schedule = tuple(row for j in runnable for row in loop.schedule[j.job_id])
    records = tuple(cloud.records())
    res = _figures(policy, runnable, schedule, records, catalog, cloud.min_bill_s)
    on_cloud = {s.job_id for s in schedule if any(i not in loop.owned for i in s.instance_ids)}
    return SimResult(
        **{
            **res.__dict__,
            "schedule": schedule,
            "instances": records,
            "rejected": tuple(rejected),
            "wall_s": time.perf_counter() - t_wall,
            "preemptions": loop.preemptions,
            "owned_gpus": owned_gpus,
            "burst_after_s": None if burst is None else burst.after_s,
            "burst_jobs": len(on_cloud),
            "cloud_gpu_h": round(paid_gpu_s(records) / 3600.0, 3),
        }
    )


# The name the team's own hosts go by in the scheduler's fleet (the worker passes a static
# host's provider name the same way): no catalog type, so nothing buys or prices one.
OWNED_TYPE = "owned"


def owned_hosts(catalog: Catalog, model: str, gpus: int) -> list[_Inst]:
    """`gpus` of the team's own GPUs of `model`, as hosts of the catalog's largest size
    for it (the last one smaller when they do not divide), up from the start at $0."""
    per = max((t.gpus for t in catalog.for_model(model)), default=8)
    out: list[_Inst] = []
    while gpus > 0:
        n = min(per, gpus)
        out.append(
            _Inst(
                f"owned-{len(out) + 1:02d}",
                OWNED_TYPE,
                model,
                n,
                0.0,
                "ondemand",
                "running",
                0.0,
                idle_since=0.0,
            )
        )
        gpus -= n
    return out


@dataclass(frozen=True)
class World:
    """What the scheduler may know and what a preemption costs: the simulator's contract.

    `estimates`: "none" (the default: a job's run time is never shown to the scheduler,
    as the worker knows none without a user's --max; the trace format has no limit
    column) or "exact" (the trace's duration as the time limit: research only).
    `checkpointable`: the fraction F of jobs that may be preempted, chosen by
    `checkpointable(job_id, F)`. `checkpoint_every_s`: a preempted segment keeps only
    whole multiples of it of the work done after its resume overhead (0: it
    checkpoints on the signal). `stop_s`: from the signal until the GPUs are free again
    (the checkpoint write, the exit, the worker's next poll and requeue); the victim
    holds and pays for them meanwhile, and the run it makes way for is placed by a later
    decision, as in the worker."""

    estimates: str = "none"
    checkpointable: float = 0.0
    checkpoint_every_s: float = 1800.0
    stop_s: float = 0.0


class _Loop:
    def __init__(
        self,
        jobs: list[TraceJob],
        cloud: SimulatedCloud,
        catalog: Catalog,
        cfg: SchedulerConfig,
        world: World | None = None,
        on_decision: DecisionHook | None = None,
        *,
        owned: Sequence[_Inst] = (),
        burst: BurstGate | None = None,
    ) -> None:
        self.world = world or World()
        # The team's own hosts (never stopped, never bought) and when the cloud may be
        # bought for a run that waits (None: at once, a cloud-only pool).
        self.owned = {i.iid for i in owned}
        self.burst = burst
        self.waiting_since: dict[str, float] = {}
        self.exact = self.world.estimates == "exact"
        self.eligible = {
            j.job_id
            for j in jobs
            if (
                checkpointable(j.job_id, self.world.checkpointable)
                if j.checkpoints is None
                else j.checkpoints
            )
        }
        self.on_decision = on_decision
        self.stopping: dict[str, float] = {}  # signalled job -> when its GPUs come back
        # what the scheduler may know of run times without an oracle: finished jobs
        self.history = RunHistory()
        self.est_end: dict[str, float] = {}  # running job -> its predicted end (stepped)
        self.jobs = jobs
        self.cloud = cloud
        self.catalog = catalog
        self.cfg = cfg
        self.by_id = {j.job_id: j for j in jobs}
        self.heap: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.insts: dict[str, _Inst] = {}
        self.queues: dict[str, list[QueuedRun]] = {}
        self.queued = 0
        self.usage: dict[str, float] = {}
        self.running: dict[str, int] = {}
        self.schedule: dict[str, list[ScheduledJob]] = {}  # a row per run segment
        self.left: dict[str, float] = {j.job_id: j.duration_s for j in jobs}  # work to do
        self.seg: dict[str, tuple[float, float, float]] = {}  # running: start, end, resume
        self.preemptions = 0
        self.pslot = -(2**62)  # the last preemption slot looked at (see preempt_slot)
        self.placed_on: dict[str, tuple[str, ...]] = {}
        self.launched_for: dict[str, list[str]] = {}  # job -> instances launched for it
        self.per_host: dict[str, int] = {}
        self.wakes: set[float] = set()
        self.arrivals_left = len(jobs)
        self.last_t = 0.0
        self.fair = cfg.policy == "fair"
        # the fleet's snapshots as decide sees them, rebuilt only after an instance changed
        self.fleet_cache: list[FleetInstance] = []
        self.fleet_stale = True
        for inst in owned:
            self.insts[inst.iid] = inst

    def push(self, t: float, kind: int, key: str) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, key))

    def run(self) -> None:
        for j in self.jobs:
            self.push(j.submit_s, _ARRIVE, j.job_id)
        heap = self.heap
        while heap:
            t = heap[0][0]
            self.advance(t)
            dirty = False
            while heap and heap[0][0] == t:
                _, kind, _, key = heapq.heappop(heap)
                self.handle(kind, key, t)
                # a start changes no decision's inputs; a stepped prediction is seen by
                # the next decision an event calls for (alone it would rarely change one)
                dirty = dirty or (kind != _START and kind != _REEST)
            if dirty:
                self.tick(t)
        end = self.cloud.now
        for inst in list(self.insts.values()):  # nothing is left running unaccounted
            if inst.iid in self.owned:
                continue
            self.cloud.terminate(inst.iid)
            del self.insts[inst.iid]
            self.fleet_stale = True
        self.cloud.advance_to(end)

    def advance(self, t: float) -> None:
        if self.fair and t > self.last_t:
            self.usage = decay_usage(
                self.usage, self.running, t - self.last_t, self.cfg.half_life_s
            )
        self.last_t = t
        self.cloud.advance_to(t)

    def handle(self, kind: int, key: str, t: float) -> None:
        if kind == _ARRIVE:
            j = self.by_id[key]
            self.arrivals_left -= 1
            self.queues.setdefault(j.user, []).append(
                QueuedRun(
                    run_id=j.job_id,
                    user=j.user,
                    gpus=j.gpus,
                    gpu_model=j.gpu_model,
                    submit_s=j.submit_s,
                    est_duration_s=j.duration_s
                    if self.exact
                    else self.history.predict_duration(j.user, j.gpus),
                    preemptible=j.job_id in self.eligible,
                    spot=j.spot,
                )
            )
            self.queued += 1
            self.waiting_since[j.job_id] = t
        elif kind == _READY:
            inst = self.insts.get(key)
            if inst is not None and inst.state == "pending" and t >= inst.ready_at:
                self.cloud.mark_ready(key)
                inst.state = "running"
                if not inst.allocs:
                    inst.idle_since = t
                inst.snap = None
                self.fleet_stale = True
        elif kind == _START:
            j = self.by_id[key]
            if not self.exact:
                self.predict(key, t, t)
            self.running[j.user] = self.running.get(j.user, 0) + j.gpus
        elif kind == _END:
            seg = self.seg.get(key)
            if seg is None or seg[1] != t:
                return  # the segment was preempted before this end
            del self.seg[key]
            self.stopping.pop(key, None)  # it ended before its signal took effect
            self.left[key] = 0.0
            self.release(key, t)
            j = self.by_id[key]
            self.history.add(j.user, j.gpus, j.duration_s)  # known now that it ended
        elif kind == _REEST:
            if self.est_end.get(key) == t and key in self.seg:
                self.predict(key, self.seg[key][0], t)
        elif kind == _RELEASE:
            if self.stopping.get(key) == t:
                del self.stopping[key]
                self.requeue(key, t)
        elif kind == _WAKE:
            self.wakes.discard(t)

    def fleet(self) -> list[FleetInstance]:
        """Every instance's snapshot; the same list while none changed (most events leave
        the fleet as it was, and a long run asks for it hundreds of thousands of times)."""
        if self.fleet_stale:
            self.fleet_cache = [i.snapshot() for i in self.insts.values()]
            self.fleet_stale = False
        return self.fleet_cache

    def window(self) -> list[QueuedRun]:
        limit = self.cfg.scan_limit
        out: list[QueuedRun] = []
        for q in self.queues.values():
            out.extend(q[:limit])
        return out

    def tick(self, now: float) -> None:
        queue = self.window() if self.queued else []
        fleet = self.fleet()
        if not queue and not fleet and self.arrivals_left:
            return
        due = False
        if self.fair and self.cfg.preempt:
            slot = preempt_slot(now, self.cfg)
            due = slot > self.pslot
            if due:
                self.pslot = slot
            if (self.queued or any(i.allocs for i in self.insts.values())) and any(
                a.preemptible for i in self.insts.values() for a in i.allocs.values()
            ):
                # look again at the next slot even if nothing else happens by then, as
                # the worker's tick does (a due look, too, must book the next one), while
                # a run that could be moved runs (without one the look finds nothing)
                nxt = (self.pslot + 1) * self.cfg.preempt_period_s
                if nxt not in self.wakes:
                    self.wakes.add(nxt)
                    self.push(nxt, _WAKE, "")
        actions = decide(
            queue,
            fleet,
            now,
            catalog=self.catalog,
            config=self.cfg,
            usage=self.usage,
            more_expected=self.arrivals_left > 0,
            preempt_due=due,
        )
        if actions:
            if self.on_decision is not None:
                self.on_decision(now, list(actions))
            self.apply(actions, now)
            fleet = self.fleet()
            if any(isinstance(a, Preempt) for a in actions):
                # the window moved on and the shares changed: look again at once
                self.pslot -= 1
                self.push(now, _WAKE, "")
        wake = next_wakeup(fleet, self.cfg, queue, now)
        if wake is not None and wake > now and wake not in self.wakes:
            self.wakes.add(wake)
            self.push(wake, _WAKE, "")

    def apply(self, actions: list[Action], now: float) -> None:
        refs: dict[str, str] = {}
        cloud = self.cloud
        for a in actions:
            if isinstance(a, Place):
                self.place(a, refs, now)
            elif isinstance(a, Preempt):
                self.preempt(a.run_id, now)
            elif isinstance(a, Launch):
                if self.bought_already(a.for_run) or self.held_back(a.for_run, now):
                    continue
                iid = cloud.launch(a.instance_type, a.market)
                self.launched_for.setdefault(a.for_run, []).append(iid)
                t = self.catalog.get(a.instance_type)
                assert t is not None
                refs[a.ref] = iid
                ready = cloud.usable_at(iid)
                usd = t.hourly(a.market)
                self.fleet_stale = True
                self.insts[iid] = _Inst(
                    iid, t.instance_type, t.gpu_model, t.gpus, usd, a.market, "pending", ready
                )
                self.push(ready, _READY, iid)
            elif isinstance(a, Start):
                if self.bought_already(a.for_run) or self.held_back(a.for_run, now):
                    continue
                ready = cloud.start(a.instance_id)
                inst = self.insts[a.instance_id]
                self.fleet_stale = True
                inst.state, inst.ready_at, inst.stopped_since, inst.snap = (
                    "pending",
                    ready,
                    None,
                    None,
                )
                self.push(ready, _READY, inst.iid)
            elif isinstance(a, Stop | Terminate) and a.instance_id in self.owned:
                continue  # the team's own hosts stay up: nothing to save by stopping them
            elif isinstance(a, Stop):
                cloud.stop(a.instance_id)
                inst = self.insts[a.instance_id]
                if inst.allocs:
                    raise RuntimeError(f"scheduler stopped busy instance {inst.iid}")
                self.fleet_stale = True
                inst.state, inst.stopped_since, inst.idle_since, inst.snap = (
                    "stopped",
                    now,
                    None,
                    None,
                )
            elif isinstance(a, Terminate):
                inst = self.insts[a.instance_id]
                if inst.allocs:
                    raise RuntimeError(f"scheduler terminated busy instance {inst.iid}")
                cloud.terminate(a.instance_id)
                del self.insts[a.instance_id]
                self.fleet_stale = True

    def held_back(self, job_id: str, now: float) -> bool:
        """The burst gate (`BurstGate`, as the worker applies it): a run is bought cloud
        capacity only once it has waited long enough for the team's own; until then the
        Launch or Start is dropped, and the loop looks again when the gate opens."""
        if self.burst is None:
            return False
        since = self.waiting_since.get(job_id, now)
        if self.burst.open_for(now - since):
            return False
        at = self.burst.opens_at(since)
        if at is not None and at > now and at not in self.wakes:
            self.wakes.add(at)
            self.push(at, _WAKE, "")
        return True

    def bought_already(self, job_id: str) -> bool:
        """The worker's fleet buys for a run once: while the instances launched for it
        run (booting, or taken by another run since), it neither launches nor starts
        another for it (`bot.app.fleet.provision.Buyer.provision_run`)."""
        if not self.fair:
            return False
        insts = self.insts
        live = sum(
            1
            for iid in self.launched_for.get(job_id, ())
            if iid in insts and insts[iid].state != "stopped"
        )
        if not live:
            return False
        j = self.by_id[job_id]
        shape = run_shape(self.catalog, j.gpu_model, j.gpus)
        return shape is None or live >= shape[1]

    def predict(self, job_id: str, start: float, now: float) -> None:
        """Sets a running job's predicted end from the history (`RunHistory.predict_end`,
        its work before a preemption counted as attained) and wakes at it to step on."""
        j = self.by_id[job_id]
        done = j.duration_s - self.left[job_id]  # work of earlier segments: known
        resume = self.seg[job_id][2]
        end = self.history.predict_end(j.user, j.gpus, start + resume - done, now)
        self.est_end.pop(job_id, None)
        if end is not None:
            self.est_end[job_id] = end
            self.push(end, _REEST, job_id)
        for iid in self.placed_on[job_id]:
            inst = self.insts[iid]
            al = inst.allocs[job_id]
            inst.allocs[job_id] = Allocation(
                al.run_id,
                al.user,
                al.gpus,
                end,
                al.preemptible,
                al.stopping,
                al.started_s,
                al.attained_s,
            )
            inst.snap = None
            self.fleet_stale = True

    def release(self, job_id: str, t: float) -> None:
        """A job's GPUs go back (it ended or was preempted); emptied instances idle from t."""
        j = self.by_id[job_id]
        self.running[j.user] -= j.gpus
        for iid in self.placed_on.pop(job_id):
            inst = self.insts[iid]
            del inst.allocs[job_id]
            if not inst.allocs:
                inst.idle_since = t
            inst.snap = None
            self.fleet_stale = True

    def preempt(self, job_id: str, now: float) -> None:
        """Signals a running job to checkpoint and stop. Its GPUs stay held (and paid
        for) `stop_s` longer, then it goes back in line keeping the work its checkpoints
        saved (`kept_work`) and owing `resume_s` more on its next start."""
        seg = self.seg.get(job_id)
        if seg is None or seg[0] > now or job_id in self.stopping:
            raise RuntimeError(f"scheduler preempted {job_id}, which is not running")
        if job_id not in self.eligible:
            raise RuntimeError(f"scheduler preempted {job_id}, which does not checkpoint")
        self.preemptions += 1
        stop = self.world.stop_s
        if stop <= 0:
            self.requeue(job_id, now)
            return
        self.stopping[job_id] = now + stop
        for iid in self.placed_on[job_id]:
            inst = self.insts[iid]
            al = inst.allocs[job_id]
            inst.allocs[job_id] = Allocation(
                al.run_id,
                al.user,
                al.gpus,
                al.est_end_s,
                al.preemptible,
                True,
                al.started_s,
                al.attained_s,
            )
            inst.snap = None
            self.fleet_stale = True
        self.push(now + stop, _RELEASE, job_id)

    def requeue(self, job_id: str, now: float) -> None:
        """The preempted job's GPUs come back and it waits again in its place in line."""
        start, _, resume = self.seg.pop(job_id)
        j = self.by_id[job_id]
        # the same arithmetic as the checker's, on the row's own numbers
        w = self.world
        self.left[job_id] -= kept_work(now - w.stop_s - start - resume, w.checkpoint_every_s)
        self.release(job_id, now)
        rows = self.schedule[job_id]
        last = rows[-1]
        rows[-1] = ScheduledJob(
            last.job_id, last.user, last.instance_ids, last.submit_s, last.start_s, now, last.gpus
        )
        # back in its place in line (by submission): the user's queue stays sorted, and
        # with an overloaded trace it is long, so insert rather than sort
        bisect.insort(
            self.queues.setdefault(j.user, []),
            QueuedRun(
                run_id=j.job_id,
                user=j.user,
                gpus=j.gpus,
                gpu_model=j.gpu_model,
                submit_s=j.submit_s,
                est_duration_s=self.left[job_id] + self.cfg.resume_s
                if self.exact
                else self.history.expected_remaining(
                    j.user, j.gpus, j.duration_s - self.left[job_id]
                ),
                preemptible=True,
                attained_s=j.duration_s - self.left[job_id],
                spot=j.spot,
            ),
            key=lambda r: (r.submit_s, r.run_id),
        )
        self.queued += 1
        self.waiting_since[job_id] = now

    def place(self, a: Place, refs: dict[str, str], now: float) -> None:
        j = self.by_id[a.run_id]
        iids = tuple(refs.get(i, i) for i in a.instance_ids)
        if self.fair and any(i not in self.insts for i in iids):
            return  # on an instance the fleet did not buy (bought_already)
        insts = [self.insts[i] for i in iids]
        if a.gpus_per_instance * len(insts) != j.gpus:
            raise RuntimeError(f"scheduler split {j.job_id} wrongly")
        if a.run_id in self.stopping:
            return  # still checkpointing: the worker places it once poll has requeued it
        if self.fair and any(i.state != "running" for i in insts):
            # Booting or restarting: the worker starts runs on ready hosts only, so the run
            # stays in line and the decision when the instance is ready places it afresh
            # (tests/core/test_replay.py). The baselines model tools that bind a run to
            # the instance launched for it.
            return
        if a.run_id in self.seg:
            raise RuntimeError(f"scheduler placed {j.job_id}, which is running")
        start = max([now] + [i.ready_at for i in insts])
        resume = self.cfg.resume_s if j.job_id in self.schedule else 0.0
        end = start + self.left[j.job_id] + resume
        for inst in insts:
            used = sum(x.gpus for x in inst.allocs.values())
            if inst.gpus - used < a.gpus_per_instance and inst.state != "stopped":
                held = sum(x.gpus for x in inst.allocs.values() if x.stopping)
                if inst.gpus - used + held >= a.gpus_per_instance:
                    # GPUs a preempted run still holds: the worker's claim fails the same
                    # way and the run waits for a later tick
                    return
            if (
                inst.state == "stopped"
                or inst.gpus - used < a.gpus_per_instance
                or inst.model != j.gpu_model
            ):
                raise RuntimeError(f"scheduler over-committed {inst.iid} with {j.job_id}")
        for inst in insts:
            inst.allocs[j.job_id] = Allocation(
                j.job_id,
                j.user,
                a.gpus_per_instance,
                end if self.exact else None,
                preemptible=j.job_id in self.eligible,
                started_s=start,
                attained_s=j.duration_s - self.left[j.job_id],
            )
            inst.idle_since = None
            inst.snap = None
            self.fleet_stale = True
        self.placed_on[j.job_id] = iids
        q = self.queues[j.user]
        for idx, r in enumerate(q):
            if r.run_id == j.job_id:
                del q[idx]
                break
        self.queued -= 1
        self.schedule.setdefault(j.job_id, []).append(
            ScheduledJob(j.job_id, j.user, iids, j.submit_s, start, end, j.gpus)
        )
        self.seg[j.job_id] = (start, end, resume)
        if start > now:
            self.push(start, _START, j.job_id)
        else:
            self.running[j.user] = self.running.get(j.user, 0) + j.gpus
            if not self.exact:
                self.predict(j.job_id, start, now)
        self.push(end, _END, j.job_id)


# ---------------------------------------------------------------- figures


def paid_gpu_s(records: Sequence[InstanceRecord]) -> float:
    """GPU-seconds the instances were billed as running: launch to end, less the stopped
    stretches (the utilization's denominator, and the burst's cloud GPU-hours)."""
    paid = 0.0
    for r in records:
        end = r.end_s if r.end_s is not None else r.launch_s
        paid += r.gpus * ((end - r.launch_s) - sum(b - a for a, b in r.stopped))
    return paid


def nearest_rank(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _figures(
    policy: str,
    jobs: Sequence[TraceJob],
    schedule: Sequence[ScheduledJob],
    records: Sequence[InstanceRecord],
    catalog: Catalog,
    min_bill_s: float,
) -> SimResult:
    del min_bill_s
    total = sum(r.usd for r in records)
    per_gpu: dict[str, float] = {}
    for m in {j.gpu_model for j in jobs}:
        per_gpu[m] = min(t.ondemand_per_gpu_hr for t in catalog.for_model(m))
    ideal = sum(j.gpus * j.duration_s * per_gpu[j.gpu_model] / 3600.0 for j in jobs)
    # A preempted job has a row per segment: its queueing is all the time it was not
    # running, before its first start and between its segments.
    ran: dict[str, float] = {}
    last: dict[str, ScheduledJob] = {}
    for s in schedule:
        ran[s.job_id] = ran.get(s.job_id, 0.0) + (s.end_s - s.start_s)
        if s.job_id not in last or s.end_s > last[s.job_id].end_s:
            last[s.job_id] = s
    queue = [s.end_s - s.submit_s - ran[jid] for jid, s in last.items()]
    jct = [s.end_s - s.submit_s for s in last.values()]
    busy = sum(j.gpus * j.duration_s for j in jobs)
    paid = paid_gpu_s(records)
    n = len(last)
    makespan = (max(s.end_s for s in schedule) - min(s.submit_s for s in schedule)) if n else 0.0
    return SimResult(
        policy=policy,
        jobs=n,
        total_cost_usd=round(total, 4),
        ideal_cost_usd=round(ideal, 4),
        cost_efficiency=round(ideal / total, 6) if total > 0 else (1.0 if n else 0.0),
        avg_jct_s=round(sum(jct) / n, 3) if n else 0.0,
        avg_queue_s=round(sum(queue) / n, 3) if n else 0.0,
        p95_queue_s=round(nearest_rank(queue, 0.95), 3),
        gpu_utilization=round(busy / paid, 6) if paid > 0 else 0.0,
        makespan_s=round(makespan, 3),
    )
