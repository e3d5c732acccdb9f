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
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from db.models import TrainingRun, UsageInterval, User
from db.session import transaction

HEADER = ("job_id", "user", "submit_time", "duration_s", "gpus", "gpu_type")


def history_trace(engine: Engine, since: datetime, now: datetime) -> tuple[str, int]:
    """(trace CSV text, runs left out) for runs submitted in [since, now) that ran.

    Times are seconds since `since`. Runs without a GPU model of their own, CPU runs and
    runs that never ran are left out (there is nothing to replay)."""
    rows: list[tuple[float, str, str, float, int, str]] = []
    skipped = 0
    with transaction(engine, write=False) as s:
        gpu_s: dict[int, float] = {}
        for iv in s.exec(
            select(UsageInterval).where(
                col(UsageInterval.run_id).is_not(None), UsageInterval.started_at >= since
            )
        ):
            end = iv.ended_at or now
            if iv.run_id is not None:
                secs = max(0.0, (end - iv.started_at).total_seconds())
                gpu_s[iv.run_id] = gpu_s.get(iv.run_id, 0.0) + secs
        for run, user in s.exec(
            select(TrainingRun, User)
            .join(User, col(User.id) == col(TrainingRun.user_id))
            .where(TrainingRun.submitted_at >= since, TrainingRun.submitted_at < now)
            .order_by(col(TrainingRun.id))
        ):
            used = gpu_s.get(run.id or -1, 0.0)
            if not run.gpu_model or run.gpu_model == "cpu" or used <= 0 or run.gpu_count < 1:
                skipped += 1
                continue
            rows.append(
                (
                    (run.submitted_at - since).total_seconds(),
                    f"run-{run.id}",
                    user.key,
                    round(used / run.gpu_count, 3),
                    run.gpu_count,
                    run.gpu_model,
                )
            )
    rows.sort()
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(HEADER)
    for submit, job_id, user_key, dur, gpus, model in rows:
        w.writerow([job_id, user_key, f"{submit:.3f}", f"{dur:.3f}", gpus, model])
    return out.getvalue(), skipped
