"""A fake Slack Web API on 127.0.0.1 that the real `slack_sdk.WebClient` talks to.

Slack cannot run here, and a hand-written mock would only echo what the bot's author believes
Slack does. So every request is checked against Slack's published reference data in
`<repo>/../shared/slack/` (the OpenAPI spec, the supplement that corrects it for how slack_sdk
really sends calls, and the Block Kit limits): a call that real Slack would reject is recorded as
a *violation* and answered the way Slack answers it (`ok: false`), and the `fake_slack` fixture
fails the test at teardown. Plain runtime errors that a correct bot must handle (a message that is
gone, an unknown user, an injected fault) are answered but are not violations.

The parts: `slack_spec` (the reference data and the Block Kit checks), `slack_records` (what is
recorded, faults, body parsing), `slack_methods` (each method's behaviour); this module is the
server, the dispatch and the test-facing API, and re-exports what tests import.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from slack_sdk import WebClient

from tests.fakes.slack_methods import SlackMethods
from tests.fakes.slack_records import (
    RESPONSE_URL_ENDPOINT,
    UPLOAD_ENDPOINT,
    Call,
    FakeUser,
    FaultKind,
    Hold,
    Message,
    Responder,
    ResponsePost,
    UploadedFile,
    _absent,
    _decode_json_args,
    _Fault,
    _parse_body,
    _redact,
    _Reply,
    _ResponseUrl,
    _SlackError,
    _Violation,
)
from tests.fakes.slack_spec import (
    ENFORCED_LIMITS,
    NOT_ENFORCED_LIMITS,
    WEB_API_LIMIT_SECTIONS,
    JsonDict,
    MethodSpec,
    SlackReference,
    SlackSpecMissingError,
    load_reference,
    shared_slack_dir,
    supplement_methods,
)

__all__ = [
    "ENFORCED_LIMITS",
    "NOT_ENFORCED_LIMITS",
    "RESPONSE_URL_ENDPOINT",
    "UPLOAD_ENDPOINT",
    "WEB_API_LIMIT_SECTIONS",
    "Call",
    "FakeSlack",
    "FakeUser",
    "Hold",
    "JsonDict",
    "Message",
    "MethodSpec",
    "ResponsePost",
    "SlackReference",
    "SlackSpecMissingError",
    "UploadedFile",
    "load_reference",
    "shared_slack_dir",
    "supplement_methods",
]

_TOKEN_RE = re.compile(r"^(xoxe\.)?xox[a-z]-[A-Za-z0-9-]+$")
_APP_TOKEN_RE = re.compile(r"^xapp-[A-Za-z0-9-]+$")
_MESSAGE_METHODS = ("chat.postMessage", "chat.postEphemeral", "chat.update")


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeSlack


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the default access log would be noise, and logging must never carry tokens."""

    def do_POST(self) -> None:
        self.server.fake._serve(self)

    def do_GET(self) -> None:
        self.server.fake._serve(self)


