"""A `View` as Block Kit, within Slack's limits by construction.

Slack rejects a whole message (`invalid_blocks`, `msg_blocks_too_long`) when one
part is over a limit, so the user would see nothing at all. Here every cut is made
before sending and said out loud ("…and N more"): a long table becomes monospace
sections of at most 3000 characters, a view with too many blocks ends with a
context block naming what was left out, and the whole payload stays under a text
budget (Slack refuses long messages well below 50 × 3000 characters).

The numbers mirror `../shared/slack/limits.json`; a test checks they still agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bot.domain import views

JsonDict = dict[str, Any]

BLOCKS_PER_MESSAGE = 50
BLOCKS_PER_VIEW = 100
SECTION_TEXT_CHARS = 3000
SECTION_FIELDS_COUNT = 10
SECTION_FIELD_TEXT_CHARS = 2000
HEADER_TEXT_CHARS = 150
ACTIONS_BLOCK_ELEMENTS = 25
BUTTON_TEXT_CHARS = 75
ACTION_ID_CHARS = 255
BUTTON_VALUE_CHARS = 2000
CONTEXT_TEXT_CHARS = 3000
# Slack truncates at 40,000 and advises under 4,000: the fallback is a summary anyway.
MESSAGE_TEXT_CHARS = 3900

ELLIPSIS = "…"


@dataclass(frozen=True)
class Budget:
    """How much one surface may carry. `chars` bounds the text of all blocks together:
    Slack answers `msg_blocks_too_long` for big messages long before 50 full sections."""

    blocks: int
    chars: int
    table_rows: int
    cell_chars: int = 40


MESSAGE = Budget(blocks=BLOCKS_PER_MESSAGE, chars=11_000, table_rows=60)
# Home and modal views may be 250 kB; stay far below it.
VIEW = Budget(blocks=BLOCKS_PER_VIEW, chars=60_000, table_rows=200)


def escape(text: str) -> str:
    """Slack's three control characters: without this a user's display name `<!channel>`
    would ping everyone, and a stray `<` would swallow the rest of the line."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 1)] + ELLIPSIS


def _clip_escaped(text: str, limit: int) -> str:
    """Escapes, then cuts without splitting an `&amp;` entity in half."""
    out = escape(text)
    if len(out) <= limit:
        return out
    cut = out[: max(0, limit - 1)]
    amp = cut.rfind("&")
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    return cut + ELLIPSIS


def plain(text: str, limit: int) -> JsonDict:
    """plain_text is not mrkdwn: no escaping, but it must not be empty."""
    return {"type": "plain_text", "text": clip(text, limit) or " ", "emoji": True}


def mrkdwn(text: str) -> JsonDict:
    return {"type": "mrkdwn", "text": text}


def _section(text: str) -> JsonDict:
    return {"type": "section", "text": mrkdwn(text or " ")}


def _chunks(lines: list[str], limit: int) -> Iterator[list[str]]:
    """Groups lines so that each group joined with newlines fits `limit`; a single line
    longer than the limit is split hard (a 5000-character command line still shows)."""
    group: list[str] = []
    size = 0
    for line in lines:
        while len(line) > limit:
            if group:
                yield group
                group, size = [], 0
            yield [line[:limit]]
            line = line[limit:]
        extra = len(line) + (1 if group else 0)
        if group and size + extra > limit:
            yield group
            group, size = [], 0
            extra = len(line)
        group.append(line)
        size += extra
    if group:
        yield group


def _text_sections(text: str) -> list[JsonDict]:
    lines = escape(text).split("\n")
    return [_section("\n".join(g)) for g in _chunks(lines, SECTION_TEXT_CHARS)]


_FENCE = "```"


def _code_sections(lines: list[str]) -> list[JsonDict]:
    body = SECTION_TEXT_CHARS - 2 * len(_FENCE) - 2
    return [
        _section(f"{_FENCE}\n" + "\n".join(g) + f"\n{_FENCE}")
        for g in _chunks([escape(line) for line in lines] or [" "], body)
    ]


def table_lines(table: views.Table, budget: Budget) -> list[str]:
    """Aligned columns for a monospace block; rows past the budget become one
    "…and N more rows" line, so a queue of 300 runs still renders."""
    strip = re.compile(r"\*([^*\n]+)\*|`([^`\n]+)`")

    def cell(value: object) -> str:
        text = strip.sub(lambda m: m.group(1) or m.group(2), str(value)).replace("\n", " ")
        return clip(text, budget.cell_chars)

    ncols = len(table.columns)
    shown = table.rows[: budget.table_rows]
    grid = [[cell(c) for c in table.columns]]
    grid += [[cell(r[i]) if i < len(r) else "" for i in range(ncols)] for r in shown]
    widths = [max((len(row[i]) for row in grid), default=0) for i in range(ncols)]
    out = []
    for n, row in enumerate(grid):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    left = len(table.rows) - len(shown)
    if left > 0:
        out.append(f"{ELLIPSIS}and {left} more row" + ("s" if left != 1 else ""))
    return out


def _fields_sections(fields: views.Fields) -> list[JsonDict]:
    items = [
        mrkdwn(_clip_escaped(f"*{k}*\n{v}" if k else v, SECTION_FIELD_TEXT_CHARS) or " ")
        for k, v in fields.items
    ]
    return [
        {"type": "section", "fields": items[i : i + SECTION_FIELDS_COUNT]}
        for i in range(0, len(items), SECTION_FIELDS_COUNT)
    ] or [_section(" ")]


def button_value(button: views.Button) -> str:
    """What a click carries back: the button's `/gpu` line, so the click handler can run any
    button, present or future, through the same path as typed text."""
    return button.command or button.value


def _actions(block: views.Actions) -> list[JsonDict]:
    out: list[JsonDict] = []
    buttons = [b for b in block.buttons if len(button_value(b)) <= BUTTON_VALUE_CHARS]
    for start in range(0, len(buttons), ACTIONS_BLOCK_ELEMENTS):
        elements: list[JsonDict] = []
        seen: set[str] = set()
        for i, b in enumerate(buttons[start : start + ACTIONS_BLOCK_ELEMENTS]):
            action_id = b.action_id[: ACTION_ID_CHARS - 5] or "gpubot_button"
            if action_id in seen:  # Slack wants action ids unique within a block
                action_id = f"{action_id}#{i}"
            seen.add(action_id)
            el: JsonDict = {
                "type": "button",
                "text": plain(b.label, BUTTON_TEXT_CHARS),
                "action_id": action_id,
                "value": button_value(b),
            }
            if b.style in ("primary", "danger"):
                el["style"] = b.style
            elements.append(el)
        if elements:
            out.append({"type": "actions", "elements": elements})
    return out


def render_block(block: views.Block, budget: Budget) -> list[JsonDict]:
    """One view block as one or more Slack blocks, each within its own limits."""
    if isinstance(block, views.Header):
        return [{"type": "header", "text": plain(block.text, HEADER_TEXT_CHARS)}]
    if isinstance(block, views.Text):
        return _text_sections(block.text)
    if isinstance(block, views.Context):
        return [
            {
                "type": "context",
                "elements": [mrkdwn(_clip_escaped(block.text, CONTEXT_TEXT_CHARS) or " ")],
            }
        ]
    if isinstance(block, views.Fields):
        return _fields_sections(block)
    if isinstance(block, views.Table):
        return _code_sections(table_lines(block, budget))
    if isinstance(block, views.Code):
        return _code_sections(block.text.split("\n"))
    if isinstance(block, views.Divider):
        return [{"type": "divider"}]
    if isinstance(block, views.Actions):
        return _actions(block)
    raise TypeError(f"unknown view block {block!r}")


def block_chars(block: JsonDict) -> int:
    """The text a block carries, as Slack counts it for its payload ceiling."""
    n = 0
    text = block.get("text")
    if isinstance(text, dict):
        n += len(str(text.get("text", "")))
    for f in block.get("fields", []) or []:
        n += len(str(f.get("text", "")))
    for el in block.get("elements", []) or []:
        t = el.get("text")
        n += len(str(t.get("text", ""))) if isinstance(t, dict) else len(str(t or ""))
        n += len(str(el.get("value", "")))
    return n


def render_blocks(view: views.View, budget: Budget = MESSAGE) -> list[JsonDict]:
    """All of a view's blocks that fit the budget; when some do not, the last block says
    how many were left out, so a cut list never looks complete."""
    rendered: list[JsonDict] = []
    for block in view.blocks:
        rendered.extend(render_block(block, budget))
    if not rendered:
        rendered = _text_sections(view.text or " ")
    kept: list[JsonDict] = []
    chars = 0
    for b in rendered:
        size = block_chars(b)
        if len(kept) >= budget.blocks or chars + size > budget.chars:
            break
        kept.append(b)
        chars += size
    left = len(rendered) - len(kept)
    if left == 0:
        return kept
    # Make room for the note within both limits.
    note_chars = 120
    while kept and (len(kept) > budget.blocks - 1 or chars + note_chars > budget.chars):
        chars -= block_chars(kept.pop())
        left += 1
    note = (
        f"{ELLIPSIS}and {left} more block"
        + ("s" if left != 1 else "")
        + " not shown: Slack limits how much one message may hold."
    )
    kept.append({"type": "context", "elements": [mrkdwn(note)]})
    return kept


def fallback_text(view: views.View) -> str:
    """Notification and screen-reader text: the view's summary, never empty."""
    return clip(view.text.strip(), MESSAGE_TEXT_CHARS) or "gpubot"


def message(view: views.View) -> JsonDict:
    """`text` + `blocks` for chat.postMessage, chat.update, response_url and acks."""
    return {"text": fallback_text(view), "blocks": render_blocks(view, MESSAGE)}
