"""The HTTP face against strangers, over real sockets to the real front and Bolt app:
bodies over the limit refused from the headers alone, slow connections that hold
nothing a signed request needs, unsigned bodies never logged, and 400/401 (never a
500 or a traceback) for whatever arrives malformed or unsigned."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bot.faces.slack.server import HttpServer, Limits
from tests.slack.conftest import SlackStack

FORM = "application/x-www-form-urlencoded"


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _raw(server: HttpServer, data: bytes) -> bytes:
    """Sends bytes as they are, then reads until the server closes (it always does)."""
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(data)
        return _read_all(s)


def _status(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    return int(reply.split(b" ", 2)[1])


def _head(length: int, extra: bytes = b"") -> bytes:
    return (
        b"POST /slack/events HTTP/1.1\r\nHost: bot\r\nContent-Type: " + FORM.encode() + b"\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n" + extra + b"\r\n"
    )


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record at every level, from every logger (Bolt's included)."""
    caplog.set_level(logging.DEBUG)
    yield caplog


def _no_traceback(logs: pytest.LogCaptureFixture) -> None:
    assert not [r for r in logs.records if r.exc_info], [r.getMessage() for r in logs.records]
    assert "Traceback" not in logs.text


# --- size ---------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_413_from_the_headers_alone(stack: SlackStack) -> None:
    # 200 MB promised and not one byte sent: an answer can only come from the headers.
    reply = _raw(stack.server, _head(200_000_000))
    assert _status(reply) == 413
    # Just under the limit is read, and refused for what it is: unsigned.
    under = stack.client.post(b"x" * (Limits().max_body_bytes - 1), FORM, signature="v0=00")
    assert under.status == 401


