"""The one place that turns text into POSIX shell words.

Every shell line the bot sends to a host (or to this machine's shell) is built from
these functions, so user text (a `--path`, a git URL or ref, a run directory, an
environment value) reaches the command as exactly one literal argument whatever it
holds: quotes, `$(...)`, backticks, newlines, globs, leading dashes. Nothing else in
`bot/` or `provisioning/` writes a quote around data by hand; a constant snippet
(``'%s\\n'``, ``"$HOME"``) may keep its own quotes, since it carries no data.

Three things quoting alone does not cover, and these functions do:

- NUL cannot be passed in an argument at all (C strings end there), so it is refused
  rather than silently cut.
- A word that begins with ``-`` is still an option to most commands: builders put
  ``--`` before operands, and `path` anchors a relative path as ``./-x``.
- ``cd`` treats ``-`` as "the previous directory" even after ``--`` and searches
  ``$CDPATH`` for relative names (printing where it went): `cd` anchors relative
  directories with ``./`` so neither happens.

The quoting is `shlex.quote`: one single-quoted word, whose meaning is the same in
dash, bash, zsh and busybox sh.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def quote(word: str) -> str:
    """`word` as one shell word that the shell reads back byte for byte."""
    if not isinstance(word, str):
        raise TypeError(f"a shell word must be text, not {type(word).__name__}")
    if "\0" in word:
        raise ValueError("a shell word cannot hold a NUL character")
    return shlex.quote(word)


def join(argv: Iterable[str]) -> str:
    """A command line whose words are exactly `argv` (the first one is the program)."""
    words = [quote(a) for a in argv]
    if not words:
        raise ValueError("a command needs at least a program name")
    return " ".join(words)


def anchored(path: str) -> str:
    """A path that no command reads as an option: a relative one that starts with `-`
    gets ``./`` in front (the same file). Absolute paths are unchanged."""
    if not path:
        raise ValueError("an empty path names no file")
    return "./" + path if path.startswith("-") else path


def path(p: str) -> str:
    """`p` as one shell word that is never an option (see `anchored`)."""
    return quote(anchored(p))


def cd_target(directory: str) -> str:
    """`directory` as ``cd`` must be given it to go exactly there: a relative name is
    anchored with ``./``, so ``-`` is a directory named "-" (not the previous one) and
    ``$CDPATH`` is never searched. Unquoted: for a ``cd "$0"`` that gets it as an argument."""
    if not directory:
        raise ValueError("an empty directory name")
    first = directory.split("/", 1)[0]
    if directory.startswith("/") or first in (".", ".."):
        return directory
    return "./" + directory


def cd(directory: str) -> str:
    """``cd DIR`` that goes exactly to DIR (see `cd_target`)."""
    return "cd " + quote(cd_target(directory))


def in_dir(directory: str, line: str) -> str:
    """`line` run in `directory`, and not at all when the directory cannot be entered.
    The line goes in a group on its own lines, so a trailing comment in it cannot
    swallow the closing brace."""
    return f"{cd(directory)} && {{\n{line}\n}}"


def env_name(name: str) -> str:
    """`name` when it is a valid environment variable name; ValueError otherwise (an
    `=` or a space in a name would make the rest of the assignment a new word)."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ValueError(f"not an environment variable name: {name!r}")
    return name


def assignments(env: Mapping[str, str]) -> list[str]:
    """``NAME=value`` shell words in the mapping's order, each value quoted inside its word."""
    return [f"{env_name(k)}={quote(v)}" for k, v in env.items()]


def env_prefix(env: Mapping[str, str] | None) -> str:
    """``env NAME=value ... `` before a command ("" for no variables). `env` rather than
    bare assignments, so the prefix also works in front of ``exec``, ``timeout`` and
    ``setsid`` and can never be read as a shell keyword."""
    if not env:
        return ""
    return "env " + " ".join(assignments(env)) + " "
