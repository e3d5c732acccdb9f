"""The outbox to Slack: a 429, a dropped connection or a crash mid-send loses no
notification and sends none twice."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine

from bot import views
from bot.clock import VirtualClock
from bot.service import GpuService
from bot.slack.notifier import SlackNotifier, make_client
from bot.worker import deliver
from tests.core.helpers import host, make_service
from tests.fakes.slack_api import Call, FakeSlack

BOB = "U0BOB0001"


def _setup(fake: FakeSlack, engine: Engine) -> tuple[GpuService, SlackNotifier, VirtualClock]:
    svc, clock = make_service(
        engine, [host("gpu1", "A100", 1)], slack_bot_token=fake.bot_token, slack_api_url=fake.url
    )

    def history(call: Call) -> dict[str, Any]:
        msgs = [fake.message_json(m) for m in reversed(fake.messages_in(call.params["channel"]))]
        if call.params.get("include_all_metadata") not in ("1", "true", True):
            for m in msgs:
                m.pop("metadata", None)
        return {"ok": True, "messages": msgs, "has_more": False, "pin_count": 0}

    fake.on("conversations.history", history)
    return svc, SlackNotifier(make_client(svc.settings), svc.settings.channel), clock


def _queue_dm(svc: GpuService, text: str = "hello bob") -> None:
    from db.session import transaction

    with transaction(svc.engine) as s:
        svc.notify_dm(s, BOB, views.View(text, (views.Text(text),)), svc.clock.now(), None)


def test_429_is_retried_after_retry_after(fake_slack: FakeSlack, sqlite_engine: Engine) -> None:
    svc, notifier, clock = _setup(fake_slack, sqlite_engine)
    _queue_dm(svc)
    fake_slack.rate_limit("chat.postMessage", retry_after=7)
    assert deliver(svc, notifier) == 0
    assert svc.pending_notifications() == []  # not due yet: Slack asked for 7 s
    clock.advance(timedelta(seconds=6))
    assert svc.pending_notifications() == []
    clock.advance(timedelta(seconds=1))
    assert deliver(svc, notifier) == 1
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1


def test_reply_lost_after_slack_took_the_message_is_not_sent_twice(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, sqlite_engine)
    _queue_dm(svc)
    fake_slack.fail_next("chat.postMessage", kind="disconnect_after")
    assert deliver(svc, notifier) == 0  # outcome unknown: retried later
    clock.advance(timedelta(seconds=60))
    assert deliver(svc, notifier) == 1  # history shows it arrived: marked sent, not resent
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1
    assert len(fake_slack.calls_to("conversations.history")) == 1


def test_network_error_before_slack_took_it_is_sent_once_later(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, sqlite_engine)
    _queue_dm(svc)
    fake_slack.fail_next("chat.postMessage", kind="disconnect")
    assert deliver(svc, notifier) == 0
    clock.advance(timedelta(seconds=60))
    assert deliver(svc, notifier) == 1
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1


def test_crash_mid_send_checks_history_then_sends_once(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, sqlite_engine)
    _queue_dm(svc)
    (item,) = svc.pending_notifications()
    assert svc.mark_attempt(item.id)  # the process died here, before or during the send
    clock.advance(timedelta(seconds=61))  # its claim runs out
    (again,) = svc.pending_notifications()
    assert again.maybe_sent
    assert deliver(svc, notifier) == 1
    (msg,) = fake_slack.messages_in(fake_slack.dm_channel_for(BOB))
    assert msg.metadata == {
        "event_type": "gpubot_notification",
        "event_payload": {"notification_id": item.id},
    }
    assert len(fake_slack.calls_to("conversations.history")) == 1


def test_channel_posts_go_to_the_team_channel(fake_slack: FakeSlack, sqlite_engine: Engine) -> None:
    svc, notifier, _clock = _setup(fake_slack, sqlite_engine)
    svc.notify_channel(views.View("pool note", (views.Text("pool note"),)))
    assert deliver(svc, notifier) == 1
    (call,) = fake_slack.calls_to("chat.postMessage")
    assert call.params["channel"] == "gpu"
    assert call.params["text"] == "pool note"


def test_chart_upload_uses_the_external_upload_flow(fake_slack: FakeSlack) -> None:
    from bot.slack.notifier import upload_file

    channel = fake_slack.client().conversations_open(users=BOB)["channel"]["id"]
    file_id = upload_file(
        fake_slack.client(), channel, "chart.png", b"\x89PNG fake", title="GPUs", alt_txt="a chart"
    )
    assert fake_slack.files[file_id].data == b"\x89PNG fake"
    assert fake_slack.files[file_id].completed
