"""Start-up shared by every entry point: engine, schema upgrade, providers, service.

The app upgrades its own schema on start (DESIGN: "the app upgrades itself"),
then makes the host rows match what the configured provider reports.

Providers (GPUBOT_PROVIDER):

- `local`: this machine, reached without SSH.
- `ssh`: the static hosts of GPUBOT_SSH_HOSTS (`[name=][user@]host[:port][/4xA100]`),
  owned (no hourly bill), reached over SSH.
- `aws`: EC2 (GPUBOT_AWS_* settings); instances are launched, started, stopped and
  terminated by the fleet (bot.fleet) from the worker. The host rows are not synced
  here but by the worker's first fleet pass (reconcile), which also waits for SSH
  before calling an instance ready: a web process never needs EC2 credentials.

SSH and EC2 hosts share one `SshClient`; a `Resolver` says where to dial each host
(tests pass one that maps instances to loopback sshd hosts).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Engine

from bot.clock import Clock, SystemClock
from bot.config import ConfigError, Settings
from bot.fleet import (
    CloudGpuService,
    CloudRunService,
    Fleet,
    Prepare,
    RemoteAccess,
    attach,
    bootstrap_prepare,
)
from bot.leader import Leadership, leadership_for
from bot.runs import LocalAccess, RunService
from bot.service import GpuService
from db.migrate import upgrade
from db.session import make_engine
from provisioning.aws import Ec2Compute
from provisioning.base import Compute
from provisioning.catalog import Catalog
from provisioning.hosts import LocalCompute, StaticHostsCompute
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from provisioning.ssh import InstanceResolver, Resolver, SshClient, SshRunner, StaticResolver


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    service: GpuService
    compute: Compute
    # The cloud side (launch, reuse, reconcile, idle stop); None for owned hosts.
    fleet: Fleet | None = None

    def leadership(self) -> Leadership:
        """Only the leading worker acts; the others stand by (see bot.leader)."""
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
    from bot.doctor import ec2_settings_from_env, static_hosts_from_env

    if settings.provider == "ssh":
        hosts = static_hosts_from_env(os.environ)
        if not hosts:
            raise ConfigError(
                "GPUBOT_PROVIDER=ssh but GPUBOT_SSH_HOSTS lists no hosts; list them as "
                "[name=][user@]host[:port][/4xA100], comma-separated."
            )
        return StaticHostsCompute(hosts, runner)
    if settings.provider == "aws":
        from bot.metrics import instrument_boto3_session
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


def _for_hosts(prepare: Prepare | None, *, cloud: bool) -> Prepare | None:
    """The production preparation told which kind of host it prepares (an EC2 instance
    gets the stopping agent, a team's own server a watching one) rather than guessing it
    from the host's name; a test's own preparation is passed through as it is."""
    if prepare is bootstrap_prepare:
        return functools.partial(bootstrap_prepare, cloud=cloud)
    return prepare


def build_runtime(
    settings: Settings,
    clock: Clock | None = None,
    compute: Compute | None = None,
    *,
    resolver: Resolver | None = None,
    ssh: SshRunner | None = None,
    prepare: Prepare | None = bootstrap_prepare,
) -> Runtime:
    """`resolver`, `ssh` and `prepare` replace where hosts are dialed, the SSH client, and
    how a host is made ready on first use (tests: loopback sshd hosts, no bootstrap)."""
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    runner = ssh or SshClient()
    compute = compute or make_compute(settings, runner)
    catalog = (
        compute.catalog
        if isinstance(compute, Ec2Compute)
        else Catalog.load(prefer=settings.prices_path)
    )
    service = (
        CloudGpuService(engine, settings, clock or SystemClock(), catalog)
        if isinstance(compute, Ec2Compute)
        else GpuService(engine, settings, clock or SystemClock())
    )
    fleet: Fleet | None = None
    if isinstance(compute, LocalCompute):
        service.sync_hosts(compute.list_instances())
        service.runs = RunService(
            service,
            LocalAccess(LocalRunner(), LOCAL_TARGET, (settings.home / "runs").resolve()),
            catalog,
        )
    elif isinstance(compute, StaticHostsCompute):
        service.sync_hosts(compute.list_instances())
        access = RemoteAccess(
            engine,
            runner,
            resolver or StaticResolver(compute.targets()),
            prepare=_for_hosts(prepare, cloud=False),
        )
        service.runs = RunService(service, access, catalog)
    elif isinstance(compute, Ec2Compute):
        access = RemoteAccess(
            engine,
            runner,
            resolver or InstanceResolver(user=compute.settings.ssh_user, key_path=_ssh_key()),
            prepare=_for_hosts(prepare, cloud=True),
        )
        service.runs = CloudRunService(service, access, catalog)
        fleet = Fleet(service, compute, access, catalog=catalog)
        attach(service, fleet)
    else:
        service.sync_hosts(compute.list_instances())
    return Runtime(settings=settings, engine=engine, service=service, compute=compute, fleet=fleet)
