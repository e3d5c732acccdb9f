"""A gallery of every reply a new team meets, with real data: the real use cases on
SQLite, a priced host, an owned one and a booting instance, two people and an admin,
in a time zone other than UTC. Each reply, DM and channel post is rendered as terminal
text and as Block Kit, and each is read for the faults found by trying the bot as a new
user: a negative count, raw shell quoting, an empty table, "unknown" where the figure
is known, a time in UTC when the team lives elsewhere, a usage line after a refusal."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.runs import RunService
from bot.app.service import GpuService
from bot.app.watching.runwatch import Outcome, result_view
from bot.domain import views
from bot.domain.commands import VERBS
from bot.faces.dispatch import handle_text
from bot.faces.slack.blocks import render_blocks
from bot.faces.terminal import render
from db.models import Notification, TrainingRun
from provisioning.base import GpuDevice, Instance
from tests.core.helpers import actor, host, make_service, runs_here

NEGATIVE = re.compile(
    r"(?<![\w/.:-])-\d+(?:\.\d+)?\s+(?:running|waiting|free|of|ahead|GPUs?|hosts?)\b"
)
DASH_QUOTING = "'\"'\"'"


def faults(view: views.View) -> list[str]:
    """What is wrong with one view, in its terminal text and its Block Kit."""
    found = []
    for face, text in (
        ("terminal", render(view)),
        ("block kit", json.dumps(render_blocks(view), ensure_ascii=False)),
    ):
        if NEGATIVE.search(text):
            found.append(f"{face}: a negative count: {NEGATIVE.search(text)}")
        if DASH_QUOTING in text:
            found.append(f"{face}: raw shell quoting")
        if re.search(r"\bunknown\b", text):
            found.append(f"{face}: 'unknown' where every figure is known")
        if "UTC" in text:
            found.append(f"{face}: a time in UTC for a team in Europe/Paris")
        if "README" in text:
            found.append(f"{face}: points to a README")
    for block in view.blocks:
        if isinstance(block, views.Table) and not block.rows:
            found.append(f"an empty table {block.columns}")
    return found


@pytest.fixture
def team(sqlite_engine: Engine, tmp_path: Path) -> tuple[GpuService, RunService]:
    booting = replace(
        host("i-0boot", "A100", 2, hourly=8.20), provider="aws", state="pending", market="ondemand"
    )
    local = Instance(
        name="local", provider="local", state="ready", gpus=(GpuDevice(index=0, model="cpu"),)
    )
    svc, clock = make_service(
        sqlite_engine,
        [host("box", "A100", 2, hourly=8.20), host("lab", "V100", 1), booting, local],
        timezone="Europe/Paris",
        home=tmp_path,
        places=runs_here(tmp_path / "runs"),
    )
    clock.set(datetime(2026, 12, 3, 13, 0, tzinfo=UTC))
    return svc, svc.runs


# Who says what, in order; every line is a reply a new team meets in its first hour.
SCRIPT = (
    ("alice", "/gpu help"),
    ("alice", "/gpu help run"),
    ("alice", "/gpu status"),
    ("alice", "/gpu reserve a100 for 3h"),
    ("bob", "/gpu reserve 2 a100 for 2h"),
    ("bob", "/gpu run --gpu a100 --max 2h -- python -c \"print('hello')\""),
    ("alice", "/gpu run --gpu cpu --max 30m --recipe digits"),
    ("alice", "/gpu queue"),
    ("bob", "/gpu queue me"),
    ("alice", "/gpu status"),
    ("alice", "/gpu status me"),
    ("alice", "/gpu extend 1 1h"),
    ("bob", "/gpu release 1"),
    ("bob", "/gpu logs 1"),
    ("alice", "/gpu prices"),
    ("alice", "/gpu prices h100"),
    ("alice", "/gpu prices cpu"),
    ("alice", "/gpu recommend --mem 40 --hours 10"),
    ("alice", "/gpu cost"),
    ("alice", "/gpu cost team week"),
    ("root", "/gpu budget @alice 200/week"),
    ("alice", "/gpu budget"),
    ("bob", "/gpu budget @alice off"),
    ("alice", "/gpu pool"),
    ("alice", "/gpu cloud"),
    ("alice", "/gpu cloud take 1"),
    ("alice", "/gpu util"),
    ("alice", "/gpu bogus"),
    ("alice", "/gpu release 1"),
    ("bob", "/gpu cancel 1"),
)


def test_every_reply_dm_and_post_reads_right(team: tuple[GpuService, RunService]) -> None:
    svc, _ = team
    shown: list[tuple[str, views.View]] = []
    for who, line in SCRIPT:
        reply = handle_text(svc, actor(svc, who), line)
        assert "on our side" not in reply.view.text, (line, reply.view.text)
        if (reply.error and "not yours" in reply.view.text) or "Only an admin" in reply.view.text:
            assert "Usage:" not in reply.view.text, line
        shown.append((line, reply.view))
    # The end of a run, every way it can end, as its owner's DM.
    for state, code, error in (
        ("succeeded", 0, None),
        ("failed", 76, "time_limit"),
        ("failed", 1, "disk full"),
        ("cancelled", None, None),
    ):
        with Session(svc.engine) as s:
            run = s.exec(select(TrainingRun).order_by(col(TrainingRun.id))).first()
            assert run is not None
            # Changed in this session only: it is never committed.
            run.state, run.exit_code = state, code
            outcome = Outcome(state, code, None, "Traceback: disk full\n", error)
            view, _ = result_view(s, run, outcome, datetime.now(UTC))
        shown.append((f"run {state} {error}", view))
    with Session(svc.engine) as s:
        for n in s.exec(select(Notification).order_by(col(Notification.id))):
            shown.append((f"to {n.target}", views.View.from_dict(n.view)))
    assert len(shown) > len(SCRIPT)  # DMs and posts were written (a grant, the run DMs)
    problems = {line: found for line, view in shown if (found := faults(view))}
    assert not problems, problems
    # Every verb a person types is in the gallery.
    typed = {line.split()[1] for _, line in SCRIPT}
    assert set(VERBS) - {"bogus"} <= typed | {"keep"}, set(VERBS) - typed


def test_the_gallery_catches_each_fault() -> None:
    """Each check above fires on the fault it is for."""
    bad = (
        views.View(text="3 waiting, -2 running"),
        views.View(text="x", blocks=(views.Code("python -c 'print('\"'\"'hi'\"'\"')'"),)),
        views.View(text="x", blocks=(views.Table(("a",), ()),)),
        views.View(text="est. start unknown"),
        views.View(text="until 14:00 UTC (in 1h)"),
    )
    for view in bad:
        assert faults(view), view
    assert not faults(views.View(text="1 waiting, 0 running; 14:00 CET (in 1h)"))
