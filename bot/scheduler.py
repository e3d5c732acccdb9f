"""The scheduler: given the queue, the fleet and the time, what to do next.

Pure on purpose. The same `decide` runs inside the worker (inputs loaded from the
database, clock = the system clock) and inside `gpubot simulate` (inputs from a trace,
clock = virtual), so what the simulator measures is what production does. No I/O, no
clock reads, no randomness: equal inputs give equal actions.

Policies (``SchedulerConfig.policy``):

``fair`` — the product.
  * Order: a Slurm-multifactor-like score per run, ``w_fairshare * F + w_priority *
    priority + w_age * min(age / max_age, 1)`` with ``F = 2 ** (-N * u / U)`` (u: the
    user's decayed GPU-seconds, U: everybody's, N: users with usage or queued runs; the
    classic Slurm fair-share factor with equal shares). The queue is a merge of the
    users' own queues (each in ``(-priority, submit, id)`` order) by their head's score,
    as Slurm's Fair Tree ranks users first and then their jobs; age raises a run's
    score up to max_age, so a heavy user's old run overtakes a light user's new one and
    nothing starves. Among equals — one user's runs of one shape and priority, queued
    within ``peer_window()`` (one provisioning time) of each other, as a sweep is — the
    one that packs best goes first: their order is not the user's intent, and the fit
    decides how long an instance stays paid for.
  * Placement on the warm fleet first (running, then booting instances), choosing the
    instance that adds the least paid instance-time (``gpus * max(0, run_end -
    instance_horizon)``) — short runs fill the gaps beside long ones, long runs share
    instances with runs that end at about the same time, so a draining fleet does not
    keep an 8-GPU instance alive for one run.
  * EASY backfill: the first run that cannot be placed (the head) gets a reservation:
    the earliest time the warm fleet has room for it, by the runs' estimated ends, on
    the instances it would use. A later run may start only where it does not touch that
    reservation: on other instances, on GPUs the head leaves spare, or ending before it.
  * Provisioning by the cost model: runs that must wait are bundled onto a restarted
    stopped instance (cheaper, faster) or a new one; the bundle is provisioned only if
    the waiting it saves, valued at ``wait_value`` times the GPUs' own price, beats what
    the provisioning costs: the boot (or restart) billing plus the GPUs of the new
    instance that the bundle leaves empty for its duration (the pessimistic "nobody else
    comes" case). No constant fitted to a trace.
  * Idle stop and terminate, as ski rental (see ``SchedulerConfig.idle_stop_after``).
  * Preemption of runs that checkpoint (``Preempt``, once per ``preempt_period_s``):
    fair-share reclaim and defragmentation for runs the quota keeps out, and
    consolidation of a draining fleet so whole instances stop (`PreemptionPlanner`).

``per-job`` — what a launch-per-job tool does: each run, in submit order, gets its own
instance(s) of the cheapest type that fits it; an instance is terminated once its run ends.

``fifo`` — a plain cluster: a fixed fleet (``fixed_fleet``) launched once and kept on,
runs started strictly in submit order, none overtaking a blocked head.

Runs larger than one instance use ``k`` instances of one type with ``gpus / k`` each
(the smallest such k), started together.

Estimated durations (``QueuedRun.est_duration_s``) are the user's time limit; backfill
and packing use them the way Slurm uses time limits. Unknown ones count as
``unknown_duration_s``.

Decide looks at each user's first ``scan_limit`` runs (in ``(-priority, submit_s,
run_id)`` order; the baselines at the first ``scan_limit`` by submission), so callers
with long queues may pass just those, with the same result.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import groupby, islice
from operator import attrgetter
from typing import Literal

from provisioning.catalog import Catalog, InstanceType

Market = Literal["ondemand", "spot"]
InstanceState = Literal["pending", "running", "stopped"]
POLICIES: tuple[str, ...] = ("fair", "per-job", "fifo")
DAY_S = 86400.0


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


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the policies; every default is argued from the cost model, not a trace."""

    policy: str = "fair"
    max_gpus: int = 256  # quota: GPUs of instances not stopped, at once
    boot_s: float = 120.0  # launch -> SSH-ready
    setup_s: float = 300.0  # bootstrap of a fresh instance
    start_s: float = 60.0  # restart of a stopped instance -> usable
    min_bill_s: float = 60.0  # minimum billed seconds per start
    ebs_usd_s: float = 500 * 0.08 / (730 * 3600)  # a stopped instance's storage, USD/s
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


# ---------------------------------------------------------------- fair-share state


def decay_usage(
    usage: Mapping[str, float], running: Mapping[str, int], dt: float, half_life_s: float
) -> dict[str, float]:
    """Advances decayed GPU-seconds by dt while `running[user]` GPUs ran throughout.

    Exact for a constant rate: u' = u * 2^(-dt/h) + g * h/ln2 * (1 - 2^(-dt/h)). The worker
    and the simulator both keep usage with this, so they agree with each other."""
    if dt <= 0:
        return dict(usage)
    f = 2.0 ** (-dt / half_life_s)
    acc = half_life_s / math.log(2.0) * (1.0 - f)
    out = {u: v * f for u, v in usage.items()}
    for user, g in running.items():
        if g:
            out[user] = out.get(user, 0.0) + g * acc
    return out


def fairshare_factors(users: Iterable[str], usage: Mapping[str, float]) -> dict[str, float]:
    """Slurm's classic factor 2^(-usage_share / fair_share) with equal shares."""
    names = set(users) | {u for u, v in usage.items() if v > 0}
    total = sum(usage.get(u, 0.0) for u in names)
    if not names:
        return {}
    n = len(names)
    if total <= 0:
        return dict.fromkeys(names, 1.0)
    return {u: 2.0 ** (-n * usage.get(u, 0.0) / total) for u in names}


_submit_key = attrgetter("submit_s", "run_id")
_user_key = attrgetter("user")
_priority_key = attrgetter("priority")


def order_queue(
    queue: Sequence[QueuedRun], now: float, usage: Mapping[str, float], config: SchedulerConfig
) -> list[QueuedRun]:
    """The fair order (each user's first scan_limit runs): users' queues merged by head score."""
    return list(iter_order(queue, now, usage, config))


def iter_order(
    queue: Sequence[QueuedRun], now: float, usage: Mapping[str, float], config: SchedulerConfig
) -> Iterator[QueuedRun]:
    """Lazy `order_queue`: a decision that runs out of room stops pulling runs."""
    return iter(_Ordering(queue, now, usage, config))


class _Ordering:
    """The fair order of a queue, pulled lazily; `key` ranks runs the same way."""

    def __init__(
        self,
        queue: Sequence[QueuedRun],
        now: float,
        usage: Mapping[str, float],
        config: SchedulerConfig,
    ) -> None:
        # C-keyed sorts + groupby: this runs on every decision over the whole window
        self.by_user = {u: list(g) for u, g in groupby(sorted(queue, key=_user_key), key=_user_key)}
        self.factors = fairshare_factors(self.by_user, usage)
        self.usage = usage
        for runs in self.by_user.values():
            runs.sort(key=_submit_key)
            runs.sort(key=_priority_key, reverse=True)
            del runs[config.scan_limit :]
        prios = {r.priority for r in queue}
        # With one priority level the merge is a plain sort by `key` (score falls with
        # submit time within a user), so a subset can be ordered directly.
        self.uniform = len(prios) <= 1
        self.now = now
        self.config = config

    def key(self, run: QueuedRun) -> tuple[float, float, float, str, str]:
        c = self.config
        age = min(max(0.0, self.now - run.submit_s) / c.max_age_s, 1.0) if c.max_age_s > 0 else 1.0
        score = (
            c.w_fairshare * self.factors.get(run.user, 1.0)
            + c.w_priority * run.priority
            + c.w_age * age
        )
        # Raw usage breaks ties of the score: the factor rounds to 1.0 for tiny shares,
        # and less recent usage must still go first among equals.
        return (-score, self.usage.get(run.user, 0.0), run.submit_s, run.run_id, run.user)

    def runs(self) -> Iterator[QueuedRun]:
        for runs in self.by_user.values():
            yield from runs

    def __iter__(self) -> Iterator[QueuedRun]:
        by_user, key = self.by_user, self.key
        heads = [key(runs[0]) for runs in by_user.values()]
        heapq.heapify(heads)
        pos = dict.fromkeys(by_user, 0)
        while heads:
            user = heads[0][-1]
            runs = by_user[user]
            i = pos[user]
            yield runs[i]
            i += 1
            pos[user] = i
            if i < len(runs):
                heapq.heapreplace(heads, key(runs[i]))
            else:
                heapq.heappop(heads)