class FakeSlack(SlackMethods):
    """The fake Web API. Use as a context manager, or through the `fake_slack` fixture.

    Give `fake.url` to `WebClient(base_url=...)` (or `fake.client()`), and `fake.bot_token` as
    the token. Assert on `.calls`, `.messages`, `.files`, `.responses`; inject faults with
    `rate_limit()` and `fail_next()`.
    """

    bot_token = "xoxb-1000000001-2000000002-fakebottoken"
    user_token = "xoxp-1000000001-2000000002-fakeusertoken"
    app_token = "xapp-1-AFAKEAPP01-3000000003-fakeapptoken"
    team_id = "TFAKETEAM1"
    team = "gpubot test workspace"
    bot_user_id = "UFAKEBOT01"
    bot_id = "BFAKEBOT01"
    app_id = "AFAKEAPP01"

    def __init__(
        self,
        *,
        auto_users: bool = True,
        home_tab_enabled: bool = True,
        valid_tokens: set[str] | None = None,
        reference: SlackReference | None = None,
    ) -> None:
        """`auto_users`: users.info invents a user for any well-formed unknown id (else
        user_not_found). `valid_tokens`: if set, other well-formed tokens get invalid_auth."""
        self.ref = reference or load_reference()
        self.auto_users = auto_users
        self.home_tab_enabled = home_tab_enabled
        self.valid_tokens = valid_tokens
        self.socket_mode_url: str | None = None

        self.calls: list[Call] = []
        self.violations: list[str] = []
        self.internal_errors: list[str] = []
        self.messages: list[Message] = []
        self.users: dict[str, FakeUser] = {}
        self.usergroups: dict[str, list[str]] = {}
        self.files: dict[str, UploadedFile] = {}
        self.views: dict[str, JsonDict] = {}
        self.home_views: dict[str, JsonDict] = {}
        self.responses: list[ResponsePost] = []

        self._lock = threading.RLock()
        self._faults: dict[str, deque[_Fault]] = {}
        self._responders: dict[str, Responder] = {}
        self._expected: list[str] = []
        self._response_urls: dict[str, _ResponseUrl] = {}
        self._triggers_issued: dict[str, float] = {}
        self._triggers_used: set[str] = set()
        self._dm_channels: dict[str, str] = {}
        self._named_channels: dict[str, str] = {}
        self._last_us = 0
        self._ids = itertools.count(1)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._handlers: dict[str, Callable[[Call, str], JsonDict]] = {
            method: getattr(self, attr) for method, attr in self.HANDLERS.items()
        }

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeSlack:
        if self._server is None:
            server = _Server(("127.0.0.1", 0), _Handler)
            server.fake = self
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None
            self._thread = None

    def __enter__(self) -> FakeSlack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeSlack is not started")
        return int(self._server.server_address[1])

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The Web API base URL; slack_sdk appends the method name, so it ends with '/'."""
        return f"{self.root_url}/api/"

    def client(self, token: str | None = None, **kwargs: Any) -> WebClient:
        return WebClient(token=token or self.bot_token, base_url=self.url, **kwargs)

    # ---- test-facing helpers ---------------------------------------------------------------

    def add_user(
        self,
        user_id: str,
        display_name: str | None = None,
        *,
        real_name: str | None = None,
        name: str | None = None,
        **extra: Any,
    ) -> FakeUser:
        name = name or (display_name or user_id).lower().replace(" ", ".")
        user = FakeUser(
            id=user_id,
            name=name,
            display_name=display_name if display_name is not None else name,
            real_name=real_name or (display_name or name).title(),
            **extra,
        )
        with self._lock:
            self.users[user_id] = user
        return user

    def add_usergroup(self, group_id: str, members: list[str]) -> None:
        """A user group (id `S…`) and its members, for usergroups.users.list."""
        with self._lock:
            self.usergroups[group_id] = list(members)

    def dm_channel_for(self, user_id: str) -> str:
        """The DM channel id the fake gives the bot's conversation with `user_id`."""
        with self._lock:
            if user_id not in self._dm_channels:
                self._dm_channels[user_id] = f"DFAKE{next(self._ids):06d}"
            return self._dm_channels[user_id]

    def rate_limit(
        self, method: str, times: int = 1, retry_after: int = 1, *, after: int = 0
    ) -> None:
        """The next `times` calls of `method` ('*' for any) get HTTP 429 with Retry-After;
        `after`: that many calls first go through untouched."""
        self._add_fault(method, times, _Fault("ratelimit", retry_after=retry_after), after)

    def hold_next(self, method: str) -> Hold:
        """The next call of `method` takes effect, then is held open unanswered until the
        returned Hold is released (then its connection closes): a sender killed meanwhile
        died after Slack acted and before it learnt so."""
        hold = Hold()
        self._add_fault(method, 1, _Fault("hold", hold=hold))
        return hold

    def fail_next(
        self,
        method: str,
        times: int = 1,
        kind: FaultKind = "disconnect",
        error: str = "internal_error",
        status: int = 500,
        *,
        after: int = 0,
    ) -> None:
        """The next `times` calls of `method` ('*' for any) fail; `after`: that many calls
        first go through untouched.

        `disconnect`: the connection is closed before the call takes effect (a network error).
        `disconnect_after`: the call takes effect, then the connection is closed without a reply:
        the case where a sender cannot know whether it went through.
        `error`: `{"ok": false, "error": error}` (for the upload and response_url endpoints,
        HTTP `status` instead). `ratelimit`: as `rate_limit()`.
        """
        self._add_fault(method, times, _Fault(kind, error=error, status=status), after)

    def _add_fault(self, method: str, times: int, fault: _Fault, after: int = 0) -> None:
        with self._lock:
            queue = self._faults.setdefault(method, deque())
            queue.extend(_Fault("pass") for _ in range(after))
            queue.extend(fault for _ in range(times))

    def on(self, method: str, responder: Responder) -> None:
        """Answer a spec method the fake has no built-in behaviour for. The call is still
        checked against the spec first; the responder gets the recorded Call."""
        if method not in self.ref.methods:
            raise ValueError(f"{method} is not a Slack Web API method in the reference data")
        self._responders[method] = responder

    def response_url(self) -> str:
        """A fresh response_url, as Slack puts in a slash command or block_actions payload."""
        with self._lock:
            n = next(self._ids)
            url = f"{self.root_url}/response/{self.team_id}/{n}/fakeresponse{n:06d}"
            self._response_urls[url] = _ResponseUrl(url)
            return url

    def trigger_id(self) -> str:
        """A fresh trigger_id; views.open with it more than limits.json's lifetime later fails."""
        with self._lock:
            trigger = f"{next(self._ids)}.1000000001.fake{next(self._ids):08x}"
            self._triggers_issued[trigger] = time.monotonic()
            return trigger

    def calls_to(self, method: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == method]

    def last_call(self, method: str) -> Call:
        calls = self.calls_to(method)
        if not calls:
            raise AssertionError(
                f"no call to {method}; calls were {[c.method for c in self.calls]}"
            )
        return calls[-1]

    def messages_in(self, channel: str, *, include_deleted: bool = False) -> list[Message]:
        with self._lock:
            return [
                m
                for m in self.messages
                if m.channel == channel and (include_deleted or not m.deleted)
            ]

    def per_minute(self, method: str) -> int:
        """The calls a minute `method`'s published tier allows (limits.json: "Tier 3" is
        "50+ per minute"), for tests that check the bot keeps within it. Raises for a method
        whose tier is not a numbered one."""
        rates = self.ref.limits["rate_limits"]
        tier = next(m["tier"] for m in rates["methods"] if m["method"] == method)
        rate = next(t["rate"] for t in rates["tiers"] if t["tier"] == tier)
        return int(re.match(r"(\d+)", rate).group(1))  # type: ignore[union-attr]

    def expect_violation(self, pattern: str) -> None:
        """Declare that this test provokes a violation matching `pattern` (a regex); the
        fixture then fails the test if it does NOT happen, or if any other one does."""
        self._expected.append(pattern)

    def take_violations(self) -> list[str]:
        """Return and forget the violations so far (for tests that assert on them directly)."""
        with self._lock:
            taken, self.violations = self.violations, []
            return taken

    def problems(self) -> list[str]:
        """What the fixture reports at teardown; empty when the test used Slack correctly."""
        with self._lock:
            out = [f"Slack API violation: {v}" for v in self.violations if not self._matches(v)]
            out += [
                f"expected a violation matching {p!r}, none happened"
                for p in self._expected
                if not any(re.search(p, v) for v in self.violations)
            ]
            out += [f"fake crashed: {e}" for e in self.internal_errors]
            return out

    def _matches(self, violation: str) -> bool:
        return any(re.search(p, violation) for p in self._expected)

    # ---- request dispatch ---------------------------------------------------------------------

    def _serve(self, req: _Handler) -> None:
        try:
            length = int(req.headers.get("Content-Length") or 0)
            body = req.rfile.read(length) if length > 0 else b""
            parts = urlsplit(req.path)
            path = parts.path
            if path.startswith("/api/"):
                reply = self._web_api(path[len("/api/") :], req, body, parts.query)
            elif path.startswith("/upload/v1/"):
                reply = self._upload(path[len("/upload/v1/") :], req, body)
            elif path.startswith("/response/"):
                reply = self._response_post(self.root_url + path, req, body)
            else:
                reply = _Reply(404, {"ok": False, "error": "not_found"})
        except Exception:
            with self._lock:
                self.internal_errors.append(traceback.format_exc())
            reply = _Reply(500, {"ok": False, "error": "fatal_error"})
        if reply.drop:
            req.close_connection = True
            return
        if isinstance(reply.body, str):
            data = reply.body.encode("utf-8")
            ctype = "text/plain; charset=utf-8"
        else:
            data = json.dumps(reply.body).encode("utf-8")
            ctype = "application/json; charset=utf-8"
        req.send_response(reply.status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        for k, v in reply.headers.items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(data)

    def _take_fault(self, name: str) -> _Fault | None:
        with self._lock:
            for key in (name, "*"):
                queue = self._faults.get(key)
                if queue:
                    fault = queue.popleft()
                    return None if fault.kind == "pass" else fault
        return None

    @staticmethod
    def _fault_reply(fault: _Fault, api: bool) -> _Reply:
        if fault.kind == "ratelimit":
            return _Reply(
                429,
                {"ok": False, "error": "ratelimited"},
                headers={"Retry-After": str(fault.retry_after)},
            )
        if fault.kind == "error":
            if api:
                return _Reply(200, {"ok": False, "error": fault.error})
            return _Reply(fault.status, {"ok": False, "error": fault.error})
        return _Reply(drop=True)

    def _web_api(self, method: str, req: _Handler, body: bytes, query: str) -> _Reply:
        content_type = req.headers.get("Content-Type", "")
        raw, was_json, parse_problem = _parse_body(content_type, body)
        params = {**dict(parse_qsl(query, keep_blank_values=True)), **raw}
        params, json_problems = _decode_json_args(params)
        auth_header = req.headers.get("Authorization", "")
        body_token = params.pop("token", None)
        call = Call(
            method=method,
            params=params,
            headers=_redact(dict(req.headers.items())),
            http_method=req.command,
            content_type=content_type,
        )
        with self._lock:
            self.calls.append(call)
        fault = self._take_fault(method)
        if fault is not None and fault.kind not in ("disconnect_after", "hold"):
            call.fault = fault.kind
            reply = self._fault_reply(fault, api=True)
            call.status = reply.status
            call.response = reply.body if isinstance(reply.body, dict) else None
            call.error = call.response.get("error") if call.response else None
            return reply
        try:
            if parse_problem:
                raise _Violation(parse_problem, f"body is not valid {content_type or 'form data'}")
            if json_problems:
                raise _Violation("invalid_arguments", *json_problems)
            token = self._check_request(method, req.command, was_json, auth_header, body_token)
            response = self._dispatch(call, token)
        except _Violation as v:
            detail = "; ".join(v.details)
            with self._lock:
                self.violations.append(f"{method}: {v.error}: {detail}")
            call.violation = True
            response = {
                "ok": False,
                "error": v.error,
                "response_metadata": {"messages": [f"[ERROR] {d}" for d in v.details]},
            }
        except _SlackError as e:
            response = {"ok": False, "error": e.error}
        call.status = 200
        call.response = response
        call.error = None if response.get("ok") else str(response.get("error"))
        if fault is not None:
            call.fault = fault.kind
            if fault.hold is not None:
                fault.hold.arrived.set()
                fault.hold.wait_released(timeout=60)
            return _Reply(drop=True)
        return _Reply(200, response)

    def _check_request(
        self, method: str, verb: str, was_json: bool, auth_header: str, body_token: Any
    ) -> str:
        """The spec checks every method shares; returns the token."""
        spec = self.ref.methods.get(method)
        if spec is None:
            raise _Violation("unknown_method", f"{method} is not in the spec or its supplement")
        if spec.retired:
            raise _Violation(
                "method_deprecated",
                f"{method} is retired; use files.getUploadURLExternal + files.completeUploadExternal",
            )
        if spec.post_only and verb != "POST":
            raise _Violation("insecure_request", f"{method} must be called with POST")
        if was_json and not spec.accepts_json:
            raise _Violation(
                "invalid_arguments", f"{method} does not take a JSON body; send form data"
            )
        token = ""
        if auth_header.startswith("Bearer "):
            token = auth_header[len("Bearer ") :].strip()
        elif isinstance(body_token, str) and not was_json:
            token = body_token  # Slack takes a form-field token, never one inside JSON
        if not spec.takes_token:
            return token
        if not token:
            raise _Violation("not_authed", "no token: send Authorization: Bearer xox...")
        if spec.app_token:
            if not _APP_TOKEN_RE.match(token):
                raise _Violation(
                    "not_allowed_token_type", f"{method} needs an app-level xapp- token"
                )
        elif not _TOKEN_RE.match(token):
            kind = "an app-level token" if _APP_TOKEN_RE.match(token) else "a malformed token"
            raise _Violation(
                "not_allowed_token_type" if kind.startswith("an") else "invalid_auth",
                f"{method} was called with {kind}; it needs a bot or user token",
            )
        if self.valid_tokens is not None and token not in self.valid_tokens:
            raise _SlackError("invalid_auth")
        return token

    def _dispatch(self, call: Call, token: str) -> JsonDict:
        spec = self.ref.methods[call.method]
        params = call.params
        missing = [a for a in spec.required if _absent(params.get(a))]
        if missing:
            raise _Violation(
                spec.missing_arg_error, *(f"missing required field: {a}" for a in missing)
            )
        for group in spec.required_one_of:
            if all(_absent(params.get(a)) for a in group):
                code = "no_text" if call.method in _MESSAGE_METHODS else spec.missing_arg_error
                raise _Violation(code, f"one of {', '.join(group)} is required")
        responder = self._responders.get(call.method)
        if responder is not None:
            return responder(call)
        handler = self._handlers.get(call.method)
        if handler is None:
            raise _Violation(
                "not_implemented_in_fake",
                f"{call.method} is valid Slack but the fake has no behaviour for it; "
                "register one with fake.on()",
            )
        return handler(call, token)

    # ---- message checks for payloads that bypass the Web API -------------------------------

    def message_json(self, msg: Message) -> JsonDict:
        """A stored message as the Web API returns it (for conversations.history responders)."""
        return self._message_json(msg)

    def message_problems(self, payload: JsonDict) -> list[str]:
        """What Slack would reject in a message body that never passes through the fake:
        an HTTP ack or Socket Mode ack payload (text, blocks, Block Kit limits)."""
        try:
            self._check_message(payload)
        except _Violation as v:
            return v.details
        return []

    def view_problems(self, view: JsonDict, method: str = "views.publish") -> list[str]:
        """As message_problems, for a modal or Home view (e.g. a response_action update)."""
        try:
            self._check_view(method, view)
        except _Violation as v:
            return v.details
        return []

    # ---- the upload URL (step 2 of files_upload_v2) -------------------------------------------

    def _upload(self, file_id: str, req: _Handler, body: bytes) -> _Reply:
        fault = self._take_fault(UPLOAD_ENDPOINT)
        if fault is not None and fault.kind != "disconnect_after":
            return self._fault_reply(fault, api=False)
        reply = self._store_upload(file_id, req, body)
        return _Reply(drop=True) if fault is not None else reply

    # ---- response_url -------------------------------------------------------------------------

    def _response_post(self, url: str, req: _Handler, body: bytes) -> _Reply:
        fault = self._take_fault(RESPONSE_URL_ENDPOINT)
        if fault is not None and fault.kind != "disconnect_after":
            return self._fault_reply(fault, api=False)
        reply = self._store_response(url, req, body)
        return _Reply(drop=True) if fault is not None else reply
