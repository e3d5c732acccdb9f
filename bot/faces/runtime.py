"""Start-up shared by every entry point: engine, schema upgrade, providers, service.

The app upgrades its own schema on start (DESIGN: "the app upgrades itself"),
then makes the host rows match what the configured provider reports.

Providers (GPUBOT_PROVIDER):

- `local`: this machine, reached without SSH.
- `ssh`: the static hosts of GPUBOT_SSH_HOSTS (`[name=][user@]host[:port][/4xA100]`),
  owned (no hourly bill), reached over SSH.
- `aws`: EC2 (GPUBOT_AWS_* settings); instances are launched, started, stopped and
  terminated by the fleet (bot.app.fleet) from the worker. The host rows are not synced
  here but by the worker's first fleet pass (reconcile), which also waits for SSH
  before calling an instance ready: a web process never needs EC2 credentials.

SSH and EC2 hosts share one `SshClient`; a `Resolver` says where to dial each host
(tests pass one that maps instances to loopback sshd hosts).

Runs on this machine never run as the bot (it holds the Slack token, the signing secret,
AWS keys and the database password): with GPUBOT_RUN_AS they run as that unprivileged
account, their directories in its home as on a remote host, and $GPUBOT_HOME (0700) with
the SQLite file (0600) out of its reach. Without it, `gpubot serve` refuses runs and only
`gpubot shell`, one trusted person at their own terminal, runs them as itself.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import select

from bot.adapters.leader import Leadership, leadership_for
from bot.app import hostcheck
from bot.app.config import ConfigError, Settings
from bot.app.fleet import CatalogSupply, Fleet, attach
from bot.app.hostcheck import HostChecker
from bot.app.ports import FIXED_POOL, Supply
from bot.app.remote import Prepare, RemoteAccess, bootstrap_prepare
from bot.app.rollups import backfill_rollups
from bot.app.runaccount import RunAccount
from bot.app.runs import LocalAccess, RunService
from bot.app.service import GpuService
from bot.domain.clock import Clock, SystemClock
from db.migrate import upgrade
from db.models import HOST_CHECKING, HOST_UNREACHABLE, Host
from db.session import make_engine, transaction
from provisioning.aws import Ec2Compute
from provisioning.base import Compute, Instance
from provisioning.catalog import Catalog
from provisioning.hosts import LocalCompute, StaticHostsCompute
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import (
    InstanceResolver,
    Resolver,
    SshClient,
    SshError,
    SshRunner,
    StaticResolver,
)

log = logging.getLogger(__name__)

RUN_AS_MISSING = (
    "Runs are off on this bot: it would run them as its own user, next to its Slack and "
    "database secrets. An admin turns them on by setting GPUBOT_RUN_AS to an unprivileged "
    "unix account (e.g. gpubot-run) and restarting. Reservations work as usual."
)


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    service: GpuService
    compute: Compute
    # The cloud side (launch, reuse, reconcile, idle stop); None for owned hosts.
    fleet: Fleet | None = None

    def leadership(self) -> Leadership:
        """Only the leading worker acts; the others stand by (see bot.adapters.leader)."""
        return leadership_for(self.engine, self.service.clock, self.settings.tick_seconds)


def _ssh_key() -> str | None:
    key = os.environ.get("GPUBOT_SSH_KEY", "").strip()
    return str(Path(key).expanduser()) if key else None


def make_compute(settings: Settings, runner: SshRunner | None = None) -> Compute:
    """The configured provider; `runner` lets static hosts without declared GPUs be probed."""
    if settings.provider == "local":
        if settings.local_gpus == "none":
            return LocalCompute(slots=settings.local_slots, probe=list)
        return LocalCompute(slots=settings.local_slots)
    # Imported here: the doctor pulls in Slack's client, which the local build never needs.
    from bot.faces.doctor import ec2_settings_from_env, static_hosts_from_env

    if settings.provider == "ssh":
        hosts = static_hosts_from_env(os.environ)
        if not hosts:
            raise ConfigError(
                "GPUBOT_PROVIDER=ssh but GPUBOT_SSH_HOSTS lists no hosts; list them as "
                "[name=][user@]host[:port][/4xA100], comma-separated."
            )
        return StaticHostsCompute(hosts, runner)
    if settings.provider == "aws":
        from bot.adapters.metrics import instrument_boto3_session
        from provisioning.aws import make_session
        from provisioning.base import ProvisioningError

        try:
            aws = ec2_settings_from_env(os.environ)
            # Timed from the bot's side (AWS latency and errors on /metrics); prices
            # from `gpubot prices refresh` when it has run.
            return Ec2Compute(
                aws,
                Catalog.load(prefer=settings.prices_path),
                session=instrument_boto3_session(make_session(aws.region)),
            )
        except ProvisioningError as exc:
            raise ConfigError(str(exc)) from None
    raise ConfigError(
        f"GPUBOT_PROVIDER={settings.provider} is not supported; use local, ssh or aws."
    )


def _static_listing(engine: Engine, compute: StaticHostsCompute) -> list[Instance]:
    """The static hosts as configured, without dialling any. A host that has never
    answered a check (new, or only ever down) is `checking` until bot.app.hostcheck's
    first check answers: declaring its GPUs does not make it reachable, and nothing is
    granted on it meanwhile. A host given without a GPU list gets them from that check
    (its bootstrap, then its inventory: a bare `python3` there cannot import
    `training`). One marked down stays down until a check sees it answer, across
    restarts; one that answered before keeps its state."""
    with transaction(engine, write=False) as s:
        rows = {h.name: h for h in s.exec(select(Host).where(Host.provider == "ssh"))}
    out = []
    for inst in StaticHostsCompute(compute.hosts).list_instances():
        row = rows.get(inst.name)
        if row is not None and row.state == HOST_UNREACHABLE and row.down_reason:
            inst = replace(inst, state=HOST_UNREACHABLE)
        elif row is None or row.ready_at is None or not inst.gpus:
            inst = replace(inst, state=HOST_CHECKING)
        out.append(inst)
    return out


def _for_hosts(
    prepare: Prepare | None, *, cloud: bool, metadata_url: str | None = None
) -> Prepare | None:
    """The production preparation told which kind of host it prepares (an EC2 instance
    gets the stopping agent, a team's own server a watching one) rather than guessing it
    from the host's name, and on EC2 where the agent asks for spot notices; a test's own
    preparation is passed through as it is."""
    if prepare is bootstrap_prepare:
        if metadata_url is not None:
            return functools.partial(bootstrap_prepare, cloud=cloud, metadata_url=metadata_url)
        return functools.partial(bootstrap_prepare, cloud=cloud)
    return prepare


# --- runs on this machine, as the run account -------------------------------------------


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


@dataclass(frozen=True)
class _Parts:
    """What every provider's wiring is built from."""

    settings: Settings
    engine: Engine
    runner: SshRunner
    resolver: Resolver | None
    prepare: Prepare | None
    runs_as_self: bool


@dataclass(frozen=True)
class _Wiring:
    """One provider's ports: its price list, the supply its pool can grow into, and
    `connect`, which puts the runs (and, for a cloud, the fleet) on the service once it
    exists and returns the fleet or None."""

    catalog: Catalog
    supply: Supply
    connect: Callable[[GpuService], Fleet | None]


@functools.singledispatch
def _wiring(compute: Compute, parts: _Parts) -> _Wiring:
    """A provider with no way to run anything (a test's double): its hosts, reservations
    only. Each real provider registers its own wiring below, by the type of its compute;
    this is the one place that knows which ports each provider gets."""

    def connect(service: GpuService) -> None:
        service.sync_hosts(compute.list_instances())

    return _Wiring(Catalog.load(prefer=parts.settings.prices_path), FIXED_POOL, connect)


@_wiring.register
def _local_wiring(compute: LocalCompute, parts: _Parts) -> _Wiring:
    """This machine: runs as the run account (or, in `gpubot shell`, as the bot)."""
    catalog = Catalog.load(prefer=parts.settings.prices_path)

    def connect(service: GpuService) -> None:
        service.sync_hosts(compute.list_instances())
        refused = not parts.settings.run_as and not parts.runs_as_self
        service.runs = RunService(
            service,
            local_access(parts.settings),
            catalog,
            refusal=RUN_AS_MISSING if refused else None,
        )

    return _Wiring(catalog, FIXED_POOL, connect)


@_wiring.register
def _static_wiring(compute: StaticHostsCompute, parts: _Parts) -> _Wiring:
    """Owned hosts over SSH: bootstrap, inventory and health run on the checker's threads,
    never in the tick."""
    catalog = Catalog.load(prefer=parts.settings.prices_path)

    def connect(service: GpuService) -> None:
        service.sync_hosts(_static_listing(parts.engine, compute))
        access = RemoteAccess(
            parts.engine,
            parts.runner,
            parts.resolver or StaticResolver(compute.targets()),
            prepare=_for_hosts(parts.prepare, cloud=False),
            # The checker bootstraps; the tick (dispatch, sampling) never waits on one.
            wait_for_prepare=False,
            clock=service.clock,
        )
        service.runs = RunService(service, access, catalog)
        hostcheck.attach(service, HostChecker(service, access, compute.hosts))

    return _Wiring(catalog, FIXED_POOL, connect)


@_wiring.register
def _cloud_wiring(compute: Ec2Compute, parts: _Parts) -> _Wiring:
    """EC2: the pool grows to what the catalog can launch; the fleet buys and stops. An
    instance's bootstrap runs on the host checker's threads, never in the fleet's job."""

    def connect(service: GpuService) -> Fleet:
        access = RemoteAccess(
            parts.engine,
            parts.runner,
            parts.resolver or InstanceResolver(user=compute.settings.ssh_user, key_path=_ssh_key()),
            prepare=_for_hosts(
                parts.prepare, cloud=True, metadata_url=compute.settings.metadata_url
            ),
            # The checker bootstraps; the tick (dispatch, sampling) never waits on one.
            wait_for_prepare=False,
            clock=service.clock,
        )
        service.runs = RunService(service, access, compute.catalog)
        fleet = Fleet(service, compute, access, catalog=compute.catalog)
        checker = HostChecker(service, access, (), cloud=compute.name)
        hostcheck.attach(service, checker)
        fleet.set_up_off_tick(checker.tick)
        attach(service, fleet)
        return fleet

    return _Wiring(compute.catalog, CatalogSupply(compute.catalog), connect)


def build_runtime(
    settings: Settings,
    clock: Clock | None = None,
    compute: Compute | None = None,
    *,
    resolver: Resolver | None = None,
    ssh: SshRunner | None = None,
    prepare: Prepare | None = bootstrap_prepare,
    runs_as_self: bool = True,
) -> Runtime:
    """`resolver`, `ssh` and `prepare` replace where hosts are dialed, the SSH client, and
    how a host is made ready on first use (tests: loopback sshd hosts, no bootstrap).
    `runs_as_self=False` (`gpubot serve`): on the local provider without GPUBOT_RUN_AS,
    runs are refused rather than run as the bot's own user."""
    private_home(settings.home)
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    backfill_rollups(engine)  # once, after the upgrade that brought rollups in
    private_database(settings)
    runner = ssh or SshClient()
    compute = compute or make_compute(settings, runner)
    parts = _Parts(settings, engine, runner, resolver, prepare, runs_as_self)
    wiring = _wiring(compute, parts)
    service = GpuService(engine, settings, clock or SystemClock(), wiring.supply)
    fleet = wiring.connect(service)
    return Runtime(settings=settings, engine=engine, service=service, compute=compute, fleet=fleet)
