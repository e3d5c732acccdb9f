"""The packing bound: how cost-efficient any schedule that starts every job on arrival can be.

Why: ``cost_efficiency`` is ideal / total, where the ideal pays each job's GPU-seconds at
the cheapest on-demand per-GPU price and nothing else. That ideal is out of reach when
instances come in 8-GPU sizes (A100, H100): a lone one-GPU job at night keeps a whole
8-GPU instance running, whoever schedules it. A goal of 0.75 on a trace where no schedule
can pass 0.7 without delaying jobs is a goal about delaying jobs, not about packing; this
bound says which it is.

What it is, exactly. Every job runs at its submit time for its trace duration, on as
many instances as wanted (no quota, no queue). At each instant, for each GPU model,
``b`` GPUs of that model are busy (the sum of the running jobs' GPUs). The fleet paid at
that instant is the cheapest set of that model's instance types, by on-demand hourly
price, whose GPUs add up to at least ``b`` (a small covering knapsack, ``_cover``). With
one instance size of ``G`` GPUs at price ``P`` that is ``ceil(b / G) * P``: perfect
consolidation at every instant. ``packed_cost_usd`` is the integral of that price over
the trace; ``efficiency_bound`` is ``ideal_cost_usd / packed_cost_usd`` with the
simulator's ideal (`bot.sim.simulate`).

For every schedule in which each job runs once, uninterrupted, from its submit time to
submit + duration, the simulator's total cost is at least ``packed_cost_usd``: at each
instant its running instances carry at least the busy GPUs, and the cheapest way to carry
them is the cover. So such a schedule's efficiency is at most the bound.

What it ignores, and so where it is not a bound:

* Boot and setup time, the 60 s minimum per start, the idle time before an idle stop,
  stopped instances' storage, and a resumed job's lost work and resume time: each only
  adds cost to a real schedule, so leaving them out keeps the bound an upper bound.
* That a job must fit on one instance (or a run over whole instances): ignored, which
  can only lower the cover's price; still an upper bound.
* Queueing. A schedule that delays jobs changes ``b(t)``: a late job can fill GPUs that
  an earlier one left idle on an instance, so the overlap, and the efficiency, can grow
  past the bound (in the limit, holding every job until eight one-GPU jobs can start
  together fills every instance). The bound is therefore *not* strict against a
  schedule with queueing, and a fair or fifo figure above it is possible: it means that
  schedule bought packing with waiting. Read it as the efficiency on offer without
  making anyone wait.
* The quota. The no-wait schedule may need more GPUs at once than ``--max-gpus``
  allows; ``over_quota_s`` says for how long it would, since under the quota such
  stretches force waiting (and the bound is not binding there either).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from bot.sim.simulate import SimResult, TraceJob
from provisioning.catalog import Catalog
from provisioning.costs import DEFAULT_COSTS


@dataclass(frozen=True)
class PackingBound:
    """The no-wait, perfectly consolidated schedule's cost, against the ideal."""

    ideal_cost_usd: float  # the simulator's ideal: GPU-seconds at the cheapest per-GPU price
    packed_cost_usd: float  # the cheapest fleet that carries every job from its submit time
    efficiency_bound: float  # ideal / packed
    peak_gpus: int  # most GPUs busy at once (all models together)
    over_quota_s: float  # how long that schedule needs more GPUs than the quota (0 without one)

    def figures(self) -> dict[str, object]:
        return {
            "ideal_cost_usd": round(self.ideal_cost_usd, 4),
            "packed_cost_usd": round(self.packed_cost_usd, 4),
            "efficiency_bound": round(self.efficiency_bound, 6),
            "peak_gpus": self.peak_gpus,
            "over_quota_s": round(self.over_quota_s, 3),
        }