class _Lazy:
    """A list filled from an iterator on demand (look-ahead for the peer choice)."""

    def __init__(self, it: Iterator[QueuedRun], limit: int) -> None:
        self._it = islice(it, limit)
        self.items: list[QueuedRun] = []

    def get(self, i: int) -> QueuedRun | None:
        items = self.items
        while len(items) <= i:
            nxt = next(self._it, None)
            if nxt is None:
                return None
            items.append(nxt)
        return items[i]


# ---------------------------------------------------------------- shapes and profiles


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


def _est(run: QueuedRun, config: SchedulerConfig) -> float:
    e = run.est_duration_s
    return config.unknown_duration_s if e is None else max(0.0, e)


class _Slot:
    """Mutable view of one instance during a decision."""

    __slots__ = ("free", "gpus", "horizon", "inst", "placed", "ready", "ref", "type_name", "usd_hr")

    def __init__(
        self,
        inst: FleetInstance | None,
        ref: str,
        gpus: int,
        ready: float,
        usd_hr: float,
        type_name: str,
        free: int,
        horizon: float,
    ) -> None:
        self.inst = inst
        self.ref = ref
        self.gpus = gpus
        self.ready = ready
        self.usd_hr = usd_hr
        self.type_name = type_name
        self.free = free
        self.horizon = horizon  # latest expected end of what it holds
        self.placed: list[tuple[float, int]] = []  # (end, GPUs) placed in this decision


def _free_at_profile(
    inst: FleetInstance, config: SchedulerConfig, now: float
) -> list[tuple[float, int]]:
    """(time, free GPUs from then on) steps from the allocations' expected ends."""
    free = inst.free_gpus
    start = max(now, inst.ready_at_s)
    steps = [(start, free)]
    rel: Iterable[tuple[float, int]] = inst.releases
    if inst.unknown_end_gpus:
        rel = sorted([*rel, (now + config.unknown_duration_s, inst.unknown_end_gpus)])
    for end, g in rel:
        free += g
        if end <= start:
            steps[-1] = (start, free)
        elif steps[-1][0] == end:
            steps[-1] = (end, free)
        else:
            steps.append((end, free))
    return steps


def _horizon(inst: FleetInstance, config: SchedulerConfig, now: float) -> float:
    h = max(now, inst.ready_at_s)
    if inst.releases:
        h = max(h, inst.releases[-1][0])
    if inst.unknown_end_gpus:
        h = max(h, now + config.unknown_duration_s)
    return h


def _earliest(profile: list[tuple[float, int]], need: int, dur: float) -> float:
    """Earliest t with free >= need during [t, t + dur) on a step profile."""
    n = len(profile)
    for i in range(n):
        t, f = profile[i]
        if f < need:
            continue
        ok = True
        for j in range(i + 1, n):
            tj, fj = profile[j]
            if tj >= t + dur:
                break
            if fj < need:
                ok = False
                break
        if ok:
            return t
    return math.inf


def _reserve(profile: list[tuple[float, int]], t0: float, t1: float, need: int) -> None:
    """Takes `need` GPUs off the profile during [t0, t1)."""
    times = [p[0] for p in profile]
    for t in (t0, t1):
        if t == math.inf or t in times:
            continue
        prev = max((p for p in profile if p[0] < t), key=lambda p: p[0], default=None)
        profile.append((t, prev[1] if prev else 0))
        times.append(t)
    profile.sort()
    for i, (t, f) in enumerate(profile):
        if t0 <= t < t1:
            profile[i] = (t, f - need)


# ---------------------------------------------------------------- decide


def decide(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    *,
    catalog: Catalog,
    config: SchedulerConfig,
    usage: Mapping[str, float] | None = None,
    more_expected: bool = True,
    preempt_due: bool = True,
) -> list[Action]:
    """Actions to take now. Execute them in order: Launch refs are used by later Places.

    `preempt_due`: whether this decision may preempt (fair); callers say so once per
    `preempt_period_s` (`preempt_slot`). `usage`: decayed GPU-seconds per user as of `now` (see decay_usage). `more_expected`:
    False when no further runs can arrive (the simulator's end of trace), which lets
    fifo release its fixed fleet."""
    if config.policy == "fair":
        return _decide_fair(queue, fleet, now, catalog, config, usage or {}, preempt_due)
    if config.policy == "per-job":
        return _decide_per_job(queue, fleet, now, catalog, config)
    if config.policy == "fifo":
        return _decide_fifo(queue, fleet, now, catalog, config, more_expected)
    raise ValueError(f"unknown policy {config.policy!r}; choose one of {', '.join(POLICIES)}")


