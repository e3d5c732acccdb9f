"""Provisioning by the cost model: when a restarted or new instance pays for itself.

Runs that must wait are bundled onto a stopped instance or a new one only when the
waiting it saves, valued at `wait_value` times the GPUs' own price, beats the boot
billing and the GPUs the bundle leaves empty (see the package docstring).

Where the catalog has the model in several sizes (a 1-GPU and a 4-GPU type), the size
bought is the one that serves the waiting GPUs cheapest: its net worth per GPU served,
with the waiting valued at the model's cheapest per-GPU price whatever size is bought,
and the size's own per-GPU price above that counted as a cost. Valuing the waiting at
each size's own price made the dearer-per-GPU size look worth more, and a lone 1-GPU
run bought a 4-GPU instance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bot.domain.scheduling.model import (
    Action,
    FleetInstance,
    Launch,
    Market,
    Place,
    QueuedRun,
    SchedulerConfig,
    Start,
    est,
    gpu_price,
    market_of,
    min_gpus,
    run_shape,
)
from bot.domain.scheduling.slots import (
    Slot,
    earliest_start,
    free_profile,
    hosts_for,
    reserve_profile,
)
from provisioning.catalog import Catalog, InstanceType


def provision(
    waiting: list[QueuedRun],
    slots: dict[tuple[str, str], list[Slot]],
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
        by_group.setdefault((run.gpu_model, market_of(run)), []).append(run)
    for (model, market), runs in by_group.items():
        can_start = any(
            i.gpu_model == model and i.market == market and i.gpus <= headroom for i in stopped_left
        )
        if headroom < min_gpus(catalog, model) and not can_start:
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
            # (net worth per GPU served, GPUs served, type name, type, hosts, restart)
            options: list[tuple[float, int, str, InstanceType, int, FleetInstance | None]] = []
            base_hr = gpu_price(catalog, model, market)
            for t in catalog.for_model(model):
                if first.gpus <= t.gpus:
                    k = 1
                elif t.instance_type == shape[0].instance_type:
                    k = shape[1]
                else:
                    continue
                usd = t.hourly(market)
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
                net, members = _bundle_value(
                    runs, i, waits, placed, t, k, usd, delay, bill, base_hr, now, config
                )
                if net > 0:
                    served = sum(r.gpus for r, _ in members)
                    options.append((net / served, served, t.instance_type, t, k, reuse))
            # the most worth per GPU served; among equals the bigger bundle (fewer boots)
            options.sort(key=lambda o: (-o[0], -o[1], o[2]))
            if not options:
                i += 1
                continue
            _, _, _, t, k, reuse = options[0]
            usd = t.hourly(market)
            delay = config.start_s if reuse is not None else config.boot_s + config.setup_s
            bill = max(delay, config.min_bill_s) if reuse is not None else delay
            _, members = _bundle_value(
                runs, i, waits, placed, t, k, usd, delay, bill, base_hr, now, config
            )
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
                Slot(None, r, t.gpus, ready, usd, t.instance_type, t.gpus, ready) for r in refs
            ]
            for run, per in members:
                placed.add(run.run_id)
                hosts = new_slots if k > 1 else [new_slots[0]]
                for s in hosts:
                    s.free -= per
                    s.horizon = max(s.horizon, ready + est(run, config))
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
    base_hr: float,
    now: float,
    config: SchedulerConfig,
) -> tuple[float, list[tuple[QueuedRun, int]]]:
    """Net worth (USD) of provisioning k instances of t for runs[i] and whoever else fits.

    The waiting saved is valued at `base_hr`, one GPU's cheapest price for the model, so
    that every size is credited alike for the same runs; what t charges per GPU above
    it, for as long as the runs are expected to hold them, is a cost of choosing t."""
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
    base_usd_s = min(base_hr / 3600.0, gpu_usd_s)
    saved = 0.0
    longest = 0.0
    held = 0.0  # GPU-seconds the members are expected to hold
    for run, _ in members:
        w = waits.get(run.run_id, math.inf) - now
        saved += run.gpus * (min(w, 1e9) - delay)
        longest = max(longest, est(run, config))
        held += run.gpus * est(run, config)
    value = config.wait_value * saved * base_usd_s
    premium = held * (gpu_usd_s - base_usd_s)
    cost = k * (bill_s * usd_hr / 3600.0 + free * gpu_usd_s * longest) + premium
    return value - cost, members


def _expected_waits(
    runs: list[QueuedRun], group: list[Slot], now: float, config: SchedulerConfig
) -> dict[str, float]:
    """When each waiting run would start on the warm fleet alone, in queue order.

    Conservative backfill over step profiles: each run takes the earliest gap that fits
    it, and the next run sees what is left."""
    profiles: list[tuple[Slot, list[tuple[float, int]]]] = []
    for s in group:
        if s.inst is None:
            prof = [(s.ready, s.free)]
            if s.free < s.gpus:
                prof.append((s.horizon, s.gpus))
        else:
            prof = free_profile(s.inst, config, now)
            taken = s.inst.free_gpus - s.free
            if taken:
                reserve_profile(prof, now, s.horizon, taken)
        profiles.append((s, prof))
    out: dict[str, float] = {}
    for run in runs:
        dur = est(run, config)
        k, per = hosts_for(run, group)
        if k == 0:
            out[run.run_id] = math.inf
            continue
        if k == 1:
            best = (math.inf, -1)
            for idx, (s, prof) in enumerate(profiles):
                if s.gpus < per:
                    continue
                t = earliest_start(prof, per, dur)
                if t < best[0]:
                    best = (t, idx)
            out[run.run_id] = best[0]
            if best[1] >= 0 and best[0] != math.inf:
                reserve_profile(profiles[best[1]][1], best[0], best[0] + dur, per)
        else:
            times = sorted(
                (earliest_start(prof, per, dur), idx)
                for idx, (s, prof) in enumerate(profiles)
                if s.gpus >= per
            )
            if len(times) < k or times[k - 1][0] == math.inf:
                out[run.run_id] = math.inf
                continue
            t0 = times[k - 1][0]
            out[run.run_id] = t0
            for _, idx in times[:k]:
                reserve_profile(profiles[idx][1], t0, t0 + dur, per)
    return out
