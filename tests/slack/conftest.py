"""Fixtures for the Slack face: the real Bolt app on the real HTTP front (bot/faces/slack/server.py) on
127.0.0.1, the real service on SQLite, the fake Slack Web API behind it, and a
client that signs requests the way Slack does (HMAC-SHA256 over v0:ts:body)."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from sqlalchemy.engine import Engine

from bot.app.service import GpuService, Wire
from bot.domain.clock import VirtualClock
from bot.faces.slack.app import SlackFace, build_face
from bot.faces.slack.notifier import SlackNotifier, make_client
from bot.faces.slack.server import HttpServer
from provisioning.base import Instance
from tests.core.helpers import host, make_service, wait_for
from tests.fakes.slack_api import FakeSlack

ALICE, BOB, ADMIN = "U0ALICE01", "U0BOB0001", "U0ADMIN01"
# The channel commands come from unless a test says otherwise: #gpu.
GPU_CHANNEL = "C0GPU0001"


@dataclass
class HttpReply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


@dataclass
class SignedClient:
    """Posts to /slack/events over a real socket, signed with the app's secret."""

    host: str
    port: int
    secret: str
    fake: FakeSlack
    sent: list[str] = field(default_factory=list)

    def post(
        self,
        body: bytes,
        content_type: str,
        *,
        timestamp: int | None = None,
        signature: str | None = None,
        headers: dict[str, str] | None = None,
        path: str = "/slack/events",
    ) -> HttpReply:
        ts = int(time.time()) if timestamp is None else timestamp
        base = b"v0:" + str(ts).encode() + b":" + body
        good = "v0=" + hmac.new(self.secret.encode(), base, hashlib.sha256).hexdigest()
        sig = good if signature is None else signature
        hdrs = {"Content-Type": content_type, "X-Slack-Request-Timestamp": str(ts)}
        if sig:  # "" sends no signature header at all
            hdrs["X-Slack-Signature"] = sig
        hdrs.update(headers or {})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("POST", path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return HttpReply(resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()})
        finally:
            conn.close()

    def command(
        self,
        text: str,
        user: str = ALICE,
        *,
        trigger_id: str | None = None,
        response_url: str | None = None,
        channel: str = GPU_CHANNEL,
        **kw: Any,
    ) -> HttpReply:
        form = {
            "token": "deprecated-verification-token",
            "team_id": "T111",
            "team_domain": "gpubot-test",
            "channel_id": channel,
            "channel_name": "gpu" if channel == GPU_CHANNEL else "random",
            "user_id": user,
            "user_name": user.lower(),
            "command": "/gpu",
            "text": text,
            "api_app_id": "A111",
            "is_enterprise_install": "false",
            "response_url": response_url or self.fake.response_url(),
            "trigger_id": trigger_id or self.fake.trigger_id(),
        }
        return self.post(urlencode(form).encode(), "application/x-www-form-urlencoded", **kw)

    def answer(self, text: str, user: str = ALICE, **kw: Any) -> dict[str, Any]:
        """The answer to `/gpu TEXT` where the user sees it: in the ack when the bot was
        quick enough, else posted to the response_url the ack promised ("Working on …").
        A test of what a reply says must not depend on how fast this machine is today;
        the deadline itself has its own test (test_http's slow work)."""
        url = self.fake.response_url()
        body: dict[str, Any] = self.command(text, user, response_url=url, **kw).json()
        if not str(body.get("text", "")).startswith("Working on `"):
            return body
        posts = wait_for(lambda: [r for r in self.fake.responses if r.url == url], timeout=120)
        later: dict[str, Any] = posts[0].body
        return later

    def interactive(self, payload: dict[str, Any], **kw: Any) -> HttpReply:
        body = ("payload=" + quote(json.dumps(payload))).encode()
        return self.post(body, "application/x-www-form-urlencoded", **kw)

    def event(self, event: dict[str, Any], event_id: str = "Ev0001", **kw: Any) -> HttpReply:
        wrapper = {
            "token": "verification-token",
            "team_id": "T111",
            "api_app_id": "A111",
            "event": event,
            "type": "event_callback",
            "event_id": event_id,
            "event_time": int(time.time()),
            "authorizations": [
                {
                    "enterprise_id": None,
                    "team_id": "T111",
                    "user_id": FakeSlack.bot_user_id,
                    "is_bot": True,
                    "is_enterprise_install": False,
                }
            ],
            "is_ext_shared_channel": False,
        }
        return self.post(json.dumps(wrapper).encode(), "application/json", **kw)


