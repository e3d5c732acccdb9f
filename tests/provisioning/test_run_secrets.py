"""A remote host never receives a bot secret: not in a run's environment, not in a file.

The bot (this test process) holds secrets in its environment; a run on a static SSH host
(the real sshd on 127.0.0.2), submitted and driven through the runtime the worker uses,
prints its whole environment, and afterwards every file the bot put on that host (run
directory, status, log, the host agent's lease) is searched for them. The loopback host
is this machine underneath, so what a process there could read of the bot's own /proc
entry says nothing about a real remote host and is not looked at here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session

from bot.app.config import load_settings
from bot.app.hosts.remote import PreparedHost
from bot.domain.commands import Logs, Run
from bot.faces.dispatch import execute
from bot.faces.runtime import build_runtime
from bot.faces.terminal import render
from db.models import TrainingRun
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.runtime_helpers import checked
from tests.ssh_hosts import SshLab

SECRETS = {
    "SLACK_BOT_TOKEN": "xoxb-remote-bot-token-80417",
    "SLACK_SIGNING_SECRET": "remote-signing-secret-22093",
    "SLACK_APP_TOKEN": "xapp-remote-app-token-61170",
    "AWS_ACCESS_KEY_ID": "AKIAREMOTETEST000042",
    "AWS_SECRET_ACCESS_KEY": "remote-aws-secret-key-39951",
    "AWS_SESSION_TOKEN": "remote-aws-session-token-11204",
    "PGPASSWORD": "remote-pg-password-73310",
}


@pytest.fixture
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=5, command_timeout=30)
    try:
        yield c
    finally:
        c.close()


def test_a_run_on_an_ssh_host_sees_none_of_the_bots_secrets(
    ssh_lab: SshLab, client: SshClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = ssh_lab.hosts["gpu-a"]
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "bot"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("GPUBOT_RUN_AS", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    monkeypatch.setenv(
        "GPUBOT_SSH_HOSTS", f"gpu-a={ssh_lab.user}@{host.address}:{host.port}/1xA100"
    )
    remote = host.root / f"secrets-{tmp_path.name}"

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        return PreparedHost(root=str(remote), python=sys.executable)

    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about secrets reaching a run;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    rt = checked(build_runtime(load_settings(), ssh=client, prepare=prepare, runs_as_self=False))
    try:
        alice = rt.service.actor("alice")
        reply = execute(
            rt.service, alice, Run(command=("sh", "-c", "env; echo finished-env"), model="A100")
        )
        run_id = reply.extra["run_id"]
        runs = rt.service.runs
        deadline = time.monotonic() + 120
        while True:
            runs.dispatch()
            runs.poll()
            with Session(rt.engine) as s:
                run = s.get(TrainingRun, run_id)
                assert run is not None
                if run.finished_at is not None:
                    break
            assert time.monotonic() < deadline, run.state
            time.sleep(0.2)
        text = render(execute(rt.service, alice, Logs(run_id, lines=400)).view)
        assert "finished-env" in text and "CUDA_VISIBLE_DEVICES=0" in text, text
        assert [n for n, v in SECRETS.items() if v in text or n in text] == []
        # Everything the bot left on the host: the run's directory, its log and status,
        # and the host agent's lease (written on every poll).
        sent = [p for p in remote.rglob("*") if p.is_file()]
        assert any(p.name == "run.log" for p in sent)
        for path in sent:
            data = path.read_bytes()
            assert [n for n, v in SECRETS.items() if v.encode() in data] == [], path
    finally:
        rt.engine.dispose()
