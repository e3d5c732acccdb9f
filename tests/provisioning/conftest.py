"""Fixtures for the SSH layer: real sshd hosts, and one bench per `HostShell`.

The contract tests take `bench`, which is parametrized over the real `SshClient`
(against gpu-a of the module's `ssh_lab`) and the `LocalRunner` double, so both are held
to the same behaviour.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import pytest

from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import LOOPBACK_ONLY_ENV, SshClient, SshTarget
from tests.ssh_hosts import SshHost, SshLab, running_lab


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may dial an address a fake cloud invented, even by mistake."""
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")


@pytest.fixture(scope="session")
def ssh_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    """Two fake GPU hosts, gpu-a on 127.0.0.2 and gpu-b on 127.0.0.3, for the whole run.

    The shortcut lab: both log in as the bot's own user, with its venv and code readable,
    for tests whose hosts must run `training` (runs, agents, probes) without paying for a
    bootstrap. A module about the SSH layer itself overrides it with `stranger_lab`
    (tests/isolated_hosts.py), as test_ssh.py does."""
    with running_lab(tmp_path_factory.mktemp("sshd")) as lab:
        yield lab


def target_for(lab: SshLab, name: str) -> SshTarget:
    host = lab.hosts[name]
    return SshTarget(
        host=host.address,
        port=host.port,
        user=lab.user_of(name),
        key_path=str(lab.client_key),
        name=name,
    )


@pytest.fixture
def ssh_targets(ssh_lab: SshLab) -> dict[str, SshTarget]:
    return {name: target_for(ssh_lab, name) for name in ssh_lab.hosts}


@pytest.fixture
def ssh_client() -> Iterator[SshClient]:
    client = SshClient(connect_timeout=5, command_timeout=20)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def droppable_host(ssh_lab: SshLab) -> Iterator[SshHost]:
    """gpu-b, which a test may stop and start; it is up again for the next test."""
    host = ssh_lab.hosts["gpu-b"]
    try:
        yield host
    finally:
        host.start()


@dataclass
class Bench:
    """One runner, the target it serves, and a fresh directory on that host."""

    kind: str
    runner: HostShell
    target: SshTarget
    root: str
    started: list[int] = field(default_factory=list)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def start(
        self,
        command: str,
        log: str = "out.log",
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pid_file: str | None = None,
    ) -> int:
        pgid = self.runner.start_detached(
            self.target, command, self.path(log), cwd=cwd, env=env, pid_file=pid_file
        )
        self.started.append(pgid)
        return pgid

    def disconnect(self) -> None:
        self.runner.close(self.target)


RUN_ACCOUNT = os.environ.get("GPUBOT_TEST_RUN_AS", "gpubot-run")


def run_account_missing() -> str | None:
    """Why the LocalRunner cannot run as the test run account here, or None."""
    try:
        pwd.getpwnam(RUN_ACCOUNT)
    except KeyError:
        return f"no account {RUN_ACCOUNT} (scripts/run_account.sh creates it)"
    if os.geteuid() != 0 and shutil.which("sudo") is None:
        return "switching to the run account needs root or sudo"
    return None


@pytest.fixture(params=["ssh", "local", "local-as"])
def bench(request: pytest.FixtureRequest) -> Iterator[Bench]:
    runner: HostShell
    if request.param == "local-as":
        # The LocalRunner as GPUBOT_RUN_AS sets it up: every command and file operation
        # as the unprivileged run account, in a directory of its own home.
        # (the "local-as" case is in the run-account xdist group: tests/conftest.py)
        account: str = request.getfixturevalue("run_account")
        runner = LocalRunner(command_timeout=20, run_as=account)
        made = runner.run(LOCAL_TARGET, 'mktemp -d "$HOME/gpubot-bench.XXXXXX"', timeout=20)
        assert made.ok, made.stderr
        root = made.stdout.strip()
        target = LOCAL_TARGET
    elif request.param == "ssh":
        lab: SshLab = request.getfixturevalue("ssh_lab")
        host = lab.hosts["gpu-a"]
        host.root.mkdir(parents=True, exist_ok=True)
        root = tempfile.mkdtemp(dir=host.root)
        if host.account is not None:  # a stranger's home: the directory is its own
            owner = pwd.getpwnam(host.account)
            os.chown(root, owner.pw_uid, owner.pw_gid)
        runner = SshClient(connect_timeout=5, command_timeout=20)
        target = target_for(lab, "gpu-a")
    else:
        root = tempfile.mkdtemp(prefix="gpubot-localhost-")
        runner = LocalRunner(command_timeout=20)
        target = LOCAL_TARGET
    b = Bench(kind=str(request.param), runner=runner, target=target, root=root)
    try:
        yield b
    finally:
        runner.close()
        # Both hosts are this machine: what a test started, it ends here by its id.
        for pgid in b.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
