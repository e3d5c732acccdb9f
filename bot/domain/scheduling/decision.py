"""The scheduler's entry point: `decide` runs one policy over the queue and the fleet.

Also the timers a caller needs to know when to decide again (`next_wakeup`) and when a
decision may preempt (`preempt_slot`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bot.domain.scheduling.baselines import decide_fifo, decide_per_job
from bot.domain.scheduling.model import POLICIES, Action, FleetInstance, QueuedRun, SchedulerConfig
from bot.domain.scheduling.placement import place_fair
from bot.domain.scheduling.preemption import PreemptionPlanner
from provisioning.catalog import Catalog


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
        return decide_per_job(queue, fleet, now, catalog, config)
    if config.policy == "fifo":
        return decide_fifo(queue, fleet, now, catalog, config, more_expected)
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
        for r in queue:  # the soonest run to reach `after` of waiting, in one pass
            due = r.submit_s + after
            if due > now and (best is None or due < best):
                best = due
    idle = config.idle_stop_after()
    for inst in fleet:
        t: float | None = None
        if inst.owned:
            continue  # never stopped: its idle time is due nothing
        if inst.state == "running" and not inst.allocations and inst.idle_since_s is not None:
            t = inst.idle_since_s + idle
        elif inst.state == "stopped" and inst.stopped_since_s is not None:
            t = inst.stopped_since_s + config.terminate_after(inst.usd_hr)
        if t is not None and t != math.inf and (best is None or t < best):
            best = t
    return best


def _decide_fair(
    queue: Sequence[QueuedRun],
    fleet: Sequence[FleetInstance],
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
    usage: Mapping[str, float],
    preempt_due: bool = True,
) -> list[Action]:
    actions = place_fair(queue, fleet, now, catalog, config, usage)
    if not (config.preempt and preempt_due):
        return actions
    if not any(i.preemptible_users or i.stopping_gpus for i in fleet):
        # Every step of the planner moves a running run that checkpoints, or hands on
        # GPUs a preempted one is giving back: with neither there is nothing to plan
        # (the usual case where no run checkpoints, and a long decision saved).
        return actions
    actions.extend(PreemptionPlanner(fleet, actions, now, catalog, config).plan(queue, usage))
    return actions
