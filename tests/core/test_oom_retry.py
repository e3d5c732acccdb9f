"""Out of GPU memory (exit 77): the run goes back in line once with half the batch it
reported, its owner is told; a second OOM fails it with the advice. Real runner, real
status files, this machine's local runner."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.runs import RunService, runner_command
from bot.domain.commands import Run
from db.models import TrainingRun, UsageInterval
from tests.core.helpers import actor, make_service, runs_here
from tests.core.test_runs import dms_to, local_host, run_until, state

# Runs out of memory the first time (no marker yet), then trains at the batch it is given.
SCRIPT = """\
import os, pathlib, sys
import training
marker, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
batch = int(os.environ.get("GPUBOT_BATCH_SIZE", "64"))
training.report(step=0, batch_size=batch, force=True)
if not marker.exists() or sys.argv[3] == "always":
    marker.write_text(str(batch))
    print(f"CUDA out of memory at batch {batch}", flush=True)
    sys.exit(77)
out.write_text(f"{batch} {os.environ.get('GPUBOT_BATCH_SCALE')}")
"""


def submit(tmp_path: Path, engine: Engine, mode: str) -> tuple[RunService, int]:
    svc, _ = make_service(engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    script = tmp_path / "oom.py"
    script.write_text(SCRIPT)
    cmd = Run(
        command=(sys.executable, str(script), str(tmp_path / "marker"), str(tmp_path / "out"), mode)
    )
    return runs, runs.submit(actor(svc, "dana"), cmd).extra["run_id"]


def test_an_oom_is_retried_once_with_half_the_batch_and_then_succeeds(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    runs, rid = submit(tmp_path, sqlite_engine, "once")
    run_until(runs, lambda: state(sqlite_engine, rid).state in {"succeeded", "failed"})
    run = state(sqlite_engine, rid)
    assert run.state == "succeeded" and run.exit_code == 0
    assert (tmp_path / "marker").read_text() == "64"
    assert (tmp_path / "out").read_text() == "32 0.5", "the retry ran at half the batch"
    assert run.metrics["oom_retry"]["from_batch"] == 64
    assert run.metrics["oom_retry"]["batch_size"] == 32
    texts = dms_to(sqlite_engine, "dana")
    told = [t for t in texts if "ran out of GPU memory" in t]
    assert told == [
        f"Run #{rid} ran out of GPU memory at batch 64. It is back in line and will be "
        "retried once with batch 32."
    ]
    assert texts.index(told[0]) < len(texts) - 1 and "finished" in texts[-1]
    with Session(sqlite_engine) as s:
        ivs = s.exec(select(UsageInterval).where(UsageInterval.run_id == rid)).all()
    assert len(ivs) == 2 and all(iv.ended_at is not None for iv in ivs), (
        "each attempt's GPU time is on record and closed"
    )


def test_a_second_oom_fails_the_run_with_the_advice(sqlite_engine: Engine, tmp_path: Path) -> None:
    runs, rid = submit(tmp_path, sqlite_engine, "always")
    run_until(runs, lambda: state(sqlite_engine, rid).state in {"succeeded", "failed"})
    run = state(sqlite_engine, rid)
    assert run.state == "failed" and run.exit_code == 77
    assert (tmp_path / "marker").read_text() == "32", "the second try was at half the batch"
    error = run.metrics["summary"]["error"]
    assert "out of GPU memory" in error and "smaller `--batch-size`" in error
    texts = dms_to(sqlite_engine, "dana")
    assert sum("ran out of GPU memory at batch 64" in t for t in texts) == 1, "retried once only"
    with Session(sqlite_engine) as s:
        n = s.exec(select(TrainingRun).where(col(TrainingRun.id) == rid)).one()
    assert n.finished_at is not None


def test_a_retry_passes_the_halved_batch_to_the_runner() -> None:
    placement = {"status": "/r/s.json", "checkpoints": "/r/ckpt"}

    def run(recipe: str | None = None, metrics: dict[str, Any] | None = None) -> TrainingRun:
        return TrainingRun(
            user_id=1,
            command="python t.py",
            recipe=recipe,
            metrics=metrics or {},
            submitted_at=datetime.now(UTC),
        )

    recipe = run("digits")
    assert "--batch-size" not in runner_command(recipe, placement, sys.executable)
    recipe.metrics = {"oom_retry": {"from_batch": 256, "batch_size": 128}}
    assert runner_command(recipe, placement, sys.executable).endswith(
        "--recipe digits --batch-size 128"
    )
    unknown = run(metrics={"oom_retry": {"batch_size": None}})
    line = runner_command(unknown, placement, sys.executable)
    assert line.endswith("-- env GPUBOT_OOM_RETRY=1 GPUBOT_BATCH_SCALE=0.5 python t.py")
    first = run()
    assert runner_command(first, placement, sys.executable).endswith(" -- python t.py")
