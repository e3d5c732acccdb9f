"""The scheduler's vocabulary: what it is given (runs, instances, their allocations,
the knobs) and what it answers (actions), and the shape a run takes on the catalog.

Every other module of the package speaks these types, so they sit at the bottom and
import nothing of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Generic, Literal, TypeVar, overload

from provisioning.catalog import Catalog, InstanceType
from provisioning.costs import DEFAULT_COSTS

Market = Literal["ondemand", "spot"]


InstanceState = Literal["pending", "running", "stopped"]


POLICIES: tuple[str, ...] = ("fair", "per-job", "fifo")


DAY_S = 86400.0


# How long a rented instance with nothing on it is kept before it is stopped, unless the
# operator says otherwise: one default for the worker (`Settings.idle_stop_after`) and
# for `gpubot simulate`, so the simulator measures the fleet a team actually runs. Longer
# than the ski-rental break-even of `SchedulerConfig.idle_stop_after()` (two minutes with
# the default costs) on purpose: people come back to an instance between runs and
# reservations within minutes, and a restart makes them wait for it.
IDLE_STOP_S = 15 * 60.0


_T = TypeVar("_T")


class cached_property(Generic[_T]):
    """`functools.cached_property` without its per-instance lock (Python < 3.12).

    A decision reads an instance's summaries (free GPUs, holders, horizon) hundreds of
    thousands of times in a long simulation, and the lock made the first read of each
    cost several times the work. A plain non-data descriptor: the value lands in the
    instance's __dict__, which later reads find first. Frozen dataclasses allow it, as
    they do for the functools one (it writes __dict__ directly)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> cached_property[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _T | cached_property[_T]:
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


@dataclass(frozen=True)
class QueuedRun:
    """A training run waiting for GPUs."""

    run_id: str  # stable id (db primary key or trace job_id)
    user: str  # who pays for it and whose fair share it draws on
    gpus: int  # GPUs it needs in total (> one instance's count means multi-host)
    gpu_model: str  # canonical catalog model, e.g. "A100"
    submit_s: float  # when it was queued, seconds on the caller's clock
    est_duration_s: float | None = None  # the user's time limit / estimate, None = unknown
    priority: int = 0  # explicit nudge, higher first (like a Slurm QOS)
    spot: bool = False  # may run on spot capacity (it checkpoints and resumes)
    preemptible: bool = False  # it checkpoints on SIGTERM, so it may be moved once running
    attained_s: float = 0.0  # how long it has run already (resumed after a preemption)


@dataclass(frozen=True)
class Allocation:
    """GPUs of one instance held by one run (placed, possibly not started yet)."""

    run_id: str
    user: str
    gpus: int  # GPUs on THIS instance
    est_end_s: float | None  # when the run is expected to free them; None = unknown
    preemptible: bool = False  # it checkpoints on SIGTERM and resumes when requeued
    stopping: bool = False  # told to stop (preempted, interrupted): its GPUs come back soon
    started_s: float | None = None  # when it (last) started here; None = long ago
    attained_s: float = 0.0  # how long it ran before this start (earlier segments)


@dataclass(frozen=True)
class FleetInstance:
    """An instance we pay for (or hold stopped)."""

    instance_id: str
    instance_type: str  # catalog name
    gpu_model: str  # canonical model
    gpus: int  # GPUs on the instance
    usd_hr: float  # what it costs per hour while running (on-demand or spot price)
    market: Market
    state: InstanceState  # pending = launched or restarting, not usable before ready_at_s
    ready_at_s: float  # pending: when it will be usable; running: when it became usable
    allocations: tuple[Allocation, ...] = ()
    idle_since_s: float | None = None  # running with no allocations: since when
    stopped_since_s: float | None = None  # stopped: since when
    # One of the team's own machines (a static host, this machine): never stopped or
    # terminated by the scheduler, and nothing to buy.
    owned: bool = False

    @cached_property
    def used_gpus(self) -> int:
        return sum(a.gpus for a in self.allocations)

    @cached_property
    def free_gpus(self) -> int:
        return self.gpus - self.used_gpus

    @cached_property
    def releases(self) -> tuple[tuple[float, int], ...]:
        """(expected end, GPUs) of the known-end allocations, soonest first."""
        return tuple(
            sorted((a.est_end_s, a.gpus) for a in self.allocations if a.est_end_s is not None)
        )

    @cached_property
    def free_after_releases(self) -> tuple[int, ...]:
        """Free GPUs once each of `releases` has happened, in their order (cumulative)."""
        free, out = self.free_gpus, []
        for _, g in self.releases:
            free += g
            out.append(free)
        return tuple(out)

    @cached_property
    def latest_end(self) -> float:
        """The last known expected end of its allocations (-inf without one)."""
        ends = [a.est_end_s for a in self.allocations if a.est_end_s is not None]
        return max(ends) if ends else -math.inf

    @cached_property
    def unknown_end_gpus(self) -> int:
        return sum(a.gpus for a in self.allocations if a.est_end_s is None)

    # Summaries the preemption pass reads on every decision; cached per snapshot, which
    # the simulator reuses while an instance does not change.
    @cached_property
    def holders(self) -> dict[str, int]:
        """GPUs per user, of allocations not already stopping."""
        out: dict[str, int] = {}
        for a in self.allocations:
            if not a.stopping:
                out[a.user] = out.get(a.user, 0) + a.gpus
        return out

    @cached_property
    def stopping_gpus(self) -> int:
        return sum(a.gpus for a in self.allocations if a.stopping)

    @cached_property
    def run_ids(self) -> frozenset[str]:
        return frozenset(a.run_id for a in self.allocations)

    @cached_property
    def pinned(self) -> bool:
        """Holds a run that cannot be moved, so consolidation can never empty it."""
        return any(not a.preemptible for a in self.allocations)

    @cached_property
    def preemptible_users(self) -> frozenset[str]:
        return frozenset(a.user for a in self.allocations if a.preemptible and not a.stopping)


@dataclass(frozen=True)
class Place:
    """Run `run_id` on these instances (ids or Launch refs), `gpus_per_instance` on each.

    It starts once every instance is usable (at once on running ones)."""

    run_id: str
    instance_ids: tuple[str, ...]
    gpus_per_instance: int


@dataclass(frozen=True)
class Launch:
    """Launch a new instance; `ref` names it for Place actions of the same decision."""

    ref: str
    instance_type: str
    market: Market
    for_run: str  # the run that justified it (for tags and the audit trail)


@dataclass(frozen=True)
class Start:
    instance_id: str
    for_run: str


@dataclass(frozen=True)
class Preempt:
    """Stop `run_id` with a checkpoint (SIGTERM; it exits 75) and put it back in line.

    Its GPUs go to `for_run`, whose user is below a fair share of the quota while the
    preempted run's user is above theirs. The run resumes from the checkpoint later."""

    run_id: str
    for_run: str


@dataclass(frozen=True)
class Stop:
    instance_id: str


@dataclass(frozen=True)
class Terminate:
    instance_id: str


Action = Place | Launch | Start | Stop | Terminate | Preempt


# How long a run may wait for the team's own GPUs before the cloud is offered
# (GPUBOT_BURST_AFTER's default, issue 37).
BURST_AFTER_S = 15 * 60.0


@dataclass(frozen=True)
class BurstGate:
    """When a run that waits for the team's own GPUs may be bought cloud capacity: once
    it has waited `after_s` (0: at once, as a cloud-only pool buys); never when `after_s`
    is None. One rule for the worker and the simulator, so the threshold the simulator
    prices is the one the bot applies. The scheduler proposes a Launch or Start as soon
    as nothing owned fits; the gate holds it back until the wait is long enough."""

    after_s: float | None = BURST_AFTER_S

    def open_for(self, waited_s: float) -> bool:
        return self.after_s is not None and waited_s >= self.after_s

    def opens_at(self, waiting_since_s: float) -> float | None:
        """When a run waiting since then may be bought for; None: never."""
        return None if self.after_s is None else waiting_since_s + self.after_s


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the policies; every default is argued from the cost model, not a trace."""

    policy: str = "fair"
    max_gpus: int = 256  # quota: GPUs of instances not stopped, at once
    # The cloud's lifecycle costs: one declaration (provisioning.costs) for all readers.
    boot_s: float = DEFAULT_COSTS.boot_s  # launch -> SSH-ready
    setup_s: float = DEFAULT_COSTS.setup_s  # bootstrap of a fresh instance
    start_s: float = DEFAULT_COSTS.start_s  # restart of a stopped instance -> usable
    min_bill_s: float = DEFAULT_COSTS.min_bill_s  # minimum billed seconds per start
    ebs_usd_s: float = DEFAULT_COSTS.storage_usd_per_s  # a stopped instance's storage, USD/s
    half_life_s: float = 7 * DAY_S  # Slurm's PriorityDecayHalfLife default
    max_age_s: float = 7 * DAY_S  # Slurm's PriorityMaxAge default
    w_fairshare: float = 1.0  # fair share dominates, as Slurm sites usually weigh it
    w_age: float = 0.5  # a week of waiting is worth half the fair-share range
    w_priority: float = 0.1  # per priority level
    wait_value: float = 1.0  # a GPU-second of waiting is worth this many GPU-seconds of price
    scan_limit: int = 16  # runs per user looked at per decision (cf. Slurm's
    # bf_max_job_user); deeper costs time on every event and rarely finds a better fit
    wait_scan: int = 64  # waiting runs per GPU model whose wait is estimated for provisioning
    peer_window_s: float | None = None  # one user's runs queued this close are equals;
    # None: boot_s + setup_s, the time one provisioning takes, below which the scheduler
    # could not have served them apart anyway
    peer_scan: int = 32  # how far down the order to look for a better-packing equal
    unknown_duration_s: float = DAY_S  # estimate for runs without one (a common time limit)
    idle_stop_s: float | None = None  # None: derived, see idle_stop_after()
    terminate_after_s: float | None = None  # None: derived, see terminate_after()
    fixed_fleet: tuple[tuple[str, int], ...] = ()  # fifo: (instance type, count)
    preempt: bool = True  # fair: reclaim GPUs for users below their fair share
    preempt_after_s: float | None = None  # a run waits this long before it may preempt;
    # None: boot_s + setup_s, one provisioning time (a run that ends or an instance that
    # comes within it is cheaper than a preemption)
    preempt_scan: int = 4  # claimants (of distinct user and size) that may search for
    # victims in vain per decision; the next decision, after the next event, goes on
    preempt_period_s: float = 300.0  # callers pass preempt_due once per period: moving
    # runs is a slow decision (runs wait preempt_after() first, and stay put for
    # preempt_exempt()), so a look every 5 minutes loses little and costs little
    preempt_group: int = 16  # claimants per user and shape considered per decision
    las_after_s: float | None = None  # runs that ran this long may be preempted for any
    # run that waits (least attained service, see preemption); None: off, as where run
    # times are known (`--estimates exact`); without them, LAS_AFTER_S
    pin_cost: float = 1.0  # weight of the instance-time a run that cannot be moved pins
    # on an instance of movable runs (0: ignored); in a world where every run
    # checkpoints nothing pins, so it changes nothing there
    resume_s: float = 300.0  # what a preemption costs the preempted run: the checkpoint
    # write on SIGTERM, a process start and the reload on resume, on its GPUs (5 min is
    # generous for one GPU's state; the simulator charges it on every resume)

    def peer_window(self) -> float:
        if self.peer_window_s is not None:
            return self.peer_window_s
        return self.boot_s + self.setup_s

    def preempt_after(self) -> float:
        if self.preempt_after_s is not None:
            return self.preempt_after_s
        return self.boot_s + self.setup_s

    def preempt_exempt(self) -> float:
        """How long a run runs, once (re)started, before it may be moved again.

        Slurm's PreemptExemptTime, derived: every move costs the run `resume_s`, so ten
        of those keep the overhead at 10% of its time however busy the fleet is; and never
        less than preempt_after(), so a decision cannot undo the one before it."""
        return max(self.preempt_after(), 10.0 * self.resume_s, 1.0)

    def idle_stop_after(self) -> float:
        """Stop an idle instance after it has idled as long as a stop/restart costs.

        Ski rental: a restart bills max(start_s, min_bill_s) and delays the next run by
        start_s (worth wait_value of the same price), so idling that long first is
        2-competitive. The price cancels out, which is why it holds for every type."""
        if self.idle_stop_s is not None:
            return self.idle_stop_s
        return max(self.start_s, self.min_bill_s) + self.wait_value * self.start_s

    def terminate_after(self, usd_hr: float) -> float:
        """Terminate a stopped instance once its storage bill has matched what keeping it
        saves the next time: a relaunch instead of a restart costs boot+setup-start more
        billing and as much more waiting."""
        if self.terminate_after_s is not None:
            return self.terminate_after_s
        extra = max(0.0, self.boot_s + self.setup_s - self.start_s)
        saved_usd = (1.0 + self.wait_value) * extra * usd_hr / 3600.0
        return saved_usd / self.ebs_usd_s if self.ebs_usd_s > 0 else math.inf


# Without known run times, a run that has run an hour goes to the long queue of least
# attained service: past a small team's 90th percentile of run times (about 75 minutes),
# and two checkpoint periods of the usual half hour, so a move loses at most one.
LAS_AFTER_S = 3600.0


def run_shape(catalog: Catalog, model: str, gpus: int) -> tuple[InstanceType, int, int] | None:
    """(type, k hosts, GPUs per host) to launch for a run; one host when it fits on one.

    Single host: the cheapest type with enough GPUs. Multi-host: the type with the most
    GPUs (cheapest among those), the smallest k dividing the run evenly."""
    single = catalog.cheapest(model, gpus)
    if single is not None:
        return single, 1, gpus
    types = catalog.for_model(model)
    if not types:
        return None
    most = max(t.gpus for t in types)
    big = min((t for t in types if t.gpus == most), key=lambda t: t.ondemand_usd_hr)
    k = split_hosts(gpus, big.gpus)
    return big, k, gpus // k


def split_hosts(gpus: int, per_host_max: int) -> int:
    """Smallest k >= ceil(gpus / per_host_max) with gpus divisible by k."""
    k = max(1, -(-gpus // per_host_max))
    while gpus % k:
        k += 1
    return k


def est(run: QueuedRun, config: SchedulerConfig) -> float:
    e = run.est_duration_s
    return config.unknown_duration_s if e is None else max(0.0, e)


def market_of(run: QueuedRun) -> Market:
    return "spot" if run.spot else "ondemand"


cached_shape = lru_cache(maxsize=4096)(run_shape)  # run_shape is pure; decide asks it per run


@lru_cache(maxsize=256)
def gpu_price(catalog: Catalog, model: str, market: Market) -> float:
    """What one GPU of `model` costs an hour at least (the cheapest per-GPU price in
    `market`): the rate at which waiting for one is valued, whatever size is bought."""
    return min((t.gpu_hourly(market) for t in catalog.for_model(model)), default=0.0)


@lru_cache(maxsize=256)
def min_gpus(catalog: Catalog, model: str) -> int:
    """GPUs of the smallest instance of a model: less headroom than this launches nothing."""
    return min((t.gpus for t in catalog.for_model(model)), default=0)
