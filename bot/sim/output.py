"""`gpubot simulate`'s files and table: the schedule and the instances as the simulator
contract's CSVs (docs/SIMULATOR.md), and the summary it prints."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from bot.sim.simulate import ScheduledJob, SimResult
from provisioning.simulated import InstanceRecord

SCHEDULE_HEADER = ("job_id", "user", "instance_ids", "submit_s", "start_s", "end_s", "gpus")
INSTANCES_HEADER = (
    "instance_id",
    "instance_type",
    "market",
    "launch_s",
    "ready_s",
    "end_s",
    "stopped",
    "usd",
)


def write_schedule(path: Path, schedule: Sequence[ScheduledJob]) -> None:
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(SCHEDULE_HEADER)
        for s in schedule:
            w.writerow(
                [
                    s.job_id,
                    s.user,
                    ";".join(s.instance_ids),
                    repr(s.submit_s),
                    repr(s.start_s),
                    repr(s.end_s),
                    s.gpus,
                ]
            )


def write_instances(path: Path, records: Sequence[InstanceRecord]) -> None:
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(INSTANCES_HEADER)
        for r in records:
            stopped = ";".join(f"{a!r}-{b!r}" for a, b in r.stopped)
            end = "" if r.end_s is None else repr(r.end_s)
            w.writerow(
                [
                    r.instance_id,
                    r.instance_type,
                    r.market,
                    repr(r.launch_s),
                    repr(r.ready_s),
                    end,
                    stopped,
                    f"{r.usd:.6f}",
                ]
            )


def summary_table(res: SimResult) -> str:
    h = 3600.0
    lines = [
        f"policy           {res.policy}",
        f"jobs             {res.jobs}"
        + (f"  ({len(res.rejected)} rejected)" if res.rejected else ""),
        f"total cost       ${res.total_cost_usd:,.2f}",
        f"ideal cost       ${res.ideal_cost_usd:,.2f}",
        f"cost efficiency  {res.cost_efficiency:.3f}",
        f"avg queue        {res.avg_queue_s / h:.2f} h   (p95 {res.p95_queue_s / h:.2f} h)",
        f"avg completion   {res.avg_jct_s / h:.2f} h",
        f"GPU utilization  {res.gpu_utilization:.3f}",
        f"makespan         {res.makespan_s / h:.2f} h",
        f"instances        {len(res.instances)}",
        f"preemptions      {res.preemptions}",
    ]
    if res.owned_gpus:
        after = res.burst_after_s
        when = (
            "never" if after is None else ("at once" if after == 0 else f"after {after / 60:g} min")
        )
        lines += [
            f"owned GPUs       {res.owned_gpus} (at $0; total cost is the cloud's bill)",
            f"burst            {when}: {res.burst_jobs} jobs ran on the cloud, "
            f"{res.cloud_gpu_h:,.1f} GPU-h bought",
        ]
    return "\n".join(lines)
