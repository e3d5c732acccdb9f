"""`gpubot hosts forget`: the agent a bootstrap left on an isolated host is stopped and
removed, and the host leaves the bot. On lab-b (its own account), bootstrapped without
torch: the test is about the agent, and the agent needs only the standard library."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select
from typer.testing import CliRunner

from bot.app.config import load_settings
from bot.domain.commands import Status
from bot.faces.cli import app
from bot.faces.runtime import build_runtime
from db.models import Host
from provisioning.bootstrap import AgentInstall, agent_supervisor_alive, bootstrap
from provisioning.ssh import SshClient
from tests.isolated_hosts import isolated_target
from tests.ssh_hosts import SshLab, pip_env


@pytest.fixture
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=5, command_timeout=60)
    try:
        yield c
    finally:
        c.close()


def test_forget_stops_and_removes_the_agent_and_the_host(
    isolated_lab: SshLab, client: SshClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = isolated_target(isolated_lab, "lab-b")
    agent = AgentInstall(stop_command=None, imds_endpoint=None, use_systemd=False)
    report = bootstrap(
        client, target, remote_root="~/.gpubot", install_torch=False, agent=agent, env=pip_env()
    )
    assert agent_supervisor_alive(client, target, report.root)
    home = isolated_lab.hosts["lab-b"].root
    assert (home / ".gpubot" / "agent").is_dir()

    host = isolated_lab.hosts["lab-b"]
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(isolated_lab.client_key))
    entry = f"lab-b={target.user}@{host.address}:{host.port}/1xA100"
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", entry)
    rt = build_runtime(load_settings())
    rt.engine.dispose()

    result = CliRunner().invoke(app, ["hosts", "forget", "lab-b"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("host agent: supervised process group ")
    assert "removed" in lines[-3] and "the venv and code stay" in lines[-3]
    assert lines[-2] == "host lab-b forgotten: it no longer shows in /gpu status"
    assert "still in GPUBOT_SSH_HOSTS" in lines[-1]

    assert not agent_supervisor_alive(client, target, report.root)
    assert not (home / ".gpubot" / "agent").exists()
    assert not (home / ".gpubot" / "bootstrap.json").exists()
    assert (home / ".gpubot" / "venv").is_dir()
    # Nothing of the agent runs as that account any more.
    ps = client.run(target, 'ps -u "$(id -un)" -o args=', timeout=30)
    assert "training.agent" not in ps.stdout and "supervise.sh" not in ps.stdout

    monkeypatch.setenv("GPUBOT_SSH_HOSTS", f"other={target.user}@{host.address}:{host.port}/1xT4")
    rt = build_runtime(load_settings())
    with Session(rt.engine) as s:
        assert s.exec(select(Host).where(Host.name == "lab-b")).one().state == "terminated"
    status = rt.service.status(rt.service.actor("erin"), Status()).view
    assert not any("lab-b" in str(b) for b in status.blocks)
    assert any("*other*" in str(b) for b in status.blocks)
    rt.engine.dispose()

    again = CliRunner().invoke(app, ["hosts", "forget", "lab-b"])
    assert again.exit_code == 1
    assert "There is no host `lab-b`" in again.output
