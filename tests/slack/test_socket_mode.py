"""Socket Mode: slack_sdk's builtin client dials a local `websockets` server (the URL
the fake's apps.connections.open returns), which says hello, sends envelopes shaped
like ../shared/slack/payloads/socket_mode/, and collects the acks."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from websockets.sync.server import Server, ServerConnection, serve

from bot.faces.slack.server import socket_mode
from tests.core.helpers import host, wait_for
from tests.fakes.slack_api import FakeSlack, shared_slack_dir
from tests.slack.conftest import ALICE, block_actions, buttons_of, make_stack


def _payload(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (shared_slack_dir() / "payloads" / "socket_mode" / name).read_text()
    )
    return {k: v for k, v in data.items() if not k.startswith("_")}


class SocketModeServer:
    def __init__(self) -> None:
        self.outbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.acks: dict[str, dict[str, Any]] = {}
        self.connected = threading.Event()
        self._server: Server = serve(self._handle, "127.0.0.1", 0)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"ws://127.0.0.1:{port}/link/?ticket=test"

    def _handle(self, ws: ServerConnection) -> None:
        ws.send(json.dumps(_payload("hello.json")))
        self.connected.set()
        while True:
            try:
                envelope = self.outbox.get(timeout=0.05)
                ws.send(json.dumps(envelope))
            except queue.Empty:
                pass
            try:
                raw = ws.recv(timeout=0.01)
            except TimeoutError:
                continue
            except Exception:
                return
            msg = json.loads(raw)
            if "envelope_id" in msg:
                self.acks[msg["envelope_id"]] = msg

    def send(self, envelope: dict[str, Any]) -> dict[str, Any]:
        self.outbox.put(envelope)
        ack: dict[str, Any] = wait_for(lambda: self.acks.get(envelope["envelope_id"]), timeout=5)
        return ack

    def __enter__(self) -> SocketModeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)


@pytest.fixture
def ws_server() -> Iterator[SocketModeServer]:
    with SocketModeServer() as server:
        yield server


def test_socket_mode_command_button_and_home(
    fake_slack: FakeSlack, sqlite_engine: Engine, ws_server: SocketModeServer
) -> None:
    fake_slack.socket_mode_url = ws_server.url
    face, server, _stack = make_stack(fake_slack, sqlite_engine, [host("gpu1", "A100", 1)])
    handler = socket_mode(face, fake_slack.app_token)
    try:
        handler.connect()  # type: ignore[no-untyped-call]
        assert ws_server.connected.wait(5)
        assert fake_slack.last_call("apps.connections.open").ok

        slash = _payload("slash_commands_envelope.json")
        slash["payload"].update(
            command="/gpu",
            text="reserve",
            user_id=ALICE,
            response_url=fake_slack.response_url(),
            trigger_id=fake_slack.trigger_id(),
        )
        ack = ws_server.send(slash)
        body = ack["payload"]
        assert "Reserved: reservation #1" in body["text"]
        assert fake_slack.message_problems(body) == []

        # The same envelope again (a redelivery): the same answer, no second reservation.
        redelivered = {**slash, "envelope_id": "redelivery-1"}
        again = ws_server.send(redelivered)["payload"]
        assert "reservation #1" in again["text"]

        release = next(b for b in buttons_of(body) if b["text"]["text"] == "Release")
        url = fake_slack.response_url()
        click = {
            "envelope_id": "click-1",
            "payload": block_actions(ALICE, release, url),
            "type": "interactive",
            "accepts_response_payload": False,
        }
        assert ws_server.send(click)["envelope_id"] == "click-1"
        post = wait_for(lambda: [r for r in fake_slack.responses if r.url == url])[0]
        assert "Done: #1 released." in post.body["text"]

        event = _payload("events_api_envelope_retry.json")
        event["payload"]["event"] = {
            "type": "app_home_opened",
            "user": ALICE,
            "channel": "D0ALICE",
            "tab": "home",
            "event_ts": "1515449522000016",
        }
        fake_slack.home_views.pop(ALICE, None)
        ws_server.send(event)
        home = wait_for(lambda: fake_slack.home_views.get(ALICE))
        assert "hold no GPUs" in json.dumps(home["blocks"])
    finally:
        handler.close()  # type: ignore[no-untyped-call]
        server.stop()
        face.shutdown()
