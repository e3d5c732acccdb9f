"""`/gpu status` (the fleet and the line, cached per database write generation so a
burst of status requests reads the database once) and `/gpu cost` / the team bill."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy.engine import Connection
from sqlmodel import Session, col, select

from bot.app.burst.summary import BurstWeek, burst_week
from bot.app.money.billing import TeamBill, team_bill, window_costs
from bot.app.ports import Actor, Core
from bot.app.service.common import read_hosts, reservation_info
from bot.app.watching.held import fleet_counts
from bot.domain import views
from bot.domain.commands import Status
from bot.domain.metering import Window, period_window
from bot.domain.readmodels import HomeSnapshot, HostState, ReservationInfo, StatusSnapshot
from db.models import (
    RES_OPEN_STATES,
    RES_WAITING,
    Gpu,
    Host,
    Reservation,
    UsageInterval,
    User,
)
from db.session import transaction, write_generation
from provisioning.catalog import Catalog

log = logging.getLogger(__name__)


class StatusBoard:
    """The read side: what is held and waiting, and what it cost."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._status_lock = threading.Lock()
        self._status_shared: tuple[int, float, list[HostState], list[ReservationInfo]] | None = None
        self._status_mine: dict[str, tuple[int, float, list[ReservationInfo]]] = {}

    def status(self, actor: Actor, cmd: Status) -> views.Reply:
        hosts, waiting, mine = self._status_data(actor.key)
        display = self.core.display
        snap = StatusSnapshot(
            now=self.core.clock.now(),
            hosts=tuple(replace(h, note=display.note(h)) for h in hosts),
            waiting=tuple(waiting),
            mine=tuple(mine),
            mine_only=cmd.mine_only,
            # A pool that grows on demand (a cloud) is empty before its first request.
            empty_pool=views.GROWS_ON_DEMAND
            if self.core.supply.offered()
            else display.empty_pool(),
            notes=(*self.core.place_lines(hosts), *display.status_lines()),
            tz=self.core.settings.timezone,
        )
        return views.Reply(views.status_view(snap))

    def _status_data(
        self, user_key: str
    ) -> tuple[list[HostState], list[ReservationInfo], list[ReservationInfo]]:
        """What /gpu status shows for one user, cached.

        It is the bulk of the work of the most frequent command (measured: with it
        cached, 16 concurrent signed requests go from ~150 to several hundred per
        second). A cached entry is dropped at once by any write this process commits,
        and is used for at most `status_cache_s` against writes by other processes
        (replicas, a separate worker), so a status is never older than that. The
        view is rebuilt each time from the data, so "in 2h" is always current.
        """
        generation = write_generation()
        started = time.monotonic()
        ttl = self.core.settings.status_cache_s

        def fresh(entry: tuple[int, float] | None) -> bool:
            # Computed at this call's generation or a later one: it has every write this
            # process committed before the call began (a burst of writes, each moving the
            # generation, would otherwise have each waiting call compute it once more).
            return entry is not None and entry[0] >= generation and started - entry[1] < ttl

        # The shared part is computed by one thread at a time: when it expires, the
        # burst of requests waiting on it reuses one result instead of stampeding.
        with self._status_lock:
            shared = self._status_shared
            if shared is None or not fresh(shared[:2]):
                with transaction(self.core.engine, write=False) as s:
                    hosts = read_hosts(s)
                    shared = (generation, started, hosts, self._waiting(s, hosts))
                self._status_shared = shared
            mine_hit = self._status_mine.get(user_key)
        _, _, hosts, waiting = shared
        if mine_hit is not None and fresh(mine_hit[:2]):
            return hosts, waiting, mine_hit[2]
        mine: list[ReservationInfo] = []
        with transaction(self.core.engine, write=False) as s:
            user = s.exec(select(User).where(User.key == user_key)).first()
            if user is not None:
                mine_rows = s.exec(
                    select(Reservation)
                    .where(
                        Reservation.user_id == user.id, col(Reservation.state).in_(RES_OPEN_STATES)
                    )
                    .order_by(col(Reservation.id))
                ).all()
                pos: dict[int | None, int | None] = {r.id: r.position for r in waiting}
                mine = [reservation_info(s, r, hosts, position=pos.get(r.id)) for r in mine_rows]
        with self._status_lock:
            if len(self._status_mine) > 4096:
                self._status_mine.clear()
            # Stamped with the generation read before the queries: a write committed
            # meanwhile makes the next call recompute.
            self._status_mine[user_key] = (generation, started, mine)
        return hosts, waiting, mine

    def _waiting(self, s: Session, hosts: list[HostState] | None = None) -> list[ReservationInfo]:
        rows = s.exec(
            select(Reservation)
            .where(Reservation.state == RES_WAITING)
            .order_by(col(Reservation.requested_at), col(Reservation.id))
        ).all()
        return [reservation_info(s, r, hosts, position=i + 1) for i, r in enumerate(rows)]

    def home(self, actor: Actor) -> HomeSnapshot:
        """What App Home shows of the pool and the caller's cost this week, in one read.

        Home showed the whole status (every GPU of every host, with its holder) to keep
        only its first line, the waiting line and the caller's part, and then read the
        cost in a transaction of its own: at 100 hosts most of its time. Here the first
        line comes from counts grouped by host state (bot.app.watching.held.fleet_counts), and
        the lines are worded by the status's own functions (bot.domain.views), so Home
        and `/gpu status` still agree. The rows are plain columns through the
        connection; a statement count that does not grow with the hosts."""
        now = self.core.clock.now()
        window = period_window("week", now, self.core.settings.timezone)
        with transaction(self.core.engine, write=False) as s:
            conn = s.connection()
            fleet = fleet_counts(s)
            waiting = self._waiting_rows(conn)
            user_cols: tuple[Any, ...] = (User.id, User.display_name)
            user = conn.execute(select(*user_cols).where(User.key == actor.key)).first()
            mine: list[ReservationInfo] = []
            cost = Decimal(0)
            if user is not None:
                user_id, name = user
                positions = {r.id: r.position for r in waiting}
                mine = self._mine_rows(conn, user_id, actor.key, name, positions)
                cost = window_costs(s, window, now, user_id).users().get(actor.key, Decimal(0))
        return HomeSnapshot(
            now=now,
            fleet=fleet,
            waiting=tuple(waiting),
            mine=tuple(mine),
            week_usd=cost,
            tz=self.core.settings.timezone,
        )

    @staticmethod
    def _waiting_rows(conn: Connection) -> list[ReservationInfo]:
        """The waiting line with each one's name, in one query (`_waiting` reads it as
        reservations and their users, a row and a lookup each)."""
        columns: tuple[Any, ...] = (
            Reservation.id,
            User.key,
            User.display_name,
            Reservation.gpu_model,
            Reservation.gpu_count,
            Reservation.duration_s,
            Reservation.requested_at,
        )
        rows = conn.execute(
            select(*columns)
            .join(User, col(User.id) == col(Reservation.user_id))
            .where(Reservation.state == RES_WAITING)
            .order_by(col(Reservation.requested_at), col(Reservation.id))
        ).all()
        return [
            ReservationInfo(
                id=rid,
                user_key=key,
                user_name=name,
                state=RES_WAITING,
                gpu_model=model,
                gpu_count=count,
                duration_s=duration,
                requested_at=requested,
                position=i + 1,
            )
            for i, (rid, key, name, model, count, duration, requested) in enumerate(rows)
        ]

    @staticmethod
    def _mine_rows(
        conn: Connection,
        user_id: int,
        user_key: str,
        user_name: str,
        positions: dict[int, int | None],
    ) -> list[ReservationInfo]:
        """The caller's open reservations with the host and the GPUs each holds, in one
        query (a row per GPU of each; a GPU once per interval of the reservation on it,
        so deduplicated as `reservation_info` does). The host is named only: what Home's
        lines show of it."""
        columns: tuple[Any, ...] = (
            Reservation.id,
            Reservation.state,
            Reservation.gpu_model,
            Reservation.gpu_count,
            Reservation.duration_s,
            Reservation.requested_at,
            Reservation.granted_at,
            Reservation.ends_at,
            Reservation.ended_at,
            Host.name,
            Host.provider,
            Host.state,
            Host.address,
            Host.ssh_user,
            Host.ssh_port,
            Host.market,
            Host.hourly_usd,
            Gpu.id,
            Gpu.index,
            Gpu.model,
        )
        rows = conn.execute(
            select(*columns)
            .join(Host, col(Host.id) == col(Reservation.host_id), isouter=True)
            .join(
                UsageInterval,
                col(UsageInterval.reservation_id) == col(Reservation.id),
                isouter=True,
            )
            .join(Gpu, col(Gpu.id) == col(UsageInterval.gpu_id), isouter=True)
            .where(Reservation.user_id == user_id, col(Reservation.state).in_(RES_OPEN_STATES))
            .order_by(col(Reservation.id), col(Gpu.index))
        ).all()
        by_id: dict[int, tuple[Any, dict[int, tuple[int, str]]]] = {}
        for row in rows:
            held = by_id.setdefault(row[0], (row, {}))[1]
            if row[17] is not None:
                held.setdefault(row[17], (row[18], row[19]))
        out = []
        for rid, (row, held) in by_id.items():
            state, model, count, duration, requested, granted, ends, ended = row[1:9]
            name, provider, host_state, address, ssh_user, port, market, usd = row[9:17]
            host = (
                HostState(name, provider, host_state, address, ssh_user, port, market, usd, ())
                if name is not None
                else None
            )
            out.append(
                ReservationInfo(
                    id=rid,
                    user_key=user_key,
                    user_name=user_name,
                    state=state,
                    gpu_model=model,
                    gpu_count=count,
                    duration_s=duration,
                    requested_at=requested,
                    granted_at=granted,
                    ends_at=ends,
                    ended_at=ended,
                    host=host,
                    gpu_indexes=tuple(index for index, _ in held.values()),
                    gpu_models=tuple(m for _, m in held.values()),
                    position=positions.get(rid) if state == RES_WAITING else None,
                )
            )
        return out

    def costs(
        self, period: str, user_key: str | None = None
    ) -> tuple[Window, dict[str, Decimal], dict[str, str]]:
        """Each user's cost over the calendar period (team time zone), from the usage
        intervals: every GPU-second held at its share of the host's price. Returns the
        window, cost per user key, and display names. Only `user_key` when given."""
        now = self.core.clock.now()
        window = period_window(period, now, self.core.settings.timezone)  # type: ignore[arg-type]
        with transaction(self.core.engine, write=False) as s:
            user_id = _user_id(s, user_key)
            if user_id is False:
                return window, {}, {}
            costs = window_costs(s, window, now, user_id).users()
            names = _names(s, set(costs))
        return window, costs, names

    def cost_sides(
        self, period: str, user_key: str | None = None
    ) -> tuple[dict[str, tuple[Decimal, Decimal]], dict[str, str], BurstWeek | None]:
        """Each user's cost over the period as (the team's own GPUs, bought ones), their
        display names, and what bursting did in it (bot.app.burst.summary)."""
        now = self.core.clock.now()
        window = period_window(period, now, self.core.settings.timezone)  # type: ignore[arg-type]
        with transaction(self.core.engine, write=False) as s:
            user_id = _user_id(s, user_key)
            if user_id is False:
                return {}, {}, None
            sides = window_costs(s, window, now, user_id).sides()
            return sides, _names(s, set(sides)), burst_week(s, window, now)

    def team_bill(self, period: str, catalog: Catalog | None = None) -> TeamBill:
        """`/gpu cost team`: users, idle overhead and the instances' bill (bot.app.money.billing)."""
        now = self.core.clock.now()
        window = period_window(period, now, self.core.settings.timezone)  # type: ignore[arg-type]
        with transaction(self.core.engine, write=False) as s:
            return team_bill(s, window, now, catalog)


def _user_id(s: Session, user_key: str | None) -> int | Literal[False] | None:
    """The id of the user a cost is asked for; None: everyone; False: nobody known."""
    if user_key is None:
        return None
    user = s.exec(select(User).where(User.key == user_key)).first()
    return False if user is None else user.id


def _names(s: Session, keys: set[str]) -> dict[str, str]:
    """Display names of these user keys."""
    if not keys:
        return {}
    return {u.key: u.display_name for u in s.exec(select(User).where(col(User.key).in_(keys)))}
