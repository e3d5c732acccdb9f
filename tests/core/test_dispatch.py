"""From text to reply: user errors verbatim, our failures as a reference id only."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from bot.app.config import Settings
from bot.app.service import Actor, GpuService
from bot.domain.clock import VirtualClock
from bot.faces.dispatch import handle_text
from bot.faces.terminal import render
from db.session import make_engine
from tests.core.helpers import actor, host, make_service


def test_user_errors_reach_the_user_verbatim(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)])
    reply = handle_text(svc, actor(svc, "alice"), "/gpu reserve 2 potato")
    assert reply.error and reply.ephemeral
    assert reply.view.text.startswith("I don't know the GPU model `potato`.")


def test_an_unexpected_failure_shows_a_reference_and_logs_the_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = make_engine(f"sqlite:///{tmp_path / 'never-migrated.db'}")  # no tables at all
    svc = GpuService(broken, Settings(), VirtualClock())
    with caplog.at_level(logging.ERROR, logger="gpubot"):
        reply = handle_text(svc, Actor("alice", "alice"), "/gpu status")
    m = re.search(r"failed on our side \(ref ([0-9a-f]{8})\)", reply.view.text)
    assert m and reply.error
    assert "Traceback" not in render(reply.view) and "sqlite" not in reply.view.text.lower()
    record = [r for r in caplog.records if m.group(1) in r.getMessage()]
    assert record and record[0].exc_info is not None


def test_every_verb_has_a_handler_and_runless_services_say_so(sqlite_engine: Engine) -> None:
    import typing

    from bot.domain import commands
    from bot.faces import dispatch

    handled = set(dispatch._HANDLERS)
    assert set(typing.get_args(commands.Command)) == handled
    assert len(commands.VERBS) == len(handled)
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)])
    for line in ["/gpu run --recipe digits", "/gpu queue"]:  # a service without run hosts
        reply = handle_text(svc, actor(svc, "alice"), line)
        assert reply.error and "needs hosts that can run training" in reply.view.text
    assert "1 of 1 free" in handle_text(svc, actor(svc, "alice"), "/gpu status").view.text


def test_prices_come_from_the_catalog_with_their_source(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [host("one", "A100", 1)])
    text = render(handle_text(svc, actor(svc, "alice"), "/gpu prices h100").view)
    assert "p5.48xlarge" in text and "$55.04" in text and "$6.88" in text
    assert "Source: skypilot-org/skypilot-catalog" in text


def test_cost_for_me_someone_and_the_team(sqlite_engine: Engine) -> None:
    svc, clock = make_service(sqlite_engine, [host("box", "A100", 8, hourly=21.96)])
    handle_text(svc, actor(svc, "alice"), "/gpu reserve 2 a100 for 1h")
    from datetime import timedelta

    clock.advance(timedelta(hours=2))
    svc.tick()
    mine = handle_text(svc, actor(svc, "alice"), "/gpu cost").view.text
    assert mine.startswith("Your GPU cost this week (") and mine.endswith("): $5.49.")
    theirs = handle_text(svc, actor(svc, "bob"), "/gpu cost @alice today").view.text
    assert theirs.startswith("alice's GPU cost today") and "$5.49" in theirs
    team = render(handle_text(svc, actor(svc, "bob"), "/gpu cost team month").view)
    assert "Team GPU cost this month" in team and "alice  $5.49" in team
    assert "Idle overhead" in team
