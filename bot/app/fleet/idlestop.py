"""Idle stop and terminate: a rented instance nobody has held for `idle_stop_after`
is stopped (a spot one, which cannot stop, is terminated), one still booting after
BOOT_TIMEOUT likewise, and one stopped for `terminate_after` is terminated. Idle time
is read from the bill (the host's open HostPeriod), the time the host last became ready
and the usage intervals: "idle since" is the latest of its billed period's start, its
readiness and its last use, so a restart does not count the time before it was stopped,
and a never-used instance is idle from when it was ready, not from its launch (the
simulator's rule, `bot.sim.simulate`)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlmodel import col, func, select

from bot.app.fleet.common import BOOT_TIMEOUT, FleetContext, text_view
from bot.app.watching.held import held_gpu_ids
from bot.domain.durations import format_duration
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_UNREACHABLE,
    Host,
    HostPeriod,
    UsageInterval,
)
from db.session import transaction
from provisioning.base import ProvisioningError
from provisioning.costs import storage_usd_per_hour

log = logging.getLogger(__name__)


class IdleStopper:
    """Stops paying for what sits unused."""

    def __init__(self, ctx: FleetContext) -> None:
        self.ctx = ctx

    def idle(self) -> list[str]:
        """Stops rented instances idle for `idle_stop_after` (spot ones, which cannot stop,
        are terminated), those still booting after BOOT_TIMEOUT, and terminates those
        stopped for `terminate_after`."""
        now = self.ctx.service.clock.now()
        stop_after = self.ctx.settings.idle_stop_after
        end_after = self.ctx.settings.terminate_after
        to_stop: list[tuple[Host, datetime]] = []
        to_end: list[tuple[Host, datetime]] = []
        with transaction(self.ctx.engine, write=False) as s:
            for host in s.exec(
                select(Host).where(
                    Host.provider == self.ctx.compute.name,
                    col(Host.state).in_((HOST_READY, HOST_PENDING, HOST_UNREACHABLE, HOST_STOPPED)),
                )
            ):
                if not host.instance_id:
                    continue
                period = s.exec(
                    select(HostPeriod).where(
                        HostPeriod.host_id == host.id, col(HostPeriod.ended_at).is_(None)
                    )
                ).first()
                if period is None:
                    continue
                if host.state == HOST_STOPPED:
                    if period.state == "stopped" and now - period.started_at >= end_after:
                        to_end.append((host, period.started_at))
                    continue
                if held_gpu_ids(s, host_id=host.id):
                    continue
                last_use = s.exec(
                    select(func.max(UsageInterval.ended_at)).where(UsageInterval.host_id == host.id)
                ).one()
                since = period.started_at
                # A ready host is idle from when it became ready (after this period's
                # boot), as the simulator counts it: not from its launch or restart.
                if host.state != HOST_PENDING and host.ready_at is not None:
                    since = max(since, _aware(host.ready_at))
                if last_use is not None:
                    last_use = _aware(last_use)
                    since = max(since, last_use)
                # A booting one gets longer (bootstrap may install torch), but not forever:
                # one that never answers SSH is billed for nothing.
                limit = max(stop_after, BOOT_TIMEOUT) if host.state == HOST_PENDING else stop_after
                if now - since >= limit:
                    to_stop.append((host, since))
        done: list[str] = []
        for host, since in to_stop:
            assert host.instance_id is not None
            spot = host.market == "spot"
            try:
                inst = (
                    self.ctx.compute.terminate(host.instance_id)
                    if spot
                    else self.ctx.compute.stop(host.instance_id)
                )
            except ProvisioningError as exc:
                log.warning("idle %s: %s", host.instance_id, exc)
                continue
            self.ctx.service.sync_hosts([inst])
            idle_for = format_duration(now - since)
            never = (
                " It never became reachable over SSH: check the key pair, the security group "
                "and the image."
                if host.state == HOST_PENDING
                else ""
            )
            if spot:
                text = (
                    f"Terminated idle spot instance {host.instance_id} ({host.instance_type}): "
                    f"no reservation or run for {idle_for} (spot instances cannot be stopped)."
                    + never
                )
                key = f"fleet-terminate:{host.instance_id}"
            else:
                storage = _storage_usd_per_hour(self.ctx.settings)
                text = (
                    f"Stopped idle instance {host.instance_id} ({host.instance_type}, "
                    f"${host.hourly_usd:.2f}/h): no reservation or run for {idle_for}. Its disk "
                    f"stays (about ${storage:.2f}/h) so the next `/gpu reserve` starts it "
                    f"quickly; it is terminated after {format_duration(end_after)} stopped." + never
                )
                key = f"fleet-stop:{host.instance_id}:{since.isoformat()}"
            self.ctx.service.notify_channel(text_view(text), dedupe=key)
            done.append(f"{'terminated' if spot else 'stopped'} {host.instance_id}")
        for host, since in to_end:
            assert host.instance_id is not None
            try:
                inst = self.ctx.compute.terminate(host.instance_id)
            except ProvisioningError as exc:
                log.warning("terminate %s: %s", host.instance_id, exc)
                continue
            self.ctx.service.sync_hosts([inst])
            text = (
                f"Terminated instance {host.instance_id} ({host.instance_type}): stopped for "
                f"{format_duration(now - since)} with nobody asking for it, so its disk is "
                "no longer worth paying for."
            )
            self.ctx.service.notify_channel(
                text_view(text), dedupe=f"fleet-terminate:{host.instance_id}"
            )
            done.append(f"terminated {host.instance_id}")
        return done


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _storage_usd_per_hour(settings: Any) -> float:
    return storage_usd_per_hour(float(settings.ebs_gb), float(settings.ebs_usd_gb_month))
