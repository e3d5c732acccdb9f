"""Builders for fleet tests: a fleet on moto whose hosts are reached on loopback sshd.

moto invents instance addresses (10.x, public-looking ones) that must never be dialed;
`LoopbackResolver` sends every instance to one real sshd host on 127.0.0.x instead, the
way DESIGN asks tests to replace the production resolver.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.fleet import CatalogSupply, Fleet
from bot.app.hosts.remote import PreparedHost, RemoteAccess
from bot.app.places import RunParts, Wiring
from bot.app.service import GpuService, Wire
from bot.domain.clock import VirtualClock
from db.models import Host, LaunchRequest, Notification
from provisioning.base import Instance
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.ssh_hosts import SshLab


@dataclass(frozen=True)
class LoopbackResolver:
    """Every instance → the one loopback target (named after the instance)."""

    target: SshTarget

    def resolve(self, instance: Instance | str) -> SshTarget:
        name = instance.name if isinstance(instance, Instance) else instance
        assert self.target.host.startswith("127."), "tests dial loopback only"
        return replace(self.target, name=name)


def lab_target(lab: SshLab, name: str = "gpu-a") -> SshTarget:
    host = lab.hosts[name]
    return SshTarget(
        host=host.address, port=host.port, user=lab.user, key_path=str(lab.client_key), name=name
    )


@dataclass
class FleetBench:
    service: GpuService
    clock: VirtualClock
    fleet: Fleet
    client: SshClient
    # Names of the hosts prepared (bootstrapped), in order: once each.
    prepared: list[str]

    def dms(self, user: str) -> list[str]:
        return notes(self.service.engine, "dm", user)

    def channel(self) -> list[str]:
        return notes(self.service.engine, "channel", self.service.settings.channel)

    def host(self, name: str) -> Host:
        with Session(self.service.engine) as s:
            return s.exec(select(Host).where(Host.name == name)).one()

    def requests(self) -> list[LaunchRequest]:
        with Session(self.service.engine) as s:
            return list(s.exec(select(LaunchRequest).order_by(col(LaunchRequest.id))))


def notes(engine: Engine, kind: str, target: str) -> list[str]:
    with Session(engine) as s:
        return [
            n.text
            for n in s.exec(
                select(Notification)
                .where(Notification.kind == kind, Notification.target == target)
                .order_by(col(Notification.id))
            )
        ]


def make_fleet(
    engine: Engine,
    compute: Any,
    ssh: SshLab,
    remote_root: Path,
    admins: tuple[str, ...] = ("root",),
    target: SshTarget | None = None,
) -> FleetBench:
    """A fleet attached to its service (the worker's job and `bot.app.runs` find it), with
    runs on the loopback host kept under `remote_root` (this machine's interpreter)."""
    clock = VirtualClock()
    client = SshClient(connect_timeout=5, command_timeout=20)
    prepared: list[str] = []

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        prepared.append(target.name)
        return PreparedHost(root=str(remote_root), python=sys.executable)

    resolver = LoopbackResolver(target or lab_target(ssh))
    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about the fleet's money and lifecycle;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    access = RemoteAccess(engine, client, resolver, prepare=prepare)
    svc = GpuService(engine, Settings(admins=admins), clock, cloud_place(compute, access))
    fleet = svc.fleet
    assert isinstance(fleet, Fleet)
    return FleetBench(service=svc, clock=clock, fleet=fleet, client=client, prepared=prepared)


def cloud_place(compute: Any, access: RemoteAccess) -> Wire:
    """A cloud place wired as bot.providers.aws wires EC2 (its fleet, supply and runs),
    without the host checker: these tests prepare hosts themselves."""

    def wire(core: GpuService) -> list[Wiring]:
        return [
            Wiring(
                "aws",
                label="EC2",
                supply=CatalogSupply(compute.catalog),
                runs=RunParts(access, compute.catalog),
                fleet=Fleet(core, compute, access, catalog=compute.catalog),
            )
        ]

    return wire