def packing_bound(
    jobs: Sequence[TraceJob], catalog: Catalog, max_gpus: int | None = None
) -> PackingBound:
    """The packing bound of `jobs` (module docstring); `max_gpus` only sets `over_quota_s`.

    A job whose model no instance type carries cannot run anywhere and is left out, as
    the simulator rejects it."""
    by_model: dict[str, list[TraceJob]] = {}
    for j in jobs:
        if j.duration_s > 0 and catalog.for_model(j.gpu_model):
            by_model.setdefault(j.gpu_model, []).append(j)
    ideal = 0.0
    packed = 0.0
    # all models' busy GPUs over time, for the peak and the time over the quota
    deltas: dict[float, int] = {}
    for model, group in sorted(by_model.items()):
        types = [(t.gpus, t.ondemand_usd_hr) for t in catalog.for_model(model)]
        per_gpu = min(t.ondemand_per_gpu_hr for t in catalog.for_model(model))
        ideal += sum(j.gpus * j.duration_s for j in group) * per_gpu / 3600.0
        steps: dict[float, int] = {}
        for j in group:
            end = j.submit_s + j.duration_s
            steps[j.submit_s] = steps.get(j.submit_s, 0) + j.gpus
            steps[end] = steps.get(end, 0) - j.gpus
            deltas[j.submit_s] = deltas.get(j.submit_s, 0) + j.gpus
            deltas[end] = deltas.get(end, 0) - j.gpus
        profile = _profile(steps)
        cover = _cover(types, max(b for _, _, b in profile))
        packed += sum((t1 - t0) * cover[b] for t0, t1, b in profile) / 3600.0
    total = _profile(deltas)
    peak = max((b for _, _, b in total), default=0)
    over = sum(t1 - t0 for t0, t1, b in total if max_gpus is not None and b > max_gpus)
    return PackingBound(
        ideal_cost_usd=ideal,
        packed_cost_usd=packed,
        efficiency_bound=ideal / packed if packed > 0 else 1.0,
        peak_gpus=peak,
        over_quota_s=over,
    )


def _profile(steps: dict[float, int]) -> list[tuple[float, float, int]]:
    """(from, to, busy GPUs) for each stretch between consecutive distinct event times."""
    out: list[tuple[float, float, int]] = []
    busy = 0
    times = sorted(steps)
    for t0, t1 in pairwise(times):
        busy += steps[t0]
        if busy > 0:
            out.append((t0, t1, busy))
    return out


def _cover(types: Sequence[tuple[int, float]], most: int) -> list[float]:
    """cover[b]: the cheapest hourly price of instances (any number of each type) with at
    least b GPUs, for b = 0..most."""
    cover = [0.0] + [math.inf] * most
    for b in range(1, most + 1):
        cover[b] = min(usd + cover[max(0, b - g)] for g, usd in types)
    return cover


def arrival_window_efficiency(
    result: SimResult,
    jobs: Sequence[TraceJob],
    catalog: Catalog,
    storage_usd_s: float = DEFAULT_COSTS.storage_usd_per_s,
) -> float:
    """`cost_efficiency` measured only from the first submission to the last: the ideal
    cost of the GPU time the schedule used in that window over what its instances cost
    in it (running at their on-demand price, stopped at storage).

    Why: a finite trace ends with a drain. After the last submission nothing new arrives,
    and the longest jobs run on alone for days (on the 7-day team loads, 86-131 hours
    after the last job came), each holding an 8-GPU instance for one GPU. A team keeps
    submitting, so production never sees that drain; reported beside the whole-trace
    figure, not instead of it. The per-start minimum bill is left out (a few cents)."""
    by_id = {j.job_id: j for j in jobs}
    if not by_id or not result.schedule:
        return 1.0
    lo = min(j.submit_s for j in jobs)
    hi = max(j.submit_s for j in jobs)
    if hi <= lo:
        return result.cost_efficiency

    def inside(a: float, b: float) -> float:
        return max(0.0, min(b, hi) - max(a, lo))

    per_gpu = {
        m: min(t.ondemand_per_gpu_hr for t in catalog.for_model(m))
        for m in {j.gpu_model for j in jobs}
        if catalog.for_model(m)
    }
    ideal = sum(
        inside(seg.start_s, seg.end_s) * seg.gpus * per_gpu[by_id[seg.job_id].gpu_model] / 3600.0
        for seg in result.schedule
    )
    last_end = max(seg.end_s for seg in result.schedule)  # for an instance still alive
    cost = 0.0
    for inst in result.instances:
        end = inst.end_s if inst.end_s is not None else last_end
        stopped = sum(inside(a, b) for a, b in inst.stopped)
        itype = catalog.get(inst.instance_type)
        assert itype is not None, inst.instance_type
        hourly = itype.ondemand_usd_hr
        cost += (inside(inst.launch_s, end) - stopped) * hourly / 3600.0
        cost += stopped * storage_usd_s
    return ideal / cost if cost > 0 else 1.0


