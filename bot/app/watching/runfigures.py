"""What the views of runs show of running runs, read for many runs at once: each run's
cost so far and its GPUs' latest utilization. `/gpu queue` (and App Home, which shows the
caller's runs through it) asked both run by run, two statements per running run (76 of a
queue's statements with 36 runs going); here they are two statements whatever the number
of runs. `bot.app.watching.runwatch` reads one run's through the same functions, so the live
message, the result and the queue say the same."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from bot.domain.metering import metered_micro, to_cents
from db.models import GpuSample, TrainingRun, UsageInterval


def costs_so_far(
    s: Session, run_ids: Collection[int], now: datetime
) -> dict[int, tuple[float, float]]:
    """Each run's (USD, GPU-hours) of its usage intervals up to `now`, every run asked
    about included (0 for one with none): the same intervals the bill is made of, so the
    live figure and the final one agree."""
    micro: dict[int, int] = dict.fromkeys(run_ids, 0)
    hours: dict[int, float] = dict.fromkeys(run_ids, 0.0)
    if run_ids:
        columns: tuple[Any, ...] = (
            UsageInterval.run_id,
            UsageInterval.usd_per_hour,
            UsageInterval.started_at,
            UsageInterval.ended_at,
        )
        rows = s.connection().execute(
            select(*columns)
            .where(col(UsageInterval.run_id).in_(sorted(run_ids)))
            .order_by(col(UsageInterval.id))
        )
        for run_id, usd_per_hour, started, ended in rows:
            end = ended or now
            if end > started:
                # Metered exactly as `/gpu cost` and the bill meter it, and rounded to the
                # cent as they show it: a float sum rounded its own way could show a cent
                # less in the DM.
                micro[run_id] += metered_micro(Decimal(str(usd_per_hour)), started, end)
                hours[run_id] += (end - started).total_seconds() / 3600
    return {r: (float(to_cents(Decimal(m) / 1_000_000)), hours[r]) for r, m in micro.items()}


def gpus_now(s: Session, run_ids: Collection[int]) -> dict[int, str]:
    """Each run's GPUs at their latest sample since it (last) started, as a phrase
    ("GPU 87%, mem 30.1/40 GB"); a run with no samples is left out. One statement: each
    GPU's latest sample picked in the database (a row per GPU comes back, not a row per
    minute each has run), found through the (run, time) index."""
    if not run_ids:
        return {}
    latest = (
        func.row_number()
        .over(
            partition_by=(col(GpuSample.run_id), col(GpuSample.host_id), col(GpuSample.gpu_index)),
            order_by=(col(GpuSample.at).desc(), col(GpuSample.id).desc()),
        )
        .label("latest")
    )
    columns: tuple[Any, ...] = (
        GpuSample.run_id,
        GpuSample.host_id,
        GpuSample.gpu_index,
        GpuSample.util_pct,
        GpuSample.mem_used_mb,
        GpuSample.mem_total_mb,
        latest,
    )
    ranked: Any = (
        select(*columns)
        .join(TrainingRun, col(TrainingRun.id) == col(GpuSample.run_id))
        .where(
            col(GpuSample.run_id).in_(sorted(run_ids)),
            col(TrainingRun.started_at).is_not(None),
            col(GpuSample.at) >= col(TrainingRun.started_at),
        )
        .subquery()
    )
    rows = s.connection().execute(
        select(ranked.c.run_id, ranked.c.util_pct, ranked.c.mem_used_mb, ranked.c.mem_total_mb)
        .where(ranked.c.latest == 1)
        .order_by(ranked.c.run_id, ranked.c.host_id, ranked.c.gpu_index)
    )
    by_run: dict[int, list[tuple[float, float, float]]] = {}
    for run_id, util, used, total in rows:
        by_run.setdefault(run_id, []).append((util, used, total))
    out = {}
    for run_id, gpus in by_run.items():
        util = sum(g[0] for g in gpus) / len(gpus)
        used = sum(g[1] for g in gpus) / 1024
        total = sum(g[2] for g in gpus) / 1024
        out[run_id] = f"GPU {util:.0f}%, mem {used:.1f}/{total:.0f} GB"
    return out
