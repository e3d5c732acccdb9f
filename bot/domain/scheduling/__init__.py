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
    decides how long an instance stays paid for; at an equal fit, one that checkpoints
    goes before one that would pin a rented instance no unmovable run holds yet, so a sweep's
    unmovable runs end up together and its movable ones where consolidation can empty
    their instances.
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
    the waiting it saves, valued at ``wait_value`` times the GPUs' own price (the
    model's cheapest per GPU), beats what the provisioning costs: the boot (or restart)
    billing plus the GPUs of the new instance that the bundle leaves empty for its
    duration (the pessimistic "nobody else comes" case), plus what a size dearer per GPU
    charges above that price. Where the model comes in several sizes, the one with the
    most net worth per GPU served is bought: the size the queue fills. No constant
    fitted to a trace.
  * Idle stop and terminate, as ski rental (see ``SchedulerConfig.idle_stop_after``).
  * Preemption of runs that checkpoint (``Preempt``, once per ``preempt_period_s``):
    fair-share reclaim and defragmentation for runs the quota keeps out, and
    consolidation of a draining fleet so whole instances stop (`preemption.PreemptionPlanner`).

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

Modules, in layers (`LAYERS`; each imports only modules before it): `model` (inputs,
actions, knobs, a run's shape), `order` (fair-share ordering), `slots` (the warm fleet's
free GPUs over time), `provision` (the cost model for launching or restarting),
`placement` (best fit, EASY backfill; hands what waits to `provision`), `preemption`
(the planner), `baselines` (per-job, fifo) and `decision` (`decide`, the entry point).
This package's namespace is the public API: callers import from `bot.domain.scheduling`, not
from its modules.
"""

from __future__ import annotations

from bot.domain.scheduling.baselines import fifo_fleet
from bot.domain.scheduling.decision import decide, next_wakeup, preempt_slot
from bot.domain.scheduling.history import RunHistory
from bot.domain.scheduling.model import (
    BURST_AFTER_S,
    DAY_S,
    IDLE_STOP_S,
    LAS_AFTER_S,
    POLICIES,
    Action,
    Allocation,
    BurstGate,
    FleetInstance,
    InstanceState,
    Launch,
    Market,
    Place,
    Preempt,
    QueuedRun,
    SchedulerConfig,
    Start,
    Stop,
    Terminate,
    run_shape,
    split_hosts,
)
from bot.domain.scheduling.order import decay_usage, fairshare_factors, iter_order, order_queue
from bot.domain.scheduling.preemption import PreemptionPlanner, fair_shares

LAYERS: tuple[str, ...] = (
    "history",
    "model",
    "order",
    "slots",
    "provision",
    "placement",
    "preemption",
    "baselines",
    "decision",
)

__all__ = [
    "BURST_AFTER_S",
    "DAY_S",
    "IDLE_STOP_S",
    "LAS_AFTER_S",
    "LAYERS",
    "POLICIES",
    "Action",
    "Allocation",
    "BurstGate",
    "FleetInstance",
    "InstanceState",
    "Launch",
    "Market",
    "Place",
    "Preempt",
    "PreemptionPlanner",
    "QueuedRun",
    "RunHistory",
    "SchedulerConfig",
    "Start",
    "Stop",
    "Terminate",
    "decay_usage",
    "decide",
    "fair_shares",
    "fairshare_factors",
    "fifo_fleet",
    "iter_order",
    "next_wakeup",
    "order_queue",
    "preempt_slot",
    "run_shape",
    "split_hosts",
]
