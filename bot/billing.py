"""The instances' side of the bill: one `HostPeriod` row per stretch of a host's state.

Usage intervals say who held which GPU; these rows say what the machines themselves
cost while running (at their price) or stopped (their storage). Idle overhead is the
difference, computed from both sides in `bot.metering`. Every change of a host's state
or price goes through `note_host_state`, inside the transaction that changes the host,
so the history can never disagree with the host row.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlmodel import Session, col, func, select

from bot.config import Settings
from bot.metering import HostPeriod as MeteredPeriod
from bot.metering import Window, storage_usd_per_hour
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_UNREACHABLE,
    Gpu,
    Host,
    HostPeriod,
)

# An unreachable host is still billed: the cloud does not know we cannot reach it.
_RUNNING_STATES = (HOST_READY, HOST_PENDING, HOST_UNREACHABLE)
# Only rented machines have a volume the team pays for while stopped.
_RENTED_PROVIDERS = ("aws", "sim")


def billed_state(host: Host) -> str | None:
    """ "running", "stopped", or None (terminated: no bill at all)."""
    if host.state in _RUNNING_STATES:
        return "running"
    if host.state == HOST_STOPPED:
        return "stopped"
    return None


def storage_rate(host: Host, settings: Settings) -> float:
    if host.provider not in _RENTED_PROVIDERS:
        return 0.0
    return float(
        storage_usd_per_hour(Decimal(str(settings.ebs_gb)), Decimal(str(settings.ebs_usd_gb_month)))
    )


def note_host_state(s: Session, host: Host, now: datetime, settings: Settings) -> None:
    """Closes the host's open period and opens one for its current state when anything
    billed changed (state, GPU count, price, market). Idempotent: calling it again with
    nothing changed writes nothing. `host` must be flushed (it needs its id)."""
    assert host.id is not None, "flush the host before noting its state"
    state = billed_state(host)
    gpus = s.exec(
        select(func.count())
        .select_from(Gpu)
        .where(Gpu.host_id == host.id, col(Gpu.present).is_(True))
    ).one()
    storage = storage_rate(host, settings)
    current = s.exec(
        select(HostPeriod).where(HostPeriod.host_id == host.id, col(HostPeriod.ended_at).is_(None))
    ).first()
    if current is not None:
        same = (
            current.state == state
            and current.gpus == gpus
            and current.usd_per_hour == host.hourly_usd
            and current.storage_usd_per_hour == storage
            and current.market == host.market
        )
        if same:
            return
        current.ended_at = max(now, current.started_at)
        s.add(current)
        s.flush()  # the open-period index must see it closed before the next opens
    if state is None:
        return
    s.add(
        HostPeriod(
            host_id=host.id,
            state=state,
            started_at=now,
            gpus=int(gpus),
            usd_per_hour=host.hourly_usd,
            storage_usd_per_hour=storage,
            market=host.market,
        )
    )


def host_periods(s: Session, window: Window) -> list[MeteredPeriod]:
    """Every period that overlaps the window, as `bot.metering` takes them."""
    rows = s.exec(
        select(HostPeriod)
        .where(
            col(HostPeriod.started_at) < window.end,
            col(HostPeriod.ended_at).is_(None) | (col(HostPeriod.ended_at) > window.start),
        )
        .order_by(col(HostPeriod.host_id), col(HostPeriod.started_at))
    ).all()
    return [
        MeteredPeriod(
            host_id=p.host_id,
            gpus=p.gpus,
            usd_per_hour=Decimal(str(p.usd_per_hour)),
            state="running" if p.state == "running" else "stopped",
            start=p.started_at,
            end=p.ended_at,
            storage_usd_per_hour=Decimal(str(p.storage_usd_per_hour)),
        )
        for p in rows
    ]
