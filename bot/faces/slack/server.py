"""How Slack reaches the app: HTTP on our own small front (below), or Socket Mode over
Slack's WebSocket.

Why not a thread-per-connection server (cheroot, Bolt's development server): a worker
thread there reads the request itself, so 16 strangers sending one byte every few
seconds held all 16 threads and stalled every signed request for 15-20 s. Here one
thread reads every connection through `selectors` and a request reaches the worker
pool only once it has fully arrived, within limits:

- headers within `header_timeout_s` of the accept, the body within `body_timeout_s`
  of the headers (Slack gives up after 3 s, so a request slower than that cannot be
  answered usefully anyway); slower ones are dropped with 408;
- a Content-Length over `max_body_bytes` is answered 413 from the headers alone,
  before a byte of body is read; no Content-Length (or chunked) is 411;
- at most `max_reading` connections and `max_buffered_bytes` are being read at once;
  past that the oldest unfinished one is dropped. Slack's own requests arrive in
  milliseconds, so it is always a straggler that goes, never a live request;
- one request per connection (`Connection: close`), as Slack sends them.

Then `WsgiApp` checks the Slack signature over the raw bytes before anything parses
them: an unsigned or stale request is 401 and a signed one of the wrong shape is 400,
both counted in `gpubot_http_refused` and neither ever logged with its body (Bolt
logs the whole body of a request that fails its own check, at INFO; none reaches
it). Bolt runs with `process_before_response=True`, so its sync listener answers on
the worker thread.

`/healthz` and `/metrics` (bot.adapters.metrics) answer beside `/slack/events`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import re
import selectors
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote_to_bytes

from slack_bolt.adapter.socket_mode import SocketModeHandler
from slack_bolt.adapter.wsgi import SlackRequestHandler

from bot.adapters.metrics import HTTP_REFUSED, OpsApp
from bot.faces.slack.app import RECEIVED_AT_HEADER, SlackFace

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger(__name__)

EVENTS_PATH = "/slack/events"
HEALTH_PATH = "/healthz"
# Slack's rule: a request whose timestamp is more than five minutes off is a replay.
# The front's note of when a request had fully arrived (time.monotonic()).
RECEIVED_AT_ENVIRON = "gpubot.received_at"
SIGNATURE_WINDOW_S = 300


@dataclass(frozen=True)
class Limits:
    """What a stranger can make the front hold.

    1 MiB of body: the largest real payload in shared/slack/payloads is ~2 KB, and the
    largest Slack can send us is a click on App Home, which carries the whole view
    (100 blocks of at most 3,000 characters: ~300 KB, more once form-encoded); 1 MiB
    covers that with room and keeps 48 slow uploads under 50 MB."""

    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 5.0
    body_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_reading: int = 1024
    max_buffered_bytes: int = 64 << 20
    # Complete requests waiting for a worker; past this a new one is told 503 at once.
    max_queued: int = 512


# --- the Slack-facing WSGI app ----------------------------------------------------------


def signature_problem(secret: str, timestamp: str, signature: str, body: bytes, now: float) -> str:
    """Why this is not a request Slack signed just now ("" when it is). Works on the raw
    bytes, so nothing in the body is looked at before the sender is known."""
    if not secret:
        return "no signing secret configured"
    if not timestamp or len(timestamp) > 12 or not timestamp.isascii() or not timestamp.isdigit():
        return "bad timestamp"
    if abs(now - int(timestamp)) > SIGNATURE_WINDOW_S:
        return "stale timestamp"
    base = b"v0:" + timestamp.encode("ascii") + b":" + body
    expected = b"v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest().encode()
    # Header values arrive as latin-1 text; compared as bytes so that any character works.
    if not hmac.compare_digest(expected, signature.encode("latin-1", "replace")):
        return "bad signature"
    return ""


def _is_ssl_check(body: bytes) -> bool:
    """Slack's certificate probe for slash commands (`ssl_check=1&token=…`) is not
    always signed; Bolt answers it before verifying too. Only a tiny body qualifies."""
    if len(body) > 256:
        return False
    fields = dict(parse_qsl(body.decode("latin-1"), keep_blank_values=True))
    return fields.get("ssl_check") == "1" and set(fields) <= {"ssl_check", "token"}


# Keys of a payload that Bolt or our listeners read as objects or lists of objects.
_OBJECT_KEYS = ("team", "user", "view", "container", "event", "state", "message")
_LIST_OF_OBJECT_KEYS = ("actions", "authorizations")


def payload_problem(content_type: str, body: bytes) -> str:
    """Why a signed body is not one Bolt can read ("" when it is). Mirrors Bolt's own
    parse (`slack_bolt.request.internals.parse_body`), which otherwise fails with a
    500 and a traceback on e.g. `payload=[1,2]`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "body is not UTF-8"
    if not text:
        return ""
    data: Any
    if content_type == "application/json" or text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return "body is not JSON"
    elif "payload" in text:
        payload = dict(parse_qsl(text, keep_blank_values=True)).get("payload")
        if payload is None:
            return ""
        try:
            data = json.loads(payload)
        except ValueError:
            return "payload is not JSON"
    else:
        return ""  # a plain form: Bolt reads it as strings
    if not isinstance(data, dict):
        return "payload is not a JSON object"
    for key in _OBJECT_KEYS:
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key} is not an object"
    for key in _LIST_OF_OBJECT_KEYS:
        value = data.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, dict) for v in value)
        ):
            return f"{key} is not a list of objects"
    return ""


