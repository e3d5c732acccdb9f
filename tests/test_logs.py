"""Structured logs: one JSON object a line that parses, with time, level, logger, message,
ref and exception; and no secret in any line, in either format, whatever logger wrote it
and wherever the secret sat (message, arguments, exception text)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from bot.adapters.logs import REDACTED, log_format, scrub, secret_values, setup_logging
from bot.app.config import Settings
from bot.domain.errors import new_ref

ROOT = Path(__file__).resolve().parents[1]

BOT_TOKEN = "xoxb-1111111111-2222222222-AbCdEfGhIjKlMnOpQrStUvWx"
APP_TOKEN = "xapp-1-A0123456789-1234567890123-0a1b2c3d4e5f60718293a4b5c6d7e8f9"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
DB_PASSWORD = "pg-Pa55word-never-logged"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
OTHER_SLACK = "xoxp-9999999999-8888888888-7777777777-abcdef0123456789abcdef0123456789"

SETTINGS = Settings(
    slack_bot_token=SecretStr(BOT_TOKEN),
    slack_app_token=SecretStr(APP_TOKEN),
    slack_signing_secret=SecretStr(SIGNING_SECRET),
    database_url=SecretStr(f"postgresql://gpubot:{DB_PASSWORD}@db.internal:5432/gpubot"),
)
SECRETS = (BOT_TOKEN, APP_TOKEN, SIGNING_SECRET, DB_PASSWORD, AWS_SECRET, OTHER_SLACK)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit_everything() -> str:
    """Lines a careless caller (ours or a library's) could write; returns the ref used."""
    logging.getLogger("bot.faces.worker").info("connecting with %s", BOT_TOKEN)
    logging.getLogger("slack_bolt.App").warning(f"socket mode token {APP_TOKEN} refused")
    logging.getLogger("bot.faces.slack").info("signing secret is %r", SIGNING_SECRET)
    logging.getLogger("sqlalchemy.engine").error(
        "cannot reach postgresql+psycopg://gpubot:%s@db.internal/gpubot", DB_PASSWORD
    )
    logging.getLogger("botocore.credentials").info(
        "found credentials: aws_secret_access_key=%s", AWS_SECRET
    )
    logging.getLogger("bot.anything").info("bare key %s in a list", AWS_SECRET)
    logging.getLogger("bot.anything").info("a user pasted %s into a command", OTHER_SLACK)
    ref = new_ref()
    try:
        raise RuntimeError(f"auth.test failed for token {BOT_TOKEN} and {AWS_SECRET}")
    except RuntimeError as exc:
        logging.getLogger("bot.faces.dispatch").error(
            "ref=%s /gpu status failed", ref, exc_info=exc
        )
    return ref


def test_json_lines_parse_and_carry_no_secret(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    out = io.StringIO()
    setup_logging("json", SETTINGS, stream=out)
    ref = _emit_everything()
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) == 8
    docs = [json.loads(line) for line in lines]  # every line is one object
    for doc in docs:
        assert {"time", "level", "logger", "message"} <= set(doc)
        assert doc["time"].endswith("+00:00")
    for secret in SECRETS:
        assert secret not in text
    assert docs[0] == {**docs[0], "level": "INFO", "logger": "bot.faces.worker"}
    assert docs[0]["message"] == f"connecting with {REDACTED}"
    assert "postgresql+psycopg://gpubot:<redacted>@db.internal" in docs[3]["message"]
    failed = docs[-1]
    assert failed["level"] == "ERROR" and failed["ref"] == ref
    assert "RuntimeError: auth.test failed for token <redacted>" in failed["exception"]
    assert "Traceback" in failed["exception"]
    assert "ref" not in docs[0]


def test_text_lines_are_scrubbed_too(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("text", SETTINGS, stream=out)
    _emit_everything()
    text = out.getvalue()
    for secret in SECRETS:
        assert secret not in text
    assert "INFO bot.faces.worker connecting with <redacted>" in text
    assert "Traceback" in text  # the exception is kept, only its secrets are masked


def test_ordinary_text_is_left_alone() -> None:
    commit = "3f786850e387550fdab836ed7e6dc881de23001b"  # a SHA-1: all lower case hex
    line = f"run 12 on p4d.24xlarge at commit {commit}, see https://example.com/a/b?x=1"
    assert scrub(line, secret_values(Settings(), env={})) == line


def test_the_format_comes_from_the_option_then_the_environment() -> None:
    assert log_format("", {}) == "text"
    assert log_format("", {"GPUBOT_LOG_FORMAT": "json"}) == "json"
    assert log_format("text", {"GPUBOT_LOG_FORMAT": "json"}) == "text"
    with pytest.raises(ValueError, match="text, json"):
        log_format("yaml", {})


def test_a_worker_process_writes_one_json_object_a_line(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "GPUBOT_", "PORT"))}
    env.update(
        GPUBOT_HOME=str(tmp_path),
        GPUBOT_LOCAL_GPUS="none",
        GPUBOT_TICK_SECONDS="0.2",
        GPUBOT_LOG_FORMAT="json",
        SLACK_SIGNING_SECRET=SIGNING_SECRET,
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "bot.faces.cli", "worker"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # SIGTERM only once the worker says it started (its handler is in place by then);
    # a loaded machine may take a while to import everything.
    assert proc.stderr is not None
    head = []
    for raw in proc.stderr:
        head.append(raw)
        if b"worker started" in raw:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    err = b"".join(head) + rest
    assert proc.returncode == 0, err
    lines = err.decode().splitlines()
    docs = [json.loads(line) for line in lines]
    messages = [d["message"] for d in docs]
    assert any("worker started" in m for m in messages), messages
    assert messages[-1].startswith("worker stopped"), messages
    assert SIGNING_SECRET not in err.decode()


def test_a_bad_log_format_is_one_plain_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "GPUBOT_"))}
    env.update(GPUBOT_HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "bot.faces.cli", "worker", "--log-format", "xml"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == (
        "gpubot: log format must be one of text, json, not 'xml'"
    )
