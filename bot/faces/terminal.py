"""The shell face: the whole bot in a terminal, reading `/gpu` lines from stdin.

It renders the same views the Slack face renders as Block Kit, as plain text.
A line `@alice /gpu reserve` runs as alice; DMs and channel posts come out as
`[dm @alice] …` and `[#gpu] …`. Output is flushed per line so that a program
driving the shell through a pipe sees every reply as it happens.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from bot.app.delivery import deliver
from bot.app.service import Actor, GpuService, OutboxItem
from bot.domain import views
from bot.faces.dispatch import handle_text

_ACTOR = re.compile(r"^@([\w.\-]{1,64})\s*(.*)$", re.DOTALL)


def _plain(text: str) -> str:
    """Drops the `*bold*` marks; backticks stay, they read well in a terminal."""
    return re.sub(r"\*([^*\n]+)\*", r"\1", text)


def render(view: views.View) -> str:
    out: list[str] = []
    for block in view.blocks:
        if isinstance(block, views.Header):
            out.append(block.text)
            out.append("=" * len(block.text))
        elif isinstance(block, views.Text | views.Context):
            out.append(_plain(block.text))
        elif isinstance(block, views.Fields):
            width = max((len(k) for k, _ in block.items), default=0)
            out.extend(f"{k.ljust(width)}  {v}" for k, v in block.items)
        elif isinstance(block, views.Table):
            out.extend(_table(block))
        elif isinstance(block, views.Code):
            out.extend("    " + line for line in block.text.splitlines())
        elif isinstance(block, views.Divider):
            out.append("-" * 40)
        elif isinstance(block, views.Actions):
            hints = [
                f"[{b.label}: {b.command}]" if b.command else f"[{b.label}]" for b in block.buttons
            ]
            out.append("  ".join(hints))
    if not out:
        out.append(view.text)
    return "\n".join(out)


def _table(table: views.Table) -> list[str]:
    rows = [tuple(_plain(c) for c in table.columns), *table.rows]
    widths = [
        max(len(str(r[i])) if i < len(r) else 0 for r in rows) for i in range(len(table.columns))
    ]
    lines = []
    for n, row in enumerate(rows):
        cells = [str(row[i]).ljust(widths[i]) if i < len(row) else "" for i in range(len(widths))]
        lines.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


class TerminalNotifier:
    """Prints DMs and channel posts; shares the shell's lock so lines never interleave."""

    def __init__(self, out: TextIO, lock: threading.Lock, files_dir: Path | None = None) -> None:
        self._out = out
        self._lock = lock
        # Where attachments (charts) are written so a person at the terminal can open them.
        self._files_dir = files_dir
        self._edits: dict[int, int] = {}  # edits printed per live message

    def send(self, item: OutboxItem) -> None:
        prefix = f"[dm @{item.target}]" if item.kind == "dm" else f"[#{item.target}]"
        if item.edit_of is not None:
            # A live message edited in place in Slack; a terminal cannot edit a line it
            # printed, so each edit is a line of its own, numbered per message.
            self._edits[item.edit_of] = self._edits.get(item.edit_of, 0) + 1
            prefix = f"[update #{self._edits[item.edit_of]}] [dm @{item.target}]"
        body = render(item.view).splitlines() or [item.view.text]
        if item.attachment is not None:
            body.append(self._save(item.id, *item.attachment))
        with self._lock:
            self._out.write(f"{prefix} {body[0]}\n")
            for line in body[1:]:
                self._out.write(f"{' ' * len(prefix)} {line}\n")
            self._out.flush()

    def _save(self, item_id: int, name: str, data: bytes) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "file"
        if self._files_dir is None:
            return f"(attached: {safe}, {len(data):,} bytes)"
        self._files_dir.mkdir(parents=True, exist_ok=True)
        path = self._files_dir / f"{item_id}-{safe}"
        path.write_bytes(data)
        return f"(attached: {safe}, {len(data):,} bytes, saved to {path})"


class Shell:
    def __init__(
        self, service: GpuService, default_user: str, out: TextIO, lock: threading.Lock
    ) -> None:
        self.service = service
        self.default_user = default_user
        self.out = out
        self.lock = lock
        self.notifier = TerminalNotifier(out, lock, service.settings.home / "files")
        self._actors: dict[str, Actor] = {}
        # Runs submitted from this shell: at end of input it waits for them.
        self.run_ids: set[int] = set()

    def _actor(self, name: str) -> Actor:
        if name not in self._actors:
            self._actors[name] = self.service.actor(name)
        return self._actors[name]

    def print(self, text: str) -> None:
        with self.lock:
            self.out.write(text.rstrip("\n") + "\n")
            self.out.flush()

    def handle_line(self, line: str) -> None:
        line = line.strip()
        if not line or line.startswith("#"):
            return
        user = self.default_user
        m = _ACTOR.match(line)
        if m:
            user, line = m.group(1), m.group(2).strip()
        if not line.lower().startswith("/gpu"):
            if line.split(" ", 1)[0].lower() in {"quit", "exit"}:
                raise EOFError
            line = "/gpu " + line  # "reserve a100" works as well as "/gpu reserve a100"
        reply = handle_text(self.service, self._actor(user), line)
        if isinstance(reply.extra.get("run_id"), int):
            self.run_ids.add(reply.extra["run_id"])
        self.run_ids.update(i for i in reply.extra.get("run_ids") or () if isinstance(i, int))
        text = render(reply.view)
        if not reply.ephemeral:
            text = f"[#{self.service.settings.channel}] " + text
        self.print(text)
        # DMs this command caused (a release that granted someone) show up right after it.
        deliver(self.service, self.notifier)

    def run(self, lines: Iterable[str]) -> None:
        for line in lines:
            try:
                self.handle_line(line)
            except EOFError:
                break
        deliver(self.service, self.notifier)

    def wait_for_runs(self, poll_s: float) -> None:
        """Blocks until the runs this shell started have ended (the worker finishes them
        and delivers their DMs meanwhile); a run left running would outlive the shell."""
        runs = self.service.runs
        if not self.run_ids:
            return
        left = runs.open_runs(self.run_ids)
        if left:
            self.print(f"Waiting for {left} run(s) to finish (Ctrl-C to leave them running)...")
        while runs.open_runs(self.run_ids):
            time.sleep(poll_s)
        deliver(self.service, self.notifier)
