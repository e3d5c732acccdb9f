"""Builders for core tests: a service on a given engine with a virtual clock and
hosts described as plain provisioning dataclasses (the same ones providers return)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from bot.app.config import Settings
from bot.app.service import Actor, GpuService
from bot.domain.clock import VirtualClock
from provisioning.base import GpuDevice, Instance


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
    **settings: object,
) -> tuple[GpuService, VirtualClock]:
    clock = VirtualClock()
    cfg = Settings(admins=admins, **settings)  # type: ignore[arg-type]
    svc = GpuService(engine, cfg, clock)
    svc.sync_hosts(hosts)
    return svc, clock


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
