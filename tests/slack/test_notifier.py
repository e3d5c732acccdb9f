"""The outbox to Slack: a 429, a dropped connection or a crash mid-send loses no
notification and sends none twice, and a restarted process knows what its predecessor
did from the database alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.delivery import deliver
from bot.app.outbox import StoredDeliveryLog
from bot.app.service import GpuService
from bot.domain import views
from bot.domain.clock import VirtualClock
from bot.faces.slack.notifier import SlackNotifier, make_client
from db.models import Notification
from db.session import transaction
from tests.core.helpers import host, make_service
from tests.fakes.slack_api import Call, FakeSlack

BOB = "U0BOB0001"
ROOT = Path(__file__).resolve().parents[2]


def _history_responder(fake: FakeSlack) -> None:
    """conversations.history as Slack answers it: newest first, after `oldest` if given,
    metadata only when asked for."""

    def history(call: Call) -> dict[str, Any]:
        oldest = float(call.params.get("oldest") or 0)
        found = [m for m in fake.messages_in(call.params["channel"]) if float(m.ts) > oldest]
        msgs = [fake.message_json(m) for m in reversed(found)]
        if call.params.get("include_all_metadata") not in ("1", "true", True):
            for m in msgs:
                m.pop("metadata", None)
        return {"ok": True, "messages": msgs, "has_more": False, "pin_count": 0}

    fake.on("conversations.history", history)


def _notifier(svc: GpuService) -> SlackNotifier:
    """A notifier as `gpubot worker` builds one: facts in the service's database. Each
    call gives a fresh one, holding nothing in memory: a restarted process."""
    facts = StoredDeliveryLog(svc.engine, svc.clock)
    return SlackNotifier(make_client(svc.settings), svc.settings.channel, facts)


def _setup(fake: FakeSlack, engine: Engine) -> tuple[GpuService, SlackNotifier, VirtualClock]:
    svc, clock = make_service(
        engine, [host("gpu1", "A100", 1)], slack_bot_token=fake.bot_token, slack_api_url=fake.url
    )
    _history_responder(fake)
    return svc, _notifier(svc), clock


def _queue_dm(svc: GpuService, text: str = "hello bob", user: str = BOB) -> None:
    with transaction(svc.engine) as s:
        svc.notify_dm(s, user, views.View(text, (views.Text(text),)), svc.clock.now(), None)


def _post(svc: GpuService, text: str, attachment: tuple[str, bytes] | None = None) -> None:
    svc.notify_channel(views.View(text, (views.Text(text),)), attachment=attachment)


def _texts(fake: FakeSlack, channel: str) -> list[str | None]:
    return [m.text for m in fake.messages_in(channel)]


def _row(engine: Engine, text: str) -> Notification:
    with Session(engine) as s:
        return s.exec(select(Notification).where(Notification.text == text)).one()


def test_429_is_retried_after_retry_after(fake_slack: FakeSlack, engine: Engine) -> None:
    svc, notifier, clock = _setup(fake_slack, engine)
    _queue_dm(svc)
    fake_slack.rate_limit("chat.postMessage", retry_after=7)
    assert deliver(svc, notifier) == 0
    assert svc.pending_notifications() == []  # not due yet: Slack asked for 7 s
    clock.advance(timedelta(seconds=6))
    assert svc.pending_notifications() == []
    clock.advance(timedelta(seconds=1))
    assert deliver(svc, notifier) == 1
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1
    # A 429 is Slack refusing: nothing was maybe-sent, so nothing was looked up.
    assert fake_slack.calls_to("conversations.history") == []


def test_reply_lost_after_slack_took_the_message_is_not_sent_twice(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, engine)
    _queue_dm(svc)
    fake_slack.fail_next("chat.postMessage", kind="disconnect_after")
    assert deliver(svc, notifier) == 0  # outcome unknown: retried later
    clock.advance(timedelta(seconds=60))
    assert deliver(svc, notifier) == 1  # history shows it arrived: marked sent, not resent
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1
    assert len(fake_slack.calls_to("conversations.history")) == 1


def test_network_error_before_slack_took_it_is_sent_once_later(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, engine)
    _queue_dm(svc)
    fake_slack.fail_next("chat.postMessage", kind="disconnect")
    assert deliver(svc, notifier) == 0
    clock.advance(timedelta(seconds=60))
    assert deliver(svc, notifier) == 1
    assert len(fake_slack.messages_in(fake_slack.dm_channel_for(BOB))) == 1
    assert len(fake_slack.calls_to("conversations.history")) == 1


def test_a_claim_without_a_started_call_is_sent_without_a_lookup(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    """The process died after claiming the item and before recording an attempt: the
    stored facts say no call was made, so there is nothing to look for."""
    svc, notifier, clock = _setup(fake_slack, engine)
    _queue_dm(svc)
    (item,) = svc.pending_notifications()
    assert svc.mark_attempt(item.id)
    clock.advance(timedelta(seconds=61))  # its claim runs out
    (again,) = svc.pending_notifications()
    assert again.maybe_sent
    assert deliver(svc, notifier) == 1
    (msg,) = fake_slack.messages_in(fake_slack.dm_channel_for(BOB))
    assert msg.metadata == {
        "event_type": "gpubot_notification",
        "event_payload": {"notification_id": item.id},
    }
    assert fake_slack.calls_to("conversations.history") == []


_CHILD = """
import os
import sys
from datetime import datetime

