"""The baseline policies the simulator compares the product with: per-job and fifo.

``per-job`` is what a launch-per-job tool does; ``fifo`` is a plain cluster with a fixed
fleet. Kept apart so that the fair policy's modules carry none of their rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from bot.domain.scheduling.model import (
    Action,
    FleetInstance,
    Launch,
    Market,
    Place,
    QueuedRun,
    SchedulerConfig,
    Terminate,
    run_shape,
)
from bot.domain.scheduling.slots import Slot, hosts_for
from provisioning.catalog import Catalog


def _committed(fleet: Iterable[FleetInstance]) -> int:
    return sum(i.gpus for i in fleet if i.state != "stopped")


def decide_per_job(
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


def decide_fifo(
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
    slots: list[Slot] = [
        Slot(
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
                    Slot(
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
        k, per = hosts_for(run, group)
        if k == 0:
            break
        fits = [s for s in group if s.free >= per]
        if k == 1:
            if not fits:
                break
            pick = [min(fits, key=lambda s: (s.ready, s.free, s.ref))]
        else:
            fits.sort(key=lambda s: (s.ready, s.free, s.ref))
            by_type: dict[str, list[Slot]] = {}
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
