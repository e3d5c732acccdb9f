"""The fleet: the bot's side of provisioning — reuse before launch, reconcile, idle stop.

Its steps, one module each over one FleetContext: `reconcile` (Reconciler), `provision`
(Buyer), `idlestop` (IdleStopper), `pool` (/gpu pool, CatalogSupply); `common` holds what
they share. Fleet composes them and is the `Provisioner` the worker's job drives.

Money is spent here, so the order of every step is chosen for what survives a crash:

- A launch is written down (`LaunchRequest`, pending) and committed *before* the cloud
  is called, with a request key made from the reservation; the provider passes the same
  key to EC2 (tag and ClientToken). A worker killed between the cloud's answer and its
  own commit leaves a pending request, which reconcile resolves by looking the key up:
  the instance is adopted, never launched a second time.
- Reconcile compares the cloud's tagged instances with the host rows: an unknown tagged
  one is adopted, a host whose instance the cloud no longer lists is marked terminated,
  and what it held (reservations, runs) is ended or requeued with a DM. The provider only
  ever lists instances carrying `gpubot:managed`, so a foreign machine is never touched.
- Reuse comes first: free GPUs on a ready host are the grant pass's business; a host that
  is already booting counts as supply on the way; a stopped instance is started (its disk
  keeps the bootstrap, so it is faster and cheaper than a new one); only then a launch,
  within the pool limits (per instance type: instances running or booting, and spend per
  hour; `PoolLimit` rows over the settings).
- An instance is granted on only once SSH answers and it is bootstrapped: the cloud's
  "running" is not a usable host. Idle time is read from the bill (the host's open `HostPeriod`) and the usage
  intervals, so "idle since" is a time, not a counter that a restart would reset.

The work runs in the worker (`fleet_job`, a periodic job), never in a slash command:
provisioning takes minutes. One lock per fleet keeps its steps from overlapping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from bot.app.fleet.common import (
    REQ_FAILED,
    REQ_LAUNCHED,
    REQ_PENDING,
    FleetContext,
    Limits,
    ReconcileReport,
)
from bot.app.fleet.idlestop import IdleStopper
from bot.app.fleet.pool import POOL_USAGE, CatalogSupply, launchable, pool, pool_view
from bot.app.fleet.provision import Buyer
from bot.app.fleet.reconcile import Reconciler
from bot.app.hosts.remote import RemoteAccess
from bot.app.money.prices import priced_catalog
from bot.app.service import GpuService
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.compute import RentingCompute

__all__ = [
    "POOL_USAGE",
    "REQ_FAILED",
    "REQ_LAUNCHED",
    "REQ_PENDING",
    "CatalogSupply",
    "Fleet",
    "Limits",
    "ReconcileReport",
    "fleet_job",
    "fleet_trigger",
    "launchable",
    "pool",
    "pool_view",
]


class Fleet:
    """The steps composed, with one lock so that a cycle and a run's launch never overlap.
    A facade, not a base class: the steps share state only through `ctx`."""

    def __init__(
        self,
        service: GpuService,
        compute: RentingCompute,
        access: RemoteAccess,
        catalog: Catalog | None = None,
        *,
        reconcile_every_s: float = 180.0,
        after_launch: Callable[[Instance], None] | None = None,
    ) -> None:
        self.ctx = FleetContext(
            service,
            compute,
            access,
            catalog or priced_catalog(service.settings),
            after_launch=after_launch,
        )
        # How often a cycle also reconciles (the first cycle always does).
        self.reconcile_every_s = reconcile_every_s
        self.reconciler = Reconciler(self.ctx)
        self.buyer = Buyer(self.ctx)
        self.idle_stopper = IdleStopper(self.ctx)
        self._lock = threading.Lock()
        self._last_reconcile: float | None = None

    @property
    def service(self) -> GpuService:
        return self.ctx.service

    @property
    def compute(self) -> RentingCompute:
        return self.ctx.compute

    @property
    def access(self) -> RemoteAccess:
        return self.ctx.access

    @property
    def catalog(self) -> Catalog:
        return self.ctx.catalog

    @property
    def engine(self) -> Any:
        return self.ctx.engine

    @property
    def settings(self) -> Any:
        return self.ctx.settings

    @property
    def after_launch(self) -> Callable[[Instance], None] | None:
        return self.ctx.after_launch

    @after_launch.setter
    def after_launch(self, hook: Callable[[Instance], None] | None) -> None:
        self.ctx.after_launch = hook

    def set_up_off_tick(self, nudge: Callable[[], object]) -> None:
        """Hands instances' bootstraps to an off-tick pool (bot.app.hosts.hostcheck): the cycle
        only launches and reconciles; `nudge` hands out the setups due and returns at
        once. Until this is called, refresh prepares instances inline."""
        self.ctx.setup = nudge

    def cycle(self) -> None:
        """One periodic pass: reconcile (at start and every few minutes) or refresh,
        then provision for the waiting line, then stop or end what sits idle."""
        with self._lock:
            due = (
                self._last_reconcile is None
                or time.monotonic() - self._last_reconcile >= self.reconcile_every_s
            )
            if due:
                self.reconcile()
                self._last_reconcile = time.monotonic()
            else:
                self.refresh()
            self.provision()
            self.idle()

    def refresh(self) -> list[Instance]:
        return self.reconciler.refresh()

    def reconcile(self) -> ReconcileReport:
        return self.reconciler.reconcile()

    def provision(self) -> list[str]:
        return self.buyer.provision()

    def provision_run(self, run_id: int, instance_type: str | None = None) -> str | None:
        """The scheduler's Launch/Start for a queued run, under the fleet's lock."""
        with self._lock:
            return self.buyer.provision_run(run_id, instance_type)

    def provision_for(
        self, run_id: int, instance_type: str, price_cap: float, *, in_cluster: bool
    ) -> str | None:
        """A launch for a run whose owner took the cloud's offer (bot.app.burst): the type
        offered first, none dearer a GPU-hour than the price shown. `in_cluster`: it still
        waits in a cluster's queue; the first place to start it wins."""
        with self._lock:
            return self.buyer.provision_run(
                run_id, instance_type, in_cluster=in_cluster, price_cap=price_cap
            )

    def give_back(self, kind: str, ref: int) -> bool:
        """Ends what was bought for a run or reservation the owned GPUs started first;
        True when done."""
        with self._lock:
            return self.buyer.give_back(kind, ref)

    def pool_refusal(self, instance_type: str) -> str | None:
        return self.buyer.pool_refusal(instance_type)

    def idle(self) -> list[str]:
        return self.idle_stopper.idle()

    def limits(self, s: Session, instance_type: str) -> Limits:
        return self.buyer.limits(s, instance_type)


def fleet_trigger(settings: Any) -> dict[str, Any]:
    """Every tick, and once right away: reconcile runs at worker start (a crash between a
    launch and its commit is settled before anything else is launched)."""
    return {"seconds": max(5.0, float(settings.tick_seconds)), "next_run_time": datetime.now(UTC)}


def fleet_job(service: GpuService) -> None:
    """The worker's periodic fleet pass; nothing to do where no cloud provider is set."""
    if service.fleet is not None:
        service.fleet.cycle()