from bot.domain.clock import VirtualClock
from bot.app.config import Settings
from bot.app.outbox import StoredDeliveryLog
from bot.app.service import GpuService
from bot.faces.slack.notifier import SlackNotifier, make_client
from bot.app.delivery import deliver
from db.session import make_engine

url, api, start = sys.argv[1:4]
engine = make_engine(url)
clock = VirtualClock(datetime.fromisoformat(start))
settings = Settings(slack_bot_token=os.environ["SLACK_BOT_TOKEN"], slack_api_url=api)
facts = StoredDeliveryLog(engine, clock)
deliver(GpuService(engine, settings, clock), SlackNotifier(make_client(settings), "gpu", facts))
print("deliver returned: the hold did not happen", flush=True)
"""


def _deliver_in_a_process_killed_mid_post(fake: FakeSlack, svc: GpuService) -> None:
    """Runs `gpubot`'s delivery in a real process, lets Slack act on its chat.postMessage,
    and kills the process with SIGKILL before it hears the answer."""
    hold = fake.hold_next("chat.postMessage")
    url = svc.engine.url.render_as_string(hide_password=False)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, fake.url, svc.clock.now().isoformat()],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SLACK_BOT_TOKEN": fake.bot_token},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if not hold.arrived.wait(timeout=60):
            child.kill()
            out = child.communicate()[0]
            pytest.fail(f"the child never reached chat.postMessage:\n{out}")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        hold.release()
        if child.poll() is None:
            child.kill()
        child.communicate()


@pytest.mark.parametrize("kind", ["channel", "dm"])
def test_crash_between_the_post_and_its_ts_leaves_one_message(
    fake_slack: FakeSlack, engine: Engine, kind: str
) -> None:
    """kill -9 during chat.postMessage (Slack took the message), then a new process on the
    same database: it finds the message by its metadata and does not post it again."""
    svc, notifier, clock = _setup(fake_slack, engine)
    if kind == "channel":
        _post(svc, "yesterday")  # an earlier post taught the channel's id, as in production
        assert deliver(svc, notifier) == 1
        _post(svc, "digest")
        where = fake_slack.last_call("chat.postMessage").response["channel"]  # type: ignore[index]
    else:
        _queue_dm(svc, "digest")
        where = fake_slack.dm_channel_for(BOB)
    posts_before = len(fake_slack.calls_to("chat.postMessage"))

    _deliver_in_a_process_killed_mid_post(fake_slack, svc)

    assert _texts(fake_slack, where).count("digest") == 1  # Slack has it ...
    row = _row(svc.engine, "digest")
    assert row.attempt_started_at is not None and row.posted_ts is None  # ... nobody knows

    clock.advance(timedelta(seconds=61))  # the dead process's claim runs out
    assert deliver(svc, _notifier(svc)) == 1  # a fresh process: nothing in memory
    assert _texts(fake_slack, where).count("digest") == 1
    assert len(fake_slack.calls_to("chat.postMessage")) == posts_before + 1  # the killed one
    assert len(fake_slack.calls_to("conversations.history")) == 1
    # The DM's channel id came from the database too, not from a second conversations.open.
    assert len(fake_slack.calls_to("conversations.open")) == (1 if kind == "dm" else 0)
    assert _row(svc.engine, "digest").posted_ts == fake_slack.messages_in(where)[-1].ts
    assert deliver(svc, _notifier(svc)) == 0


def test_a_429_stops_the_batch_until_retry_after_for_every_deliverer(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, engine)
    for n in range(1, 6):
        _post(svc, f"item {n}")
    fake_slack.rate_limit("chat.postMessage", retry_after=5, after=1)
    assert deliver(svc, notifier) == 1
    posts = fake_slack.calls_to("chat.postMessage")
    assert [c.params["text"] for c in posts] == ["item 1", "item 2"]  # 3-5 never tried
    assert posts[1].status == 429
    # The batch stopped at the 429: items 3-5 were not even marked as attempted.
    assert [_row(svc.engine, f"item {n}").attempts for n in (3, 4, 5)] == [0, 0, 0]

    # Another worker (or this one restarted) respects the stored pause, even for an item
    # that became due after the 429.
    _post(svc, "item 6")
    assert deliver(svc, _notifier(svc)) == 0
    clock.advance(timedelta(seconds=4))
    assert deliver(svc, _notifier(svc)) == 0
    assert len(fake_slack.calls_to("chat.postMessage")) == 2

    clock.advance(timedelta(seconds=1))
    assert deliver(svc, _notifier(svc)) == 5
    channel = str(posts[0].response["channel"])  # type: ignore[index]
    assert _texts(fake_slack, channel) == [f"item {n}" for n in range(1, 7)]
    assert len(fake_slack.calls_to("chat.postMessage")) == 7
    assert fake_slack.calls_to("conversations.history") == []  # no item was maybe-sent


def test_one_history_lookup_per_maybe_sent_item_however_often_it_is_retried(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    svc, notifier, clock = _setup(fake_slack, engine)
    for n in range(1, 5):
        _queue_dm(svc, f"dm {n}")
    dm = fake_slack.dm_channel_for(BOB)
    fake_slack.fail_next("chat.postMessage", kind="disconnect_after")  # 1: taken, reply lost
    fake_slack.fail_next("chat.postMessage", kind="disconnect")  # 2: lost before Slack
    fake_slack.rate_limit("chat.postMessage", retry_after=5)  # 3: refused; 4 then waits
    assert deliver(svc, notifier) == 0
    assert len(fake_slack.calls_to("chat.postMessage")) == 3

    clock.advance(timedelta(seconds=60))
    fake_slack.rate_limit("chat.postMessage", retry_after=5)  # 2's resend is refused too
    assert deliver(svc, notifier) == 1  # 1 found in history; 2 looked up, then 429
    assert len(fake_slack.calls_to("conversations.history")) == 2

    clock.advance(timedelta(seconds=5))
    assert deliver(svc, notifier) == 3  # 2, 3, 4: none maybe-sent any more
    assert len(fake_slack.calls_to("conversations.history")) == 2
    assert _texts(fake_slack, dm) == ["dm 1", "dm 2", "dm 3", "dm 4"]


@pytest.mark.parametrize("kind", ["disconnect_after", "disconnect"])
def test_an_upload_cut_short_leaves_one_chart(
    fake_slack: FakeSlack, sqlite_engine: Engine, kind: str
) -> None:
    """The message went out; the chart's upload lost its answer (`disconnect_after`: it was
    shared) or its connection (`disconnect`: it was not). Either way: one message, one chart."""
    svc, notifier, clock = _setup(fake_slack, sqlite_engine)
    _post(svc, "weekly", attachment=("chart.png", b"\x89PNG fake chart"))
    fake_slack.fail_next("files.completeUploadExternal", kind=kind)  # type: ignore[arg-type]
    assert deliver(svc, notifier) == 0
    clock.advance(timedelta(seconds=60))
    assert deliver(svc, _notifier(svc)) == 1
    channel = str(fake_slack.last_call("chat.postMessage").response["channel"])  # type: ignore[index]
    in_channel = fake_slack.messages_in(channel)
    assert [m.text for m in in_channel if not m.files] == ["weekly"]
    assert len([m for m in in_channel if m.files]) == 1
    assert len(fake_slack.calls_to("chat.postMessage")) == 1
    assert len(fake_slack.calls_to("conversations.history")) == 1


def test_channel_posts_go_to_the_team_channel(fake_slack: FakeSlack, sqlite_engine: Engine) -> None:
    svc, notifier, _clock = _setup(fake_slack, sqlite_engine)
    svc.notify_channel(views.View("pool note", (views.Text("pool note"),)))
    assert deliver(svc, notifier) == 1
    (call,) = fake_slack.calls_to("chat.postMessage")
    assert call.params["channel"] == "gpu"
    assert call.params["text"] == "pool note"
    # Its id is stored: the next post, by any process, goes to the id.
    svc.notify_channel(views.View("second", (views.Text("second"),)))
    assert deliver(svc, _notifier(svc)) == 1
    assert fake_slack.last_call("chat.postMessage").params["channel"] == call.response["channel"]  # type: ignore[index]


def test_chart_upload_uses_the_external_upload_flow(fake_slack: FakeSlack) -> None:
    from bot.faces.slack.notifier import upload_file

    channel = fake_slack.client().conversations_open(users=BOB)["channel"]["id"]
    file_id = upload_file(
        fake_slack.client(), channel, "chart.png", b"\x89PNG fake", title="GPUs", alt_txt="a chart"
    )
    assert fake_slack.files[file_id].data == b"\x89PNG fake"
    assert fake_slack.files[file_id].completed
