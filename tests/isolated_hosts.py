"""Fixtures for hosts that are not the bot's machine: real sshd, each its own unix account.

`stranger_lab` is the SSH layer's: two accounts per xdist worker, never bootstrapped.

`isolated_lab` starts them once per session with empty homes; `bootstrapped` runs the
real bootstrap from nothing on lab-a once per session (a venv from the system python3,
the `train` extra from the shared wheel cache, the training package, the marker), so
every test that needs a prepared stranger shares the one slow step, and a test that
bootstraps again measures the no-op.
"""

from __future__ import annotations

import contextlib
import pwd
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from provisioning.bootstrap import BootstrapReport, bootstrap
from provisioning.ssh import SshClient, SshTarget
from tests.ssh_hosts import (
    SshdUnavailable,
    SshLab,
    end_account_processes,
    pip_env,
    start_isolated_lab,
    wipe_home,
    worker_accounts,
)


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


@pytest.fixture(scope="session")
def stranger_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    """gpu-a (127.0.0.6) and gpu-b (127.0.0.7) for the SSH layer's own tests: each its own
    account, this xdist worker's (`worker_accounts`), never bootstrapped. Running a
    command, moving files, timeouts, drops and the doctor's login need nothing of the
    bot's on the host, so they meet what a team's server offers and no more; with an
    account pair per worker they run beside the bootstrapped hosts' tests."""
    try:
        lab = start_isolated_lab(
            tmp_path_factory.mktemp("stranger-sshd"),
            {"gpu-a": "127.0.0.6", "gpu-b": "127.0.0.7"},
            accounts=worker_accounts(),
            wheels=False,
        )
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


@contextlib.contextmanager
def emptied(lab: SshLab, name: str) -> Iterator[SshTarget]:
    """Host `name` as a new machine: nothing of its account runs and its home is empty.

    For a test that bootstraps from nothing itself, whatever ran on that account before
    it in the session (a clone, a bootstrap without torch, an agent). Emptied again
    afterwards, so the tests after it find the host as `isolated_lab` left it."""
    account = lab.hosts[name].account
    if account is None:
        raise ValueError(f"{name} is not an isolated host")
    end_account_processes(account)
    wipe_home(account)
    try:
        yield isolated_target(lab, name)
    finally:
        end_account_processes(account)
        wipe_home(account)


def clone_prepared(lab: SshLab, source: str, dest: str, root: str = ".gpubot") -> Path:
    """`dest` gets `source`'s bootstrapped root (venv, code, marker); returns its path.

    A second instance of one type, made from the same image as the first: what a run
    across hosts meets. It stands in for a second bootstrap from nothing, which costs the
    suite over a minute and proves nothing the `bootstrapped` fixture does not; a
    bootstrap on `dest` afterwards must find it current (a no-op). The files are hard
    links (a copy of the 1 GB venv takes ~16 s on a busy 2-core machine): they keep
    `source`'s owner and their mode 0644, so `dest`'s account reads them and cannot change
    them; every directory is `dest`'s own, so what it writes there (bytecode, runs) is its.
    Remove it with `remove_clone`.
    """
    src = lab.hosts[source].root / root
    dst = lab.hosts[dest].root / root
    account = lab.hosts[dest].account
    if account is None:
        raise ValueError(f"{dest} is not an isolated host")
    remove_clone(dst)
    subprocess.run(["cp", "-al", "--", str(src), str(dst)], check=True, timeout=300)
    owner = f"{account}:{pwd.getpwnam(account).pw_gid}"
    subprocess.run(
        ["find", str(dst), "-type", "d", "-exec", "chown", owner, "{}", "+"],
        check=True,
        timeout=300,
    )
    return dst


def remove_clone(path: Path) -> None:
    """rm(1): ~24k entries, twice as fast as shutil.rmtree."""
    subprocess.run(["rm", "-rf", "--", str(path)], check=True, timeout=300)
