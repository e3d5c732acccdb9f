"""What the service's parts share: the reports they return, a reservation as people
read it, and the rules that need no state (ending a reservation, reading the hosts,
choosing GPUs by best fit)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import func
from sqlmodel import Session, col, select

from bot.app.ports import Actor as Actor  # re-exported: the faces take it with the service
from bot.app.watching.held import end_held, who_holds
from bot.domain import views
from bot.domain.best_fit import best_fit
from bot.domain.errors import UserError
from bot.domain.readmodels import GpuState, HostState, ReservationInfo
from db.models import (
    RES_ACTIVE,
    RES_OPEN_STATES,
    RES_WAITING,
    Gpu,
    Host,
    Reservation,
    UsageInterval,
    User,
)
from db.session import locked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TickReport:
    expired: int = 0
    warned: int = 0
    granted: int = 0


# Session.info key: the host and GPUs (index, model) of each reservation granted in this
# transaction, so that its reply or DM (`reservation_info`) does not read them back.
GRANTED = "gpubot.granted"


IN_FLIGHT = "in flight"


@dataclass(frozen=True)
class OutboxItem:
    id: int
    kind: str
    target: str
    view: views.View
    attempts: int
    # True when an earlier send started and its outcome is unknown (crash, lost reply).
    maybe_sent: bool = False
    # A file that goes with it (a chart PNG): its name and bytes.
    attachment: tuple[str, bytes] | None = None
    # An edit of this earlier notification (a run's live message), not a new message.
    edit_of: int | None = None


@dataclass(frozen=True)
class FreeGpu:
    """A free GPU as the grant pass weighs it: its id, model and index, read as plain
    columns."""

    id: int
    model: str
    index: int


def reservation_info(
    s: Session,
    res: Reservation,
    hosts: list[HostState] | None = None,
    position: int | None = None,
) -> ReservationInfo:
    """The read model of one reservation. A caller that already knows a waiting
    reservation's place in line passes it, sparing a count query per entry."""
    user = s.get(User, res.user_id)
    assert user is not None and res.id is not None
    host_state: HostState | None = None
    indexes: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    if res.state == RES_ACTIVE or res.host_id is not None:
        granted_host: HostState | None = None
        cached: tuple[HostState, list[tuple[int, str]]] | None = s.info.get(GRANTED, {}).get(res.id)
        if cached is not None:
            granted_host, granted = cached
        else:
            # Plain columns: a GPU once per interval on it, so deduplicated by id.
            columns: tuple[Any, ...] = (Gpu.id, Gpu.index, Gpu.model)
            rows = s.exec(
                select(*columns)
                .join(UsageInterval, col(UsageInterval.gpu_id) == col(Gpu.id))
                .where(UsageInterval.reservation_id == res.id)
                .order_by(col(Gpu.index))
            ).all()
            granted = list({gpu_id: (index, model) for gpu_id, index, model in rows}.values())
        indexes = tuple(index for index, _ in granted)
        models = tuple(model for _, model in granted)
        known = {h.name: h for h in hosts} if hosts is not None else {}
        if granted_host is not None:
            host_state = known.get(granted_host.name) or granted_host
        elif res.host_id is not None:
            host = s.get(Host, res.host_id)
            if host is not None:
                host_state = known.get(host.name) or to_host_state(host, [])
    if res.state != RES_WAITING:
        position = None
    elif position is None:
        ahead = s.exec(
            select(func.count())
            .select_from(Reservation)
            .where(
                Reservation.state == RES_WAITING,
                (col(Reservation.requested_at) < res.requested_at)
                | (
                    (col(Reservation.requested_at) == res.requested_at)
                    & (col(Reservation.id) < res.id)
                ),
            )
        ).one()
        position = int(ahead) + 1
    return replace(
        released_info(res, user),
        host=host_state,
        gpu_indexes=indexes,
        gpu_models=models,
        position=position,
        how=tuple(str(line) for line in (res.external or {}).get("how", ())),
    )


def released_info(res: Reservation, holder: User) -> ReservationInfo:
    """The reservation's own fields with its holder, nothing read back: what the release
    reply names (the host and GPUs it held are not shown) and what `reservation_info`
    fills in the rest of."""
    assert res.id is not None
    return ReservationInfo(
        id=res.id,
        user_key=holder.key,
        user_name=holder.display_name,
        state=res.state,
        gpu_model=res.gpu_model,
        gpu_count=res.gpu_count,
        duration_s=res.duration_s,
        requested_at=res.requested_at,
        granted_at=res.granted_at,
        ends_at=res.ends_at,
        ended_at=res.ended_at,
    )


