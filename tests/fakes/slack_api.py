"""A fake Slack Web API on 127.0.0.1 that the real `slack_sdk.WebClient` talks to.

Slack cannot run here, and a hand-written mock would only echo what the bot's author believes
Slack does. So every request is checked against Slack's published reference data in
`<repo>/../shared/slack/` (the OpenAPI spec, the supplement that corrects it for how slack_sdk
really sends calls, and the Block Kit limits): a call that real Slack would reject is recorded as
a *violation* and answered the way Slack answers it (`ok: false`), and the `fake_slack` fixture
fails the test at teardown. Plain runtime errors that a correct bot must handle (a message that is
gone, an unknown user, an injected fault) are answered but are not violations.
"""

from __future__ import annotations

import email.parser
import email.policy
import functools
import itertools
import json
import os
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qsl, urlsplit

from slack_sdk import WebClient

__all__ = [
    "ENFORCED_LIMITS",
    "NOT_ENFORCED_LIMITS",
    "RESPONSE_URL_ENDPOINT",
    "UPLOAD_ENDPOINT",
    "Call",
    "FakeSlack",
    "FakeUser",
    "Hold",
    "MethodSpec",
    "ResponsePost",
    "SlackReference",
    "SlackSpecMissingError",
    "UploadedFile",
    "load_reference",
    "shared_slack_dir",
    "supplement_methods",
]

# Pseudo method names for the two endpoints that are not `/api/<method>`, so that faults can be
# injected there too (a chart upload that dies half-way, a response_url that times out).
UPLOAD_ENDPOINT = "upload_url"
RESPONSE_URL_ENDPOINT = "response_url"

JsonDict = dict[str, Any]
FaultKind = Literal["disconnect", "disconnect_after", "error", "ratelimit", "hold"]
Responder = Callable[["Call"], JsonDict]

_TOKEN_RE = re.compile(r"^(xoxe\.)?xox[a-z]-[A-Za-z0-9-]+$")
_APP_TOKEN_RE = re.compile(r"^xapp-[A-Za-z0-9-]+$")
_USER_ID_RE = re.compile(r"^[UW][A-Z0-9]{2,}$")
# Arguments that Slack takes as JSON; in form bodies they arrive as JSON-encoded strings.
_JSON_ARGS = ("blocks", "attachments", "view", "files", "metadata")
_MESSAGE_METHODS = ("chat.postMessage", "chat.postEphemeral", "chat.update")
_BLOCK_TYPES = frozenset(
    {
        "actions",
        "call",
        "context",
        "context_actions",
        "divider",
        "file",
        "header",
        "image",
        "input",
        "markdown",
        "rich_text",
        "section",
        "table",
        "video",
    }
)


# --------------------------------------------------------------------------------------------
# Reference data
# --------------------------------------------------------------------------------------------


class SlackSpecMissingError(FileNotFoundError):
    """Raised when `../shared/slack` is absent, so the fixture can skip instead of erroring."""


def shared_slack_dir() -> Path:
    """`$GPUBOT_SHARED_DIR/slack` if set (or the variable itself if it is the slack folder),
    else `<repo>/../shared/slack`: the data lives beside the checkout, not in it."""
    env = os.environ.get("GPUBOT_SHARED_DIR")
    if env:
        base = Path(env)
        if (base / "slack_web_openapi_v2.json").exists():
            return base.resolve()
        return (base / "slack").resolve()
    return (Path(__file__).resolve().parents[2] / ".." / "shared" / "slack").resolve()


@dataclass(frozen=True)
class MethodSpec:
    """What the fake checks for one Web API method; built from the spec, then the supplement."""

    name: str
    in_spec: bool
    required: tuple[str, ...]
    required_one_of: tuple[tuple[str, ...], ...]
    takes_token: bool
    accepts_json: bool
    post_only: bool = False
    app_token: bool = False
    retired: bool = False
    missing_arg_error: str = "invalid_arguments"


@dataclass(frozen=True)
class SlackReference:
    """The parsed reference files; parsed once per process (the OpenAPI file is 1.2 MB)."""

    directory: Path
    spec: JsonDict
    supplement: JsonDict
    limits: JsonDict
    shapes: dict[str, JsonDict]
    methods: dict[str, MethodSpec]
    limit_values: dict[str, int]
    button_styles: frozenset[str]

    def limit(self, limit_id: str) -> int:
        return self.limit_values[limit_id]


# Where Slack's docs (the supplement's sources) say more than either file encodes. Each is a
# deliberate, documented correction; keep the list short.
_LOCAL_OVERRIDES: dict[str, JsonDict] = {
    # slack_sdk's views_push takes trigger_id or interactivity_pointer, like views.open
    # (supplement: views.open); the stale spec requires trigger_id only.
    "views.push": {
        "required": ["view"],
        "required_one_of": [["trigger_id", "interactivity_pointer"]],
    },
    # The spec marks nothing required; Slack's docs require both (message_not_found otherwise).
    "chat.delete": {"required": ["channel", "ts"]},
}

