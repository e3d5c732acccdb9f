"""Who may start runs, tried through signed requests to the real Bolt app over a socket:
the users in GPUBOT_RUN_USERS, the members of a user group in GPUBOT_RUN_GROUPS (the
fake Slack's usergroups.users.list), from the channels in GPUBOT_RUN_CHANNELS only.
Everyone else gets a short ephemeral refusal and no run row exists."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.faces.slack.app import build_face
from bot.faces.slack.notifier import SlackNotifier, make_client
from bot.faces.slack.server import HttpServer
from db.models import TrainingRun
from tests.core.helpers import make_service, runs_here
from tests.core.test_runs import local_host
from tests.fakes.slack_api import FakeSlack
from tests.slack.conftest import ADMIN, ALICE, BOB, GPU_CHANNEL, HttpReply, SignedClient

RUN_CHANNEL, OTHER_CHANNEL = GPU_CHANNEL, "C0RANDOM1"
GROUP, CAROL, MALLORY = "S0GPUTEAM", "U0CAROL01", "U0MALLORY"


@dataclass
class Stack:
    fake: FakeSlack
    engine: Engine
    client: SignedClient

    def command(self, text: str, user: str, channel: str = RUN_CHANNEL) -> HttpReply:
        """`/gpu TEXT` as Slack sends it from `channel`: the ack as it came."""
        return self.client.command(text, user, channel=channel)

    def answer(self, text: str, user: str, channel: str = RUN_CHANNEL) -> dict[str, Any]:
        """What the user reads: the ack, or the post it promised when the bot was slow
        (a loaded machine must not turn "Run #1 queued" into "Working on …")."""
        return self.client.answer(text, user, channel=channel)

    def runs(self) -> list[TrainingRun]:
        with Session(self.engine) as s:
            return list(s.exec(select(TrainingRun)))


@pytest.fixture(params=[8.0, 0.0], ids=["quick-ack", "late-answer"])
def stack(
    request: pytest.FixtureRequest, fake_slack: FakeSlack, sqlite_engine: Engine, tmp_path: Path
) -> Iterator[Stack]:
    """`serve`'s wiring: the service has runs before the face is built (bot.faces.cli).
    Each test runs with an ack that has time for the answer and with one that has none
    (every answer posted later), as a slow machine would see it."""
    secret = secrets.token_hex(16)
    service, _ = make_service(
        sqlite_engine,
        [local_host(1)],
        admins=(ADMIN,),
        run_users=(ALICE,),
        run_groups=(GROUP,),
        run_channels=(RUN_CHANNEL,),
        slack_bot_token=fake_slack.bot_token,
        slack_signing_secret=secret,
        slack_api_url=fake_slack.url,
        places=runs_here(tmp_path / "runs"),
    )
    fake_slack.add_usergroup(GROUP, [CAROL])
    notifier = SlackNotifier(make_client(service.settings), service.settings.channel)
    face = build_face(
        service,
        service.settings,
        notifier=notifier,
        deliver_after_commands=True,
        ack_deadline_s=request.param,
    )
    server = HttpServer(face, host="127.0.0.1", port=0, threads=8).start()
    try:
        yield Stack(
            fake_slack, sqlite_engine, SignedClient(server.host, server.port, secret, fake_slack)
        )
    finally:
        server.stop()
        face.shutdown()


def _refused(body: dict[str, Any]) -> dict[str, Any]:
    assert body["response_type"] == "ephemeral"
    assert "Traceback" not in body["text"] and "ref " not in body["text"]
    return body


def test_someone_outside_the_run_lists_is_refused_and_nothing_is_queued(stack: Stack) -> None:
    body = _refused(stack.answer("run --recipe digits", MALLORY))
    assert "Starting runs is limited" in body["text"]
    assert stack.runs() == []
    assert [c.params["usergroup"] for c in stack.fake.calls_to("usergroups.users.list")] == [GROUP]


def test_a_listed_user_and_an_admin_may_run(stack: Stack) -> None:
    alice = stack.answer("run --recipe digits", ALICE)
    assert "Run #1 queued" in alice["text"]
    admin = stack.answer("run --recipe digits", ADMIN)
    assert "Run #2 queued" in admin["text"]
    assert stack.fake.calls_to("usergroups.users.list") == []  # neither needed a lookup


def test_a_member_of_an_allowed_user_group_may_run_and_the_group_is_read_once(
    stack: Stack,
) -> None:
    first = stack.answer("run --recipe digits", CAROL)
    assert "Run #1 queued" in first["text"]
    second = stack.answer("run --recipe digits", CAROL)
    assert "Run #2 queued" in second["text"]
    _refused(stack.answer("run --recipe digits", MALLORY))
    # One Slack round trip for all three: the members are cached, not asked per request.
    assert len(stack.fake.calls_to("usergroups.users.list")) == 1
    assert len(stack.runs()) == 2


def test_a_failed_group_lookup_is_a_plain_refusal(stack: Stack) -> None:
    stack.fake.fail_next("usergroups.users.list", kind="error", error="missing_scope")
    body = _refused(stack.answer("run --recipe digits", CAROL))
    assert "could not check with Slack" in body["text"]
    assert stack.runs() == []
    # Slack answers again: the same person may run (a failure was not remembered).
    assert "Run #1 queued" in stack.answer("run --recipe digits", CAROL)["text"]


def test_a_channel_outside_the_run_channels_is_refused_even_for_allowed_people(
    stack: Stack,
) -> None:
    for who in (ALICE, ADMIN):
        body = _refused(stack.answer("run --recipe digits", who, channel=OTHER_CHANNEL))
        assert f"<#{RUN_CHANNEL}>" in body["text"]
    # The bare form is not opened there either.
    _refused(stack.answer("run", ALICE, channel=OTHER_CHANNEL))
    assert stack.fake.calls_to("views.open") == []
    assert stack.runs() == []
    # Other verbs are not limited by channel.
    assert stack.command("status", MALLORY, channel=OTHER_CHANNEL).status == 200
    assert "GPU status" in json.dumps(stack.answer("status", BOB, channel=OTHER_CHANNEL))


def test_bob_cannot_read_alices_log_over_slack(stack: Stack) -> None:
    assert "Run #1 queued" in stack.answer("run --recipe digits", ALICE)["text"]
    body = _refused(stack.answer("logs 1", BOB))
    assert "Run #1 is not yours" in body["text"]
    own = stack.answer("logs 1", ALICE)
    assert "has not started yet" in own["text"]  # the owner gets past the check
