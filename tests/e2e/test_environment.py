"""What the environment gets wrong, as a new team meets it: a database that is down, a
fresh home without Slack, an http request URL, Bolt's start-up noise. Each entry point
says it in one line with the fix, never a traceback; `doctor` checks what the chosen
face and provider need and nothing else."""

from __future__ import annotations

import logging
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bot.adapters.leader import LeaseLeadership
from bot.app.config import Settings
from bot.domain.clock import SystemClock
from bot.faces.cli import app
from bot.faces.doctor import render, run_checks
from bot.faces.slack.app import build_face
from db.migrate import upgrade
from db.session import make_engine
from tests.core.helpers import make_service
from tests.e2e.shell_driver import ROOT, gpubot_cmd, shell_env
from tests.fakes.slack_api import FakeSlack


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


ENTRY_POINTS = (
    ("shell", "--no-wait"),
    ("worker",),
    ("db", "upgrade"),
    ("serve",),
    ("submit", "PROJECT", "--", "python", "train.py"),
)


@pytest.mark.parametrize("args", ENTRY_POINTS, ids=lambda a: " ".join(a[:2]))
def test_a_database_that_is_down_is_one_line_with_the_fix(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    env = shell_env(
        tmp_path / "home",
        DATABASE_URL=f"postgresql://gpubot:hunter2pw@127.0.0.1:{closed_port()}/gpubot",
        SLACK_BOT_TOKEN="xoxb-1-2-abc",
        SLACK_SIGNING_SECRET="signing-secret",
    )
    argv = [str(project) if a == "PROJECT" else a for a in args]
    proc = subprocess.run(
        gpubot_cmd(*argv), input="", capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpubot: cannot use the database at postgresql://gpubot:***@")
    assert "DATABASE_URL" in lines[0] and "Traceback" not in proc.stderr
    assert "hunter2pw" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("args", ENTRY_POINTS, ids=lambda a: " ".join(a[:2]))
def test_a_bad_setting_is_one_line_naming_it(tmp_path: Path, args: tuple[str, ...]) -> None:
    env = shell_env(tmp_path / "home", GPUBOT_PROVIDER="azure")
    argv = [str(tmp_path) if a == "PROJECT" else a for a in args]
    proc = subprocess.run(
        gpubot_cmd(*argv), input="", capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "GPUBOT_PROVIDER" in lines[0], proc.stderr


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("GPUBOT_CONFIG", "DATABASE_URL", "GPUBOT_PROVIDER", "GPUBOT_SSH_HOSTS"):
        monkeypatch.delenv(var, raising=False)
    for var in ("SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_API_URL"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("GPUBOT_HOME", str(home))
    return home


def test_doctor_on_a_fresh_shell_only_home_is_green_with_notes(bare_env: Path) -> None:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "! Slack: no Slack secret is set: a shell-only set-up" in result.output
    assert "no database yet" in result.output and "first gpubot command creates it" in result.output


@pytest.mark.parametrize("provider", ["aws", "ssh"])
def test_doctor_on_a_remote_provider_says_nothing_of_this_machine(
    provider: str, tmp_path: Path
) -> None:
    checks = run_checks(Settings(provider=provider, home=tmp_path), env={})
    text = "\n".join(render(c) for c in checks)
    assert "CPU slots" not in text and "This machine's GPUs" not in text


def test_manifest_refuses_an_http_url() -> None:
    result = CliRunner().invoke(app, ["manifest", "--url", "http://bot.example/slack/events"])
    assert result.exit_code == 2
    assert "https://" in result.output and "request_url" not in result.output
    ok = CliRunner().invoke(app, ["manifest", "--url", "https://bot.example/slack/events"])
    assert ok.exit_code == 0 and "https://bot.example/slack/events" in ok.output


def test_serve_starts_without_bolts_token_warning(
    fake_slack: FakeSlack, sqlite_engine: object, caplog: pytest.LogCaptureFixture
) -> None:
    # fake_slack puts SLACK_BOT_TOKEN in the environment, as a deployment does.
    service, _ = make_service(
        sqlite_engine,  # type: ignore[arg-type]
        [],
        slack_bot_token=fake_slack.bot_token,
        slack_signing_secret="signing-secret",
        slack_api_url=fake_slack.url,
    )
    with caplog.at_level(logging.DEBUG):
        face = build_face(service, service.settings)
    face.shutdown()
    assert not [r for r in caplog.records if "will be unused" in r.getMessage()]


def test_submit_without_a_worker_says_none_runs_and_how_to_start_one(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    proc = subprocess.run(
        gpubot_cmd("submit", str(project), "--", "python", "train.py"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=shell_env(tmp_path / "home"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Run #1 queued" in proc.stdout
    assert "No gpubot worker is running, so run #1 waits in the queue" in proc.stdout
    assert "`gpubot worker`" in proc.stdout and "--wait" in proc.stdout


def test_submit_with_a_worker_running_says_it_places_the_run(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
    upgrade(engine)
    lease = LeaseLeadership(engine, SystemClock(), timedelta(hours=1))
    assert lease.hold()  # a worker leads, as `gpubot worker` would
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    try:
        proc = subprocess.run(
            gpubot_cmd("submit", str(project), "--", "python", "train.py"),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=shell_env(home),
        )
    finally:
        lease.release()
        engine.dispose()
    assert proc.returncode == 0, proc.stderr
    assert "A gpubot worker is running: it places run #1 on its next tick" in proc.stdout