# Limit ids from limits.json that the fake enforces, and those it does not, with the reason.
# tests/test_fake_slack.py checks that every id in the Web-API sections is in one of the two,
# so a new limit in limits.json cannot be silently ignored.
ENFORCED_LIMITS = frozenset(
    {
        "blocks_per_message",
        "blocks_per_modal_or_home",
        "section_text_chars",
        "section_fields_count",
        "section_field_text_chars",
        "block_id_chars",
        "header_text_chars",
        "actions_block_elements",
        "button_text_chars",
        "action_id_chars",
        "button_value_chars",
        "button_url_chars",
        "button_accessibility_label_chars",
        "button_style_values",
        "modal_title_chars",
        "modal_submit_close_chars",
        "private_metadata_chars",
        "callback_id_chars",
        "external_id_chars",
        "view_size",
        "trigger_id_lifetime",
        "home_tab_must_be_enabled",
        "message_text_chars",
        "text_or_blocks_required",
        "markdown_text_chars",
        "chat_update_dm_channel",
        "response_url_uses",
        "response_url_body",
        "alt_txt_chars",
        "files_upload_retired",
    }
)
NOT_ENFORCED_LIMITS: dict[str, str] = {
    "views_push_depth": "the fake cannot tell which modal stack a views.push trigger belongs to",
    "total_blocks_payload": "no published threshold (~13k chars observed); a rule would be a guess",
}
# The sections of limits.json that concern the Web API (ack, manifest and rate-limit tiers do not).
WEB_API_LIMIT_SECTIONS = ("block_kit", "views", "messages", "response_url", "files")


def _leading_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.match(r"^\s*(\d+)\s*(kB)?", value)
        if m:
            # "250 kB": take KiB, the larger reading, so the fake never rejects what Slack takes.
            return int(m.group(1)) * (1024 if m.group(2) else 1)
    return None


def _build_methods(spec: JsonDict, supplement: JsonDict) -> dict[str, MethodSpec]:
    methods: dict[str, MethodSpec] = {}
    for path, ops in spec["paths"].items():
        name = path.lstrip("/")
        for op in ops.values():
            params = op.get("parameters", [])
            methods[name] = MethodSpec(
                name=name,
                in_spec=True,
                required=tuple(
                    p["name"] for p in params if p.get("required") and p["name"] != "token"
                ),
                required_one_of=(),
                takes_token=any(p["name"] == "token" for p in params),
                accepts_json="application/json" in op.get("consumes", []),
            )
    overlays: dict[str, JsonDict] = {k: v for k, v in supplement["methods"].items() if " " not in k}
    for name, extra in _LOCAL_OVERRIDES.items():
        overlays[name] = {**overlays.get(name, {}), **extra}
    for name, sup in overlays.items():
        base = methods.get(name)
        required = tuple(sup["required"]) if "required" in sup else (base.required if base else ())
        one_of = tuple(tuple(g) for g in sup.get("required_one_of", []))
        if "content_types" in sup:
            accepts_json = "application/json" in sup["content_types"]
        else:
            accepts_json = base.accepts_json if base else False
        methods[name] = MethodSpec(
            name=name,
            in_spec=base is not None,
            required=required,
            required_one_of=one_of,
            takes_token=base.takes_token if base else True,
            accepts_json=accepts_json,
            post_only="must be POST" in str(sup.get("http", "")),
            app_token="xapp-" in str(sup.get("token", "")),
            retired="retired" in str(sup.get("status", "")),
            missing_arg_error=(
                "missing_argument"
                if "missing_argument" in sup.get("errors", [])
                else "invalid_arguments"
            ),
        )
    return methods


@functools.cache
def _load_reference(directory: Path) -> SlackReference:
    def read(name: str) -> JsonDict:
        data: JsonDict = json.loads((directory / name).read_text(encoding="utf-8"))
        return data

    spec = read("slack_web_openapi_v2.json")
    supplement = read("spec_supplement.json")
    limits = read("limits.json")
    shapes = {
        p.stem: json.loads(p.read_text(encoding="utf-8"))
        for p in sorted((directory / "responses" / "shapes").glob("*.json"))
        if not p.name.startswith("_")
    }
    values: dict[str, int] = {}
    styles: frozenset[str] = frozenset()
    for section in WEB_API_LIMIT_SECTIONS:
        for entry in limits.get(section, []):
            n = _leading_int(entry.get("limit"))
            if n is not None:
                values[entry["id"]] = n
            if entry["id"] == "button_style_values":
                styles = frozenset(entry["values"])
    return SlackReference(
        directory=directory,
        spec=spec,
        supplement=supplement,
        limits=limits,
        shapes=shapes,
        methods=_build_methods(spec, supplement),
        limit_values=values,
        button_styles=styles,
    )


