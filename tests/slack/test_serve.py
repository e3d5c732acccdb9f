"""`gpubot serve` as a process: binds the address it is given, answers /healthz and a
signed /gpu status, refuses an unsigned one, keeps secrets out of its log, and stops
on SIGTERM."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bot.faces.slack.cli import default_host, default_port
from tests.fakes.slack_api import FakeSlack
from tests.slack.conftest import SignedClient

ROOT = Path(__file__).resolve().parents[2]
SERVE = "import typer; from bot.faces.slack.cli import serve; typer.run(serve)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_over_http(fake_slack: FakeSlack, tmp_path: Path) -> None:
    port = _free_port()
    secret = "serve-test-signing-secret-0000"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "GPUBOT_", "PORT"))}
    env.update(
        GPUBOT_HOME=str(tmp_path),
        GPUBOT_LOCAL_GPUS="none",
        SLACK_BOT_TOKEN=fake_slack.bot_token,
        SLACK_SIGNING_SECRET=secret,
        SLACK_API_URL=fake_slack.url,
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "--port", str(port), "--no-worker", "--host", "127.0.0.1"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        client = SignedClient("127.0.0.1", port, secret, fake_slack)
        body = client.command("status").json()
        assert body["response_type"] == "ephemeral"
        assert "GPU status" in body["text"] or body["blocks"][0]["type"] == "header"
        assert client.command("status", signature="v0=" + "1" * 64).status == 401
        assert fake_slack.calls_to("auth.test")  # Bolt checked the token on start
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    log = out.decode("utf-8", "replace")
    assert secret not in log and fake_slack.bot_token not in log
    assert f"127.0.0.1:{port}/slack/events" in log


def test_default_bind_address_follows_the_platform() -> None:
    assert default_host({}) == "127.0.0.1"
    assert default_host({"PORT": "8080"}) == "0.0.0.0"
    assert default_host({"PORT": "8080", "GPUBOT_HOST": "bot.lab.example"}) == "bot.lab.example"
    assert default_port({}) == 3000
    assert default_port({"PORT": "8080"}) == 8080