def preempt_slot(now: float, config: SchedulerConfig) -> int:
    """Which preemption period `now` falls in; a caller passes preempt_due=True to the
    first decision of each slot (the worker and the simulator alike)."""
    period = config.preempt_period_s
    return int(now // period) if period > 0 else int(now * 1e6)


def next_wakeup(
    fleet: Sequence[FleetInstance],
    config: SchedulerConfig,
    queue: Sequence[QueuedRun] = (),
    now: float | None = None,
) -> float | None:
    """When decide would act by itself: idle stop / terminate timers, and the moment the
    next waiting run has waited long enough to preempt (given `queue` and `now`)."""
    if config.policy != "fair":
        return None
    best: float | None = None
    if config.preempt and queue and now is not None:
        after = config.preempt_after()
        due = [r.submit_s + after for r in queue if r.submit_s + after > now]
        if due:
            best = min(due)
    idle = config.idle_stop_after()
    for inst in fleet:
        t: float | None = None
        if inst.state == "running" and not inst.allocations and inst.idle_since_s is not None:
            t = inst.idle_since_s + idle
        elif inst.state == "stopped" and inst.stopped_since_s is not None:
            t = inst.stopped_since_s + config.terminate_after(inst.usd_hr)
        if t is not None and t != math.inf and (best is None or t < best):
            best = t
    return best


def _market(run: QueuedRun) -> Market:
    return "spot" if run.spot else "ondemand"


def _committed(fleet: Iterable[FleetInstance]) -> int:
    return sum(i.gpus for i in fleet if i.state != "stopped")


def _decide_fair(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
    usage: Mapping[str, float],
    preempt_due: bool = True,
) -> list[Action]:
    actions = _place_fair(queue, fleet, now, catalog, config, usage)
    if not (config.preempt and preempt_due):
        return actions
    actions.extend(PreemptionPlanner(fleet, actions, now, catalog, config).plan(queue, usage))
    return actions


_shape = lru_cache(maxsize=4096)(run_shape)  # run_shape is pure; decide asks it per run


def _place_fair(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
    usage: Mapping[str, float],
) -> list[Action]:
    actions: list[Action] = []
    idle_after = config.idle_stop_after()
    stopped_now: set[str] = set()
    # Idle management first: a stopped instance frees quota for this same decision.
    for inst in fleet:
        if inst.state == "running" and not inst.allocations:
            since = inst.idle_since_s if inst.idle_since_s is not None else now
            if now - since >= idle_after:
                actions.append(Stop(inst.instance_id))
                stopped_now.add(inst.instance_id)
        elif inst.state == "stopped":
            since = inst.stopped_since_s if inst.stopped_since_s is not None else now
            if now - since >= config.terminate_after(inst.usd_hr):
                actions.append(Terminate(inst.instance_id))
                stopped_now.add(inst.instance_id)
    if not queue:
        return actions
    stopped = [i for i in fleet if i.state == "stopped" and i.instance_id not in stopped_now]
    warm = [i for i in fleet if i.state != "stopped" and i.instance_id not in stopped_now]
    headroom = config.max_gpus - sum(i.gpus for i in warm)
    if headroom > 0:
        smallest = min((_min_gpus(catalog, m) for m in {r.gpu_model for r in queue}), default=0)
    else:
        smallest = 1  # at the quota nothing can be provisioned, whatever the models
    if not any(i.free_gpus for i in warm) and (headroom < smallest or smallest == 0):
        return actions  # nothing can start and nothing can be provisioned

    slots: dict[tuple[str, str], list[_Slot]] = {}  # (model, market) -> slots
    for inst in warm:
        horizon = _horizon(inst, config, now)
        slots.setdefault((inst.gpu_model, inst.market), []).append(
            _Slot(
                inst,
                inst.instance_id,
                inst.gpus,
                max(now, inst.ready_at_s),
                inst.usd_hr,
                inst.instance_type,
                inst.free_gpus,
                horizon,
            )
        )
    ordering = _Ordering(queue, now, usage, config)
    ordered = _Lazy(iter(ordering), len(queue))
    can_provision = headroom >= smallest or any(i.gpus <= headroom for i in stopped)
    gfree = {key: sum(s.free for s in group) for key, group in slots.items()}

    # Pass 1: the warm fleet, with an EASY reservation for the first run that waits.
    head_t = math.inf
    head_extra: dict[str, int] = {}  # instance ref -> GPUs the head leaves spare at head_t
    have_head = False
    head_key: tuple[str, str] | None = None
    head_todo: tuple[QueuedRun, float] | None = None  # reservation computed on first need
    waiting: list[QueuedRun] = []
    done: set[str] = set()
    failed: dict[tuple[tuple[str, str], int], float] = {}
    peer_window = config.peer_window()
    i = 0
    tot_free = sum(gfree.values())
    unknown = config.unknown_duration_s
    bound_checked = False
    while (run := ordered.get(i)) is not None:
        if run.run_id in done:
            i += 1
            continue
        if tot_free <= 0 and not can_provision:
            break  # no room left and none to be made: the rest of the queue waits
        key = (run.gpu_model, "spot" if run.spot else "ondemand")
        dur = unknown if run.est_duration_s is None else run.est_duration_s
        # A run that did not fit makes every later run of its shape and no shorter
        # duration fail too (free GPUs and the head's spare only shrink): skip them.
        shape_key = (key, run.gpus)
        if gfree.get(key, 0) < run.gpus or dur >= failed.get(shape_key, math.inf):
            if can_provision:
                waiting.append(run)
            i += 1
            if not have_head:
                have_head = True
                head_key = key
                head_todo = (run, dur)
            elif not can_provision and not bound_checked:
                bound_checked = True
                if head_todo is not None and head_key is not None:
                    head_t, head_extra = _reservation(
                        head_todo[0], head_todo[1], slots.get(head_key, []), now, config
                    )
                    head_todo = None
                cands = _backfill_candidates(
                    ordering, ordered, slots, gfree, head_key, head_t, head_extra, unknown
                )
                if not cands:
                    break
                if ordering.uniform:
                    ordered, i = _Lazy(iter(sorted(cands, key=ordering.key)), len(cands)), 0
            continue
        group = slots.get(key, [])
        if head_todo is not None and key == head_key:
            head_t, head_extra = _reservation(head_todo[0], head_todo[1], group, now, config)
            head_todo = None
        chosen = _best_fit(run, dur, group, now, config, have_head, head_t, head_extra)
        if chosen is None:
            failed[shape_key] = dur
        pick = run
        if chosen is not None and chosen[2] > 0 and peer_window > 0:
            # Among equals (same user, shape and priority, queued together, as a sweep
            # is), the one that packs best goes first: the user's order among them is
            # not an intent, and a worse fit keeps an instance paid for longer.
            for j in range(i + 1, i + 1 + config.peer_scan):
                peer = ordered.get(j)
                if peer is None:
                    break
                if (
                    peer.run_id in done
                    or peer.user != run.user
                    or peer.gpus != run.gpus
                    or peer.priority != run.priority
                    or peer.gpu_model != run.gpu_model
                    or peer.spot != run.spot
                    or abs(peer.submit_s - run.submit_s) > peer_window
                ):
                    continue
                pdur = _est(peer, config)
                if pdur >= failed.get(shape_key, math.inf):
                    continue
                alt = _best_fit(peer, pdur, group, now, config, have_head, head_t, head_extra)
                if alt is not None and alt[2] < chosen[2]:
                    pick, chosen = peer, alt
        if chosen is not None:
            hosts, per, _ = chosen
            pdur = _est(pick, config)
            start = max(h.ready for h in hosts)
            for s in hosts:
                s.free -= per
                s.horizon = max(s.horizon, start + pdur)
                s.placed.append((start + pdur, per))
                if have_head and s.ref in head_extra and start + pdur > head_t:
                    head_extra[s.ref] -= per
            actions.append(Place(pick.run_id, tuple(s.ref for s in hosts), per))
            gfree[key] -= per * len(hosts)
            tot_free -= per * len(hosts)
            done.add(pick.run_id)
            if pick is run:
                i += 1
            continue
        if can_provision:
            waiting.append(run)
        done.add(run.run_id)
        i += 1
        if not have_head:
            # The reservation only guards the head's own instances, so only runs of its
            # model and market need it; it is computed when the first such run comes.
            have_head = True
            head_key = key
            head_todo = (run, dur)
        elif not can_provision and not bound_checked and head_todo is None:
            bound_checked = True
            cands = _backfill_candidates(
                ordering, ordered, slots, gfree, head_key, head_t, head_extra, unknown
            )
            if not cands:
                break
            if ordering.uniform:
                ordered, i = _Lazy(iter(sorted(cands, key=ordering.key)), len(cands)), 0

    if not waiting or (headroom < smallest and not any(i.gpus <= headroom for i in stopped)):
        return actions
    actions.extend(_provision(waiting, slots, stopped, headroom, now, catalog, config))
    return actions


def fair_shares(
    demand: Mapping[str, int], capacity: int, weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Max-min fair split of `capacity` GPUs over the users' demands (water-filling).

    A user asking for less than an even split gets all of it; the rest is split evenly
    among the others, again and again. This is the share preemption defends: a user
    below theirs may take GPUs back from a user above theirs (YARN's and Kueue's fair
    sharing preemption), never from one at or below it."""
    w = {u: max(1e-12, (weights or {}).get(u, 1.0)) for u in demand}
    shares: dict[str, float] = {}
    left = float(capacity)
    wsum = sum(w.values())
    for user in sorted(demand, key=lambda u: (demand[u] / w[u], u)):
        give = min(float(demand[user]), left * w[user] / wsum) if wsum > 0 else 0.0
        shares[user] = give
        left -= give
        wsum -= w[user]
    return shares


# ---------------------------------------------------------------- preemption


class PreemptionPlanner:
    """The checkpoint-and-move part of one fair decision, in named steps.

    One planner per decision. It starts from what placement decided (`decided`: places,
    launches, starts, stops) and adds `moves`: each a `Preempt` of a run that
    checkpoints and a `Place` of it, or of the run it makes room for. The steps build on
    what the earlier ones established — the GPUs committed against the quota, each
    user's holdings and share, the GPUs idle or being freed per instance, the runs
    already moved — which is why they share one object rather than a dozen arguments:

    * `reclaim`, for runs the quota keeps out: `defragment` (move small runs into the
      gaps) else `take_fair_share` (from users above their share);
    * `consolidate`, for a draining fleet: empty an instance so it can be stopped.

    The caches (movable runs and victims per instance, the swap test, failures per
    state of the holdings, `version`) are there because a decision over a long queue
    must not redo per claimant what it already knows; none changes a decision."""

    EPS = 1e-9

    def __init__(
        self,
        fleet: Sequence[FleetInstance],
        decided: Sequence[Action],
        now: float,
        catalog: Catalog,
        config: SchedulerConfig,
    ) -> None:
        self.fleet = fleet
        self.decided = tuple(decided)
        self.now = now
        self.catalog = catalog
        self.config = config
        self.after = config.preempt_after()
        self.exempt = config.preempt_exempt()
        self.stopped_ids = {a.instance_id for a in decided if isinstance(a, Stop | Terminate)}
        self.moves: list[Action] = []
        # What reclaim's steps establish, in their order.
        self.placed: set[str] = set()  # runs placement already placed in this decision
        self.committed = 0  # GPUs of instances not stopped (or being launched, started)
        self.held: dict[str, int] = {}  # user -> GPUs held (or placed) now
        self.freed: dict[str, int] = {}  # instance -> GPUs freed (or being freed) for claimants
        self.pool: dict[tuple[str, str], list[FleetInstance]] = {}  # (model, market) -> usable
        self.idle: dict[str, int] = {}  # free GPUs nobody was placed on in this decision
        self.mov_users: set[str] = set()  # users with a preemptible run on a usable instance
        self.usable_fleet: list[FleetInstance] = []  # running, ready, not being stopped
        self.by_iid: dict[str, FleetInstance] = {}
        self.multi: set[str] = set()  # runs on more than one usable instance (multi-host)
        self.weights: dict[str, float] = {}  # fair-share factor per user
        self.shares: dict[str, float] = {}  # usage-weighted max-min share of the GPUs
        self.over: set[str] = set()  # users above their share with a run that may move
        self.any_freed = False
        self.pending: dict[tuple[str, str], int] = {}  # GPUs the claimants still ask per pool
        self.gone: set[str] = set()  # runs preempted by this decision
        self.version = 0  # bumped by every preemption: what failed before may succeed now
        self.scan_over = False  # preempt_scan claimants searched in vain: the rest waits
        # Caches (see the class docstring).
        self.movable_of: dict[str, list[Allocation]] = {}
        self.span_of: dict[str, list[str]] = {}
        self.victim_lists: dict[str, list[Allocation]] = {}
        self.no_room: set[tuple[str, str, int, int]] = set()
        self.hopeless: set[tuple[tuple[str, str], int, str, int]] = set()
        self.takable_of: dict[tuple[str, int], set[str]] = {}
        self.gains: dict[tuple[str, int, str, int, int], bool] = {}

    def plan(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> list[Action]:
        """All the moves of this decision: reclaim for the runs that wait, then
        consolidation of the pools nobody waits for."""
        if queue:
            self.reclaim(queue, usage)
        placed = {a.run_id for a in (*self.decided, *self.moves) if isinstance(a, Place)}
        waiting: set[tuple[str, str]] = {
            (r.gpu_model, _market(r)) for r in queue if r.run_id not in placed
        }
        self.consolidate(waiting)
        return self.moves

    # ------------------------------------------------------------ shared helpers

    def movable(self, al: Allocation) -> bool:
        """Whether a preemption may touch this allocation at all.

        It must checkpoint (preemptible), not be stopping already, have run at least
        `preempt_exempt()` since it last started, and not be due to end within
        preempt_after() anyway."""
        if not al.preemptible or al.stopping:
            return False
        if al.started_s is not None and self.now - al.started_s < self.exempt:
            return False
        return al.est_end_s is None or al.est_end_s - self.now > self.after

    def movable_on(self, iid: str) -> list[Allocation]:
        """An instance's movable allocations, worked out where a claimant looks (a
        decision over a busy fleet must not walk every allocation)."""
        got = self.movable_of.get(iid)
        if got is None:
            got = [al for al in self.by_iid[iid].allocations if self.movable(al)]
            self.movable_of[iid] = got
        return got

    def spans(self, rid: str, where: str) -> list[str]:
        """The usable instances a run holds GPUs on; `where` is one of them."""
        if rid not in self.multi:
            return [where]
        got = self.span_of.get(rid)
        if got is None:
            got = [i.instance_id for i in self.usable_fleet if rid in i.run_ids]
            self.span_of[rid] = got
        return got

    def run_total(self, al: Allocation, where: str) -> int:
        """A run's GPUs over all its instances: what preempting it takes from its user."""
        if al.run_id not in self.multi:
            return al.gpus
        return sum(
            x.gpus
            for iid in self.spans(al.run_id, where)
            for x in self.by_iid[iid].allocations
            if x.run_id == al.run_id
        )

    @staticmethod
    def end_of(al: Allocation) -> float:
        return math.inf if al.est_end_s is None else al.est_end_s

    def victims(self, iid: str) -> list[Allocation]:
        """Movable runs of users above their share on an instance, largest then longest
        first; built on first use, as most decisions look at few instances."""
        got = self.victim_lists.get(iid)
        if got is None:
            over, end_of = self.over, self.end_of
            got = sorted(
                (al for al in self.movable_on(iid) if al.user in over),
                key=lambda al: (-al.gpus, -end_of(al), al.run_id),
            )
            self.victim_lists[iid] = got
        return got

    def first_gain(self, run: QueuedRun, mine: float, user: str, t: int) -> bool:
        """The swap test of `_pick_victims` for a first pick (a later pick of the same
        user only gains less), cached per claimant user and size, victim user and size."""
        key = (run.user, run.gpus, user, t, self.version)
        ok = self.gains.get(key)
        if ok is None:
            held, eps = self.held, self.EPS
            hc, hv, sv = held.get(run.user, 0), held.get(user, 0), self.shares.get(user, 0.0)
            before = abs(hc - mine) + abs(hv - sv)
            after_swap = abs(hc + run.gpus - mine) + abs(hv - t - sv)
            ok = before - after_swap >= (run.gpus + t) / 2 - eps
            self.gains[key] = ok
        return ok

    # ------------------------------------------------------------ reclaim

    def reclaim(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> None:
        """Preempt-and-place for runs the quota keeps out: defragmentation, then fair share.

        A claimant has waited `preempt_after()` (a run ending or an instance booting
        within that is cheaper than a preemption) and the quota leaves no room to
        provision an instance for it (on owned hosts nothing can be bought at all). First,
        if the pool has the GPUs but scattered, small runs are moved into the gaps
        (`defragment`). Else, if its user is below a usage-weighted max-min share of the
        GPUs in use (`fair_shares`, weights: the fair-share factor), it may take GPUs from
        a victim whose user is above theirs, has used at least one fair share more than
        the claimant's lately, and ends up nearer their share by at least half the GPUs
        moved (`take_fair_share`). Victims are movable runs (`movable`: preemptible, past
        `preempt_exempt()`, not ending soon), largest first (one preemption frees the
        most for the runs behind), not more than the claimants ask for, then the most
        work left. The freed GPUs go to the claimants in fair order; a preempted run goes
        back in line and resumes from its checkpoint, paying `resume_s` on its GPUs.
        Users at or below their share never lose GPUs."""
        claimants = self._claimants(queue)
        if not claimants:
            return
        if not self._survey():
            return  # nothing may be moved and nothing is being freed
        self._share(queue, usage)
        claimants = self._promising(claimants)
        if not claimants:
            return
        order = self._rank(claimants, usage)
        if (
            not self.over
            and not self.any_freed
            and not any(v > 0 and self.by_iid[k].preemptible_users for k, v in self.idle.items())
        ):
            return  # nobody to take from, nothing freed, no gaps to fill: the usual case
        for run in order:
            pkey = (run.gpu_model, _market(run))
            asked = self.pending[pkey]
            self.pending[pkey] -= run.gpus
            group = self.pool.get(pkey, [])
            if self.defragment(run, group):
                continue
            self.take_fair_share(run, group, asked)
            if self.scan_over:
                break  # like Slurm's bf_max_job_test: a long queue is not searched to the end

    def _claimants(self, queue: Sequence[QueuedRun]) -> list[QueuedRun]:
        """The runs that may preempt: not placed, waited `preempt_after()`, on one host,
        and no room under the quota to provision for them. Counts, on the way, the GPUs
        committed against the quota and those placement gave each user."""
        now, catalog = self.now, self.catalog
        by_id = {r.run_id: r for r in queue}
        committed = 0
        for inst in self.fleet:
            if inst.state != "stopped" and inst.instance_id not in self.stopped_ids:
                committed += inst.gpus
        placed_gpus: dict[str, int] = {}
        for a in self.decided:
            if isinstance(a, Place):
                self.placed.add(a.run_id)
                run = by_id.get(a.run_id)
                if run is not None:
                    n = a.gpus_per_instance * len(a.instance_ids)
                    placed_gpus[run.user] = placed_gpus.get(run.user, 0) + n
            elif isinstance(a, Launch):
                t = catalog.get(a.instance_type)
                committed += t.gpus if t is not None else 0
            elif isinstance(a, Start):
                committed += next((i.gpus for i in self.fleet if i.instance_id == a.instance_id), 0)
        self.committed = committed
        self.held = placed_gpus
        headroom = self.config.max_gpus - committed
        claimants: list[QueuedRun] = []
        for run in queue:
            if run.run_id in self.placed or now - run.submit_s < self.after:
                continue
            shape = _shape(catalog, run.gpu_model, run.gpus)
            if shape is not None and (shape[1] > 1 or shape[0].gpus <= headroom):
                continue  # multi-host runs are not placed by preemption; room to provision
            claimants.append(run)  # (no shape: owned hosts only, nothing could be bought)
        return claimants

    def _survey(self) -> bool:
        """Each user's GPUs, and per usable instance its pool and idle GPUs, from the
        instances' cached summaries. Whether anything may move or is being freed."""
        held, freed, idle, pool = self.held, self.freed, self.idle, self.pool
        usable_fleet, mov_users = self.usable_fleet, self.mov_users
        now, stopped_ids = self.now, self.stopped_ids
        for inst in self.fleet:
            iid = inst.instance_id
            for user, g in inst.holders.items():
                held[user] = held.get(user, 0) + g
            if inst.stopping_gpus:  # told to stop earlier: their GPUs are already promised
                freed[iid] = inst.stopping_gpus
            if iid in stopped_ids or inst.state != "running" or inst.ready_at_s > now:
                continue
            usable_fleet.append(inst)
            pool.setdefault((inst.gpu_model, inst.market), []).append(inst)
            idle[iid] = inst.free_gpus
            mov_users |= inst.preemptible_users
        if not mov_users and not freed:
            return False
        self.by_iid = {i.instance_id: i for i in self.fleet}
        seen_once: set[str] = set()
        for inst in usable_fleet:
            self.multi |= seen_once & inst.run_ids
            seen_once |= inst.run_ids
        return True

    def _share(self, queue: Sequence[QueuedRun], usage: Mapping[str, float]) -> None:
        """Each user's fair share of the GPUs in use, and who is above theirs."""
        held = self.held
        demand = dict(held)
        for run in queue:
            if run.run_id not in self.placed:
                demand[run.user] = demand.get(run.user, 0) + run.gpus
        self.weights = fairshare_factors(demand, usage)
        # The GPUs there are to share: at the quota (or on owned hosts, where nothing can
        # be bought) that is what runs now.
        self.shares = shares = fair_shares(
            demand, min(self.config.max_gpus, self.committed), self.weights
        )
        idle = self.idle
        for a in self.decided:
            if isinstance(a, Place):
                for iid in a.instance_ids:
                    if iid in idle:
                        idle[iid] -= a.gpus_per_instance
        eps = self.EPS
        self.over = {u for u in self.mov_users if held.get(u, 0) > shares.get(u, 0.0) + eps}
        self.any_freed = any(v > 0 for v in self.freed.values())

    def _promising(self, claimants: list[QueuedRun]) -> list[QueuedRun]:
        """The claimants with a chance, cheaply: below their share while someone above
        theirs has a run that may move, or a gap as big as the run beside a movable run,
        or GPUs being freed. The usual case ends here."""
        held, shares, eps = self.held, self.shares, self.EPS
        gaps: dict[tuple[str, str], int] = {
            key: sum(max(0, self.idle[i.instance_id]) for i in group)
            for key, group in self.pool.items()
            if any(i.preemptible_users for i in group)
        }
        return [
            r
            for r in claimants
            if (self.over and held.get(r.user, 0) < shares.get(r.user, 0.0) - eps)
            or r.gpus <= gaps.get((r.gpu_model, _market(r)), 0)
            or self.any_freed
        ]

    def _rank(self, claimants: list[QueuedRun], usage: Mapping[str, float]) -> list[QueuedRun]:
        """The order the claimants are served in, and the GPUs they ask per pool.

        Per user and shape, the first few only: the rest of a group fares as its first do
        within one decision, and the simulator decides again at once after a preemption.
        Fair order, but one user's runs of one shape that waited together (a sweep) go by
        length: the GPUs one preemption frees then hold runs that end together, and the
        instance does not stay paid for one straggler."""
        config = self.config
        per_group: dict[tuple[str, int, str, bool], int] = {}
        capped: list[QueuedRun] = []
        for r in sorted(claimants, key=_submit_key):
            gkey = (r.user, r.gpus, r.gpu_model, r.spot)
            n = per_group.get(gkey, 0)
            if n < config.preempt_group:
                per_group[gkey] = n + 1
                capped.append(r)
        ordering = _Ordering(capped, self.now, usage, config)
        ranked = sorted(capped, key=ordering.key)
        first: dict[tuple[str, int, str, bool, int], int] = {}
        for idx, run in enumerate(ranked):
            first.setdefault((run.user, run.gpus, run.gpu_model, run.spot, run.priority), idx)
        order = sorted(
            ranked,
            key=lambda r: (
                first[(r.user, r.gpus, r.gpu_model, r.spot, r.priority)],
                _est(r, config),
                r.run_id,
            ),
        )
        pending = self.pending
        for run in order:
            pkey = (run.gpu_model, _market(run))
            pending[pkey] = pending.get(pkey, 0) + run.gpus
        return order

    # ------------------------------------------------------------ defragmentation

    def defragment(self, run: QueuedRun, group: list[FleetInstance]) -> bool:
        """Room for `run` by moving a few small runs into GPUs idle elsewhere; whether it
        was placed so.

        The fleet has the GPUs but no instance has enough of them together (a big run
        behind small ones that ended at different times): moving runs off one instance
        into the gaps on others makes it whole. Nobody loses GPUs; the moved runs pay
        `resume_s` each, so it is done only when that costs less GPU-time than the run
        would wait for `preempt_after()` on its own GPUs."""
        memo = (run.gpu_model, _market(run), run.gpus, self.version)
        if memo in self.no_room:
            return False
        self.no_room.add(memo)  # a success bumps the version, so this only remembers failures
        idle = self.idle
        if sum(max(0, idle[i.instance_id]) for i in group) < run.gpus:
            return False
        gone, multi, end_of = self.gone, self.multi, self.end_of
        best: tuple[tuple[int, int, str], FleetInstance, list[tuple[Allocation, str]]] | None
        best = None
        for inst in group:
            need = run.gpus - idle[inst.instance_id]
            if inst.gpus < run.gpus or need <= 0:
                continue
            movable = sorted(
                (
                    al
                    for al in inst.allocations
                    if self.movable(al) and al.run_id not in gone and al.run_id not in multi
                ),
                key=lambda al: (al.gpus, end_of(al), al.run_id),
            )
            chosen: list[Allocation] = []
            for al in movable:
                if need <= 0:
                    break
                chosen.append(al)
                need -= al.gpus
            if need > 0:
                continue
            plan = self._into_gaps(chosen, inst, group)
            if plan is None:
                continue
            moved = sum(al.gpus for al in chosen)
            if moved * self.config.resume_s >= run.gpus * self.after:
                continue
            score = (moved, len(chosen), inst.instance_id)
            if best is None or score < best[0]:
                best = (score, inst, plan)
        if best is None:
            return False
        _, inst, plan = best
        moves: list[Action] = [Preempt(al.run_id, run.run_id) for al, _ in plan]
        for al, to in plan:
            gone.add(al.run_id)
            idle[to] -= al.gpus
            idle[inst.instance_id] += al.gpus
            moves.append(Place(al.run_id, (to,), al.gpus))
        idle[inst.instance_id] -= run.gpus
        moves.append(Place(run.run_id, (inst.instance_id,), run.gpus))
        self.moves.extend(moves)
        self.held[run.user] = self.held.get(run.user, 0) + run.gpus
        self.version += 1
        return True

    def _into_gaps(
        self, chosen: list[Allocation], inst: FleetInstance, group: list[FleetInstance]
    ) -> list[tuple[Allocation, str]] | None:
        """Where each chosen run goes, largest first, into the tightest gap on another
        instance; None when one does not fit."""
        idle = self.idle
        room = {
            o.instance_id: idle[o.instance_id]
            for o in group
            if o is not inst and idle[o.instance_id] > 0
        }
        plan: list[tuple[Allocation, str]] = []
        for al in sorted(chosen, key=lambda al: (-al.gpus, al.run_id)):
            fits = [(left - al.gpus, iid) for iid, left in room.items() if left >= al.gpus]
            if not fits:
                return None
            _, to = min(fits)
            room[to] -= al.gpus
            plan.append((al, to))
        return plan

    # ------------------------------------------------------------ fair-share reclaim

    def take_fair_share(self, run: QueuedRun, group: list[FleetInstance], asked: int) -> None:
        """Places `run` on GPUs taken from users above their share, when its own user is
        below theirs: on the instance needing the fewest preemptions, then wasting the
        fewest GPUs the claimants do not ask for (`asked`, this pool), then freeing the
        most, then the victims with the most work left."""
        held, shares, freed, eps = self.held, self.shares, self.freed, self.EPS
        mine = shares.get(run.user, 0.0)
        if held.get(run.user, 0) >= mine - eps:
            return  # at or above its share: it waits like everyone else
        memo = ((run.gpu_model, _market(run)), run.gpus, run.user, self.version)
        if memo in self.hopeless:
            return
        takable = self._takable(run.user)
        if not takable and not self.any_freed:
            return  # nobody it may take from (see the band below): no instance to scan
        best: tuple[tuple[int, int, int, float, str], FleetInstance, list[Allocation]] | None
        best = None
        end_of = self.end_of
        for inst in group:
            if inst.gpus < run.gpus:
                continue
            if not freed.get(inst.instance_id) and takable.isdisjoint(inst.preemptible_users):
                continue
            need = run.gpus - freed.get(inst.instance_id, 0)
            picks: list[Allocation] = []
            if need > 0:
                got_picks = self._pick_victims(run, inst, need, asked, mine, takable)
                if got_picks is None:
                    continue
                picks = got_picks
            got = sum(al.gpus for al in picks)
            waste = max(0, got + freed.get(inst.instance_id, 0) - asked)
            latest = max((end_of(al) for al in picks), default=0.0)
            score = (len(picks), waste, -got, -latest, inst.instance_id)
            if best is None or score < best[0]:
                best = (score, inst, picks)
        if best is None:
            self.hopeless.add(memo)
            if len(self.hopeless) >= self.config.preempt_scan:
                self.scan_over = True
            return
        _, inst, picks = best
        self._take(run, inst, picks)

    def _takable(self, user: str) -> set[str]:
        """The users a claimant of `user` may take from: above their share, and having
        used at least one fair share more than `user` lately (weight at most half)."""
        tkey = (user, self.version)
        takable = self.takable_of.get(tkey)
        if takable is None:
            held, shares, weights, eps = self.held, self.shares, self.weights, self.EPS
            wc = weights.get(user, 1.0)
            takable = {
                v
                for v in self.over
                if v != user
                and wc >= 2.0 * weights.get(v, 1.0) - eps
                and held.get(v, 0) > shares.get(v, 0.0) + eps
            }
            self.takable_of[tkey] = takable
        return takable

    def _pick_victims(
        self,
        run: QueuedRun,
        inst: FleetInstance,
        need: int,
        asked: int,
        mine: float,
        takable: set[str],
    ) -> list[Allocation] | None:
        """The runs on `inst` to preempt for `need` GPUs, or None if they cannot be had.

        Largest first frees the most for the claimants behind, but not more than they ask
        for; then the one with the most work left."""
        held, shares, weights, eps = self.held, self.shares, self.weights, self.EPS
        gone = self.gone
        fit: list[Allocation] = []
        over_ask: list[Allocation] = []
        room = 0
        for al in self.victims(inst.instance_id):  # largest, then longest, first
            if (
                al.user in takable
                and al.run_id not in gone
                and self.first_gain(run, mine, al.user, al.gpus)
            ):
                (fit if al.gpus <= asked else over_ask).append(al)
                room += al.gpus
        if room < need:
            return None
        cands = fit + over_ask[::-1]  # overshooting ones last, the smallest first
        budget: dict[str, int] = {}
        picks: list[Allocation] = []
        for al in cands:
            total = self.run_total(al, inst.instance_id)
            hv, sv = budget.get(al.user, held.get(al.user, 0)), shares.get(al.user, 0.0)
            hc = held.get(run.user, 0)
            if hv <= sv + eps:
                continue  # its user is not above their share
            if weights.get(run.user, 1.0) < 2.0 * weights.get(al.user, 1.0) - eps:
                # Only from a user who has used at least one fair share (1/N of
                # everybody's recent GPU time) more than the claimant's: usage follows
                # the GPUs, so without this band two busy users would take them back
                # and forth as their usage crosses.
                continue
            # The swap must bring the two users nearer their shares by at least half the
            # GPUs it moves (in whole GPUs a share is rarely met exactly, and shares drift
            # with usage): a small gain in fairness is not worth a checkpoint, and GPUs
            # cannot swing back and forth.
            before = abs(hc - mine) + abs(hv - sv)
            after_swap = abs(hc + run.gpus - mine) + abs(hv - total - sv)
            if before - after_swap < (run.gpus + total) / 2 - eps:
                continue
            budget[al.user] = hv - total
            picks.append(al)
            need -= al.gpus
            if need <= 0:
                break
        if need > 0:
            return None
        return picks

    def _take(self, run: QueuedRun, inst: FleetInstance, picks: list[Allocation]) -> None:
        """Commits a fair-share take: the victims preempted (all their GPUs freed, on every
        instance they span), `run` placed on `inst`."""
        self.version += 1
        held, freed = self.held, self.freed
        for al in picks:
            self.gone.add(al.run_id)
            self.moves.append(Preempt(al.run_id, run.run_id))
            for iid in self.spans(al.run_id, inst.instance_id):
                g = sum(x.gpus for x in self.by_iid[iid].allocations if x.run_id == al.run_id)
                freed[iid] = freed.get(iid, 0) + g
                held[al.user] = held.get(al.user, 0) - g
        freed[inst.instance_id] = freed.get(inst.instance_id, 0) - run.gpus
        held[run.user] = held.get(run.user, 0) + run.gpus
        self.moves.append(Place(run.run_id, (inst.instance_id,), run.gpus))

    # ------------------------------------------------------------ consolidation

    def consolidate(self, waiting: set[tuple[str, str]]) -> None:
        """Empties an instance whose runs fit in GPUs idle on others, so it can be stopped.

        What a cluster autoscaler's scale-down does with pods: a draining fleet (runs that
        ended at different times) otherwise pays for whole instances kept alive by one or
        two long runs. Each move is a preemption and a resume (`resume_s` on the run's
        GPUs); an instance is emptied only when the GPU-time it saves (its GPUs until its
        last run would have ended) exceeds what the moves cost plus the time they add to
        the targets. Only runs with a known end, preemptible, on one instance, not ending
        within `preempt_after()` move; nothing moves onto an instance being emptied. Not
        while runs of the pool (`waiting`: model, market) wait: idle GPUs are theirs (and
        the backfill promise to the head of the line covers them), and defragmentation
        serves them instead."""
        now = self.now
        actions = (*self.decided, *self.moves)
        busy_refs = {a.instance_id for a in actions if isinstance(a, Stop | Terminate)}
        placed: dict[str, list[tuple[float, int]]] = {}
        moved_runs: set[str] = set()
        for a in actions:
            if isinstance(a, Place):
                for iid in a.instance_ids:
                    placed.setdefault(iid, []).append((math.inf, a.gpus_per_instance))
            elif isinstance(a, Preempt):
                moved_runs.add(a.run_id)
        span_count: dict[str, int] = {}
        for inst in self.fleet:
            for al in inst.allocations:
                span_count[al.run_id] = span_count.get(al.run_id, 0) + 1
        groups: dict[tuple[str, str, str], list[FleetInstance]] = {}
        for inst in self.fleet:
            if inst.state != "running" or inst.ready_at_s > now or inst.instance_id in busy_refs:
                continue
            if (inst.gpu_model, inst.market) in waiting:
                continue
            groups.setdefault((inst.instance_type, inst.gpu_model, inst.market), []).append(inst)
        for group in groups.values():
            if len(group) >= 2:
                self._empty_some(group, placed, moved_runs, span_count)

    def _empty_some(
        self,
        group: list[FleetInstance],
        placed: dict[str, list[tuple[float, int]]],
        moved_runs: set[str],
        span_count: dict[str, int],
    ) -> None:
        """Consolidation within one group of alike instances, the least used first."""
        now, config = self.now, self.config
        idle: dict[str, int] = {}
        horizon: dict[str, float] = {}
        for inst in group:
            extra = placed.get(inst.instance_id, [])
            idle[inst.instance_id] = inst.free_gpus - sum(g for _, g in extra)
            ends = [al.est_end_s for al in inst.allocations]
            horizon[inst.instance_id] = (
                math.inf
                if extra or any(e is None for e in ends)
                else max([now, *(e for e in ends if e is not None)])
            )
        if sum(max(0, v) for v in idle.values()) == 0:
            return
        emptied: set[str] = set()
        for inst in sorted(group, key=lambda i: (i.used_gpus, i.instance_id)):
            iid = inst.instance_id
            als = inst.allocations
            if (
                not als
                or horizon[iid] == math.inf
                or any(
                    not self.movable(al)
                    or al.run_id in moved_runs
                    or span_count[al.run_id] != 1
                    or al.est_end_s is None
                    for al in als
                )
            ):
                continue
            room = {
                o.instance_id: idle[o.instance_id]
                for o in group
                if o is not inst and o.instance_id not in emptied and idle[o.instance_id] > 0
            }
            new_h = {k: horizon[k] for k in room}
            plan: list[tuple[Allocation, str]] = []
            for al in sorted(als, key=lambda a: (-a.gpus, -(a.est_end_s or 0.0), a.run_id)):
                end = (al.est_end_s or now) + config.resume_s
                # the target whose paid time grows least: one already kept as long
                fits = [
                    (max(0.0, end - new_h[k]), left - al.gpus, k)
                    for k, left in room.items()
                    if left >= al.gpus and new_h[k] != math.inf
                ]
                if not fits:
                    break
                _, _, to = min(fits)
                room[to] -= al.gpus
                new_h[to] = max(new_h[to], end)
                plan.append((al, to))
            if len(plan) < len(als):
                continue
            saved = inst.gpus * (horizon[iid] - now)
            added = sum(inst.gpus * (new_h[k] - horizon[k]) for k in new_h)
            cost = sum(al.gpus for al in als) * config.resume_s
            if saved - added - cost <= inst.gpus * config.preempt_after():
                continue  # not worth the moves and the restart of the emptied instance
            emptied.add(iid)
            for al, to in plan:
                self.moves.append(Preempt(al.run_id, f"consolidate:{iid}"))
                self.moves.append(Place(al.run_id, (to,), al.gpus))
                idle[to] -= al.gpus
                horizon[to] = new_h[to]
                moved_runs.add(al.run_id)
            idle[iid] = inst.gpus


@lru_cache(maxsize=256)
def _min_gpus(catalog: Catalog, model: str) -> int:
    """GPUs of the smallest instance of a model: less headroom than this launches nothing."""
    return min((t.gpus for t in catalog.for_model(model)), default=0)


def _backfill_candidates(
    ordering: _Ordering,
    ordered: _Lazy,
    slots: Mapping[tuple[str, str], list[_Slot]],
    gfree: Mapping[tuple[str, str], int],
    head_key: tuple[str, str] | None,
    head_t: float,
    head_extra: Mapping[str, int],
    unknown: float,
) -> list[QueuedRun]:
    """The runs not yet looked at that could still fit some free GPUs beside the head.

    A superset (every run that can start is in it), found in one pass: behind a blocked
    head of a long queue, the free GPUs are too few on each instance, or promised to the
    head, for nearly every run, so the scan jumps to the few that might fit instead of
    failing through the rest."""
    # per group: GPUs usable for any duration (max over instances), and the instances
    # whose free GPUs are promised to the head, with how long a run may hold them
    groups: dict[tuple[str, str], tuple[int, int, list[tuple[int, float]], int, list[_Slot]]] = {}
    for key, free in gfree.items():
        if free <= 0:
            continue
        open_ = [s for s in slots[key] if s.free > 0]
        any_cap = 0
        short: list[tuple[int, float]] = []
        for s in open_:
            if key != head_key or s.ref not in head_extra:
                cap = s.free
            else:
                cap = max(0, min(s.free, head_extra[s.ref]))
                short.append((s.free, head_t - s.ready))
            any_cap = max(any_cap, cap)
        big = max(s.gpus for s in slots[key])
        groups[key] = (any_cap, max(s.free for s in open_), short, big, open_)
    if not groups:
        return []
    seen = {r.run_id for r in ordered.items}
    out: list[QueuedRun] = []
    for runs in ordering.by_user.values():
        for r in runs:
            g = groups.get((r.gpu_model, "spot" if r.spot else "ondemand"))
            if g is None:
                continue
            any_cap, max_free, short, big, open_ = g
            gpus = r.gpus
            if gpus <= big:
                if gpus > max_free:
                    continue
                if gpus > any_cap:
                    dur = unknown if r.est_duration_s is None else r.est_duration_s
                    if not any(gpus <= f and dur <= lim for f, lim in short):
                        continue
            else:
                k = split_hosts(gpus, big)
                per = gpus // k
                dur = unknown if r.est_duration_s is None else r.est_duration_s
                n = sum(
                    1
                    for s in open_
                    if s.free >= per
                    and (
                        s.ref not in head_extra
                        or head_extra[s.ref] >= per
                        or s.ready + dur <= head_t
                    )
                )
                if n < k:
                    continue
            if r.run_id not in seen:
                out.append(r)
    return out


def _hosts_for(run: QueuedRun, group: list[_Slot]) -> tuple[int, int]:
    """(k, per-host GPUs) on instances of the group's largest size."""
    biggest = 0
    for s in group:
        if s.gpus > biggest:
            biggest = s.gpus
    if biggest <= 0:
        return 0, 0
    if run.gpus <= biggest:
        return 1, run.gpus
    k = split_hosts(run.gpus, biggest)
    return k, run.gpus // k


def _best_fit(
    run: QueuedRun,
    dur: float,
    group: list[_Slot],
    now: float,
    config: SchedulerConfig,
    have_head: bool,
    head_t: float,
    head_extra: Mapping[str, int],
) -> tuple[list[_Slot], int, float] | None:
    k, per = _hosts_for(run, group)
    if k == 0:
        return None

    def allowed(s: _Slot) -> bool:
        if s.free < per:
            return False
        if not have_head or s.ref not in head_extra:
            return True
        return s.ready + dur <= head_t or head_extra[s.ref] >= per

    def cost(s: _Slot) -> tuple[float, int, str]:
        # Paid instance-time the run adds, plus its wait valued like GPU time; then best
        # fit (fewest GPUs left over), so whole instances stay free for big runs.
        end = s.ready + dur
        added = s.gpus * max(0.0, end - s.horizon)
        delay = config.wait_value * per * (s.ready - now)
        return ((added + delay) * s.usd_hr / s.gpus, s.free - per, s.ref)

    fits = [s for s in group if allowed(s)]
    if k == 1:
        if not fits:
            return None
        one = min(fits, key=cost)
        return [one], per, cost(one)[0]
    by_type: dict[str, list[_Slot]] = {}
    for s in fits:
        if s.gpus >= per:
            by_type.setdefault(s.type_name, []).append(s)
    best: tuple[float, list[_Slot]] | None = None
    for same in by_type.values():
        if len(same) < k:
            continue
        pick = sorted(same, key=cost)[:k]
        c = sum(cost(s)[0] for s in pick)
        if best is None or c < best[0]:
            best = (c, pick)
    return (best[1], per, best[0]) if best else None


def _reservation(
    run: QueuedRun, dur: float, group: list[_Slot], now: float, config: SchedulerConfig
) -> tuple[float, dict[str, int]]:
    """When and where the head run could start on the warm fleet (EASY's shadow time).

    Free GPUs on an instance only grow as its runs end (nothing else is booked into the
    future), so the head's start on it is the first expected end that frees enough."""
    del dur
    k, per = _hosts_for(run, group)
    if k == 0:
        return math.inf, {}
    cands: list[tuple[float, str, int]] = []
    unknown_end = now + config.unknown_duration_s
    for s in group:
        if s.inst is None or s.gpus < per:
            continue
        free = s.free
        t = s.ready
        if free < per:
            rel: Iterable[tuple[float, int]] = s.inst.releases
            if s.inst.unknown_end_gpus or s.placed:
                extra = list(s.placed)
                if s.inst.unknown_end_gpus:
                    extra.append((unknown_end, s.inst.unknown_end_gpus))
                rel = sorted([*rel, *extra])
            t = math.inf
            for end, g in rel:
                free += g
                if free >= per:
                    t = max(end, s.ready)
                    break
            if t == math.inf:
                continue
        cands.append((t, s.ref, free - per))
    if len(cands) < k:
        return math.inf, {}
    cands.sort()
    chosen = cands[:k]
    t_h = chosen[-1][0]
    return t_h, {ref: extra for (_, ref, extra) in chosen}


def _provision(
    waiting: list[QueuedRun],
    slots: dict[tuple[str, str], list[_Slot]],
    stopped: list[FleetInstance],
    headroom: int,
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
) -> list[Action]:
    """Start or launch capacity for waiting runs where the cost model says waiting costs more."""
    actions: list[Action] = []
    placed: set[str] = set()
    n_new = 0
    stopped_left = sorted(stopped, key=lambda i: (i.usd_hr, i.instance_id))
    by_group: dict[tuple[str, Market], list[QueuedRun]] = {}
    for run in waiting:
        by_group.setdefault((run.gpu_model, _market(run)), []).append(run)
    for (model, market), runs in by_group.items():
        can_start = any(
            i.gpu_model == model and i.market == market and i.gpus <= headroom for i in stopped_left
        )
        if headroom < _min_gpus(catalog, model) and not can_start:
            continue
        # Only runs that new capacity within the quota could host, and of those the
        # first wait_scan: later ones are far from the head of the line, and estimating
        # every wait would make a long queue quadratic.
        fit: list[QueuedRun] = []
        for r in runs:
            shape = run_shape(catalog, model, r.gpus)
            if shape is not None and shape[1] * shape[0].gpus <= headroom:
                fit.append(r)
            if len(fit) >= config.wait_scan:
                break
        if not fit:
            continue
        runs = fit
        waits = _expected_waits(runs, slots.get((model, market), []), now, config)
        i = 0
        while i < len(runs) and headroom > 0:
            first = runs[i]
            if first.run_id in placed:
                i += 1
                continue
            shape = run_shape(catalog, model, first.gpus)
            if shape is None:
                i += 1
                continue
            options: list[tuple[float, str, InstanceType, int, FleetInstance | None]] = []
            for t in catalog.for_model(model):
                if first.gpus <= t.gpus:
                    k = 1
                elif t.instance_type == shape[0].instance_type:
                    k = shape[1]
                else:
                    continue
                usd = t.spot_usd_hr if market == "spot" and t.spot_usd_hr else t.ondemand_usd_hr
                if k * t.gpus > headroom:
                    continue
                reuse = (
                    next(
                        (
                            s
                            for s in stopped_left
                            if s.instance_type == t.instance_type and s.market == market
                        ),
                        None,
                    )
                    if k == 1
                    else None
                )
                delay = config.start_s if reuse is not None else config.boot_s + config.setup_s
                bill = max(delay, config.min_bill_s) if reuse is not None else delay
                net, _ = _bundle_value(runs, i, waits, placed, t, k, usd, delay, bill, now, config)
                options.append((net, t.instance_type, t, k, reuse))
            options.sort(key=lambda o: (-o[0], o[1]))
            if not options or options[0][0] <= 0:
                i += 1
                continue
            _, _, t, k, reuse = options[0]
            usd = t.spot_usd_hr if market == "spot" and t.spot_usd_hr else t.ondemand_usd_hr
            delay = config.start_s if reuse is not None else config.boot_s + config.setup_s
            bill = max(delay, config.min_bill_s) if reuse is not None else delay
            _, members = _bundle_value(runs, i, waits, placed, t, k, usd, delay, bill, now, config)
            refs: list[str] = []
            if reuse is not None:
                stopped_left.remove(reuse)
                actions.append(Start(reuse.instance_id, first.run_id))
                refs.append(reuse.instance_id)
            else:
                mkt: Market = market if (market == "ondemand" or t.spot_usd_hr) else "ondemand"
                for _ in range(k):
                    ref = f"new:{n_new}"
                    n_new += 1
                    actions.append(Launch(ref, t.instance_type, mkt, first.run_id))
                    refs.append(ref)
            headroom -= k * t.gpus
            ready = now + delay
            new_slots = [
                _Slot(None, r, t.gpus, ready, usd, t.instance_type, t.gpus, ready) for r in refs
            ]
            for run, per in members:
                placed.add(run.run_id)
                hosts = new_slots if k > 1 else [new_slots[0]]
                for s in hosts:
                    s.free -= per
                    s.horizon = max(s.horizon, ready + _est(run, config))
                actions.append(Place(run.run_id, tuple(s.ref for s in hosts), per))
            slots.setdefault((model, market), []).extend(new_slots)
            i += 1
    return actions


def _bundle_value(
    runs: list[QueuedRun],
    i: int,
    waits: Mapping[str, float],
    placed: set[str],
    t: InstanceType,
    k: int,
    usd_hr: float,
    delay: float,
    bill_s: float,
    now: float,
    config: SchedulerConfig,
) -> tuple[float, list[tuple[QueuedRun, int]]]:
    """Net worth (USD) of provisioning k instances of t for runs[i] and whoever else fits."""
    first = runs[i]
    per = first.gpus // k
    members: list[tuple[QueuedRun, int]] = [(first, per)]
    free = t.gpus - per
    if k == 1:
        for run in runs[i + 1 :]:
            if free <= 0:
                break
            if run.run_id in placed or run.gpus > free:
                continue
            if waits.get(run.run_id, math.inf) - now <= delay:
                continue  # it starts sooner on the warm fleet
            members.append((run, run.gpus))
            free -= run.gpus
    gpu_usd_s = usd_hr / t.gpus / 3600.0
    saved = 0.0
    longest = 0.0
    for run, _ in members:
        w = waits.get(run.run_id, math.inf) - now
        saved += run.gpus * (min(w, 1e9) - delay)
        longest = max(longest, _est(run, config))
    value = config.wait_value * saved * gpu_usd_s
    cost = k * (bill_s * usd_hr / 3600.0 + free * gpu_usd_s * longest)
    return value - cost, members


def _expected_waits(
    runs: list[QueuedRun], group: list[_Slot], now: float, config: SchedulerConfig
) -> dict[str, float]:
    """When each waiting run would start on the warm fleet alone, in queue order.

    Conservative backfill over step profiles: each run takes the earliest gap that fits
    it, and the next run sees what is left."""
    profiles: list[tuple[_Slot, list[tuple[float, int]]]] = []
    for s in group:
        if s.inst is None:
            prof = [(s.ready, s.free)]
            if s.free < s.gpus:
                prof.append((s.horizon, s.gpus))
        else:
            prof = _free_at_profile(s.inst, config, now)
            taken = s.inst.free_gpus - s.free
            if taken:
                _reserve(prof, now, s.horizon, taken)
        profiles.append((s, prof))
    out: dict[str, float] = {}
    for run in runs:
        dur = _est(run, config)
        k, per = _hosts_for(run, group)
        if k == 0:
            out[run.run_id] = math.inf
            continue
        if k == 1:
            best = (math.inf, -1)
            for idx, (s, prof) in enumerate(profiles):
                if s.gpus < per:
                    continue
                t = _earliest(prof, per, dur)
                if t < best[0]:
                    best = (t, idx)
            out[run.run_id] = best[0]
            if best[1] >= 0 and best[0] != math.inf:
                _reserve(profiles[best[1]][1], best[0], best[0] + dur, per)
        else:
            times = sorted(
                (_earliest(prof, per, dur), idx)
                for idx, (s, prof) in enumerate(profiles)
                if s.gpus >= per
            )
            if len(times) < k or times[k - 1][0] == math.inf:
                out[run.run_id] = math.inf
                continue
            t0 = times[k - 1][0]
            out[run.run_id] = t0
            for _, idx in times[:k]:
                _reserve(profiles[idx][1], t0, t0 + dur, per)
    return out


# ---------------------------------------------------------------- baselines


def _decide_per_job(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
) -> list[Action]:
    actions: list[Action] = []
    for inst in fleet:
        if inst.state == "running" and not inst.allocations:
            actions.append(Terminate(inst.instance_id))
    headroom = config.max_gpus - sum(
        i.gpus for i in fleet if i.state != "stopped" and (i.allocations or i.state == "pending")
    )
    n_new = 0
    for run in sorted(queue, key=lambda r: (r.submit_s, r.run_id))[: config.scan_limit]:
        shape = run_shape(catalog, run.gpu_model, run.gpus)
        if shape is None:
            continue
        t, k, per = shape
        if k * t.gpus > headroom:
            break  # strictly in order, like a tool retrying its launch until quota frees
        market: Market = "spot" if run.spot and t.spot_usd_hr else "ondemand"
        refs = []
        for _ in range(k):
            ref = f"new:{n_new}"
            n_new += 1
            actions.append(Launch(ref, t.instance_type, market, run.run_id))
            refs.append(ref)
        headroom -= k * t.gpus
        actions.append(Place(run.run_id, tuple(refs), per))
    return actions


def _decide_fifo(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
    more_expected: bool,
) -> list[Action]:
    actions: list[Action] = []
    if not queue and not more_expected:
        if all(not i.allocations for i in fleet):
            return [Terminate(i.instance_id) for i in fleet]
        return []
    have: dict[str, int] = {}
    for inst in fleet:
        have[inst.instance_type] = have.get(inst.instance_type, 0) + 1
    slots: list[_Slot] = [
        _Slot(
            i,
            i.instance_id,
            i.gpus,
            max(now, i.ready_at_s),
            i.usd_hr,
            i.instance_type,
            i.free_gpus,
            0.0,
        )
        for i in fleet
        if i.state != "stopped"
    ]
    model_of: dict[str, str] = {i.instance_id: i.gpu_model for i in fleet}
    n_new = 0
    headroom = config.max_gpus - _committed(fleet)
    if more_expected or queue:
        for type_name, count in config.fixed_fleet:
            t = catalog.get(type_name)
            if t is None:
                continue
            for _ in range(count - have.get(type_name, 0)):
                if t.gpus > headroom:
                    break
                headroom -= t.gpus
                ref = f"new:{n_new}"
                n_new += 1
                actions.append(Launch(ref, type_name, "ondemand", "fleet"))
                slots.append(
                    _Slot(
                        None,
                        ref,
                        t.gpus,
                        now + config.boot_s + config.setup_s,
                        t.ondemand_usd_hr,
                        type_name,
                        t.gpus,
                        0.0,
                    )
                )
                model_of[ref] = t.gpu_model
    for run in sorted(queue, key=lambda r: (r.submit_s, r.run_id))[: config.scan_limit]:
        group = [s for s in slots if model_of[s.ref] == run.gpu_model]
        k, per = _hosts_for(run, group)
        if k == 0:
            break
        fits = [s for s in group if s.free >= per]
        if k == 1:
            if not fits:
                break
            pick = [min(fits, key=lambda s: (s.ready, s.free, s.ref))]
        else:
            fits.sort(key=lambda s: (s.ready, s.free, s.ref))
            by_type: dict[str, list[_Slot]] = {}
            for s in fits:
                by_type.setdefault(s.type_name, []).append(s)
            pick = next((v[:k] for v in by_type.values() if len(v) >= k), [])
            if not pick:
                break
        for s in pick:
            s.free -= per
        actions.append(Place(run.run_id, tuple(s.ref for s in pick), per))
    return actions


def fifo_fleet(
    catalog: Catalog, demand_gpu_s: Mapping[str, float], biggest: Mapping[str, int], max_gpus: int
) -> tuple[tuple[str, int], ...]:
    """A fixed fleet for fifo: the quota split over models by GPU-second demand.

    What a cluster owner sizes from the workload mix; each model gets at least enough
    instances for its largest run (when the quota allows)."""
    total = sum(demand_gpu_s.values())
    plan: list[tuple[str, int]] = []
    left = max_gpus
    for model in sorted(demand_gpu_s, key=lambda m: -demand_gpu_s[m]):
        shape = run_shape(catalog, model, max(1, biggest.get(model, 1)))
        t = catalog.cheapest(model, 1) if shape is None else shape[0]
        if t is None:
            continue
        share = max_gpus * demand_gpu_s[model] / total if total > 0 else max_gpus
        n = max(int(share // t.gpus), shape[1] if shape else 1)
        n = min(n, left // t.gpus)
        if n > 0:
            plan.append((t.instance_type, n))
            left -= n * t.gpus
    return tuple(plan)