def load_reference() -> SlackReference:
    directory = shared_slack_dir()
    if not (directory / "slack_web_openapi_v2.json").is_file():
        raise SlackSpecMissingError(
            f"Slack reference data not found at {directory} "
            "(set GPUBOT_SHARED_DIR to the folder holding slack/)"
        )
    return _load_reference(directory)


# --------------------------------------------------------------------------------------------
# Block Kit and view checks (limits.json)
# --------------------------------------------------------------------------------------------


class _Problems:
    """Collects every broken rule of one payload, each with Slack's json-pointer style."""

    def __init__(self, ref: SlackReference) -> None:
        self.ref = ref
        self.items: list[str] = []

    def add(self, rule: str, pointer: str, detail: str) -> None:
        self.items.append(f"{rule}: {detail} [json-pointer:{pointer}]")

    def too_long(self, rule: str, pointer: str, value: Any, limit: int | None = None) -> None:
        lim = self.ref.limit(rule) if limit is None else limit
        if isinstance(value, str) and len(value) > lim:
            self.add(rule, pointer, f"must be less than {lim + 1} characters (got {len(value)})")

    def text(
        self,
        obj: Any,
        pointer: str,
        rule: str | None,
        *,
        plain_only: bool = False,
        min_len: int = 0,
    ) -> None:
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            self.add("block_structure", pointer, "must be a text object {type, text}")
            return
        kind = obj.get("type")
        if kind not in ("plain_text", "mrkdwn") or (plain_only and kind != "plain_text"):
            allowed = "plain_text" if plain_only else "plain_text or mrkdwn"
            self.add("block_structure", f"{pointer}/type", f"must be {allowed} (got {kind!r})")
        if rule is not None:
            self.too_long(rule, f"{pointer}/text", obj["text"])
        if len(obj["text"]) < min_len:
            self.add(
                rule or "block_structure",
                f"{pointer}/text",
                f"must be at least {min_len} characters",
            )

    def element(self, el: Any, pointer: str) -> None:
        if not isinstance(el, dict) or not isinstance(el.get("type"), str):
            self.add("block_structure", pointer, "element must be an object with a type")
            return
        if "action_id" in el:
            self.too_long("action_id_chars", f"{pointer}/action_id", el["action_id"])
        if el["type"] != "button":
            return
        self.text(
            el.get("text"), f"{pointer}/text", "button_text_chars", plain_only=True, min_len=1
        )
        self.too_long("button_value_chars", f"{pointer}/value", el.get("value"))
        self.too_long("button_url_chars", f"{pointer}/url", el.get("url"))
        self.too_long(
            "button_accessibility_label_chars",
            f"{pointer}/accessibility_label",
            el.get("accessibility_label"),
        )
        if "style" in el and el["style"] not in self.ref.button_styles:
            self.add(
                "button_style_values",
                f"{pointer}/style",
                f"must be one of {sorted(self.ref.button_styles)} (got {el['style']!r})",
            )

    def blocks(self, blocks: Any, pointer: str, count_rule: str) -> None:
        if not isinstance(blocks, list):
            self.add("block_structure", pointer, "blocks must be an array")
            return
        lim = self.ref.limit(count_rule)
        if len(blocks) > lim:
            self.add(count_rule, pointer, f"no more than {lim} items allowed (got {len(blocks)})")
        for i, block in enumerate(blocks):
            self.block(block, f"{pointer}/{i}")

    def block(self, block: Any, ptr: str) -> None:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            self.add("block_structure", ptr, "block must be an object with a type")
            return
        kind = block["type"]
        if kind not in _BLOCK_TYPES:
            self.add("block_structure", f"{ptr}/type", f"unknown block type {kind!r}")
            return
        if "block_id" in block:
            self.too_long("block_id_chars", f"{ptr}/block_id", block["block_id"])
        if kind == "section":
            if "text" not in block and "fields" not in block:
                self.add("section_text_chars", ptr, "a section needs text or fields")
            if "text" in block:
                self.text(block["text"], f"{ptr}/text", "section_text_chars", min_len=1)
            fields = block.get("fields")
            if fields is not None:
                if not isinstance(fields, list):
                    self.add("block_structure", f"{ptr}/fields", "must be an array")
                else:
                    lim = self.ref.limit("section_fields_count")
                    if len(fields) > lim:
                        self.add(
                            "section_fields_count",
                            f"{ptr}/fields",
                            f"no more than {lim} items allowed (got {len(fields)})",
                        )
                    for j, f in enumerate(fields):
                        self.text(f, f"{ptr}/fields/{j}", "section_field_text_chars")
            if "accessory" in block:
                self.element(block["accessory"], f"{ptr}/accessory")
        elif kind == "header":
            self.text(
                block.get("text"), f"{ptr}/text", "header_text_chars", plain_only=True, min_len=1
            )
        elif kind == "actions":
            elements = block.get("elements")
            if not isinstance(elements, list) or not elements:
                self.add("block_structure", f"{ptr}/elements", "must be a non-empty array")
                return
            lim = self.ref.limit("actions_block_elements")
            if len(elements) > lim:
                self.add(
                    "actions_block_elements",
                    f"{ptr}/elements",
                    f"no more than {lim} items allowed (got {len(elements)})",
                )
            seen: set[str] = set()
            for j, el in enumerate(elements):
                self.element(el, f"{ptr}/elements/{j}")
                action_id = el.get("action_id") if isinstance(el, dict) else None
                if isinstance(action_id, str):
                    if action_id in seen:
                        self.add(
                            "action_id_chars",
                            f"{ptr}/elements/{j}/action_id",
                            f"action_id {action_id!r} is not unique within the block",
                        )
                    seen.add(action_id)
        elif kind == "input":
            self.text(block.get("label"), f"{ptr}/label", None, plain_only=True, min_len=1)
            self.element(block.get("element"), f"{ptr}/element")

    def view(self, view: Any, method: str) -> None:
        if not isinstance(view, dict):
            self.add("block_structure", "/view", "view must be a JSON object")
            return
        kind = view.get("type")
        allowed = {
            "views.publish": ("home",),
            "views.open": ("modal",),
            "views.push": ("modal",),
        }.get(method, ("modal", "home"))
        if kind not in allowed:
            self.add(
                "block_structure", "/view/type", f"must be {' or '.join(allowed)} for {method}"
            )
        self.blocks(view.get("blocks"), "/view/blocks", "blocks_per_modal_or_home")
        if kind == "modal":
            if "title" not in view:
                self.add("modal_title_chars", "/view/title", "a modal needs a title")
            else:
                self.text(
                    view["title"], "/view/title", "modal_title_chars", plain_only=True, min_len=1
                )
            for key in ("submit", "close"):
                if key in view:
                    self.text(
                        view[key], f"/view/{key}", "modal_submit_close_chars", plain_only=True
                    )
            blocks = view.get("blocks")
            has_input = isinstance(blocks, list) and any(
                isinstance(b, dict) and b.get("type") == "input" for b in blocks
            )
            if has_input and "submit" not in view:
                self.add(
                    "modal_submit_close_chars", "/view/submit", "required when blocks hold an input"
                )
        self.too_long(
            "private_metadata_chars", "/view/private_metadata", view.get("private_metadata")
        )
        self.too_long("callback_id_chars", "/view/callback_id", view.get("callback_id"))
        self.too_long("external_id_chars", "/view/external_id", view.get("external_id"))


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


