"""Builders for core tests: a service on a given engine with a virtual clock and
hosts described as plain provisioning dataclasses (the same ones providers return)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from bot.app.config import Settings
from bot.app.places import RunParts, Wiring
from bot.app.ports import FIXED_POOL, HostAccess, HostDisplay, PlainDisplay, Supply
from bot.app.runs import LocalAccess
from bot.app.service import Actor, GpuService, Wire
from bot.domain.clock import VirtualClock
from provisioning.base import GpuDevice, Instance
from provisioning.catalog import Catalog
from provisioning.local_runner import LOCAL_TARGET, LocalRunner


def host(name: str, model: str, count: int, hourly: float = 0.0, address: str = "") -> Instance:
    return Instance(
        name=name,
        provider="ssh",
        state="ready",
        gpus=tuple(GpuDevice(index=i, model=model, memory_gb=40.0) for i in range(count)),
        hourly_usd=hourly,
        address=address or f"{name}.example",
        ssh_user="ubuntu",
        market="ondemand" if hourly else "owned",
    )


def make_service(
    engine: Engine,
    hosts: list[Instance],
    admins: tuple[str, ...] = ("root",),
    *,
    places: Wire | None = None,
    **settings: object,
) -> tuple[GpuService, VirtualClock]:
    """`places`: the service's wiring (`runs_here`, `place`); none: reservations only."""
    clock = VirtualClock()
    cfg = Settings(admins=admins, **settings)  # type: ignore[arg-type]
    svc = GpuService(engine, cfg, clock, places)
    svc.sync_hosts(hosts)
    return svc, clock


def place(
    name: str,
    access: HostAccess | None = None,
    *,
    catalog: Catalog | None = None,
    supply: Supply = FIXED_POOL,
    display: HostDisplay | None = None,
) -> Wire:
    """One place named `name` whose runs reach hosts through `access` (none: it runs
    nothing), with the shipped catalog unless told."""

    def wire(core: GpuService) -> list[Wiring]:
        runs = RunParts(access, catalog or Catalog.load()) if access is not None else None
        return [Wiring(name, display=display or PlainDisplay(), runs=runs, supply=supply)]

    return wire


def runs_here(runs_dir: Path) -> Wire:
    """One place whose runs run on this machine as this user, kept under `runs_dir`."""
    return place("local", LocalAccess(LocalRunner(), LOCAL_TARGET, runs_dir))


def actor(svc: GpuService, name: str) -> Actor:
    return svc.actor(name)


HOUR = timedelta(hours=1)


@contextmanager
def statements(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """Every statement (and its parameters) the engine runs inside the block."""
    seen: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        seen.append((statement, params))

    event.listen(engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", note)


def wait_for(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Polls `check` until it is truthy. The timeout guards against a hang; it is not a
    speed assertion, so it is long: a loaded machine must not fail a correct test."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)
