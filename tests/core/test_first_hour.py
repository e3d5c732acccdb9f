"""What a new team meets in its first hour (issue 19): the figures a reply shows are
right — counts never negative, booting instances not free, an estimate where one is
known — and each view says what it means in plain words."""

from __future__ import annotations

import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from bot.app.fleet import CatalogSupply
from bot.app.watching.runwatch import Outcome, result_view
from bot.domain import timefmt, views
from bot.domain.charts import GpuSeries, utilization_chart
from bot.domain.commands import VERBS, Cancel, Logs, Queue, Run, Status
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from db.models import TrainingRun
from provisioning.base import GpuDevice, Instance
from provisioning.catalog import Catalog
from tests.core.helpers import actor, host, make_service, place, runs_here


def last_table(view: views.View) -> views.Table:
    table = view.blocks[-1]
    assert isinstance(table, views.Table)
    return table


def booting(name: str, gpus: int, hourly: float) -> Instance:
    return replace(host(name, "A100", gpus, hourly=hourly), provider="aws", state="pending")


def test_queue_me_counts_only_my_runs(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(
        sqlite_engine, [host("box", "A100", 1)], places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    for who in ("alice", "alice", "bob"):
        runs.submit(actor(svc, who), Run(recipe="digits", model="A100"))
    mine = runs.queue(actor(svc, "bob"), Queue(mine_only=True)).view.text
    assert mine == "1 waiting, 0 running"
    assert runs.queue(actor(svc, "bob"), Queue()).view.text == "3 waiting, 0 running"


def test_booting_instances_are_not_free(sqlite_engine: Engine) -> None:
    stopped = replace(booting("i-2", 4, 16.0), state="stopped")
    svc, _ = make_service(
        sqlite_engine, [booting("i-1", 8, 32.77), host("box", "A100", 1), stopped], provider="aws"
    )
    view = svc.status(actor(svc, "alice"), Status()).view
    assert view.text == "1 of 1 free on 1 host; 8 starting up; 4 unavailable"
    tables = [b for b in view.blocks if isinstance(b, views.Table)]
    assert any(r[2] == "starting up" for t in tables for r in t.rows)


def test_an_empty_cloud_pool_says_the_first_request_launches(sqlite_engine: Engine) -> None:
    # A cloud's pool: it grows on demand.
    cloud = place("aws", supply=CatalogSupply(Catalog.load()))
    svc, _ = make_service(sqlite_engine, [], places=cloud, provider="aws")
    text = " ".join(
        getattr(b, "text", "") for b in svc.status(actor(svc, "a"), Status()).view.blocks
    )
    assert "No hosts are configured" not in text
    assert "launches one" in text


def test_queue_estimates_a_run_that_waits_for_a_booting_instance(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(
        sqlite_engine,
        [booting("i-1", 1, 4.10)],
        provider="aws",
        places=runs_here(tmp_path / "runs"),
    )
    runs = svc.runs
    a = actor(svc, "alice")
    runs.submit(a, Run(recipe="digits", model="A100", max_duration=timedelta(hours=2)))
    table = last_table(runs.queue(a, Queue()).view)
    row = dict(zip(table.columns, table.rows[0], strict=True))
    assert "unknown" not in row.values()
    assert row["est. cost"] == "$8.20"
    assert row["est. start"].startswith("in ")


# --- wording ---------------------------------------------------------------------------


def text_of(view: views.View) -> str:
    return render(view)


def local_slot() -> Instance:
    return Instance(
        name="local", provider="local", state="ready", gpus=(GpuDevice(index=0, model="cpu"),)
    )


def test_a_command_is_shown_as_typed_and_cut_with_an_ellipsis(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_slot()], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    reply = runs.submit(a, Run(command=("python", "-c", "print('hello')")))
    assert "`python -c \"print('hello')\"`" in reply.view.text
    assert "'\"'\"'" not in reply.view.text
    long = ("python", "train.py", *(f"--option-{i}=value" for i in range(10)))
    reply = runs.submit(a, Run(command=long))
    shown = reply.view.text.split("`")[1]
    assert shown.endswith("…") and len(shown) == 60
    row = last_table(runs.queue(a, Queue()).view).rows[0]
    assert row[2] == "python -c \"print('hello')\""


def test_a_run_stopped_at_its_max_says_so(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [local_slot()])
    outcome = Outcome(state="failed", exit_code=76, status=None, log_tail="", error="time_limit")
    with Session(sqlite_engine) as s:
        owner = svc.user_row(s, "alice")
        s.flush()
        assert owner.id is not None
        run = TrainingRun(
            user_id=owner.id,
            command="python train.py",
            state="failed",
            exit_code=76,
            max_seconds=7200,
            submitted_at=datetime.now(UTC),
        )
        s.add(run)
        s.flush()
        view, _ = result_view(s, run, outcome, datetime.now(UTC))
    assert view.text.startswith(
        f"Run #{run.id} (`python train.py`) stopped at its time limit (--max 2h)."
    )
    assert "exit status" not in render(view)


def test_cancelling_a_command_claims_no_checkpoint_and_its_log_says_why_none(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [local_slot()], places=runs_here(tmp_path / "runs"))
    runs = svc.runs
    a = actor(svc, "alice")
    rid = runs.submit(a, Run(command=(sys.executable, "-c", "import time; time.sleep(30)")))
    later = runs.submit(a, Run(recipe="digits"))
    assert runs.dispatch() == 1
    stopping = runs.cancel(a, Cancel(rid.extra["run_id"])).view.text
    assert "checkpoint" not in stopping and "SIGTERM" in stopping
    runs.cancel(a, Cancel(later.extra["run_id"]))
    log = runs.logs(a, Logs(later.extra["run_id"], 10)).view.text
    assert log == f"Run #{later.extra['run_id']} was cancelled before it started, so it has no log."


def test_permission_errors_come_without_a_usage_line(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [host("box", "A100", 2)])
    handle_text(svc, actor(svc, "alice"), "/gpu reserve 1 a100 for 1h")
    for line in ("/gpu release 1", "/gpu extend 1 1h", "/gpu budget @alice 100/week"):
        reply = handle_text(svc, actor(svc, "bob"), line)
        assert reply.error and "Usage:" not in reply.view.text, line


def test_prices_for_cpu_is_a_sentence_and_memory_says_gib(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [local_slot()])
    cpu = handle_text(svc, actor(svc, "a"), "/gpu prices cpu").view
    assert not any(isinstance(b, views.Table) for b in cpu.blocks)
    assert "CPU slots" in cpu.text
    h100 = text_of(handle_text(svc, actor(svc, "a"), "/gpu prices h100").view)
    assert "80 GiB" in h100 and "80 GB" not in h100
    assert "README" not in h100


def test_cost_today_names_one_day(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [host("box", "A100", 1)])
    text = handle_text(svc, actor(svc, "a"), "/gpu cost today").view.text
    assert " – " not in text


def test_only_a_close_word_gets_a_suggestion(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [local_slot()])
    assert "Did you mean" not in handle_text(svc, actor(svc, "a"), "/gpu bogus").view.text
    assert "Did you mean `status`" in handle_text(svc, actor(svc, "a"), "/gpu stauts").view.text


def test_budget_off_is_the_one_word_in_help_and_readme() -> None:
    usage = VERBS["budget"].usage
    assert usage.endswith("|off]") and "none" not in " ".join(VERBS["budget"].examples)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "budget [@user AMOUNT/week\\|month\\|off]" in readme


# --- times in the team's zone ----------------------------------------------------------


def test_times_are_shown_in_the_team_zone_with_how_far_off(sqlite_engine: Engine) -> None:
    svc, clock = make_service(sqlite_engine, [host("box", "A100", 1)], timezone="Europe/Paris")
    clock.set(datetime(2026, 12, 3, 13, 0, tzinfo=UTC))
    reply = handle_text(svc, actor(svc, "a"), "/gpu reserve a100 for 3h")
    assert "until 17:00 CET (in 3h)" in reply.view.text
    status = text_of(handle_text(svc, actor(svc, "a"), "/gpu status").view)
    assert "17:00 CET (in 3h)" in status and "UTC" not in status


def test_timefmt_relative_and_days() -> None:
    now = datetime(2026, 12, 3, 23, 30, tzinfo=UTC)
    assert timefmt.relative(now + timedelta(hours=3), now) == "in 3h"
    assert timefmt.relative(now - timedelta(minutes=5), now) == "5m ago"
    assert timefmt.relative(now, now) == "now"
    # 23:30 UTC is already Friday in Paris: the day is named.
    assert timefmt.when(now + timedelta(minutes=10), now, "Europe/Paris") == "00:40 CET (in 10m)"
    assert timefmt.when(now + timedelta(hours=1), now, "UTC") == "Fri 04 Dec 00:30 UTC (in 1h)"
    day = datetime(2026, 12, 3, tzinfo=UTC)
    assert timefmt.days(day, day + timedelta(days=1), "UTC") == "Thu 03 Dec"
    assert timefmt.days(day, day + timedelta(days=7), "UTC") == "Thu 03 Dec – Wed 09 Dec"


def test_the_utilization_chart_reads_in_the_team_zone() -> None:
    end = datetime(2026, 12, 3, 13, 0, tzinfo=UTC)
    times = [end - timedelta(minutes=m) for m in range(30, 0, -1)]
    series = [GpuSeries("box:0 A100", times, [50.0] * 30, [20.0] * 30)]
    start = end - timedelta(hours=1)
    utc = utilization_chart(series, start=start, end=end)
    assert utilization_chart(series, start=start, end=end, tz="UTC") == utc
    # Paris is an hour ahead in December: the title and the axis ticks move.
    assert utilization_chart(series, start=start, end=end, tz="Europe/Paris") != utc
