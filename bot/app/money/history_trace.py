"""The team's own runs as a simulator trace: `gpubot simulate --history 30d`.

Why: the figures an admin cares about are the team's, not a public cluster's. Every run
that started in the window becomes one trace row with what it actually did: when it was
submitted, its user, its GPUs and model, and how long it ran (its GPU-seconds over its
GPUs, from the usage intervals the bill is made of, so time spent preempted or queued
is not counted; a run still going counts up to now). Replaying that under another policy
or quota shows what the change would have cost. Whether a run checkpoints is the
simulator's `--checkpointable`; run times stay hidden from the scheduler as ever.

The output is the trace CSV itself (`bot.sim.simulate` parses it), so this module needs
nothing of the simulator's and the two cannot grow into each other.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from db.models import TrainingRun, UsageInterval, User
from db.session import transaction

HEADER = ("job_id", "user", "submit_time", "duration_s", "gpus", "gpu_type")
_RENTED = ("ondemand", "spot")


@dataclass(frozen=True)
class HistoryRun:
    """One run as it actually ran: what a replay takes from the team's history."""

    job_id: str  # "run-<id>"
    user: str  # the user's key
    submit_s: float  # seconds since the span's start
    duration_s: float  # its GPU-seconds over its GPUs
    gpus: int
    gpu_model: str
    checkpoints: bool  # submitted with --checkpoints
    spot: bool  # every GPU-second of it was on spot capacity


def history_runs(
    s: Session, since: datetime, until: datetime, now: datetime, *, rented_only: bool = False
) -> tuple[list[HistoryRun], int]:
    """(runs submitted in [since, until) that ran, in submission order; runs left out).

    Runs without a GPU model of their own, CPU runs and runs that never ran are left out
    (there is nothing to replay). `rented_only`: count only GPU time on rented instances
    (on demand or spot), for a replay of what a fleet setting changes: time on the
    team's own machines has no bill a setting could cut."""
    gpu_s: dict[int, float] = {}
    spot_s: dict[int, float] = {}
    q = select(UsageInterval).where(
        col(UsageInterval.run_id).is_not(None), UsageInterval.started_at >= since
    )
    if rented_only:
        q = q.where(col(UsageInterval.market).in_(_RENTED))
    for iv in s.exec(q):
        end = iv.ended_at or now
        if iv.run_id is not None:
            secs = max(0.0, (end - iv.started_at).total_seconds())
            gpu_s[iv.run_id] = gpu_s.get(iv.run_id, 0.0) + secs
            if iv.market == "spot":
                spot_s[iv.run_id] = spot_s.get(iv.run_id, 0.0) + secs
    rows: list[HistoryRun] = []
    skipped = 0
    for run, user in s.exec(
        select(TrainingRun, User)
        .join(User, col(User.id) == col(TrainingRun.user_id))
        .where(TrainingRun.submitted_at >= since, TrainingRun.submitted_at < until)
        .order_by(col(TrainingRun.id))
    ):
        used = gpu_s.get(run.id or -1, 0.0)
        if not run.gpu_model or run.gpu_model == "cpu" or used <= 0 or run.gpu_count < 1:
            skipped += 1
            continue
        rows.append(
            HistoryRun(
                job_id=f"run-{run.id}",
                user=user.key,
                submit_s=round((run.submitted_at - since).total_seconds(), 3),
                duration_s=round(used / run.gpu_count, 3),
                gpus=run.gpu_count,
                gpu_model=run.gpu_model,
                checkpoints=run.checkpoints,
                spot=spot_s.get(run.id or -1, 0.0) >= used,
            )
        )
    rows.sort(key=lambda r: (r.submit_s, r.job_id))
    return rows, skipped


def history_trace(engine: Engine, since: datetime, now: datetime) -> tuple[str, int]:
    """(trace CSV text, runs left out) for runs submitted in [since, now) that ran.

    Times are seconds since `since` (`history_runs`)."""
    with transaction(engine, write=False) as s:
        rows, skipped = history_runs(s, since, now, now)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(HEADER)
    for r in rows:
        w.writerow(
            [r.job_id, r.user, f"{r.submit_s:.3f}", f"{r.duration_s:.3f}", r.gpus, r.gpu_model]
        )
    return out.getvalue(), skipped