def owned_reservation(
    s: Session, actor: Actor, user: User, reservation_id: int, *, verb: str, usage: str
) -> Reservation:
    """The reservation named, read under its lock, refused unless it exists and is the
    caller's or the caller is an admin: release, extend and keep refuse alike."""
    res = locked(s, Reservation, reservation_id)
    if res is None:
        raise UserError(f"There is no reservation #{reservation_id}.", usage)
    if res.user_id != user.id and not actor.admin:
        raise UserError(
            f"Reservation #{reservation_id} is not yours; only its holder or an admin can {verb} it."
        )
    return res


def end_reservation(s: Session, res: Reservation, state: str, at: datetime) -> None:
    """Ends an open reservation: its usage closed, its state final. The caller holds
    the pool and read `res` under its lock, so the state checked is the current one."""
    if res.state not in RES_OPEN_STATES:
        raise RuntimeError(f"reservation #{res.id} is {res.state} already; not ended again")
    end_held(s, at, reservation_id=res.id)
    res.state = state
    res.ended_at = at
    s.add(res)
    s.flush()


def read_hosts(s: Session) -> list[HostState]:
    """Every host that is not terminated, with its present GPUs and who holds them.

    Plain columns run through the connection (Core), not the ORM: a fleet of hundreds
    of GPUs is read on every status and App Home, and building ORM objects, or even
    the ORM's per-row processing of plain columns, was most of their time."""
    conn = s.connection()
    host_cols: tuple[Any, ...] = (
        Host.id,
        Host.name,
        Host.provider,
        Host.state,
        Host.address,
        Host.ssh_user,
        Host.ssh_port,
        Host.market,
        Host.hourly_usd,
        Host.down_since,
        Host.down_reason,
    )
    hosts = conn.execute(
        select(*host_cols).where(Host.state != "terminated").order_by(col(Host.id))
    ).all()
    gpu_cols: tuple[Any, ...] = (
        Gpu.id,
        Gpu.host_id,
        Gpu.index,
        Gpu.model,
        Gpu.memory_gb,
        Gpu.held_by,
    )
    gpus = conn.execute(
        select(*gpu_cols)
        .where(col(Gpu.present).is_(True))
        .order_by(col(Gpu.host_id), col(Gpu.index))
    ).all()
    holder = {h.interval.gpu_id: h for h in who_holds(s)} if gpus else {}
    by_host: dict[int, list[GpuState]] = {}
    for gpu_id, host_id, index, model, memory_gb, held_by in gpus:
        h = holder.get(gpu_id)
        if h is None:
            # Free, or held outside gpubot (a cluster job of another's, in its words).
            state = GpuState(
                gpu_id=gpu_id, index=index, model=model, memory_gb=memory_gb, holder=held_by
            )
        else:
            iv, u, r = h.interval, h.user, h.reservation
            state = GpuState(
                gpu_id=gpu_id,
                index=index,
                model=model,
                memory_gb=memory_gb,
                holder=u.display_name,
                holder_key=u.key,
                reservation_id=iv.reservation_id,
                run_id=iv.run_id,
                until=r.ends_at if r is not None else None,
            )
        by_host.setdefault(host_id, []).append(state)
    out = []
    for host_id, name, provider, state_, address, user, port, market, usd, down, why in hosts:
        out.append(
            HostState(
                name=name,
                provider=provider,
                state=state_,
                address=address,
                ssh_user=user,
                ssh_port=port,
                market=market,
                hourly_usd=usd,
                gpus=tuple(by_host.get(host_id, ())),
                down_since=down,
                down_reason=why if down is not None else None,
            )
        )
    return out


def pick_gpus(
    free: dict[tuple[int, str], int], model: str | None, count: int
) -> tuple[int, str] | None:
    """The host (its id) and the GPU model to take `count` free GPUs of, by best fit
    (bot.domain.best_fit) over each host's free GPUs per model, in host id order: a
    request for no model in particular may take any one model, never a mix."""
    options = [(key, n) for key, n in free.items() if model in (None, key[1])]
    return best_fit(options, count)


class PricedHost(Protocol):
    """What usage is priced by: the host's id, hourly price and market (a `Host`, or
    the grant pass's plain columns, `bot.app.watching.held.free_gpus`)."""

    @property
    def id(self) -> int | None: ...
    @property
    def hourly_usd(self) -> float: ...
    @property
    def market(self) -> str: ...


class ShownHost(PricedHost, Protocol):
    """What a reply shows of a host (`to_host_state`)."""

    @property
    def name(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def ssh_user(self) -> str: ...
    @property
    def ssh_port(self) -> int: ...
    @property
    def down_since(self) -> datetime | None: ...
    @property
    def down_reason(self) -> str | None: ...


def to_host_state(host: ShownHost, gpus: list[GpuState]) -> HostState:
    return HostState(
        name=host.name,
        provider=host.provider,
        state=host.state,
        address=host.address,
        ssh_user=host.ssh_user,
        ssh_port=host.ssh_port,
        market=host.market,
        hourly_usd=host.hourly_usd,
        gpus=tuple(gpus),
        down_since=host.down_since,
        down_reason=host.down_reason if host.down_since is not None else None,
    )
