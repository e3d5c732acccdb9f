"""The `/gpu run` modal: what a bare `/gpu run` opens, and how a submission becomes
the equivalent `/gpu run …` line.

Validation happens here, field by field, so Slack can show each message under its
field (`response_action: errors`) instead of closing the modal on a typo. A valid
submission is turned into the same text a user could type, so the run goes
through `handle_text` like every other command and the grammar stays the one judge.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from bot.domain.commands import MAX_GPUS_PER_REQUEST, PRECISIONS
from bot.domain.durations import parse_duration
from bot.domain.errors import UserError
from bot.faces.slack.blocks import clip

CALLBACK_ID = "gpubot_run_modal"
WHAT, GPUS, MODEL, PRECISION, LIMIT = (
    "run_what",
    "run_gpus",
    "run_model",
    "run_precision",
    "run_max",
)
_ANY = "any"
_RECIPE = re.compile(r"^recipe:\s*([a-z][a-z0-9_\-]{0,31})$")
_COUNT = re.compile(r"[0-9]{1,4}")

JsonDict = dict[str, Any]


def _plain(text: str) -> JsonDict:
    return {"type": "plain_text", "text": text}


def _option(label: str, value: str) -> JsonDict:
    return {"text": _plain(clip(label, 75)), "value": value[:150]}


def run_modal(models: tuple[str, ...], metadata: dict[str, str]) -> JsonDict:
    """The view for views.open; `metadata` (where to answer) rides in private_metadata."""
    model_options = [_option("Any free GPU", _ANY)] + [
        _option(m, m)
        for m in models[:99]  # static_select takes at most 100 options
    ]
    precision_options = [_option(p, p) for p in PRECISIONS]
    private = json.dumps(metadata)
    if len(private) > 3000:
        private = "{}"
    return {
        "type": "modal",
        "callback_id": CALLBACK_ID,
        "title": _plain("Queue a training run"),
        "submit": _plain("Queue it"),
        "close": _plain("Cancel"),
        "private_metadata": private,
        "blocks": [
            {
                "type": "input",
                "block_id": WHAT,
                "label": _plain("What to run"),
                "hint": _plain("A command line, e.g. python train.py --epochs 3, or recipe:digits"),
                "element": {"type": "plain_text_input", "action_id": "value"},
            },
            {
                "type": "input",
                "block_id": GPUS,
                "label": _plain("GPUs"),
                "element": {
                    "type": "plain_text_input",
                    "action_id": "value",
                    "initial_value": "1",
                },
            },
            {
                "type": "input",
                "block_id": MODEL,
                "label": _plain("GPU model"),
                "element": {
                    "type": "static_select",
                    "action_id": "value",
                    "options": model_options,
                    "initial_option": model_options[0],
                },
            },
            {
                "type": "input",
                "block_id": PRECISION,
                "label": _plain("Precision"),
                "element": {
                    "type": "static_select",
                    "action_id": "value",
                    "options": precision_options,
                    "initial_option": precision_options[0],
                },
            },
            {
                "type": "input",
                "block_id": LIMIT,
                "optional": True,
                "label": _plain("Time limit"),
                "hint": _plain("e.g. 45m, 4h, 1h30m; empty for the team default"),
                "element": {"type": "plain_text_input", "action_id": "value"},
            },
        ],
    }


@dataclass(frozen=True)
class Submission:
    """Either the `/gpu run` line to execute, or the errors to show per field."""

    line: str | None
    errors: dict[str, str]


def _value(values: JsonDict, block: str) -> str:
    entry = values.get(block, {}).get("value", {})
    if not isinstance(entry, dict):
        return ""
    if entry.get("type") == "static_select":
        option = entry.get("selected_option") or {}
        return str(option.get("value") or "")
    return str(entry.get("value") or "").strip()


def read_submission(view: JsonDict, models: tuple[str, ...], check: Any = None) -> Submission:
    """Checks each field; `check(line)` (the grammar) gets the last word on a line whose
    fields all passed, its complaint shown under "What to run"."""
    values = (view.get("state") or {}).get("values") or {}
    errors: dict[str, str] = {}
    what = _value(values, WHAT)
    if not what:
        errors[WHAT] = "Say what to run: a command line, or recipe:NAME."
    gpus_text = _value(values, GPUS) or "1"
    # ASCII digits only: str.isdigit() is True for "²", which int() then refuses.
    if not _COUNT.fullmatch(gpus_text) or not 1 <= int(gpus_text) <= MAX_GPUS_PER_REQUEST:
        errors[GPUS] = f"A whole number from 1 to {MAX_GPUS_PER_REQUEST}."
    model = _value(values, MODEL) or _ANY
    if model != _ANY and model not in models:
        errors[MODEL] = "Pick a model from the list."
    precision = _value(values, PRECISION) or "auto"
    if precision not in PRECISIONS:
        errors[PRECISION] = f"One of {', '.join(PRECISIONS)}."
    limit = _value(values, LIMIT)
    if limit and parse_duration(limit) is None:
        errors[LIMIT] = "A duration like 45m, 4h or 1h30m."
    if errors:
        return Submission(None, errors)
    parts = ["/gpu run", f"--gpus {int(gpus_text)}"]
    if model != _ANY:
        parts.append(f"--gpu {shlex.quote(model)}")
    parts.append(f"--precision {precision}")
    if limit:
        parts.append(f"--max {shlex.quote(limit)}")
    recipe = _RECIPE.match(what)
    if recipe:
        parts.append(f"--recipe {recipe.group(1)}")
    elif what.startswith("recipe:"):
        return Submission(None, {WHAT: "A recipe name is lower-case letters, digits, - and _."})
    else:
        parts.append(f"-- {what}")
    line = " ".join(parts)
    if check is not None:
        try:
            check(line)
        except UserError as exc:
            return Submission(None, {WHAT: clip(exc.reason, 150)})
    return Submission(line, {})
