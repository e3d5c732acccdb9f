"""The README as a new team reads it (issue 19): the two commands first, then how
`gpubot` gets on the PATH, so every example runs as printed; and every file it names is
in this repository."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_lines() -> list[str]:
    """The lines of the README's shell and text examples, in order."""
    blocks = re.findall(r"```(?:sh|text|bash)?\n(.*?)```", README, re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_the_two_commands_come_first() -> None:
    first = re.search(r"```sh\n(.*?)```", README, re.S)
    assert first is not None
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert commands[:2] == ["make run", "make test"]


def test_gpubot_is_on_the_path_before_any_example_calls_it() -> None:
    lines = code_lines()
    activate = next(i for i, line in enumerate(lines) if line.startswith(". .venv/bin/activate"))
    calls = [i for i, line in enumerate(lines) if re.search(r"(^|[|$] *)gpubot\b", line)]
    assert calls and min(calls) > activate, lines[: min(calls) + 1]
    # What `activate` puts on the PATH is the console script `make run` installs.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gpubot"] == "bot.faces.cli:main"
    assert "pip install -q -e '.[train]'" in (ROOT / "Makefile").read_text()


def test_every_file_it_names_is_in_the_repository() -> None:
    linked = re.findall(r"\]\(([^)#]+)\)", README)
    named = re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|md|sh|json|csv|toml))`", README)
    missing = [p for p in linked + named if not p.startswith("http") and not (ROOT / p).exists()]
    assert not missing
    assert "DESIGN.md" not in README  # kept outside this repository
