"""Signed Slack requests over a real socket to the HTTP front (bot/faces/slack/server.py) running the Bolt
app, with the fake Slack as the Web API and the real service on SQLite."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from bot.app.delivery import deliver
from bot.faces.slack.modal import GPUS, LIMIT, MODEL, PRECISION, WHAT
from tests.core.helpers import host, runs_here, wait_for
from tests.fakes.slack_api import FakeSlack
from tests.slack.conftest import (
    ALICE,
    BOB,
    SignedClient,
    SlackStack,
    block_actions,
    buttons_of,
    make_stack,
)


def _text(body: dict[str, Any]) -> str:
    return json.dumps(body.get("blocks", [])) + str(body.get("text", ""))


def _holders(st: SlackStack) -> list[str]:
    from bot.domain.commands import Status

    actor = st.service.actor(ALICE)
    view = st.service.status(actor, Status()).view
    return [json.dumps([b.__dict__ for b in view.blocks], default=str)]


def test_healthz_answers_without_slack(stack: SlackStack) -> None:
    conn = http.client.HTTPConnection(stack.server.host, stack.server.port, timeout=5)
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["db"] == "ok"


def test_status_is_an_ephemeral_block_kit_reply(stack: SlackStack) -> None:
    reply = stack.client.command("status")
    assert reply.status == 200
    body = reply.json()
    assert body["response_type"] == "ephemeral"
    assert body["blocks"][0] == {
        "type": "header",
        "text": {"type": "plain_text", "text": "GPU status", "emoji": True},
    }
    assert "gpu1" in _text(body)
    assert stack.fake.message_problems(body) == []
    # The display name comes from users.info, once (after the ack), then from the cache.
    wait_for(lambda: stack.fake.calls_to("users.info"))
    stack.client.command("status")
    stack.client.command("status")
    assert len(stack.fake.calls_to("users.info")) == 1


def test_reserve_then_release_by_button_and_home_is_republished(stack: SlackStack) -> None:
    body = stack.client.command("reserve for 3h").json()
    assert "Reserved: reservation #1" in body["text"]
    buttons = {b["text"]["text"]: b for b in buttons_of(body)}
    assert buttons["Release"]["value"] == "/gpu release 1"
    assert stack.fake.message_problems(body) == []
    # Home shows the reservation once the command changed something.
    home = wait_for(lambda: stack.fake.home_views.get(ALICE))
    assert "#1" in json.dumps(home["blocks"])

    url = stack.fake.response_url()
    ack = stack.client.interactive(block_actions(ALICE, buttons["Release"], url))
    assert ack.status == 200 and ack.body == b""
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "Done: #1 released." in post.body["text"]
    assert post.body["replace_original"] is True
    assert "free" in _holders(stack)[0]


def test_extend_by_button(stack: SlackStack) -> None:
    body = stack.client.command("reserve for 1h").json()
    extend = next(b for b in buttons_of(body) if b["text"]["text"] == "Extend 1h")
    url = stack.fake.response_url()
    stack.client.interactive(block_actions(ALICE, extend, url))
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "extended by 1h" in post.body["text"]


def test_button_of_another_user_is_refused_as_that_user(stack: SlackStack) -> None:
    body = stack.client.command("reserve").json()
    release = next(b for b in buttons_of(body) if b["text"]["text"] == "Release")
    url = stack.fake.response_url()
    stack.client.interactive(block_actions(BOB, release, url))
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "is not yours" in post.body["text"]


def test_button_on_home_answers_by_dm_and_republishes(stack: SlackStack) -> None:
    body = stack.client.command("reserve").json()
    release = next(b for b in buttons_of(body) if b["text"]["text"] == "Release")
    stack.client.interactive(block_actions(ALICE, release, None, on_home=True))
    dm = stack.fake.dm_channel_for(ALICE)
    msg = wait_for(lambda: stack.fake.messages_in(dm))[0]
    assert "released" in (msg.text or "")
    wait_for(lambda: "hold no GPUs" in json.dumps(stack.fake.home_views.get(ALICE, {})))


def test_duplicate_delivery_reserves_once(stack: SlackStack) -> None:
    trigger = stack.fake.trigger_id()
    replies: list[dict[str, Any]] = []

    def send(retry: str | None) -> None:
        headers = (
            {"X-Slack-Retry-Num": retry, "X-Slack-Retry-Reason": "http_timeout"} if retry else {}
        )
        replies.append(stack.client.command("reserve", trigger_id=trigger, headers=headers).json())

    threads = [threading.Thread(target=send, args=(r,)) for r in (None, "1", "2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all("reservation #1" in r["text"] for r in replies), [r["text"] for r in replies]
    # A later, genuinely new request gets a new reservation (and waits: one GPU only).
    again = stack.client.command("reserve").json()
    assert "#2 is waiting" in again["text"]


def test_bad_signature_and_stale_timestamp_are_refused_and_change_nothing(
    stack: SlackStack,
) -> None:
    bad = stack.client.command("reserve", signature="v0=" + "0" * 64)
    assert bad.status == 401
    stale = stack.client.command("reserve", timestamp=int(time.time()) - 6 * 60)
    assert stale.status == 401
    missing = stack.client.post(
        b"command=%2Fgpu&text=reserve", "application/x-www-form-urlencoded", signature=""
    )
    assert missing.status == 401
    assert stack.fake.calls_to("users.info") == []
    body = stack.client.command("status").json()
    assert "1 of 1 free" in body["text"]
    # Neither the secret nor the token shows up in any reply.
    for reply in (bad, stale, missing):
        assert stack.secret.encode() not in reply.body
        assert stack.fake.bot_token.encode() not in reply.body


def test_bad_input_gets_usage_ephemeral(stack: SlackStack) -> None:
    body = stack.client.command("reserve 2 potato").json()
    assert body["response_type"] == "ephemeral"
    assert "Usage: /gpu reserve" in body["text"]


def test_slow_work_is_acked_at_once_and_answered_by_response_url(stack: SlackStack) -> None:
    stack.face.ack_deadline_s = 0.0  # nothing is fast enough: every reply comes later
    url = stack.fake.response_url()
    t0 = time.perf_counter()
    reply = stack.client.command("reserve", response_url=url).json()
    assert time.perf_counter() - t0 < 3.0
    assert reply["text"].startswith("Working on")
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "Reserved: reservation #1" in post.body["text"]


def test_run_modal_validation_then_submission(stack: SlackStack) -> None:
    url = stack.fake.response_url()
    ack = stack.client.command("run", response_url=url)
    assert ack.status == 200
    opened = stack.fake.last_call("views.open")
    view = opened.params["view"]
    assert view["callback_id"] == "gpubot_run_modal"

    def submission(values: dict[str, Any]) -> dict[str, Any]:
        state = {
            block: {"value": {"type": "plain_text_input", "value": v}}
            if block not in (MODEL, PRECISION)
            else {"value": {"type": "static_select", "selected_option": {"value": v}}}
            for block, v in values.items()
        }
        return {
            "type": "view_submission",
            "team": {"id": "T111", "domain": "gpubot-test"},
            "user": {"id": ALICE, "username": "alice", "name": "alice", "team_id": "T111"},
            "api_app_id": "A111",
            "token": "verification_token",
            "trigger_id": stack.fake.trigger_id(),
            "view": {
                **view,
                "id": "V0RUN",
                "type": "modal",
                "state": {"values": state},
                "hash": "1.x",
            },
            "response_urls": [],
        }

    bad = stack.client.interactive(
        submission({WHAT: "", GPUS: "0", MODEL: "any", PRECISION: "auto", LIMIT: "soon"})
    ).json()
    assert bad["response_action"] == "errors"
    assert set(bad["errors"]) == {WHAT, GPUS, LIMIT}
    # Digits that str.isdigit() accepts and int() does not (was a 500), and others that
    # are digits to Unicode but not a count anyone typed on purpose: a field error each.
    for odd in ("²", "٣", "１", "1.5", "-1", "65", "9" * 40):
        reply = stack.client.interactive(
            submission({WHAT: "python train.py", GPUS: odd, MODEL: "any", PRECISION: "auto"})
        )
        assert reply.status == 200, (odd, reply.status)
        assert reply.json() == {
            "response_action": "errors",
            "errors": {GPUS: "A whole number from 1 to 64."},
        }, odd
    # The time limit is the other typed field: superscripts there are an error too.
    for odd in ("²h", "1h²", "h"):
        reply = stack.client.interactive(
            submission({WHAT: "python train.py", GPUS: "1", MODEL: "any", LIMIT: odd})
        )
        assert reply.json()["errors"] == {LIMIT: "A duration like 45m, 4h or 1h30m."}, odd
    good = stack.client.interactive(
        submission(
            {WHAT: "python train.py", GPUS: "1", MODEL: "A100", PRECISION: "bf16", LIMIT: "2h"}
        )
    )
    assert good.status == 200 and good.body == b""
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "/gpu run" in post.body["text"]  # runs are not built: the core says so plainly


def test_app_home_opened_publishes_home(stack: SlackStack) -> None:
    stack.client.command("reserve", user=BOB)
    stack.client.command("reserve", user=ALICE)  # waits behind bob
    event = {
        "type": "app_home_opened",
        "user": ALICE,
        "channel": "D0ALICE",
        "tab": "home",
        "event_ts": f"{time.time():.6f}",
    }
    reply = stack.client.event(event)
    assert reply.status == 200
    home = wait_for(lambda: stack.fake.home_views.get(ALICE))
    text = json.dumps(home["blocks"])
    assert "waiting for 1 GPU" in text  # alice's own request
    assert "Your cost this week" in text and "$0.00" in text  # an owned host costs nothing
    assert stack.fake.view_problems({"type": "home", "blocks": home["blocks"]}) == []


def test_dm_on_grant_goes_through_the_outbox(stack: SlackStack) -> None:
    stack.face.deliver_after_commands = False  # the test delivers, as the worker would
    stack.client.command("reserve", user=ALICE)
    waiting = stack.client.command("reserve", user=BOB).json()
    assert "waiting" in waiting["text"]
    stack.client.command("release", user=ALICE)
    assert deliver(stack.service, stack.notifier) == 1
    dm = stack.fake.dm_channel_for(BOB)
    (msg,) = stack.fake.messages_in(dm)
    assert "Your turn: granted" in (msg.text or "")
    assert msg.metadata is not None and msg.metadata["event_type"] == "gpubot_notification"
    assert deliver(stack.service, stack.notifier) == 0


def test_unknown_user_is_created_on_first_use_with_the_slack_name(stack: SlackStack) -> None:
    stack.fake.add_user("U0CAROL01", "Carol Danvers")
    stack.client.command("reserve", user="U0CAROL01")
    # The name is looked up after the ack: the reservation is made under the payload's
    # name, and the Slack name replaces it once users.info has answered.
    wait_for(lambda: "Carol Danvers" in _text(stack.client.command("status", user=BOB).json()))


def test_a_first_status_is_answered_before_the_person_is_written(stack: SlackStack) -> None:
    """A command that only reads waits on no write: someone new is answered first, and
    their row is made after the ack, with the name users.info gives (one write)."""
    from sqlmodel import Session, select

    from db.models import User

    stack.fake.add_user("U0ERIN001", "Erin Hale")
    hold = threading.Event()
    busy = stack.face.background._max_workers

    def held() -> None:
        hold.wait(30)

    for _ in range(busy):  # every after-the-ack worker busy: what follows the ack waits
        stack.face.after(held)

    def row() -> User | None:
        with Session(stack.service.engine) as s:
            return s.exec(select(User).where(User.key == "U0ERIN001")).first()

    try:
        body = stack.client.command("status", user="U0ERIN001").json()
        assert body["blocks"][0]["text"]["text"] == "GPU status"
        assert row() is None, "answered before anything was written"
    finally:
        hold.set()
    wait_for(lambda: (made := row()) is not None and made.display_name == "Erin Hale")
    assert len(stack.fake.calls_to("users.info")) == 1


def test_redelivery_to_another_replica_still_reserves_once(
    fake_slack: FakeSlack, engine: Engine
) -> None:
    """Two app processes on one database (in-process memo does not help across them):
    the trigger_id reaches the core as request_key, and the core settles it."""
    secret = "one-app-one-signing-secret"
    face1, server1, one = make_stack(fake_slack, engine, [host("gpu1", "A100", 2)], secret=secret)
    face2, server2, two = make_stack(fake_slack, engine, [host("gpu1", "A100", 2)], secret=secret)
    try:
        trigger = fake_slack.trigger_id()
        replies: list[str] = []

        def send(client: SignedClient) -> None:
            replies.append(client.answer("reserve", trigger_id=trigger)["text"])

        threads = [threading.Thread(target=send, args=(c,)) for c in (one.client, two.client)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all("reservation #1" in r for r in replies), replies
        status = one.client.command("status").json()["text"]
        assert "1 of 2 free" in status
    finally:
        for server, face in ((server1, face1), (server2, face2)):
            server.stop()
            face.shutdown()


def test_rate_limited_users_info_falls_back_to_the_payload_name(stack: SlackStack) -> None:
    stack.fake.rate_limit("users.info", retry_after=30)
    body = stack.client.command("reserve", user="U0DAVE001").json()
    assert "Reserved" in body["text"]
    status = stack.client.command("status", user=BOB).json()
    assert "u0dave001" in _text(status)  # user_name from the payload, until users.info answers


def test_status_of_forty_hosts_and_a_long_line_fits_slack(
    fake_slack: FakeSlack, sqlite_engine: Engine
) -> None:
    hosts = [host(f"node{i:02d}", "A100", 1) for i in range(40)]
    face, server, st = make_stack(fake_slack, sqlite_engine, hosts)
    try:
        from bot.domain.commands import Reserve

        for n in range(50):  # 40 granted, 10 waiting
            st.service.reserve(st.service.actor(f"U0USER{n:03d}"), Reserve(count=1))
        body = st.client.command("status").json()
        assert fake_slack.message_problems(body) == []
        assert len(body["blocks"]) <= 50
        assert "more block" in json.dumps(body["blocks"][-1])
        st.client.event(
            {"type": "app_home_opened", "user": ALICE, "tab": "home", "event_ts": "1.2"}
        )
        home = wait_for(lambda: fake_slack.home_views.get(ALICE))
        assert "U0USER049" in json.dumps(home["blocks"])  # the last in line, on Home
        assert fake_slack.view_problems({"type": "home", "blocks": home["blocks"]}) == []
    finally:
        server.stop()
        face.shutdown()


def test_grant_dm_follows_the_release_when_the_worker_runs_here(stack: SlackStack) -> None:
    stack.client.command("reserve", user=ALICE)
    stack.client.command("reserve", user=BOB)
    stack.client.command("release", user=ALICE)
    dm = stack.fake.dm_channel_for(BOB)
    msg = wait_for(lambda: stack.fake.messages_in(dm))[0]
    assert "Your turn: granted" in (msg.text or "")
    assert any(b["type"] == "actions" for b in msg.blocks or [])  # Release / Extend on the DM


@pytest.fixture
def runs_stack(
    fake_slack: FakeSlack, sqlite_engine: Engine, tmp_path: Path
) -> Iterator[SlackStack]:
    """The `stack`'s one host, and runs that run on this machine under tmp_path."""
    face, server, st = make_stack(
        fake_slack, sqlite_engine, [host("gpu1", "A100", 1)], places=runs_here(tmp_path)
    )
    try:
        yield st
    finally:
        server.stop()
        face.shutdown()


def test_a_queued_run_shows_on_home_and_its_cancel_button_works(runs_stack: SlackStack) -> None:
    stack = runs_stack
    body = stack.client.command("run --recipe digits").json()
    assert "Run #1 queued (next in line): recipe digits" in body["text"]
    assert stack.fake.message_problems(body) == []
    home = wait_for(lambda: stack.fake.home_views.get(ALICE))
    assert "digits" in json.dumps(home["blocks"])
    cancel = next(b for b in buttons_of(body) if b["text"]["text"] == "Cancel run")
    assert cancel["value"] == "/gpu cancel 1"
    url = stack.fake.response_url()
    stack.client.interactive(block_actions(ALICE, cancel, url))
    post = wait_for(lambda: [r for r in stack.fake.responses if r.url == url])[0]
    assert "Run #1 cancelled before it started." in post.body["text"]
    wait_for(lambda: "No runs queued" in json.dumps(stack.fake.home_views.get(ALICE, {})))
