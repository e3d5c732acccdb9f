"""Charts reach Slack: a `/gpu util` chart DM and the channel snapshot go out through the
outbox and the real Slack notifier to the fake Slack Web API, which checks every call
against Slack's spec: the message first, then files.getUploadURLExternal, the bytes to
the upload URL, and files.completeUploadExternal into the same conversation."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.engine import Engine

from bot.app.delivery import deliver
from bot.app.service import GpuService
from bot.app.watching.idle import idle_job
from bot.app.watching.utilization import snapshot_job
from bot.domain.commands import Reserve
from bot.faces.dispatch import handle_text
from bot.faces.slack.notifier import SlackNotifier, make_client
from bot.faces.terminal import render
from tests.core.helpers import actor, make_service, place
from tests.core.test_utilization import (
    A100_HOST_JSON,
    MapAccess,
    RecordedRunner,
    gpu_a,
    sample_minutes,
)
from tests.core.test_utilization import with_access as access_with
from tests.fakes.slack_api import FakeSlack

ALICE = "U0ALICE01"
UPLOAD_FLOW = ["chat.postMessage", "files.getUploadURLExternal", "files.completeUploadExternal"]


def busy_service(fake: FakeSlack, engine: Engine) -> tuple[GpuService, SlackNotifier]:
    access = MapAccess()
    svc, _ = make_service(
        engine,
        [gpu_a()],
        slack_bot_token=fake.bot_token,
        slack_api_url=fake.url,
        util_post_interval=timedelta(hours=1),
        places=place("ssh", access),
    )
    access_with(access, gpu_a=RecordedRunner(A100_HOST_JSON))
    svc.reserve(svc.actor(ALICE, "alice"), Reserve(count=2, model="A100"))
    sample_minutes(svc, 20)
    return svc, SlackNotifier(make_client(svc.settings), svc.settings.channel)


def methods(fake: FakeSlack) -> list[str]:
    return [c.method for c in fake.calls if c.method in {*UPLOAD_FLOW, "conversations.open"}]


def test_the_util_chart_follows_in_a_dm_after_its_words(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc, notifier = busy_service(fake_slack, sqlite_engine)
    reply = handle_text(svc, actor(svc, ALICE), "/gpu util", request_key="slack:cmd:7")
    assert "The chart of the last 6 h follows in a DM." in render(reply.view)
    assert deliver(svc, notifier) == 1
    flow = [m for m in methods(fake_slack) if m != "conversations.open"]
    assert flow == UPLOAD_FLOW, flow
    dm = fake_slack.dm_channel_for(ALICE)
    (posted,) = fake_slack.calls_to("chat.postMessage")
    assert posted.params["text"].startswith("GPU utilization over the last 6 h")
    (f,) = fake_slack.files.values()
    assert f.completed and f.channels == [dm]
    assert f.filename.endswith(".png") and f.data is not None
    assert f.data.startswith(b"\x89PNG\r\n\x1a\n") and len(f.data) == f.length
    # In the DM: the words first, then the file.
    in_dm = fake_slack.messages_in(dm)
    assert [bool(m.files) for m in in_dm] == [False, True]


def test_the_channel_snapshot_carries_its_chart(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc, notifier = busy_service(fake_slack, sqlite_engine)
    assert snapshot_job(svc) and snapshot_job(svc)  # the same slot twice: one post
    assert deliver(svc, notifier) == 1
    assert [m for m in methods(fake_slack) if m != "conversations.open"] == UPLOAD_FLOW
    (posted,) = fake_slack.calls_to("chat.postMessage")
    assert posted.params["channel"] == "gpu"
    assert "GPU utilization" in posted.params["text"]
    (f,) = fake_slack.files.values()
    assert f.completed and f.data is not None and f.data.startswith(b"\x89PNG")


def test_the_idle_question_is_valid_block_kit_with_both_buttons(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    """Alice's GPUs 0 and 1 sit at 0% in the recording (GPU 0 with 30 GiB held)."""
    svc, notifier = busy_service(fake_slack, sqlite_engine)
    sample_minutes(svc, 11)  # 31 minutes sampled in all
    assert idle_job(svc).prompted == (1,)
    assert deliver(svc, notifier) == 1
    (posted,) = fake_slack.calls_to("chat.postMessage")
    assert posted.params["channel"] == fake_slack.dm_channel_for(ALICE)
    assert "has been idle" in posted.params["text"]
    (actions,) = [b for b in posted.params["blocks"] if b["type"] == "actions"]
    buttons = {e["text"]["text"]: e["value"] for e in actions["elements"]}
    assert buttons == {"Keep": "/gpu util keep 1", "Release": "/gpu release 1"}
