"""Watching real runs (bot.app.watching.runwatch): health alerts to the owner once each while the run
goes on, the live message edited in place on the virtual clock's cadence, the result DM
with its chart, and a sweep's table. User scripts report through `training.report`;
each waits for a file the test writes, so nothing depends on how fast this machine is."""

from __future__ import annotations

import io
import itertools
import re
import sys
import threading
from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.delivery import deliver
from bot.app.outbox import EDIT_SPACING, SUPERSEDED
from bot.app.runs import RunService
from bot.app.service import GpuService
from bot.domain.commands import Queue, Run
from bot.domain.views import Table
from bot.faces.dispatch import handle_text
from bot.faces.terminal import TerminalNotifier
from db.models import GpuSample, Notification, TrainingRun
from tests.core.helpers import actor, make_service, runs_here
from tests.core.test_runs import dms_to, local_host, run_until, state

SCRIPT = """\
import os, sys, time
import training
go, losses = sys.argv[1], [float(x) for x in sys.argv[2].split(",")]
for i, loss in enumerate(losses):
    training.report(step=i + 1, loss=loss, total_steps=len(losses) * 10, force=True)
while not os.path.exists(go):
    time.sleep(0.05)
"""


def user_run(runs: RunService, svc: GpuService, tmp_path: Path, who: str, losses: str) -> int:
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    go = tmp_path / f"go-{who}"
    cmd = (sys.executable, str(script), str(go), losses)
    return int(runs.submit(actor(svc, who), Run(command=cmd)).extra["run_id"])


def alerts(engine: Engine, run_id: int) -> list[Notification]:
    with Session(engine) as s:
        return list(
            s.exec(
                select(Notification)
                .where(col(Notification.dedupe_key).startswith(f"run-health:{run_id}:"))
                .order_by(col(Notification.id))
            )
        )


def step_seen(engine: Engine, run_id: int, step: int) -> bool:
    return state(engine, run_id).metrics.get("step") == step


def finish(runs: RunService, engine: Engine, tmp_path: Path, run_id: int, go: str) -> TrainingRun:
    (tmp_path / go).touch()
    run_until(runs, lambda: state(engine, run_id).finished_at is not None)
    return state(engine, run_id)


