"""Fixtures for hosts that are not the bot's machine: real sshd, each its own unix account.

`isolated_lab` starts them once per session with empty homes; `bootstrapped` runs the
real bootstrap from nothing on lab-a once per session (a venv from the system python3,
the `train` extra from the shared wheel cache, the training package, the marker), so
every test that needs a prepared stranger shares the one slow step, and a test that
bootstraps again measures the no-op.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from provisioning.bootstrap import BootstrapReport, bootstrap
from provisioning.ssh import SshClient, SshTarget
from tests.ssh_hosts import SshdUnavailable, SshLab, pip_env, start_isolated_lab


def isolated_target(lab: SshLab, name: str) -> SshTarget:
    host = lab.hosts[name]
    return SshTarget(
        host=host.address,
        port=host.port,
        user=lab.user_of(name),
        key_path=str(lab.client_key),
        name=name,
    )


@pytest.fixture(scope="session")
def isolated_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    """lab-a (127.0.0.4) and lab-b (127.0.0.5), each logging in as its own account."""
    try:
        lab = start_isolated_lab(tmp_path_factory.mktemp("isolated-sshd"))
    except SshdUnavailable as exc:
        pytest.skip(f"no isolated SSH hosts: {exc}")
    try:
        yield lab
    finally:
        lab.stop()


@dataclass(frozen=True)
class Bootstrapped:
    """lab-a after one real bootstrap from nothing, and how long that took (for bench)."""

    lab: SshLab
    target: SshTarget
    report: BootstrapReport
    seconds: float
    # The same bootstrap once more, right after: what every later preparation costs.
    again: BootstrapReport
    again_seconds: float


@pytest.fixture(scope="session")
def bootstrapped(isolated_lab: SshLab) -> Iterator[Bootstrapped]:
    target = isolated_target(isolated_lab, "lab-a")
    client = SshClient(connect_timeout=5, command_timeout=60)
    try:
        started = time.monotonic()
        report = bootstrap(client, target, remote_root="~/.gpubot", env=pip_env())
        seconds = time.monotonic() - started
        started = time.monotonic()
        again = bootstrap(client, target, remote_root="~/.gpubot", env=pip_env())
        again_seconds = time.monotonic() - started
    finally:
        client.close()
    yield Bootstrapped(
        lab=isolated_lab,
        target=target,
        report=report,
        seconds=seconds,
        again=again,
        again_seconds=again_seconds,
    )
