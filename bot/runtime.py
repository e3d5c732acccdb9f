"""Start-up shared by every entry point: engine, schema upgrade, providers, service.

The app upgrades its own schema on start (DESIGN: "the app upgrades itself"),
then makes the host rows match what the configured provider reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine

from bot.clock import Clock, SystemClock
from bot.config import ConfigError, Settings
from bot.leader import Leadership, leadership_for
from bot.runs import LocalAccess, RunService
from bot.service import GpuService
from db.migrate import upgrade
from db.session import make_engine
from provisioning.base import Compute
from provisioning.catalog import Catalog
from provisioning.hosts import LocalCompute
from provisioning.local_runner import LOCAL_TARGET, LocalRunner


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    service: GpuService
    compute: Compute

    def leadership(self) -> Leadership:
        """Only the leading worker acts; the others stand by (see bot.leader)."""
        return leadership_for(self.engine, self.service.clock, self.settings.tick_seconds)


def make_compute(settings: Settings) -> Compute:
    if settings.provider == "local":
        if settings.local_gpus == "none":
            return LocalCompute(slots=settings.local_slots, probe=list)
        return LocalCompute(slots=settings.local_slots)
    raise ConfigError(
        f"GPUBOT_PROVIDER={settings.provider} is not supported by this build yet; "
        "use GPUBOT_PROVIDER=local (this machine)."
    )


def build_runtime(
    settings: Settings, clock: Clock | None = None, compute: Compute | None = None
) -> Runtime:
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    service = GpuService(engine, settings, clock or SystemClock())
    compute = compute or make_compute(settings)
    service.sync_hosts(compute.list_instances())
    if isinstance(compute, LocalCompute):
        service.runs = RunService(
            service,
            LocalAccess(LocalRunner(), LOCAL_TARGET, (settings.home / "runs").resolve()),
            Catalog.load(),
        )
    return Runtime(settings=settings, engine=engine, service=service, compute=compute)
