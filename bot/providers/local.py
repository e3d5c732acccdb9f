"""This machine as the one host (`GPUBOT_PROVIDER=local`, the default; `gpubot shell`).

Its GPUs are read by `training.inventory` in a child process (CPU slots where it has
none); it is owned, so nothing is billed. Runs never run as the bot (it holds the Slack
token, the signing secret, AWS keys and the database password): with GPUBOT_RUN_AS they
run as that unprivileged account, in its home as on a remote host; without it `gpubot
serve` refuses runs and only `gpubot shell`, one trusted person at their own terminal,
runs them as itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bot.app.config import ConfigError, Settings
from bot.app.hosts.runaccount import RunAccount, bot_pip_env, run_account_fix
from bot.app.money.prices import priced_catalog
from bot.app.places import RunParts, Wiring
from bot.app.ports import FIXED_POOL, PlainDisplay, Supply
from bot.app.runs import LocalAccess
from bot.providers.base import Note, NvmlProbe, Parts, Probes, guarded
from provisioning import shell
from provisioning.catalog import Catalog
from provisioning.checks import Check
from provisioning.hosts import LocalCompute
from provisioning.hostshell import HostShell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import SshError
from training.telemetry import NO_DRIVER, parse_snapshot

if TYPE_CHECKING:
    from bot.app.service import GpuService

log = logging.getLogger(__name__)

RUN_AS_MISSING = (
    "Runs are off on this bot: it would run them as its own user, next to its Slack and "
    "database secrets. An admin turns them on by setting GPUBOT_RUN_AS to an unprivileged "
    "unix account (e.g. gpubot-run) and restarting. Reservations work as usual."
)
TELEMETRY_TIMEOUT_S = 60.0
_RUN_AS_FIX = (
    "Create an unprivileged account (`sudo useradd --create-home --shell /bin/sh gpubot-run`) "
    "and set GPUBOT_RUN_AS=gpubot-run; a bot that is not root also needs the sudoers line "
    "`BOTUSER ALL=(gpubot-run) NOPASSWD: /usr/bin/env` (README, Configuration)."
)


class LocalProvider(PlainDisplay):
    name: ClassVar[str] = "local"
    label: ClassVar[str] = "This machine"
    owns_hosts: ClassVar[bool] = False

    def __init__(self, settings: Settings, compute: LocalCompute | None = None) -> None:
        self.settings = settings
        if compute is None:
            probe = list if settings.local_gpus == "none" else None
            compute = (
                LocalCompute(slots=settings.local_slots, probe=probe)
                if probe is not None
                else LocalCompute(slots=settings.local_slots)
            )
        self._compute = compute
        self._catalog = priced_catalog(settings)

    @classmethod
    def from_env(
        cls, settings: Settings, env: Mapping[str, str], runner: HostShell
    ) -> LocalProvider:
        return cls(settings)

    @property
    def compute(self) -> LocalCompute:
        return self._compute

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def supply(self) -> Supply:
        return FIXED_POOL

    def connect(self, service: GpuService, parts: Parts) -> Wiring:
        service.sync_hosts(self._compute.list_instances())
        refused = not parts.settings.run_as and not parts.runs_as_self
        runs = RunParts(
            local_access(parts.settings),
            self._catalog,
            refusal=RUN_AS_MISSING if refused else None,
        )
        return Wiring(self.name, label="this machine", display=self, runs=runs)

    def called(self, host_name: str, provider: str) -> str:
        return "this machine"

    # --- gpubot doctor ------------------------------------------------------------------

    @classmethod
    def checks(cls, settings: Settings, env: Mapping[str, str], probes: Probes) -> list[Check]:
        return [
            *guarded("This machine's GPUs", lambda: check_gpus(settings, probes.nvml)),
            *guarded("Run account", lambda: check_run_account(settings)),
        ]

    @classmethod
    def wanted(cls, env: Mapping[str, str]) -> bool:
        return False


def local_access(settings: Settings) -> LocalAccess:
    """This machine's runs: as the run account in its home, or (no GPUBOT_RUN_AS) as
    the bot under $GPUBOT_HOME/runs."""
    if settings.run_as:
        try:
            runner = LocalRunner(run_as=settings.run_as)
        except SshError as exc:
            raise ConfigError(str(exc)) from None
        runs_dir = Path(runner.account.home) / ".gpubot" / "runs"
        return LocalAccess(runner, LOCAL_TARGET, runs_dir, RunAccount(runner).interpreter)
    log.warning(
        "GPUBOT_RUN_AS is not set: runs on this machine run as the bot's own user (fine "
        "for gpubot shell; set it wherever a worker starts runs that Slack users submit)"
    )
    return LocalAccess(LocalRunner(), LOCAL_TARGET, (settings.home / "runs").resolve())


# --- this machine's GPUs ---------------------------------------------------------------


def _telemetry_json() -> str:
    """A child process, as on a remote host, so the bot's process never loads NVML."""
    proc = subprocess.run(
        [sys.executable, "-m", "training.telemetry", "--json"],
        capture_output=True,
        text=True,
        timeout=TELEMETRY_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(tail)
    return proc.stdout


def check_gpus(settings: Settings, probe: NvmlProbe | None = None) -> list[Check]:
    """`probe`: this machine's telemetry document as text (tests); None runs the probe."""
    name = "This machine's GPUs"
    fix = "Run `python -m training.telemetry` to see what the probe says."
    try:
        text = (probe or _telemetry_json)()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return [Check(name, False, f"the GPU probe failed: {exc}", fix)]
    snap = parse_snapshot(text)
    if snap is None:
        return [Check(name, False, "the GPU probe's answer could not be read", fix)]
    if snap.source == "none" or not snap.gpus:
        why = snap.error or NO_DRIVER
        return [
            Note(
                name,
                True,
                f"{why}: this machine will offer CPU slots",
                "If it has an NVIDIA GPU, install the driver (nvidia-smi should list it); otherwise nothing to do.",
            )
        ]
    counts = Counter(g.name for g in snap.gpus)
    summary = ", ".join(f"{n} × {model}" for model, n in counts.items()) + f" (via {snap.source})"
    if settings.local_gpus == "none":
        summary += "; GPUBOT_LOCAL_GPUS=none, so the bot offers CPU slots instead"
    if snap.error:
        return [
            Note(
                name,
                True,
                f"{summary}; but {snap.error}",
                "Some metrics are missing; the GPUs are still usable.",
            )
        ]
    return [Check(name, True, summary)]


# --- the run account --------------------------------------------------------------------


def check_run_account(settings: Settings) -> list[Check]:
    """Runs on this machine must not run as the bot, next to its secrets."""
    name = "Run account"
    if not settings.run_as:
        return [
            Note(
                name,
                True,
                "GPUBOT_RUN_AS is not set: `gpubot serve` refuses runs (they would run as the "
                "bot's own user, able to read its tokens and database); `gpubot shell` runs "
                "them as you. Reservations work either way",
                _RUN_AS_FIX,
            )
        ]
    import pwd

    try:
        account = pwd.getpwnam(settings.run_as)
    except KeyError:
        return [
            Check(name, False, f"GPUBOT_RUN_AS={settings.run_as}: no such account", _RUN_AS_FIX)
        ]
    if account.pw_uid == os.geteuid():
        return [
            Check(
                name,
                False,
                f"GPUBOT_RUN_AS={settings.run_as} is the bot's own account: runs could read its secrets",
                _RUN_AS_FIX,
            )
        ]
    home = settings.home
    if home.exists() and home.stat().st_mode & 0o077:
        return [
            Check(
                name,
                False,
                f"{home} (GPUBOT_HOME) is open to other accounts, the run account among them",
                f"chmod 700 {home} (every gpubot command also does this on start)",
            )
        ]
    checks: list[Check] = [
        Check(
            name,
            True,
            f"runs run as {settings.run_as} (uid {account.pw_uid}), in {account.pw_dir}/.gpubot/runs",
        )
    ]
    own = run_account_interpreter(settings.run_as)
    if own is not None:
        checks.append(own)
    return checks


def run_account_interpreter(account: str) -> Check | None:
    """Whether the run account can run `training` and torch with the bot's interpreter;
    where it cannot (a checkout in a private home), what its first run will do instead
    and the exact fix, so nobody learns it from a run that waits minutes for an install."""
    try:
        runner = LocalRunner(run_as=account)
        probe = runner.run(
            LOCAL_TARGET,
            shell.join([sys.executable, "-c", "import training.runner, torch"]),
            timeout=180,
            cwd=runner.account.home,
        )
    except SshError as exc:
        return Check("Run environment", False, f"cannot run a command as {account}: {exc}")
    if probe.ok:
        return None
    why = (probe.stderr.strip().splitlines() or [f"exit {probe.exit_code}"])[-1][:200]
    source = ", ".join(sorted(bot_pip_env())) or "pip's defaults (PyPI)"
    return Note(
        "Run environment",
        True,
        f"{account} cannot use the bot's interpreter {sys.executable} ({why}): its first run "
        f"installs an environment of its own under {runner.account.home}/.gpubot (the train "
        f"extra, torch included, from {source}), which takes minutes once",
        run_account_fix(account),
    )