def test_an_unsigned_body_never_reaches_a_log_line_at_any_level(
    stack: SlackStack, logs: pytest.LogCaptureFixture
) -> None:
    marker = "UNSIGNED-" + secrets.token_hex(8)
    body = ("command=%2Fgpu&text=" + marker * (400_000 // len(marker))).encode()
    assert stack.client.post(body, FORM, signature="v0=" + "0" * 64).status == 401
    assert stack.client.post(body, FORM, signature="").status == 401
    stale = stack.client.post(body, FORM, timestamp=int(time.time()) - 3600)
    assert stale.status == 401
    # Over the limit: refused before its body is read, so never held or logged either.
    with socket.create_connection((stack.server.host, stack.server.port), timeout=10) as s:
        s.sendall(_head(5 << 20) + body[:60_000])
        assert _status(_read_all(s)) == 413
    assert marker not in logs.text
    assert not [r for r in logs.records if marker in r.getMessage()]
    assert stack.fake.calls_to("users.info") == []  # no listener ran


# --- slow and idle connections ------------------------------------------------------------


def test_48_slow_connections_do_not_keep_a_signed_help_from_being_answered(
    stack: SlackStack,
) -> None:
    """Each stranger sends one header byte at a time and never finishes. The stack's
    server has 8 worker threads: a thread-per-connection server would have given all
    8 to strangers, and the signed request would wait for as long as they trickle."""
    head = _head(100_000, b"X-Slack-Signature: v0=" + b"0" * 64 + b"\r\n")
    slow = [socket.create_connection((stack.server.host, stack.server.port)) for _ in range(48)]
    stop = threading.Event()

    def trickle() -> None:
        i = 10
        while not stop.wait(0.2) and i < len(head) - 2:
            for s in slow:
                s.send(head[i : i + 1])
            i += 1

    for s in slow:
        s.sendall(head[:10])
    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        reply = stack.client.command("help")
        assert reply.status == 200
        assert "gpubot commands" in reply.json()["text"]
        # The strangers were not simply dropped to make room: each is still connected.
        for s in slow:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        stop.set()
        sender.join()
        for s in slow:
            s.close()


@pytest.fixture
def strict(stack: SlackStack) -> Iterator[HttpServer]:
    """A second front on the same app with short deadlines and room for 4 at once."""
    limits = Limits(header_timeout_s=0.3, body_timeout_s=0.3, max_reading=4)
    server = HttpServer(stack.face, host="127.0.0.1", port=0, threads=2, limits=limits).start()
    try:
        yield server
    finally:
        server.stop()


def test_headers_or_a_body_that_never_finish_are_cut_off_with_408(strict: HttpServer) -> None:
    assert _status(_raw(strict, b"POST /slack/events HTTP/1.1\r\nHost: b")) == 408
    assert _status(_raw(strict, _head(100) + b"token=x")) == 408


def test_when_too_many_are_unfinished_the_oldest_straggler_goes(
    stack: SlackStack, strict: HttpServer
) -> None:
    slow = [socket.create_connection((strict.host, strict.port), timeout=10) for _ in range(4)]
    try:
        for s in slow:
            s.sendall(b"POST /slack/events HTTP/1.1\r\n")
        # A fifth, complete request: answered, and the first straggler made room.
        client = type(stack.client)(strict.host, strict.port, stack.secret, stack.fake)
        assert client.command("help").status == 200
        assert _status(_read_all(slow[0])) == 503
    finally:
        for s in slow:
            s.close()


# --- malformed and unsigned --------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"payload=[1,2]",
        b"payload={not",
        b"payload=%7B%22type%22%3A%22block_actions%22%2C%22user%22%3A%22U1%22%7D",
        b"\xff\xfe\xfd",
        b"",
    ],
)
def test_garbage_without_a_good_signature_is_401_without_a_traceback(
    stack: SlackStack, logs: pytest.LogCaptureFixture, body: bytes
) -> None:
    assert stack.client.post(body, FORM, signature="v0=" + "1" * 64).status == 401
    assert stack.client.post(body, FORM, signature="").status == 401
    # A signature header of non-ASCII text, and a timestamp that is not a number.
    assert stack.client.post(body, FORM, signature="v0=\u00e9\u00e9").status == 401
    ts = b"abc"
    sig = hmac.new(stack.secret.encode(), b"v0:" + ts + b":" + body, hashlib.sha256).hexdigest()
    reply = stack.client.post(
        body,
        FORM,
        signature="v0=" + sig,
        headers={"X-Slack-Request-Timestamp": ts.decode()},
    )
    assert reply.status == 401
    _no_traceback(logs)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"payload=[1,2]", FORM),
        (b"payload={not", FORM),
        (b"payload=%22text%22", FORM),
        (b"payload=%7B%22type%22%3A%22block_actions%22%2C%22user%22%3A%22U1%22%7D", FORM),
        (b'payload={"type":"block_actions","actions":[1,2]}', FORM),
        (b"\xff\xfe\xfd", FORM),
        (b"[1,2]", "application/json"),
        (b"{not json", "application/json"),
        (b'{"type":"event_callback","event":[1]}', "application/json"),
        (b'{"type":"event_callback","authorizations":"all"}', "application/json"),
    ],
)
def test_signed_garbage_is_400_without_a_traceback(
    stack: SlackStack, logs: pytest.LogCaptureFixture, body: bytes, content_type: str
) -> None:
    """Only Slack can sign; still, a body no listener can read is the sender's fault."""
    assert stack.client.post(body, content_type).status == 400
    _no_traceback(logs)
    assert stack.fake.calls_to("users.info") == []


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /slack/events HTTP/1.1\r\nHost: b\r\n\r\n", 411),
        (
            b"POST /slack/events HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            411,
        ),
        (b"POST /slack/events HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxy", 400),
        (b"POST /slack/events HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /slack/events HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"POST /slack/events HTTP/2.0\r\nContent-Length: 0\r\n\r\n", 505),
        (b"GET /slack/events HTTP/1.1\r\n\r\n", 405),
        (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", 404),
        (b"POST /slack/events HTTP/1.1\r\n" + b"X: " + b"y" * 20_000 + b"\r\n\r\n", 431),
    ],
)
def test_malformed_http_is_a_4xx_without_a_traceback(
    stack: SlackStack, logs: pytest.LogCaptureFixture, request_bytes: bytes, status: int
) -> None:
    assert _status(_raw(stack.server, request_bytes)) == status
    _no_traceback(logs)


def test_a_header_spelled_with_underscores_cannot_pose_as_the_signature(
    stack: SlackStack,
) -> None:
    """WSGI turns `-` into `_`, so `X-Slack_Signature` would become the signature
    header's key; the front drops such names, as nginx does."""
    body = b"command=%2Fgpu&text=help&user_id=U0ALICE01"
    ts = str(int(time.time()))
    good = hmac.new(stack.secret.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256)
    reply = _raw(
        stack.server,
        _head(len(body), f"X-Slack-Request-Timestamp: {ts}\r\n".encode())[:-2]
        + b"X-Slack_Signature: v0="
        + good.hexdigest().encode()
        + b"\r\n\r\n"
        + body,
    )
    assert _status(reply) == 401


def test_slacks_unsigned_certificate_probe_is_answered_and_nothing_else_is(
    stack: SlackStack,
) -> None:
    probe = stack.client.post(b"ssl_check=1&token=abc", FORM, signature="")
    assert probe.status == 200 and probe.body.strip() == b""
    posing = stack.client.post(
        b"ssl_check=1&token=abc&command=%2Fgpu&text=reserve", FORM, signature=""
    )
    assert posing.status == 401