def test_a_script_reporting_nan_gets_one_alert_while_it_runs(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    # One NaN, the last report: the alert counts what was seen when it was made, and the
    # run's watcher may have a tick read the status between two quick reports.
    losses = "2.3,1.5,nan"
    rid = user_run(runs, svc, tmp_path, "alice", losses)
    run_until(runs, lambda: bool(alerts(sqlite_engine, rid)))
    assert state(sqlite_engine, rid).state == "running", "told while it goes on"
    runs.poll()
    runs.poll()
    (alert,) = alerts(sqlite_engine, rid)
    assert alert.target == "alice" and alert.dedupe_key == f"run-health:{rid}:nonfinite"
    assert alert.text.startswith(f"Run #{rid} (`") and "1 NaN/inf loss was reported" in alert.text
    assert "Fix: lower the learning rate" in alert.text
    run = finish(runs, sqlite_engine, tmp_path, rid, "go-alice")
    assert run.state == "succeeded"
    last = dms_to(sqlite_engine, "alice")[-1]
    assert (
        last.startswith(f"⚠️ Run #{rid}") and "but its training went wrong (NaN/inf losses)" in last
    )
    assert len(alerts(sqlite_engine, rid)) == 1, "the final DM summarises; no second alert"


def test_a_diverging_script_is_warned_and_its_result_says_so(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    losses = "2.3,2.1,3.5,8.0,20.0"
    rid = user_run(runs, svc, tmp_path, "bob", losses)
    run_until(runs, lambda: bool(alerts(sqlite_engine, rid)))
    (alert,) = alerts(sqlite_engine, rid)
    # Step 4 (8.0) already diverges: a loaded machine's poll may read that status first.
    said = re.search(r"the loss is diverging: (8|20) at step (4|5), up from 2\.3", alert.text)
    assert said is not None and said.group(2) == {"8": "4", "20": "5"}[said.group(1)], alert.text
    finish(runs, sqlite_engine, tmp_path, rid, "go-bob")
    with Session(sqlite_engine) as s:
        result = s.exec(
            select(Notification).where(Notification.dedupe_key == f"run-finished:{rid}")
        ).one()
    assert "the loss diverged" in result.text and "Health" in str(result.view)
    assert result.attachment is not None and result.attachment[:8] == b"\x89PNG\r\n\x1a\n"


def test_telemetry_of_idle_and_full_gpus_raises_alerts(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The samples the sampling job attributes to the run (GpuSample.run_id) are read."""
    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    losses = "2.3,2.0,1.8"
    rid = user_run(runs, svc, tmp_path, "alice", losses)
    run_until(runs, lambda: step_seen(sqlite_engine, rid, 3))
    run = state(sqlite_engine, rid)
    with Session(sqlite_engine) as s:
        for i in range(6):
            s.add(
                GpuSample(
                    host_id=run.host_id or 0,
                    gpu_index=0,
                    at=clock.now() + timedelta(minutes=i),
                    util_pct=5.0,
                    mem_used_mb=39_000 if i == 5 else 10_000,
                    mem_total_mb=40_000,
                    user_id=run.user_id,
                    run_id=rid,
                )
            )
        s.commit()
    runs.poll()
    keys = sorted(str(n.dedupe_key).rsplit(":", 1)[1] for n in alerts(sqlite_engine, rid))
    assert keys == ["input_bound", "memory"]
    finish(runs, sqlite_engine, tmp_path, rid, "go-alice")


def test_a_run_that_stops_reporting_is_noticed_on_the_virtual_clock(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    losses = "2.3,2.0"
    rid = user_run(runs, svc, tmp_path, "bob", losses)
    run_until(runs, lambda: step_seen(sqlite_engine, rid, 2))
    for _ in range(3):
        clock.advance(timedelta(minutes=4))
        runs.poll()
    assert alerts(sqlite_engine, rid) == []
    clock.advance(timedelta(minutes=4))
    runs.poll()
    (alert,) = alerts(sqlite_engine, rid)
    assert "has not reported a new step for 16 minutes" in alert.text
    finish(runs, sqlite_engine, tmp_path, rid, "go-bob")


def test_the_live_message_is_edited_once_a_minute_within_slacks_limits(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, clock = make_service(sqlite_engine, [local_host(2)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = user_run(runs, svc, tmp_path, "alice", "2.3,2.0,1.8")
    b = user_run(runs, svc, tmp_path, "bob", "2.2,1.9")
    run_until(runs, lambda: step_seen(sqlite_engine, a, 3) and step_seen(sqlite_engine, b, 2))
    for _ in range(30):  # ten virtual minutes, a poll every 20 s
        clock.advance(timedelta(seconds=20))
        runs.poll()
    with Session(sqlite_engine) as s:
        edits = list(
            s.exec(
                select(Notification)
                .where(col(Notification.edit_of).is_not(None))
                .order_by(col(Notification.deliver_after))
            )
        )
    per_run: dict[int | None, list[Notification]] = {}  # live message id -> its edits
    for e in edits:
        per_run.setdefault(e.edit_of, []).append(e)
    assert len(per_run) == 2
    for rows in per_run.values():
        made = [r.created_at for r in rows]
        assert 10 <= len(made) <= 11, "about once a minute over ten minutes"
        assert all(y - x >= timedelta(seconds=60) for x, y in itertools.pairwise(made))
    due = [e.deliver_after for e in edits]
    assert all(y - x >= EDIT_SPACING for x, y in itertools.pairwise(due))
    # Nothing was delivered meanwhile: every edit but the newest of each message is
    # superseded, so a backlog never builds up.
    live = [e for e in edits if e.last_error != SUPERSEDED]
    assert sorted(e.edit_of or 0 for e in live) == sorted(k or 0 for k in per_run)
    latest = max(live, key=lambda e: e.id or 0)
    assert "is running: step" in latest.text and "$0.00 so far" in latest.text
    # `/gpu queue` (and so App Home, built from it) shows the same line.
    table = runs.queue(actor(svc, "carol"), Queue()).view.blocks[-1]
    assert isinstance(table, Table) and "progress" in table.columns
    progress = {r[1]: r[table.columns.index("progress")] for r in table.rows}
    assert progress["alice"].startswith("step 3/30, loss 1.8") and "so far" in progress["alice"]
    # The shell prints each edit as an `[update #N]` line.
    out = io.StringIO()
    clock.advance(timedelta(minutes=1))
    deliver(svc, TerminalNotifier(out, threading.Lock()))
    lines = out.getvalue().splitlines()
    assert any(
        line.startswith("[update #1] [dm @alice] Run #") and "is running: step 3/30" in line
        for line in lines
    ), lines
    for rid, who in ((a, "alice"), (b, "bob")):
        finish(runs, sqlite_engine, tmp_path, rid, f"go-{who}")


def _edits(engine: Engine) -> list[Notification]:
    with Session(engine) as s:
        return list(
            s.exec(
                select(Notification)
                .where(col(Notification.edit_of).is_not(None))
                .order_by(col(Notification.id))
            )
        )


def test_the_live_message_shows_the_first_figures_at_once_then_every_minute(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """Its first figures as soon as the runner has measured some steps, not a minute
    later (a 47-second run used to get one update, at step 0); and it says so."""
    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    rid = user_run(runs, svc, tmp_path, "alice", "2.3,2.0")
    run_until(runs, lambda: step_seen(sqlite_engine, rid, 2))
    [first] = _edits(sqlite_engine)  # the clock has not moved: no minute has passed
    assert "is running: step " in first.text and "/20, loss 2" in first.text
    assert "first figures as soon as it has measured some steps" in str(first.view)
    runs.poll()
    clock.advance(timedelta(seconds=30))
    runs.poll()
    assert len(_edits(sqlite_engine)) == 1  # then about once a minute
    clock.advance(timedelta(seconds=31))
    runs.poll()
    assert len(_edits(sqlite_engine)) == 2
    finish(runs, sqlite_engine, tmp_path, rid, "go-alice")


def test_a_script_that_reports_nothing_gets_its_first_update_after_a_minute(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, clock = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    go = tmp_path / "go-quiet"
    script = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    rid = int(
        runs.submit(actor(svc, "bob"), Run(command=(sys.executable, "-c", script))).extra["run_id"]
    )
    # Its runner has written its status (running, no step): the poll has read it.
    run_until(runs, lambda: state(sqlite_engine, rid).metrics.get("state") == "running")
    assert _edits(sqlite_engine) == []  # nothing measured: no edit that says nothing
    clock.advance(timedelta(seconds=61))
    runs.poll()
    [update] = _edits(sqlite_engine)
    assert "elapsed" in update.text and "so far" in update.text
    finish(runs, sqlite_engine, tmp_path, rid, "go-quiet")


def test_digits_at_an_absurd_learning_rate_ends_with_a_warning(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The issue's case: `/gpu run --recipe digits --lr 100000` used to say "finished"."""
    svc, _ = make_service(sqlite_engine, [local_host(1)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    reply = handle_text(svc, actor(svc, "alice"), "/gpu run --recipe digits --lr 100000 --epochs 2")
    rid = int(reply.extra["run_id"])
    run_until(runs, lambda: state(sqlite_engine, rid).finished_at is not None, timeout=300)
    run = state(sqlite_engine, rid)
    assert run.state == "succeeded" and run.options == {"lr": 100000.0, "epochs": 2}
    with Session(sqlite_engine) as s:
        result = s.exec(
            select(Notification).where(Notification.dedupe_key == f"run-finished:{rid}")
        ).one()
    assert result.text.startswith(f"⚠️ Run #{rid} (recipe digits) finished")
    assert "the loss diverged" in result.text and "Do not trust this result" in result.text
    body = str(result.view)
    # local_host's slot is a CPU slot: it held a slot, not a GPU, and says so.
    for fact in ("precision", "batch", "learning rate", "CPU-slot hours", "blew up"):
        assert fact in body, fact
    assert "GPU-hours" not in body
    assert result.attachment is not None and result.attachment_name == f"run-{rid}-curve.png"


def test_a_sweep_runs_its_variants_side_by_side_and_ranks_them_in_one_table(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_host(2)], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    reply = handle_text(
        svc, actor(svc, "carol"), "/gpu run --sweep lr=100000,0.001 --recipe digits --epochs 2"
    )
    ids = reply.extra["run_ids"]
    assert reply.view.text.startswith("Sweep s") and f"#{ids[1]} (lr 0.001)" in reply.view.text
    runs.dispatch()
    assert all(state(sqlite_engine, i).state == "running" for i in ids), "side by side"
    run_until(runs, lambda: all(state(sqlite_engine, i).finished_at for i in ids), timeout=300)
    label = state(sqlite_engine, ids[0]).sweep
    with Session(sqlite_engine) as s:
        (table_dm,) = s.exec(
            select(Notification).where(Notification.dedupe_key == f"sweep-finished:{label}")
        ).all()
    assert table_dm.target == "carol"
    assert f"Best: run #{ids[1]} (lr 0.001)" in table_dm.text
    table = table_dm.view["blocks"][-1]
    assert table["columns"] == ["run", "variant", "accuracy", "final loss", "cost", "outcome"]
    assert [row[0] for row in table["rows"]] == [f"#{ids[1]}", f"#{ids[0]}"], "best first"
    assert table["rows"][1][-1] == "succeeded: the loss diverged"
    assert all(row[4] == "$0.00" for row in table["rows"]), "cost per variant (owned host)"
