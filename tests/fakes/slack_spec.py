"""Slack's published reference data, as the fake Slack Web API reads and checks it.

The data lives in `<repo>/../shared/slack/`: the OpenAPI spec, the supplement that corrects it
for how slack_sdk really sends calls, and the Block Kit limits. This module parses it once per
process into a `SlackReference` (which methods exist, what each requires, which limits apply) and
holds the Block Kit and view checks (`_Problems`) that `FakeSlack` runs on every payload.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENFORCED_LIMITS",
    "NOT_ENFORCED_LIMITS",
    "WEB_API_LIMIT_SECTIONS",
    "JsonDict",
    "MethodSpec",
    "SlackReference",
    "SlackSpecMissingError",
    "load_reference",
    "shared_slack_dir",
    "supplement_methods",
]

JsonDict = dict[str, Any]

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


def supplement_methods(ref: SlackReference) -> list[str]:
    """The supplement's real methods (not pseudo-entries like the upload step), retired or not."""
    return [name for name in ref.supplement["methods"] if name in ref.methods]


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
