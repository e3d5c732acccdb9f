"""What the fleet's steps share: its ports (FleetContext), the launch requests' states,
the timings people are told, what one waiting reservation or run needs bought (Want),
and the launch request's two endings, which both reconcile and provision write."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlmodel import select

from bot.app.hosts.remote import RemoteAccess
from bot.app.service import GpuService
from bot.domain import views
from db.models import (
    HOST_BILLED_RUNNING,
    HOST_TERMINATED,
    LaunchRequest,
)
from db.session import transaction
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.compute import RentingCompute

log = logging.getLogger(__name__)

REQ_PENDING = "pending"
REQ_LAUNCHED = "launched"
REQ_FAILED = "failed"

# States in which an instance is billed as running and counts against the pool.
RUNNING_STATES = HOST_BILLED_RUNNING
# After a failed launch (no capacity, a quota), the next try for that reservation waits
# this long: EC2 capacity comes back in minutes, and each try costs API calls and a DM.
LAUNCH_RETRY_AFTER = timedelta(minutes=10)
# A launched or started instance that is still not SSH-ready after this long is stopped
# like an idle one (with a note saying so), rather than billed while it can serve nobody.
BOOT_TIMEOUT = timedelta(minutes=30)
# A pending request the cloud has no instance for, older than this, launched nothing.
PENDING_GRACE = timedelta(minutes=5)
# What a person is told to expect: boot to SSH, and the first bootstrap.
LAUNCH_READY_MIN = 7
START_READY_MIN = 2


@dataclass
class FleetContext:
    """The ports the fleet's steps share. `after_launch` is called right after the cloud
    answered a launch, before anything is committed: the seam the crash test uses to die
    exactly there (set after construction, so the steps read it here). `setup` likewise:
    the runtime sets it once the host checker exists."""

    service: GpuService
    compute: RentingCompute
    access: RemoteAccess
    catalog: Catalog
    after_launch: Callable[[Instance], None] | None = None
    # The off-tick setup pool's nudge (bot.app.hosts.hostcheck.HostChecker.tick): hands out the
    # bootstrap of instances not ready yet and returns at once. None: refresh prepares them
    # inline, under the fleet's lock (tests about something else).
    setup: Callable[[], object] | None = None

    @property
    def engine(self) -> Any:
        return self.service.engine

    @property
    def settings(self) -> Any:
        return self.service.settings


@dataclass(frozen=True)
class Limits:
    """The caps on one instance type; None: no cap of that kind."""

    max_instances: int | None
    max_usd_per_hour: float | None


@dataclass(frozen=True)
class Want:
    """What one waiting reservation or queued run needs bought, and whom to tell."""

    kind: str  # "res" or "run": the request key's prefix
    id: int
    owner: str
    model: str
    gpus: int
    market: str = "ondemand"

    @property
    def label(self) -> str:
        return f"your reservation #{self.id}" if self.kind == "res" else f"your run #{self.id}"

    @property
    def then(self) -> str:
        if self.kind == "res":
            return "You will get a DM when your GPUs are yours."
        return "Your run starts there as soon as it is ready."

    @property
    def ask_less(self) -> str:
        if self.kind == "res":
            return "`/gpu release` it and ask for fewer."
        return "`/gpu cancel` it and ask for fewer."


@dataclass(frozen=True)
class ReconcileReport:
    # Instance ids adopted from pending launch requests.
    adopted: tuple[str, ...] = ()
    # Instance ids the cloud no longer lists, marked terminated.
    lost: tuple[str, ...] = ()
    # Request keys that launched nothing, marked failed.
    failed: tuple[str, ...] = ()


def mark_launched(ctx: FleetContext, key: str, inst: Instance, *, adopted: bool) -> None:
    with transaction(ctx.engine) as s:
        req = s.exec(select(LaunchRequest).where(LaunchRequest.request_key == key)).one()
        if req.state == REQ_LAUNCHED:
            return
        now = ctx.service.clock.now()
        req.state = REQ_LAUNCHED
        req.instance_id = inst.instance_id
        req.updated_at = now
        s.add(req)
        if adopted and inst.state != HOST_TERMINATED:
            text = (
                f"The instance for your request {key} ({inst.instance_id}, "
                f"{inst.instance_type}) is booting; you will get a DM when your GPUs are yours."
            )
            ctx.service.notify_dm(s, req.owner, text_view(text), now, dedupe=f"fleet-adopted:{key}")


def mark_failed(ctx: FleetContext, key: str, error: str) -> None:
    with transaction(ctx.engine) as s:
        req = s.exec(select(LaunchRequest).where(LaunchRequest.request_key == key)).one()
        req.state = REQ_FAILED
        req.error = error[:500]
        req.updated_at = ctx.service.clock.now()
        s.add(req)


def dm(ctx: FleetContext, user_key: str, text: str, dedupe: str) -> None:
    with transaction(ctx.engine) as s:
        ctx.service.notify_dm(s, user_key, text_view(text), ctx.service.clock.now(), dedupe)


def text_view(text: str) -> views.View:
    return views.View(text=text, blocks=(views.Text(text),))
