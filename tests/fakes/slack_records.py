"""What the fake Slack Web API records, and the request plumbing its parts share.

The recorded calls, messages, users, files and response_url posts are what tests assert on;
the faults, replies and the two error kinds (a spec violation, a plain Slack error) pass between
the dispatch in `slack_api` and the method behaviour in `slack_methods`.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl

from tests.fakes.slack_spec import JsonDict

__all__ = [
    "RESPONSE_URL_ENDPOINT",
    "UPLOAD_ENDPOINT",
    "Call",
    "FakeUser",
    "FaultKind",
    "Hold",
    "Message",
    "Responder",
    "ResponsePost",
    "UploadedFile",
]

# Pseudo method names for the two endpoints that are not `/api/<method>`, so that faults can be
# injected there too (a chart upload that dies half-way, a response_url that times out).
UPLOAD_ENDPOINT = "upload_url"
RESPONSE_URL_ENDPOINT = "response_url"

FaultKind = Literal["disconnect", "disconnect_after", "error", "ratelimit", "hold"]
Responder = Callable[["Call"], JsonDict]

# Arguments that Slack takes as JSON; in form bodies they arrive as JSON-encoded strings.
_JSON_ARGS = ("blocks", "attachments", "view", "files", "metadata")


# --------------------------------------------------------------------------------------------
# What the fake records
# --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One request to `/api/<method>`. `params` has blocks/view/attachments/files JSON-decoded;
    `headers` has the token's value replaced, so a failing assertion never prints a token."""

    method: str
    params: JsonDict
    headers: dict[str, str]
    http_method: str
    content_type: str
    status: int = 0
    response: JsonDict | None = None
    error: str | None = None
    violation: bool = False
    fault: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.response and self.response.get("ok"))


@dataclass
class Message:
    """A message as Slack holds it after the call; what an outbox test counts."""

    channel: str
    ts: str
    text: str | None
    blocks: list[Any] | None = None
    attachments: list[Any] | None = None
    thread_ts: str | None = None
    ephemeral_to: str | None = None
    files: tuple[str, ...] = ()
    deleted: bool = False
    edits: int = 0
    # chat.postMessage's `metadata` ({event_type, event_payload}), returned by history readers.
    metadata: JsonDict | None = None


@dataclass
class FakeUser:
    id: str
    name: str
    display_name: str
    real_name: str
    is_admin: bool = False
    is_owner: bool = False
    is_bot: bool = False
    deleted: bool = False
    tz: str = "Europe/London"
    tz_offset: int = 0
    email: str | None = None


@dataclass
class UploadedFile:
    id: str
    filename: str
    length: int
    alt_txt: str | None = None
    snippet_type: str | None = None
    data: bytes | None = None
    title: str | None = None
    completed: bool = False
    channels: list[str] = field(default_factory=list)
    initial_comment: str | None = None
    thread_ts: str | None = None


@dataclass
class ResponsePost:
    """One POST to a response_url the fake handed out."""

    url: str
    body: Any
    status: int
    error: str | None = None


@dataclass
class _Fault:
    # "pass": no fault, a placeholder that lets the calls before a fault through.
    kind: FaultKind | Literal["pass"]
    retry_after: int = 1
    error: str = "internal_error"
    status: int = 500
    hold: Hold | None = None


class Hold:
    """A call the fake has carried out and holds open without answering (`hold_next`), as
    Slack looks to a sender that dies mid-call: `arrived` is set once the call has taken
    effect; after `release()` the connection closes without a reply."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait_released(self, timeout: float) -> None:
        self._released.wait(timeout)


@dataclass
class _ResponseUrl:
    url: str
    uses: int = 0


@dataclass
class _Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    drop: bool = False


class _Violation(Exception):
    """A call real Slack would reject because it is outside the spec; fails the test."""

    def __init__(self, error: str, *details: str) -> None:
        super().__init__(error)
        self.error = error
        self.details = list(details) or [error]


class _SlackError(Exception):
    """An error real Slack returns to a valid call (message gone, user unknown)."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def _absent(value: Any) -> bool:
    return value is None or value == "" or value == []


def _redact(headers: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers.items():
        if k.lower() == "authorization":
            scheme, _, tok = v.partition(" ")
            v = f"{scheme} {tok.split('-', 1)[0]}-(redacted)" if tok else "(redacted)"
        out[k] = v
    return out


def _parse_body(content_type: str, body: bytes) -> tuple[JsonDict, bool, str | None]:
    """Returns (params, was_json, problem) for the bodies slack_sdk sends: JSON, form, multipart."""
    if not body:
        return {}, False, None
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/json":
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}, True, "invalid_json"
        if not isinstance(data, dict):
            return {}, True, "invalid_json"
        return data, True, None
    if ctype == "multipart/form-data":
        raw = f"Content-Type: {content_type}\r\n\r\n".encode() + body
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(raw)
        params: JsonDict = {}
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if not isinstance(name, str) or not isinstance(payload, bytes):
                continue
            if part.get_filename() is not None:
                params[name] = payload
            else:
                params[name] = payload.decode("utf-8", "replace")
        return params, False, None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return {}, False, "invalid_form_data"
    return dict(parse_qsl(text, keep_blank_values=True)), False, None


def _decode_json_args(params: JsonDict) -> tuple[JsonDict, list[str]]:
    out = dict(params)
    problems: list[str] = []
    for key in _JSON_ARGS:
        value = out.get(key)
        if isinstance(value, str) and value != "":
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                problems.append(f"{key}: not valid JSON")
    return out, problems