def block_actions(
    user: str, button: dict[str, Any], response_url: str | None, *, on_home: bool = False
) -> dict[str, Any]:
    """A button click, in the shape of payloads/block_actions.json."""
    payload: dict[str, Any] = {
        "type": "block_actions",
        "user": {"id": user, "username": user.lower(), "name": user.lower(), "team_id": "T111"},
        "api_app_id": "A111",
        "token": "verification_token",
        "trigger_id": f"{secrets.randbelow(10**9)}.222.{secrets.token_hex(8)}",
        "team": {"id": "T111", "domain": "gpubot-test"},
        "actions": [
            {
                "action_id": button["action_id"],
                "block_id": "b1",
                "text": button["text"],
                "value": button["value"],
                "type": "button",
                "action_ts": f"{time.time():.6f}",
            }
        ],
    }
    if on_home:
        payload["container"] = {"type": "view", "view_id": "V0HOME"}
        payload["view"] = {"id": "V0HOME", "type": "home", "blocks": []}
    else:
        payload["container"] = {
            "type": "message",
            "message_ts": "111.222",
            "channel_id": GPU_CHANNEL,
            "is_ephemeral": True,
        }
        payload["channel"] = {"id": GPU_CHANNEL, "name": "gpu"}
        payload["response_url"] = response_url
    return payload


def buttons_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [el for b in body.get("blocks", []) if b["type"] == "actions" for el in b["elements"]]


@dataclass
class SlackStack:
    fake: FakeSlack
    service: GpuService
    clock: VirtualClock
    face: SlackFace
    server: HttpServer
    client: SignedClient
    notifier: SlackNotifier
    secret: str


def make_stack(
    fake: FakeSlack,
    engine: Engine,
    hosts: list[Instance],
    *,
    ack_deadline_s: float = 8.0,
    deliver_after_commands: bool = True,
    secret: str | None = None,
    places: Wire | None = None,
) -> tuple[SlackFace, HttpServer, SlackStack]:
    """A Slack face over a real socket. Its ack deadline is long (production's is 0.5 s,
    bot.faces.slack.app.ACK_DEADLINE_S), under the client's 10 s: a test of what a reply
    says reads it from the ack even on a loaded machine; a test of the deadline sets its
    own (test_http's slow work), and one of replicas in processes of their own reads
    answers with `SignedClient.answer`."""
    secret = secret or secrets.token_hex(16)
    service, clock = make_service(
        engine,
        hosts,
        admins=(ADMIN,),
        slack_bot_token=fake.bot_token,
        slack_signing_secret=secret,
        slack_api_url=fake.url,
        places=places,
    )
    notifier = SlackNotifier(make_client(service.settings), service.settings.channel)
    face = build_face(
        service,
        service.settings,
        notifier=notifier,
        deliver_after_commands=deliver_after_commands,
        ack_deadline_s=ack_deadline_s,
    )
    server = HttpServer(face, host="127.0.0.1", port=0, threads=8).start()
    client = SignedClient(server.host, server.port, secret, fake)
    stack = SlackStack(fake, service, clock, face, server, client, notifier, secret)
    return face, server, stack


@pytest.fixture
def stack(fake_slack: FakeSlack, sqlite_engine: Engine) -> Iterator[SlackStack]:
    """One host with one GPU, so a second reservation waits in line."""
    face, server, st = make_stack(fake_slack, sqlite_engine, [host("gpu1", "A100", 1)])
    try:
        yield st
    finally:
        server.stop()
        face.shutdown()