def _plain(start_response: StartResponse, status: str, text: str) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(
        status,
        [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
    )
    return [body]


def _refused(reason: str, environ: WSGIEnvironment, size: int) -> None:
    """Counted, and logged at DEBUG without the body: the sender is unknown."""
    HTTP_REFUSED.labels(reason=reason).inc()
    log.debug(
        "refused %s %s from %s: %s (%d bytes)",
        environ.get("REQUEST_METHOD"),
        environ.get("PATH_INFO"),
        environ.get("REMOTE_ADDR"),
        reason,
        size,
    )


class WsgiApp:
    """Bolt at /slack/events (commands, interactivity, events alike) behind a signature
    check on the raw body; /healthz and /metrics beside it."""

    def __init__(
        self,
        face: SlackFace,
        max_body_bytes: int = Limits.max_body_bytes,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._bolt = SlackRequestHandler(face.app, path=EVENTS_PATH)
        self._ops = OpsApp(face.service.engine, face.service.clock)
        self._secret = face.settings.slack_signing_secret.get_secret_value()
        self._max_body = max_body_bytes
        # Slack's timestamps are wall-clock time, whatever clock the service runs on.
        self._now = now

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if OpsApp.handles(environ):  # /healthz and /metrics (bot.adapters.metrics)
            return self._ops(environ, start_response)
        if environ.get("PATH_INFO") != EVENTS_PATH:
            _refused("not_found", environ, 0)
            return _plain(start_response, "404 Not Found", "not found")
        if environ.get("REQUEST_METHOD") != "POST":
            _refused("method", environ, 0)
            return _plain(start_response, "405 Method Not Allowed", "POST only")
        raw_length = str(environ.get("CONTENT_LENGTH") or "")
        if not raw_length.isascii() or not raw_length.isdigit():
            _refused("no_length", environ, 0)
            return _plain(start_response, "411 Length Required", "Content-Length required")
        if int(raw_length) > self._max_body:
            _refused("too_large", environ, 0)
            return _plain(start_response, "413 Content Too Large", "body too large")
        body = environ["wsgi.input"].read(int(raw_length))
        problem = signature_problem(
            self._secret,
            str(environ.get("HTTP_X_SLACK_REQUEST_TIMESTAMP", "")),
            str(environ.get("HTTP_X_SLACK_SIGNATURE", "")),
            body,
            self._now(),
        )
        if problem:
            if _is_ssl_check(body):
                return _plain(start_response, "200 OK", "")
            _refused("unsigned", environ, len(body))
            return _plain(start_response, "401 Unauthorized", "invalid request signature")
        problem = payload_problem(str(environ.get("CONTENT_TYPE", "")), body)
        if problem:
            _refused("malformed", environ, len(body))
            return _plain(start_response, "400 Bad Request", problem)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        # Always ours, never the sender's: the ack deadline counts from here (bot.faces.slack.app).
        received = environ.get(RECEIVED_AT_ENVIRON, time.monotonic())
        environ["HTTP_" + RECEIVED_AT_HEADER.upper().replace("-", "_")] = repr(received)
        # Bolt could not read a signed request; listeners' own errors stay in Bolt.
        try:
            return self._bolt(environ, start_response)
        except Exception as exc:
            _refused("malformed", environ, len(body))
            log.warning("could not read a signed request: %s", type(exc).__name__)
            return _plain(start_response, "400 Bad Request", "unreadable request")


# --- the HTTP front ---------------------------------------------------------------------

_REASONS = {
    200: "OK",
    400: "Bad Request",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_METHOD = re.compile(rb"^[A-Z]{1,16}$")
_MAX_HEADERS = 100
_SWEEP_S = 0.25


class _HttpError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _simple(status: int, text: str) -> bytes:
    body = (text + "\n").encode()
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


@dataclass
class _Head:
    method: str
    path: str
    query: str
    version: str
    headers: list[tuple[str, str]]
    length: int
    expect_continue: bool


def parse_head(raw: bytes, max_body: int) -> _Head:
    """The request line and headers (everything before the blank line), strictly:
    anything ambiguous is 400 rather than guessed at."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _METHOD.match(parts[0]) or not parts[1].startswith(b"/"):
        raise _HttpError(400, "bad request line")
    if parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise _HttpError(505, "HTTP/1.0 or HTTP/1.1 only")
    if len(lines) - 1 > _MAX_HEADERS:
        raise _HttpError(431, "too many headers")
    headers: list[tuple[str, str]] = []
    lengths: set[bytes] = set()
    expect = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name) or b"\n" in value or b"\r" in value:
            raise _HttpError(400, "bad header line")
        value = value.strip(b" \t")
        lower = name.lower()
        if lower == b"content-length":
            lengths.add(value)
        elif lower == b"transfer-encoding":
            raise _HttpError(411, "Content-Length required (no chunked bodies)")
        elif lower == b"expect":
            if value.lower() != b"100-continue":
                raise _HttpError(400, "unsupported Expect")
            expect = True
        if b"_" in name:  # X-Slack_Signature would pose as X-Slack-Signature in WSGI
            continue
        headers.append((name.decode("latin-1"), value.decode("latin-1")))
    method = parts[0].decode("ascii")
    if len(lengths) > 1:
        raise _HttpError(400, "conflicting Content-Length")
    raw_length = lengths.pop() if lengths else None
    if raw_length is None:
        if method in ("POST", "PUT", "PATCH"):
            raise _HttpError(411, "Content-Length required")
        length = 0
    elif not raw_length.isdigit() or len(raw_length) > 18:
        raise _HttpError(400, "bad Content-Length")
    else:
        length = int(raw_length)
    if length > max_body:
        raise _HttpError(413, f"body over {max_body} bytes")
    target = parts[1].decode("latin-1")
    path, _, query = target.partition("?")
    return _Head(
        method=method,
        path=unquote_to_bytes(path).decode("latin-1"),
        query=query,
        version=parts[2].decode("ascii"),
        headers=headers,
        length=length,
        expect_continue=expect,
    )


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: tuple[str, int]
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    head: _Head | None = None
    body_at: int = 0


class HttpServer:
    """The front: `threads` workers run the app; reading is done by one selector thread.
    Port 0 picks a free one (see `.port`).

    16 workers: with one GIL and SQLite, more runnable threads add no throughput and
    lengthen the tail. Slow or idle connections never occupy a worker."""

    def __init__(
        self,
        face: SlackFace | None,
        host: str = "127.0.0.1",
        port: int = 3000,
        threads: int = 16,
        limits: Limits | None = None,
        app: WSGIApplication | None = None,
    ) -> None:
        """`app` serves instead of the Slack face's (e.g. only /healthz and /metrics)."""
        self.limits = limits or Limits()
        if app is None:
            if face is None:
                raise ValueError("HttpServer needs a SlackFace or a WSGI app")
            app = WsgiApp(face, self.limits.max_body_bytes)
        self._app: WSGIApplication = app
        self._bind_to = (host, port)
        self._threads = threads
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._reading: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._buffered = 0
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def _bind(self) -> None:
        if self._listener is not None:
            return
        host, port = self._bind_to
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
        sock.setblocking(False)
        self._listener = sock
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ, "accept")
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gpubot-http")

    @property
    def host(self) -> str:
        if self._listener is None:
            return self._bind_to[0]
        return str(self._listener.getsockname()[0])

    @property
    def port(self) -> int:
        if self._listener is None:
            return self._bind_to[1]
        return int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{EVENTS_PATH}"

    def start(self) -> HttpServer:
        """Binds and serves on a background thread; returns once the socket listens."""
        self._bind()
        self._thread = threading.Thread(target=self._loop, name="gpubot-http-front", daemon=True)
        self._thread.start()
        log.info("serving Slack over HTTP on %s:%s%s", self.host, self.port, EVENTS_PATH)
        return self

    def serve_forever(self) -> None:
        self._bind()
        log.info("serving Slack over HTTP on %s:%s%s", self.host, self.port, EVENTS_PATH)
        self._loop()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the selector thread -----------------------------------------------------------

    def _loop(self) -> None:
        assert self._selector is not None
        last_sweep = time.monotonic()
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(_SWEEP_S):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._read(key.data)
                now = time.monotonic()
                if now - last_sweep >= _SWEEP_S:
                    last_sweep = now
                    self._sweep(now)
        finally:
            self._close_all()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: drop the oldest straggler, go on
                log.warning("accept failed: %s", exc)
                self._evict_oldest("accept_failed")
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while len(self._reading) >= self.limits.max_reading:
                self._evict_oldest("too_many_connections")
            conn = _Conn(
                sock, (str(peer[0]), int(peer[1])), time.monotonic() + self.limits.header_timeout_s
            )
            self._reading[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:  # the client went away before its request was complete
            self._drop(conn)
            return
        conn.buf += data
        self._buffered += len(data)
        try:
            if conn.head is None and not self._read_head(conn):
                return
        except _HttpError as exc:
            reason = "too_large" if exc.status == 413 else "malformed"
            self._refuse(conn, exc.status, exc.reason, reason)
            return
        assert conn.head is not None
        if len(conn.buf) - conn.body_at >= conn.head.length:
            self._dispatch(conn)
            return
        while self._buffered > self.limits.max_buffered_bytes and self._reading:
            self._evict_oldest("buffer_full")

    def _read_head(self, conn: _Conn) -> bool:
        """True once the headers are in (and parsed); False while more must come."""
        if conn.buf[:2] == b"\r\n":  # a stray CRLF before the request line is allowed
            del conn.buf[:2]
            self._buffered -= 2
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > self.limits.max_header_bytes:
                raise _HttpError(431, "headers too large")
            return False
        if end > self.limits.max_header_bytes:
            raise _HttpError(431, "headers too large")
        conn.head = parse_head(bytes(conn.buf[:end]), self.limits.max_body_bytes)
        conn.body_at = end + 4
        conn.deadline = time.monotonic() + self.limits.body_timeout_s
        if conn.head.expect_continue and conn.head.length:
            with contextlib.suppress(OSError):
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        return True

    def _forget(self, conn: _Conn) -> None:
        if self._reading.pop(conn.sock, None) is not None:
            self._buffered -= len(conn.buf)
            assert self._selector is not None
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)

    def _drop(self, conn: _Conn) -> None:
        self._forget(conn)
        conn.sock.close()

    def _refuse(self, conn: _Conn, status: int, text: str, reason: str) -> None:
        """An error answered from here, best effort (the socket is non-blocking)."""
        HTTP_REFUSED.labels(reason=reason).inc()
        self._forget(conn)
        try:
            conn.sock.send(_simple(status, text))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.sock.close()

    def _evict_oldest(self, reason: str) -> None:
        if self._reading:
            _, conn = next(iter(self._reading.items()))
            self._refuse(conn, 503, "server busy", reason)

    def _sweep(self, now: float) -> None:
        late = [c for c in self._reading.values() if c.deadline <= now]
        for conn in late:
            self._refuse(conn, 408, "request not received in time", "timeout")

    def _dispatch(self, conn: _Conn) -> None:
        assert conn.head is not None and self._pool is not None
        self._forget(conn)
        with self._queued_lock:
            if self._queued >= self.limits.max_queued:
                full = True
            else:
                full = False
                self._queued += 1
        if full:
            HTTP_REFUSED.labels(reason="queue_full").inc()
            with contextlib.suppress(OSError):
                conn.sock.send(_simple(503, "server busy"))
            conn.sock.close()
            return
        body = bytes(conn.buf[conn.body_at : conn.body_at + conn.head.length])
        try:
            self._pool.submit(self._respond, conn, conn.head, body, time.monotonic())
        except RuntimeError:  # shutting down
            conn.sock.close()

    def _close_all(self) -> None:
        for conn in list(self._reading.values()):
            self._drop(conn)
        if self._selector is not None:
            self._selector.close()
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- a worker thread ----------------------------------------------------------------

    def _environ(self, conn: _Conn, head: _Head, body: bytes, received_at: float) -> dict[str, Any]:
        environ: dict[str, Any] = {
            "REQUEST_METHOD": head.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": head.path,
            "QUERY_STRING": head.query,
            "SERVER_NAME": self.host,
            "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": head.version,
            "REMOTE_ADDR": conn.peer[0],
            "REMOTE_PORT": str(conn.peer[1]),
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            RECEIVED_AT_ENVIRON: received_at,
        }
        for name, value in head.headers:
            key = name.upper().replace("-", "_")
            if key == "CONTENT_TYPE":
                environ["CONTENT_TYPE"] = value
            elif key != "CONTENT_LENGTH":
                key = "HTTP_" + key
                environ[key] = f"{environ[key]}, {value}" if key in environ else value
        return environ

    def _call_app(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        started: list[tuple[str, list[tuple[str, str]]]] = []
        chunks: list[bytes] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], object]:
            started[:] = [(status, headers)]
            return chunks.append

        result = self._app(environ, start_response)
        try:
            chunks.extend(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if not started:
            raise RuntimeError("the app did not call start_response")
        return started[0][0], started[0][1], b"".join(chunks)

    def _respond(self, conn: _Conn, head: _Head, body: bytes, received_at: float) -> None:
        with self._queued_lock:
            self._queued -= 1
        try:
            try:
                environ = self._environ(conn, head, body, received_at)
                status, headers, out = self._call_app(environ)
            except Exception:
                log.exception("%s %s failed", head.method, head.path)
                status, headers, out = "500 Internal Server Error", [], b""
            lines = [f"HTTP/1.1 {status}"]
            for name, value in headers:
                if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                    lines.append(f"{name}: {value}")
            lines += [
                f"Content-Length: {len(out)}",
                f"Date: {formatdate(usegmt=True)}",
                "Server: gpubot",
                "Connection: close",
            ]
            payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            if head.method != "HEAD":
                payload += out
            conn.sock.settimeout(self.limits.write_timeout_s)
            conn.sock.sendall(payload)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the client left, or reads too slowly to wait for
        finally:
            conn.sock.close()


def socket_mode(face: SlackFace, app_token: str, **kwargs: Any) -> SocketModeHandler:
    """Slack's builtin Socket Mode client over the app's WebClient (same base URL), so
    apps.connections.open goes where every other call goes."""
    return SocketModeHandler(face.app, app_token=app_token, web_client=face.client, **kwargs)


def run_until(stop: threading.Event, start: Callable[[], None], close: Callable[[], None]) -> None:
    start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        close()
