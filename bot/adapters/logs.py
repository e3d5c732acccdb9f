"""Log set-up for every command: plain text or one JSON object a line, never a secret.

Why a filter on the handler and not on a logger: records from other loggers
(slack_bolt, botocore, apscheduler) propagate to the root handler without passing
the root logger's filters, but every record passes its handler's. So the scrubber
sits on each handler this module installs, and sees every line in both formats,
exception text included.

What is scrubbed: the secret values the settings hold (Slack tokens, signing secret,
the database password) and the AWS secret/session values of the environment,
literally; and by shape, Slack tokens (`xox?-…`, `xapp-…`), AWS secret keys (after
their usual names, or as a bare 40-character key with mixed case), and the password
in any `scheme://user:password@host` URL.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import IO, Any

from bot.app.config import Settings

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
REDACTED = "<redacted>"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Slack bot/user/app-level/refresh tokens (xoxb-, xoxp-, xoxa-, xoxe-, xoxs-, xoxe.…, xapp-).
    (re.compile(r"\bxox[a-z]?[.-][A-Za-z0-9.\-]+"), REDACTED),
    (re.compile(r"\bxapp-[A-Za-z0-9\-]+"), REDACTED),
    # key=value, key: value, "key": "value" for the names AWS credentials go by.
    (
        re.compile(
            r"(?i)((?:aws_?)?(?:secret_?access_?key|session_?token|security_?token|secretaccesskey)"
            r"[\"']?\s*[:=]\s*[\"']?)[^\s\"',;}]+"
        ),
        r"\1" + REDACTED,
    ),
    # A bare AWS secret access key: 40 characters of base64 with both cases (a git or
    # SHA-1 hex digest, all lower case, is left alone).
    (
        re.compile(
            r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=]))"
            r"(?=[A-Za-z0-9/+=]{0,39}[A-Z])(?=[A-Za-z0-9/+=]{0,39}[a-z])[A-Za-z0-9/+=]{40}"
        ),
        REDACTED,
    ),
    # user:password@ in any URL (DATABASE_URL, a proxy, a git remote).
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@]*:)[^\s@/]+@"), r"\1" + REDACTED + "@"),
    # Passwords in a query string or a libpq key=value string.
    (re.compile(r"(?i)(\bpassword\s*=\s*)[^\s&;]+"), r"\1" + REDACTED),
)

# Environment variables whose values are secret wherever they show up.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "PGPASSWORD")


def secret_values(settings: Settings | None, env: dict[str, str] | None = None) -> list[str]:
    """The literal secrets of this process, longest first (so a prefix never half-masks)."""
    env = dict(os.environ) if env is None else env
    found: list[str] = []
    if settings is not None:
        found += [
            settings.slack_bot_token.get_secret_value(),
            settings.slack_signing_secret.get_secret_value(),
            settings.slack_app_token.get_secret_value(),
        ]
        url = settings.database_url.get_secret_value()
        match = re.search(r"://[^\s:/@]*:([^\s@/]+)@", url)
        if match:
            found.append(match.group(1))
    found += [env.get(name, "") for name in _SECRET_ENV]
    # Short values would mask ordinary words; real secrets are long.
    return sorted({v for v in found if len(v) >= 6}, key=len, reverse=True)


def scrub(text: str, secrets: Sequence[str] = ()) -> str:
    for value in secrets:
        if value in text:
            text = text.replace(value, REDACTED)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class SecretFilter(logging.Filter):
    """Rewrites each record in place: message, arguments, exception and stack text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep what there is, still scrubbed
            message = f"{record.msg} {record.args}"
        record.msg = scrub(message, self.secrets)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info, self.secrets)
        return True


# bot.domain.errors.new_ref: 8 hex characters, logged as "ref=…" (and shown as "ref …").
_REF = re.compile(r"\bref[= ]([0-9a-f]{8})\b")


class JsonFormatter(logging.Formatter):
    """One object a line: time, level, logger, message, ref (when the line has one),
    exception (its text) — the fields a log search filters on."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        ref = getattr(record, "ref", None)
        if ref is None:
            match = _REF.search(message)
            ref = match.group(1) if match else None
        if ref is not None:
            doc["ref"] = str(ref)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = record.stack_info
        return json.dumps(doc, ensure_ascii=False, default=str)


def log_format(requested: str | None, env: dict[str, str] | None = None) -> str:
    """The format asked for on the command line, else `$GPUBOT_LOG_FORMAT`, else text."""
    env = dict(os.environ) if env is None else env
    fmt = (requested or env.get("GPUBOT_LOG_FORMAT", "") or "text").strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    return fmt


def make_handler(
    fmt: str, settings: Settings | None, stream: IO[str] | None = None, path: str | None = None
) -> logging.Handler:
    handler: logging.Handler = (
        logging.FileHandler(path)
        if path is not None
        else logging.StreamHandler(stream or sys.stderr)
    )
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(SecretFilter(secret_values(settings)))
    return handler


def setup_logging(
    fmt: str,
    settings: Settings | None,
    *,
    level: int = logging.INFO,
    stream: IO[str] | None = None,
    path: str | None = None,
) -> logging.Handler:
    """Replaces the root handlers with one scrubbed handler (stderr, or a file)."""
    handler = make_handler(fmt, settings, stream=stream, path=path)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("apscheduler", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler
