"""The bot on the test cluster as a lab's admin would let it on (tests/slurm_cluster.py):
not root, but its own plain account (`gpubot-slurmbot`) whose sudoers lines let it run
Slurm's tools as the people; the work directory its account owns, with the people's
group; the cluster's Python made once, by that account, and kept between sessions.

Shared by the provider's tests and the Slurm bench, which drive the bot as the same
account. The bot's process is root here (it starts the daemons); every Slurm command and
every file of the work directory goes through a `LocalRunner` of the bot's account, the
same seam a login node over SSH goes through.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bot.providers
from bot.app.config import load_settings
from bot.faces.runtime import Runtime, build_runtime
from bot.providers.slurm import SlurmProvider
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.slurm import SlurmClient
from tests.slurm_cluster import (
    BOT_ACCOUNT,
    LAB_GROUP,
    ONE_NODE_PARTITIONS,
    PEOPLE,
    ROOT,
    SlurmCluster,
    make_lab_workdir,
)

if TYPE_CHECKING:
    import pytest

# The cluster's Python environment (GPUBOT_SLURM_ENV), made by the bot's account once
# (the real bootstrap, about 25 s here) and kept: its marker makes later ones a check.
SHARED_ENV = ROOT / "work" / "env"


def _owned(path: Path, mode: int) -> None:
    os.chown(path, pwd.getpwnam(BOT_ACCOUNT).pw_uid, grp.getgrnam(LAB_GROUP).gr_gid)
    path.chmod(mode)


def shared_env_dir() -> str:
    """SHARED_ENV, the bot account's, readable by every job account."""
    SHARED_ENV.parent.mkdir(parents=True, exist_ok=True)
    SHARED_ENV.parent.chmod(0o755)
    SHARED_ENV.mkdir(exist_ok=True)
    _owned(SHARED_ENV, 0o755)
    return str(SHARED_ENV)


@contextlib.contextmanager
def lab_directory() -> Iterator[Path]:
    """`make_lab_workdir` for a bench or a fixture that is not function-scoped."""
    path = make_lab_workdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def lab_env(conf: Path, workdir: Path, home: Path, **extra: str) -> dict[str, str]:
    """The bot's settings for the lab: the people mapped to their accounts, on the first
    node's partitions (the one-node cluster the tests of one node were written for; a
    test across nodes passes GPUBOT_SLURM_PARTITIONS="" for every partition)."""
    return {
        "GPUBOT_SLURM_PARTITIONS": ",".join(ONE_NODE_PARTITIONS),
        "GPUBOT_PROVIDER": "slurm",
        "GPUBOT_HOME": str(home),
        "SLURM_CONF": str(conf),
        "GPUBOT_SLURM_WORKDIR": str(workdir),
        "GPUBOT_SLURM_ENV": shared_env_dir(),
        "GPUBOT_SLURM_USERS": ",".join(f"{k}={v}" for k, v in PEOPLE.items()),
        "GPUBOT_SLURM_RATES": "A100=2.00",
        **extra,
    }


class _AsBotAccount:
    """`bot.providers.KINDS["slurm"]` whose provider runs everything as BOT_ACCOUNT."""

    def __init__(self, conf: Path) -> None:
        self.conf = conf

    def from_env(self, settings: Any, env: Mapping[str, str], runner: Any) -> SlurmProvider:
        files = LocalRunner(run_as=BOT_ACCOUNT, command_timeout=300)
        provider = SlurmProvider(settings, env, runner, files=files)
        provider.client = SlurmClient(
            conf=str(self.conf),
            login=LOCAL_TARGET,
            runner=files,
            timeout_s=30,
            normalize=provider.catalog.normalize_model,
            submit_as="sudo",
        )
        return provider


@contextlib.contextmanager
def as_bot_account(conf: Path) -> Iterator[None]:
    """The Slurm provider of runtimes built meanwhile acts as the bot's own account."""
    kinds: dict[str, Any] = bot.providers.KINDS
    before = kinds["slurm"]
    kinds["slurm"] = _AsBotAccount(conf)
    try:
        yield
    finally:
        kinds["slurm"] = before


@contextlib.contextmanager
def lab_runtime(
    cluster: SlurmCluster,
    workdir: Path,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    **extra: str,
) -> Iterator[Runtime]:
    """The whole bot as the lab runs it: its settings in the environment (`lab_env`, the
    cluster read every 0.5 s unless `extra` says otherwise), Slurm's tools as the bot's
    account, on SQLite under `home`."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with as_bot_account(cluster.conf):
        env = lab_env(cluster.conf, workdir, home, **{"GPUBOT_SLURM_CACHE_S": "0.5", **extra})
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        rt = build_runtime(load_settings())
        try:
            yield rt
        finally:
            rt.engine.dispose()