class FakeSlack:
    """The fake Web API. Use as a context manager, or through the `fake_slack` fixture.

    Give `fake.url` to `WebClient(base_url=...)` (or `fake.client()`), and `fake.bot_token` as
    the token. Assert on `.calls`, `.messages`, `.files`, `.responses`; inject faults with
    `rate_limit()` and `fail_next()`.
    """

    # The methods with behaviour of their own; any other spec method needs fake.on().
    HANDLERS: ClassVar[dict[str, str]] = {
        "auth.test": "_auth_test",
        "apps.connections.open": "_apps_connections_open",
        "chat.postMessage": "_chat_post_message",
        "chat.postEphemeral": "_chat_post_ephemeral",
        "chat.update": "_chat_update",
        "chat.delete": "_chat_delete",
        "conversations.open": "_conversations_open",
        "users.info": "_users_info",
        "usergroups.users.list": "_usergroups_users_list",
        "views.open": "_views_open",
        "views.push": "_views_open",
        "views.update": "_views_update",
        "views.publish": "_views_publish",
        "files.getUploadURLExternal": "_files_get_upload_url",
        "files.completeUploadExternal": "_files_complete_upload",
    }

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

    # ---- ids ------------------------------------------------------------------------------------

    def _next_ts(self) -> str:
        """Slack message ids: unique and increasing, as the bot may sort or dedupe by them."""
        with self._lock:
            us = max(int(time.time() * 1_000_000), self._last_us + 1)
            self._last_us = us
            return f"{us // 1_000_000}.{us % 1_000_000:06d}"

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}FAKE{next(self._ids):06d}"

    def _resolve_channel(self, channel: str) -> str:
        """Posting to a user id lands in the app's DM with them; a #name maps to one C id."""
        if _USER_ID_RE.match(channel):
            return self.dm_channel_for(channel)
        if re.match(r"^[CGD][A-Z0-9]{2,}$", channel):
            return channel
        name = channel.lstrip("#")
        with self._lock:
            if name not in self._named_channels:
                self._named_channels[name] = self._new_id("C")
            return self._named_channels[name]

    # ---- message checks ---------------------------------------------------------------------

    def _check_message(self, params: JsonDict) -> tuple[str | None, list[str]]:
        """Block Kit limits and text rules of chat.* and response_url bodies.
        Returns the text as Slack stores it (truncated past the limit) and response warnings."""
        problems = _Problems(self.ref)
        blocks = params.get("blocks")
        if blocks is not None:
            problems.blocks(blocks, "/blocks", "blocks_per_message")
        if problems.items:
            raise _Violation("invalid_blocks", *problems.items)
        markdown = params.get("markdown_text")
        if markdown is not None:
            if not _absent(params.get("text")) or not _absent(blocks):
                raise _Violation(
                    "invalid_arguments", "markdown_text cannot be combined with text or blocks"
                )
            problems.too_long("markdown_text_chars", "/markdown_text", markdown)
            if problems.items:
                raise _Violation("msg_too_long", *problems.items)
        text = params.get("text")
        warnings: list[str] = []
        if text is not None and not isinstance(text, str):
            text = str(text)
        limit = self.ref.limit("message_text_chars")
        if text is not None and len(text) > limit:
            text = text[:limit]
            warnings.append("message_truncated")
        return text, warnings

    def _message_json(self, msg: Message) -> JsonDict:
        out: JsonDict = {
            "type": "message",
            "text": msg.text or "",
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
            "team": self.team_id,
            "ts": msg.ts,
        }
        if msg.blocks is not None:
            out["blocks"] = msg.blocks
        if msg.attachments is not None:
            out["attachments"] = msg.attachments
        if msg.thread_ts is not None:
            out["thread_ts"] = msg.thread_ts
        if msg.metadata is not None:
            out["metadata"] = msg.metadata
        if msg.files:
            # A file share, as history shows it: the files themselves and "upload".
            out["files"] = [self._file_json(self.files[f]) for f in msg.files if f in self.files]
            out["upload"] = True
        return out

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

    @staticmethod
    def _with_warnings(response: JsonDict, warnings: list[str]) -> JsonDict:
        if warnings:
            response["response_metadata"] = {"warnings": warnings}
        return response

    # ---- method behaviour -------------------------------------------------------------------

    def _auth_test(self, call: Call, token: str) -> JsonDict:
        return {
            "ok": True,
            "url": "https://gpubot-test.slack.com/",
            "team": self.team,
            "user": "gpubot",
            "team_id": self.team_id,
            "user_id": self.bot_user_id,
            "bot_id": self.bot_id,
            "is_enterprise_install": False,
        }

    def _apps_connections_open(self, call: Call, token: str) -> JsonDict:
        url = self.socket_mode_url or (
            f"ws://127.0.0.1:{self.port}/link/?ticket=fake{next(self._ids)}&app_id={self.app_id}"
        )
        return {"ok": True, "url": url}

    def _chat_post_message(self, call: Call, token: str) -> JsonDict:
        p = call.params
        text, warnings = self._check_message(p)
        channel = self._resolve_channel(str(p["channel"]))
        msg = Message(
            channel=channel,
            ts=self._next_ts(),
            text=text,
            blocks=p.get("blocks"),
            attachments=p.get("attachments"),
            thread_ts=p.get("thread_ts") or None,
            metadata=p.get("metadata") if isinstance(p.get("metadata"), dict) else None,
        )
        with self._lock:
            self.messages.append(msg)
        response = {
            "ok": True,
            "channel": channel,
            "ts": msg.ts,
            "message": self._message_json(msg),
        }
        return self._with_warnings(response, warnings)

    def _chat_post_ephemeral(self, call: Call, token: str) -> JsonDict:
        p = call.params
        text, warnings = self._check_message(p)
        msg = Message(
            channel=self._resolve_channel(str(p["channel"])),
            ts=self._next_ts(),
            text=text,
            blocks=p.get("blocks"),
            attachments=p.get("attachments"),
            thread_ts=p.get("thread_ts") or None,
            ephemeral_to=str(p["user"]),
        )
        with self._lock:
            self.messages.append(msg)
        return self._with_warnings({"ok": True, "message_ts": msg.ts}, warnings)

    def _find_message(self, channel: str, ts: str) -> Message:
        with self._lock:
            for m in self.messages:
                if m.channel == channel and m.ts == ts and not m.deleted and m.ephemeral_to is None:
                    return m
        raise _SlackError("message_not_found")

    def _chat_update(self, call: Call, token: str) -> JsonDict:
        p = call.params
        channel = str(p["channel"])
        if _USER_ID_RE.match(channel):
            raise _Violation(
                "channel_not_found",
                f"chat.update needs the conversation id (D...), not a user id ({channel})",
            )
        text, warnings = self._check_message(p)
        msg = self._find_message(self._resolve_channel(channel), str(p["ts"]))
        with self._lock:
            if text is not None:
                msg.text = text
                # Slack: passing text without blocks removes the previous blocks.
                msg.blocks = p.get("blocks")
            elif "blocks" in p:
                msg.blocks = p.get("blocks")
            if "attachments" in p:
                msg.attachments = p.get("attachments")
            msg.edits += 1
        message: JsonDict = {
            "text": msg.text or "",
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
        }
        if msg.blocks is not None:
            message["blocks"] = msg.blocks
        if msg.attachments is not None:
            message["attachments"] = msg.attachments
        response = {
            "ok": True,
            "channel": msg.channel,
            "ts": msg.ts,
            "text": msg.text or "",
            "message": message,
        }
        return self._with_warnings(response, warnings)

    def _chat_delete(self, call: Call, token: str) -> JsonDict:
        p = call.params
        msg = self._find_message(self._resolve_channel(str(p["channel"])), str(p["ts"]))
        with self._lock:
            msg.deleted = True
        return {"ok": True, "channel": msg.channel, "ts": msg.ts}

    def _known_user(self, user_id: str) -> FakeUser:
        with self._lock:
            user = self.users.get(user_id)
        if user is not None:
            return user
        if self.auto_users and _USER_ID_RE.match(user_id):
            return self.add_user(user_id)
        raise _SlackError("user_not_found")

    def _conversations_open(self, call: Call, token: str) -> JsonDict:
        p = call.params
        if not _absent(p.get("channel")):
            return {"ok": True, "channel": {"id": self._resolve_channel(str(p["channel"]))}}
        users = [u for u in str(p["users"]).split(",") if u]
        if not 1 <= len(users) <= 8:
            raise _Violation("invalid_arguments", f"users takes 1..8 user ids (got {len(users)})")
        for u in users:
            self._known_user(u)
        with self._lock:
            if len(users) == 1:
                already = users[0] in self._dm_channels
                channel_id = self.dm_channel_for(users[0])
            else:
                key = ",".join(sorted(users))
                already = key in self._dm_channels
                if not already:
                    self._dm_channels[key] = self._new_id("G")
                channel_id = self._dm_channels[key]
        channel: JsonDict = {"id": channel_id}
        if p.get("return_im") in ("1", "true", True) and len(users) == 1:
            channel.update({"is_im": True, "is_open": True, "user": users[0]})
        response: JsonDict = {"ok": True, "channel": channel}
        if already:
            response.update({"no_op": True, "already_open": True})
        return response

    def _users_info(self, call: Call, token: str) -> JsonDict:
        u = self._known_user(str(call.params["user"]))
        profile: JsonDict = {
            "real_name": u.real_name,
            "real_name_normalized": u.real_name,
            "display_name": u.display_name,
            "display_name_normalized": u.display_name,
            "avatar_hash": "0fake0avatar",
            "title": "",
            "phone": "",
            "skype": "",
            "status_text": "",
            "status_emoji": "",
            "fields": None,
            "team": self.team_id,
        }
        if u.email is not None:
            profile["email"] = u.email
        user: JsonDict = {
            "id": u.id,
            "team_id": self.team_id,
            "name": u.name,
            "deleted": u.deleted,
            "real_name": u.real_name,
            "tz": u.tz,
            "tz_label": u.tz,
            "tz_offset": u.tz_offset,
            "profile": profile,
            "is_admin": u.is_admin,
            "is_owner": u.is_owner,
            "is_primary_owner": False,
            "is_restricted": False,
            "is_ultra_restricted": False,
            "is_bot": u.is_bot,
            "is_app_user": False,
            "updated": 1700000000,
        }
        return {"ok": True, "user": user}

    def _usergroups_users_list(self, call: Call, token: str) -> JsonDict:
        # An unknown group: Slack's documented error (the 2020 spec's enum predates it).
        with self._lock:
            members = self.usergroups.get(str(call.params["usergroup"]))
        if members is None:
            raise _SlackError("no_such_subteam")
        return {"ok": True, "users": list(members)}

    def _check_view(self, method: str, view: Any) -> None:
        problems = _Problems(self.ref)
        problems.view(view, method)
        if problems.items:
            raise _Violation("invalid_arguments", *problems.items)
        size = len(json.dumps(view).encode("utf-8"))
        if size > self.ref.limit("view_size"):
            raise _Violation("view_too_large", f"view is {size} bytes")

    def _view_json(self, view: JsonDict, view_id: str, root: str | None = None) -> JsonDict:
        out: JsonDict = {
            "id": view_id,
            "team_id": self.team_id,
            "type": view.get("type"),
            "blocks": view.get("blocks", []),
            "private_metadata": view.get("private_metadata", ""),
            "callback_id": view.get("callback_id", ""),
            "state": {"values": {}},
            "hash": f"{int(time.time())}.fake{next(self._ids):08x}",
            "clear_on_close": bool(view.get("clear_on_close", False)),
            "notify_on_close": bool(view.get("notify_on_close", False)),
            "root_view_id": root or view_id,
            "previous_view_id": None,
            "app_id": self.app_id,
            "external_id": view.get("external_id", ""),
            "bot_id": self.bot_id,
        }
        for key in ("title", "submit", "close"):
            if key in view:
                out[key] = view[key]
        return out

    def _views_open(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        trigger = p.get("trigger_id")
        if isinstance(trigger, str) and trigger:
            with self._lock:
                if trigger in self._triggers_used:
                    raise _SlackError("exchanged_trigger_id")
                self._triggers_used.add(trigger)
                issued = self._triggers_issued.get(trigger)
            if issued is not None and time.monotonic() - issued > self.ref.limit(
                "trigger_id_lifetime"
            ):
                raise _SlackError("expired_trigger_id")
        view_id = self._new_id("V")
        stored = self._view_json(p["view"], view_id)
        with self._lock:
            self.views[view_id] = stored
        return {"ok": True, "view": stored}

    def _views_update(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        with self._lock:
            if not _absent(p.get("view_id")):
                current = self.views.get(str(p["view_id"]))
            else:
                ext = p.get("external_id")
                current = next((v for v in self.views.values() if v["external_id"] == ext), None)
            if current is None:
                raise _SlackError("not_found")
            if not _absent(p.get("hash")) and p["hash"] != current["hash"]:
                raise _SlackError("hash_conflict")
            stored = self._view_json(p["view"], current["id"], current["root_view_id"])
            self.views[current["id"]] = stored
        return {"ok": True, "view": stored}

    def _views_publish(self, call: Call, token: str) -> JsonDict:
        p = call.params
        self._check_view(call.method, p["view"])
        if not self.home_tab_enabled:
            raise _SlackError("not_enabled")
        user_id = str(p["user_id"])
        with self._lock:
            current = self.home_views.get(user_id)
            if current is not None and not _absent(p.get("hash")) and p["hash"] != current["hash"]:
                raise _SlackError("hash_conflict")
            view_id = current["id"] if current else self._new_id("V")
            stored = self._view_json(p["view"], view_id)
            self.home_views[user_id] = stored
            self.views[view_id] = stored
        return {"ok": True, "view": stored}

    def _files_get_upload_url(self, call: Call, token: str) -> JsonDict:
        p = call.params
        try:
            length = int(p["length"])
        except (TypeError, ValueError):
            raise _Violation(
                "invalid_arguments", f"length must be an integer (got {p['length']!r})"
            ) from None
        if length <= 0:
            raise _Violation("missing_argument", "length must be > 0")
        problems = _Problems(self.ref)
        problems.too_long("alt_txt_chars", "/alt_txt", p.get("alt_txt"))
        if problems.items:
            raise _Violation("alt_txt_too_large", *problems.items)
        file_id = self._new_id("F")
        with self._lock:
            self.files[file_id] = UploadedFile(
                id=file_id,
                filename=str(p["filename"]),
                length=length,
                alt_txt=p.get("alt_txt"),
                snippet_type=p.get("snippet_type"),
            )
        return {
            "ok": True,
            "upload_url": f"{self.root_url}/upload/v1/{file_id}",
            "file_id": file_id,
        }

    def _files_complete_upload(self, call: Call, token: str) -> JsonDict:
        p = call.params
        items = p["files"]
        if not isinstance(items, list) or not items:
            raise _Violation("invalid_arguments", "files must be a non-empty JSON array")
        channels: list[str] = []
        if not _absent(p.get("channel_id")):
            channels.append(str(p["channel_id"]))
        if not _absent(p.get("channels")):
            channels += [c for c in str(p["channels"]).split(",") if c]
        if not _absent(p.get("thread_ts")) and len(channels) != 1:
            raise _Violation("invalid_arguments", "thread_ts needs exactly one channel")
        picked: list[UploadedFile] = []
        with self._lock:
            for i, item in enumerate(items):
                if not isinstance(item, dict) or _absent(item.get("id")):
                    raise _Violation("invalid_arguments", f"files[{i}] needs an id")
                f = self.files.get(str(item["id"]))
                if f is None:
                    raise _Violation(
                        "file_not_found", f"files[{i}].id {item['id']} was never issued"
                    )
                if f.data is None:
                    raise _Violation(
                        "invalid_arguments",
                        f"files[{i}].id {f.id}: no bytes were POSTed to its upload_url",
                    )
                picked.append(f)
            resolved = [self._resolve_channel(c) for c in channels]
            for item, f in zip(items, picked, strict=True):
                f.title = item.get("title") or f.filename
                f.completed = True
                f.channels = resolved
                f.initial_comment = p.get("initial_comment")
                f.thread_ts = p.get("thread_ts") or None
            for ch in resolved:
                self.messages.append(
                    Message(
                        channel=ch,
                        ts=self._next_ts(),
                        text=p.get("initial_comment"),
                        thread_ts=p.get("thread_ts") or None,
                        files=tuple(f.id for f in picked),
                    )
                )
        return {"ok": True, "files": [self._file_json(f) for f in picked]}

    def _file_json(self, f: UploadedFile) -> JsonDict:
        now = int(time.time())
        ext = f.filename.rsplit(".", 1)[-1].lower() if "." in f.filename else "binary"
        mimetype = {"png": "image/png", "csv": "text/csv", "txt": "text/plain"}.get(
            ext, "application/octet-stream"
        )
        base = f"https://files.slack.com/files-pri/{self.team_id}-{f.id}/{f.filename}"
        return {
            "id": f.id,
            "created": now,
            "timestamp": now,
            "name": f.filename,
            "title": f.title or f.filename,
            "mimetype": mimetype,
            "filetype": ext,
            "pretty_type": ext.upper(),
            "user": self.bot_user_id,
            "user_team": self.team_id,
            "editable": False,
            "size": len(f.data or b""),
            "mode": "hosted",
            "is_external": False,
            "external_type": "",
            "is_public": any(c.startswith("C") for c in f.channels),
            "public_url_shared": False,
            "display_as_bot": False,
            "username": "",
            "url_private": base,
            "url_private_download": f"{base}?download=1",
            "permalink": f"https://gpubot-test.slack.com/files/{self.bot_user_id}/{f.id}",
            "channels": [c for c in f.channels if c.startswith("C")],
            "groups": [c for c in f.channels if c.startswith("G")],
            "ims": [c for c in f.channels if c.startswith("D")],
            "alt_txt": f.alt_txt or "",
            "comments_count": 0,
            "is_starred": False,
            "has_rich_preview": False,
        }

    # ---- the upload URL (step 2 of files_upload_v2) -------------------------------------------

    def _upload(self, file_id: str, req: _Handler, body: bytes) -> _Reply:
        fault = self._take_fault(UPLOAD_ENDPOINT)
        if fault is not None and fault.kind != "disconnect_after":
            return self._fault_reply(fault, api=False)
        reply = self._store_upload(file_id, req, body)
        return _Reply(drop=True) if fault is not None else reply

    def _store_upload(self, file_id: str, req: _Handler, body: bytes) -> _Reply:
        with self._lock:
            f = self.files.get(file_id)
            if f is None or req.command != "POST":
                self.violations.append(
                    f"{UPLOAD_ENDPOINT}: {req.command} to an upload URL the fake never issued "
                    f"({file_id})"
                )
                return _Reply(404, "not found")
            data = body
            ctype = req.headers.get("Content-Type", "")
            if ctype.lower().startswith("multipart/form-data"):
                parts, _, _ = _parse_body(ctype, body)
                data = next((v for v in parts.values() if isinstance(v, bytes)), b"")
            if len(data) != f.length:
                self.violations.append(
                    f"{UPLOAD_ENDPOINT}: {file_id}: {len(data)} bytes POSTed, "
                    f"files.getUploadURLExternal declared length={f.length}"
                )
                return _Reply(400, "length mismatch")
            f.data = data
        return _Reply(200, f"OK - {len(data)}")

    # ---- response_url -------------------------------------------------------------------------

    def _response_post(self, url: str, req: _Handler, body: bytes) -> _Reply:
        fault = self._take_fault(RESPONSE_URL_ENDPOINT)
        if fault is not None and fault.kind != "disconnect_after":
            return self._fault_reply(fault, api=False)
        reply = self._store_response(url, req, body)
        return _Reply(drop=True) if fault is not None else reply

    def _store_response(self, url: str, req: _Handler, body: bytes) -> _Reply:
        try:
            payload: Any = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            payload = body.decode("utf-8", "replace")
        post = ResponsePost(url=url, body=payload, status=200)
        with self._lock:
            self.responses.append(post)
            entry = self._response_urls.get(url)
        try:
            if entry is None:
                raise _Violation("invalid_url", f"{url} was not issued by fake.response_url()")
            if req.command != "POST" or not isinstance(payload, dict):
                raise _Violation("invalid_payload", "response_url takes a POSTed JSON object")
            with self._lock:
                entry.uses += 1
                uses = entry.uses
            limit = self.ref.limit("response_url_uses")
            if uses > limit:
                raise _Violation("used_url", f"response_url used {uses} times (limit {limit})")
            if payload.get("response_type", "ephemeral") not in ("ephemeral", "in_channel"):
                raise _Violation(
                    "invalid_payload", f"response_type {payload['response_type']!r} is not valid"
                )
            if not payload.get("delete_original") and all(
                _absent(payload.get(k)) for k in ("text", "blocks", "attachments")
            ):
                raise _Violation("no_text", "one of text, blocks, attachments is required")
            self._check_message(payload)
        except _Violation as v:
            with self._lock:
                self.violations.append(
                    f"{RESPONSE_URL_ENDPOINT}: {v.error}: {'; '.join(v.details)}"
                )
            post.status = 404 if v.error in ("invalid_url", "used_url") else 400
            post.error = v.error
            return _Reply(post.status, {"ok": False, "error": v.error})
        return _Reply(200, {"ok": True})


def supplement_methods(ref: SlackReference) -> list[str]:
    """The supplement's real methods (not pseudo-entries like the upload step), retired or not."""
    return [name for name in ref.supplement["methods"] if name in ref.methods]