@dataclass(frozen=True)
class PaidGpuTime:
    """Where a schedule's paid GPU-seconds went (instances running, not stopped).

    Why: on the small-team loads a third of what is paid is idle GPUs on instances that
    are running a job (one long one-GPU job on an 8-GPU instance at night), not booting,
    idle stops or lost work; this says which, so a change to the scheduler can be aimed
    at the part that is large."""

    paid_gpu_s: float  # GPUs x running time of every instance
    busy_gpu_s: float  # GPU-seconds running a job segment (lost work and resumes included)
    partial_idle_gpu_s: float  # idle GPUs on an instance that runs at least one job
    empty_gpu_s: float  # an instance running no job: booting, restarting, before a stop
    redone_gpu_s: float  # busy beyond the jobs' own GPU-seconds: work done again, resumes

    def figures(self) -> dict[str, object]:
        paid = self.paid_gpu_s or 1.0
        return {
            "paid_gpu_h": round(self.paid_gpu_s / 3600.0, 3),
            "busy": round(self.busy_gpu_s / paid, 4),
            "idle_beside_a_job": round(self.partial_idle_gpu_s / paid, 4),
            "idle_with_no_job": round(self.empty_gpu_s / paid, 4),
            "done_again": round(self.redone_gpu_s / paid, 4),
        }


def paid_gpu_time(result: SimResult, jobs: Sequence[TraceJob]) -> PaidGpuTime:
    """Splits the paid GPU-seconds of `result` (PaidGpuTime). A run over several
    instances counts its GPUs evenly on each; an instance still alive at the end runs to
    the last segment's end."""
    per_instance: dict[str, dict[float, int]] = {}
    busy = 0.0
    for seg in result.schedule:
        share = seg.gpus // len(seg.instance_ids)  # a run over k instances: gpus/k on each
        for iid in seg.instance_ids:
            steps = per_instance.setdefault(iid, {})
            steps[seg.start_s] = steps.get(seg.start_s, 0) + share
            steps[seg.end_s] = steps.get(seg.end_s, 0) - share
        busy += (seg.end_s - seg.start_s) * seg.gpus
    last_end = max((seg.end_s for seg in result.schedule), default=0.0)
    paid = partial = empty = 0.0
    for inst in result.instances:
        end = inst.end_s if inst.end_s is not None else max(last_end, inst.launch_s)
        running: list[tuple[float, float]] = []
        t = inst.launch_s
        for a, b in sorted(inst.stopped):
            if a > t:
                running.append((t, min(a, end)))
            t = max(t, b)
        if end > t:
            running.append((t, end))
        # the stretches with a job on the instance, and how many of its GPUs are busy
        stretches = _profile(per_instance.get(inst.instance_id, {}))
        for lo, hi in running:
            paid += (hi - lo) * inst.gpus
            with_a_job = 0.0
            for t0, t1, b in stretches:
                overlap = min(t1, hi) - max(t0, lo)
                if overlap > 0:
                    with_a_job += overlap
                    partial += overlap * max(0, inst.gpus - b)
            empty += (hi - lo - with_a_job) * inst.gpus
    done = {seg.job_id for seg in result.schedule}
    own = sum(j.duration_s * j.gpus for j in jobs if j.job_id in done and j.duration_s > 0)
    return PaidGpuTime(
        paid_gpu_s=paid,
        busy_gpu_s=busy,
        partial_idle_gpu_s=partial,
        empty_gpu_s=empty,
        redone_gpu_s=max(0.0, busy - own),
    )
