"""Start-up shared by every entry point: engine, schema upgrade, providers, service.

The one composition root. The app upgrades its own schema on start (DESIGN: "the app
upgrades itself"), makes the providers the settings name (bot.providers: GPUBOT_PROVIDER,
or several in GPUBOT_PROVIDERS) and hands their `connect` to the service, which calls
each once as it is made: a provider lists its hosts and returns its wiring (its runs,
holder, fleet, host checks, upkeep; bot.app.places), and the service keeps those frozen.
Nothing else picks implementations; nothing else asks which provider it is.

SSH and EC2 hosts share one `SshClient`; a `Resolver` says where to dial each host
(tests pass one that maps instances to loopback sshd hosts).

Runs on this machine never run as the bot (bot.providers.local), and $GPUBOT_HOME (0700)
with the SQLite file (0600) is out of the run account's reach.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import Engine

from bot.adapters.leader import Leadership, leadership_for
from bot.app.config import ConfigError, Settings
from bot.app.fleet import Fleet
from bot.app.hosts.remote import Prepare, bootstrap_prepare
from bot.app.money.rollups import backfill_rollups
from bot.app.places import ConflictingPlaces, Wiring
from bot.app.service import GpuService
from bot.domain.clock import Clock, SystemClock
from bot.providers import Parts, Provider, configured, for_compute
from bot.providers.local import RUN_AS_MISSING
from db.migrate import upgrade
from db.session import make_engine
from provisioning.base import Compute
from provisioning.hostshell import HostShell
from provisioning.ssh import Resolver, SshClient

log = logging.getLogger(__name__)

__all__ = [
    "RUN_AS_MISSING",
    "Runtime",
    "build_runtime",
    "open_database",
    "private_database",
    "private_home",
]


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    service: GpuService
    # The configured providers, owned ones first (bot.providers).
    providers: list[Provider] = field(default_factory=list)

    @property
    def fleet(self) -> Fleet | None:
        """The cloud side (launch, reuse, reconcile, idle stop); None without a cloud."""
        fleet = self.service.fleet
        return fleet if isinstance(fleet, Fleet) else None

    @property
    def compute(self) -> Compute:
        """The first provider's hosts (a one-provider set-up's only ones)."""
        return self.providers[0].compute

    def leadership(self) -> Leadership:
        """Only the leading worker acts; the others stand by (see bot.adapters.leader)."""
        return leadership_for(self.engine, self.service.clock, self.settings.tick_seconds)


def private_home(home: Path) -> None:
    """$GPUBOT_HOME as 0700: the database, the config and staged uploads live there, and
    no other account (the run account least of all) may list or read it. A directory
    many people share (sticky and world-writable, like /tmp) is refused, not chmodded."""
    if not home.exists():
        home.mkdir(mode=0o700, parents=True)
    st = home.stat()
    if st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH:
        raise ConfigError(
            f"GPUBOT_HOME is {home}, a directory everyone shares; give the bot one of its own"
        )
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
        home.chmod(stat.S_IMODE(st.st_mode) & 0o700)
        log.info("made %s private to the bot (0700)", home)


def private_database(settings: Settings) -> None:
    """The SQLite file 0600 (its -wal and -journal files take the same mode from it)."""
    if settings.database_url:
        return
    for path in settings.home.glob("gpubot.db*"):
        if path.is_file() and path.stat().st_uid == os.geteuid():
            path.chmod(0o600)


def open_database(settings: Settings, *, upgraded: bool = True) -> Engine:
    """The one place an entry point gets its database: $GPUBOT_HOME made private, the
    schema brought to the head (and the rollups it brought filled once), the SQLite file
    0600. `upgraded=False` only connects (the doctor, which looks and changes nothing).
    Every face is handed this engine; none makes its own."""
    if not upgraded:
        return make_engine(settings.sqlalchemy_url)
    private_home(settings.home)
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    backfill_rollups(engine)  # once, after the upgrade that brought rollups in
    private_database(settings)
    return engine


def build_runtime(
    settings: Settings,
    clock: Clock | None = None,
    compute: Compute | None = None,
    *,
    resolver: Resolver | None = None,
    ssh: HostShell | None = None,
    prepare: Prepare | None = bootstrap_prepare,
    runs_as_self: bool = True,
    providers: Sequence[Provider] | None = None,
) -> Runtime:
    """`compute` replaces the configured provider's hosts (tests: its type says which
    provider it is); `resolver`, `ssh` and `prepare` replace where hosts are dialed, the
    SSH client, and how a host is made ready on first use (tests: loopback sshd hosts, no
    bootstrap). `runs_as_self=False` (`gpubot serve`): on the local provider without
    GPUBOT_RUN_AS, runs are refused rather than run as the bot's own user. `providers`:
    the places themselves, in the team's order (tests: a cluster from the environment
    and a cloud on moto); several are the owned ones first and a cloud last
    (bot.app.places), anything else is refused at start."""
    engine = open_database(settings)
    runner = ssh or SshClient()
    if providers is None:
        providers = (
            [for_compute(compute, settings)]
            if compute is not None
            else configured(settings, os.environ, runner)
        )
    parts = Parts(settings, engine, runner, resolver, prepare, runs_as_self)

    def wire(core: GpuService) -> list[Wiring]:
        return [provider.connect(core, parts) for provider in providers]

    try:
        service = GpuService(engine, settings, clock or SystemClock(), wire)
    except ConflictingPlaces as exc:
        raise ConfigError(
            f"GPUBOT_PROVIDERS={','.join(p.name for p in providers)}: {exc}"
        ) from None
    return Runtime(settings, engine, service, list(providers))
