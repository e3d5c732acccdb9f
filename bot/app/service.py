"""The use cases: the one API that the Slack face, the terminal, the worker and
the simulator call. Every method is one database transaction, so a crash
between two lines loses nothing that a reply already promised; the
notifications a change causes go into the outbox in that same transaction.

Granting is the one contended path. It runs as a "grant pass" over the waiting
line inside the caller's transaction, serialized by `BEGIN IMMEDIATE` on SQLite
and by the pool lock (an advisory lock, `db.session.lock_pool`) on PostgreSQL; a
partial unique index (one open usage interval per GPU) is the backstop that
makes a GPU held twice impossible even if that serialization were wrong. Every
use case that changes a reservation takes the pool first and re-reads what it
changes under a row lock (the lock order is written down in `db.session`), and
is wrapped in `retrying`, so a deadlock or a busy database is run again, not
answered "failed on our side".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, or_, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.app import budgets
from bot.app.access import audit
from bot.app.billing import TeamBill, note_host_state, team_bill, window_costs
from bot.app.config import Settings
from bot.app.held import GpuCount, end_held, free_gpus, gpu_counts, who_holds
from bot.app.outbox import enqueue
from bot.app.ports import FIXED_POOL, GpuRef, Provisioner, Supply
from bot.app.ports import Actor as Actor  # re-exported: the faces take it with the service
from bot.domain import views
from bot.domain.best_fit import best_fit
from bot.domain.clock import Clock
from bot.domain.commands import Extend, Release, Reserve, Status
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.domain.metering import Window, period_window
from bot.domain.readmodels import GpuState, HostState, ReservationInfo, StatusSnapshot
from db.models import (
    HOST_READY,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RES_CANCELLED,
    RES_EXPIRED,
    RES_OPEN_STATES,
    RES_RELEASED,
    RES_WAITING,
    Gpu,
    Host,
    Notification,
    Reservation,
    UsageInterval,
    User,
)
from db.session import (
    is_postgres,
    lock_pool,
    locked,
    locked_rows,
    retrying,
    transaction,
    write_generation,
)
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.costs import gpu_share

if TYPE_CHECKING:
    from bot.app.runs import RunService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TickReport:
    expired: int = 0
    warned: int = 0
    granted: int = 0


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


# pg_advisory_xact_lock key for host syncs ("gpubsync" in ASCII, far from the leader's).
_SYNC_LOCK_KEY = 0x6770756273796E63


@dataclass(frozen=True)
class _FreeGpu:
    """A free GPU as the grant pass weighs it: its id, model and index, read as plain
    columns."""

    id: int
    model: str
    index: int


# Session.info key: the host and GPUs (index, model) of each reservation granted in this
# transaction, so that its reply or DM (`_info`) does not read them back.
_GRANTED = "gpubot.granted"


class GpuService:
    def __init__(
        self, engine: Engine, settings: Settings, clock: Clock, supply: Supply = FIXED_POOL
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.clock = clock
        # What the pool can grow into (a cloud's catalog); a fixed pool refuses what no
        # host fits, a cloud queues it for the fleet to launch.
        self.supply = supply
        # Training runs (bot.app.runs.RunService), set by the runtime when hosts can run them.
        self.runs: RunService | None = None
        # The fleet (bot.app.fleet.Fleet), attached by the runtime when a cloud provider is
        # configured: runs hand it the scheduler's Launch/Start.
        self.fleet: Provisioner | None = None
        self._status_lock = threading.Lock()
        self._status_shared: tuple[int, float, list[HostState], list[ReservationInfo]] | None = None
        self._status_mine: dict[str, tuple[int, float, list[ReservationInfo]]] = {}
        # Who wants to hear that work appeared or GPUs came free (the worker in this
        # process: it places runs at once instead of on its next tick).
        self._on_work: list[Callable[[], None]] = []

    def on_work(self, listener: Callable[[], None]) -> None:
        self._on_work.append(listener)

    def nudge(self) -> None:
        """A run was queued or GPUs were given back: ask for a placement now. Called after
        the change committed; the worker's tick stays the safety net (another process's
        worker hears nothing, and finds the change on its own next tick)."""
        for listener in list(self._on_work):
            try:
                listener()
            except Exception as exc:  # a listener must never fail the user's command
                log.warning("a work listener failed: %s", exc)

    # --- users and hosts ---------------------------------------------------------

    @retrying
    def actor(
        self, key: str, display_name: str | None = None, *, name_if_new: str | None = None
    ) -> Actor:
        """Creates the user on first sight; admins come from configuration only.
        `display_name` renames a known user; `name_if_new` only names a new one (the
        Slack face's payload name, until users.info answers after the ack)."""
        key = key.strip().lstrip("@")
        if not key:
            raise UserError("Who are you? A user name is needed.")
        # Read first: nearly every request comes from someone known, and a read does
        # not queue on SQLite's write lock or drop the status cache.
        with transaction(self.engine, write=False) as s:
            user = s.exec(select(User).where(User.key == key)).first()
        if user is None or (display_name and user.display_name != display_name):
            name = display_name or (name_if_new if user is None else None)
            with transaction(self.engine) as s:
                user = self.user_row(s, key, name)
        return Actor(key=user.key, name=user.display_name, admin=self._is_admin(user))

    def _is_admin(self, user: User) -> bool:
        # Only Settings.admins (GPUBOT_ADMINS, the config file): `user.role` is a database
        # row, and anything that can write a row (a run that once read DATABASE_URL, a
        # psql session) must not be able to make itself an admin. The column stays unread.
        return self.settings.is_admin(user.key)

    def user_row(self, s: Session, key: str, display_name: str | None = None) -> User:
        user = s.exec(select(User).where(User.key == key)).first()
        if user is None:
            user = User(key=key, display_name=display_name or key, created_at=self.clock.now())
            try:
                with s.begin_nested():
                    s.add(user)
            except IntegrityError:  # created by a concurrent first request
                user = s.exec(select(User).where(User.key == key)).one()
        elif display_name and user.display_name != display_name:
            user.display_name = display_name
            s.add(user)
        return user

    @retrying
    def sync_hosts(self, instances: Iterable[Instance]) -> None:
        """Makes the host and GPU rows match what the providers report."""
        now = self.clock.now()
        with transaction(self.engine) as s:
            if is_postgres(self.engine):
                # Replicas starting together would both insert the same new host (and
                # its first billed period); one sync at a time. SQLite's write
                # transaction (BEGIN IMMEDIATE) is that lock already.
                s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SYNC_LOCK_KEY})
            # GPU rows change here (present, model): under the pool, like every change.
            lock_pool(s)
            for inst in instances:
                host = s.exec(select(Host).where(Host.name == inst.name)).first()
                if host is None:
                    host = Host(name=inst.name, provider=inst.provider, created_at=now)
                host.provider = inst.provider
                host.instance_id = inst.instance_id
                host.instance_type = inst.instance_type
                host.market = inst.market
                host.state = inst.state
                host.address = inst.address
                host.ssh_user = inst.ssh_user
                host.ssh_port = inst.ssh_port
                host.hourly_usd = inst.hourly_usd
                host.tags = dict(inst.tags)
                host.updated_at = now
                s.add(host)
                s.flush()
                assert host.id is not None
                existing = {g.index: g for g in s.exec(select(Gpu).where(Gpu.host_id == host.id))}
                reported = {d.index for d in inst.gpus}
                for dev in inst.gpus:
                    gpu = existing.get(dev.index) or Gpu(
                        host_id=host.id, index=dev.index, model=dev.model
                    )
                    gpu.model = dev.model
                    gpu.memory_gb = dev.memory_gb
                    gpu.present = True
                    s.add(gpu)
                for index, gpu in existing.items():
                    if index not in reported and gpu.present:
                        gpu.present = False
                        s.add(gpu)
                s.flush()
                note_host_state(s, host, now, self.settings)

    # --- reserve -------------------------------------------------------------------

    @retrying
    def reserve(self, actor: Actor, cmd: Reserve, request_key: str | None = None) -> views.Reply:
        duration = cmd.duration or self.settings.default_duration
        if duration > self.settings.max_duration:
            raise UserError(
                f"A reservation can last at most {format_duration(self.settings.max_duration)}; "
                f"ask for less, and `/gpu extend` later if you need it.",
                "/gpu reserve [COUNT] [MODEL] [for DURATION]",
            )
        model = cmd.model or self.settings.default_gpu
        try:
            with transaction(self.engine) as s:
                # The pool first (db.session's lock order): the grant pass below needs it,
                # and a second delivery of this request waits here and then finds the first.
                lock_pool(s)
                if request_key and (prior := self._by_request_key(s, request_key)) is not None:
                    return views.Reply(
                        views.already_view(
                            self._info(s, prior), self.clock.now(), self.settings.timezone
                        )
                    )
                # The fleet's GPU counts, read once under the pool: for the check and for
                # this request's grant pass.
                counts = gpu_counts(s)
                self._check_feasible(model, cmd.count, counts)
                user = self.user_row(s, actor.key, actor.name)
                now = self.clock.now()
                # Budget (bot.app.budgets): refused here, before it waits or is granted. No
                # estimate (a query, under the pool lock) for the many without a budget.
                if user.budget_usd is not None:
                    budgets.check_budget(
                        s,
                        user,
                        budgets.reservation_estimate(
                            s, model, cmd.count, int(duration.total_seconds())
                        ),
                        now,
                        self.settings,
                        what=f"Reserving {views.gpu_phrase(cmd.count, model)} for {format_duration(duration)}",
                    )
                res = Reservation(
                    user_id=user.id,  # type: ignore[arg-type]
                    gpu_model=model,
                    gpu_count=cmd.count,
                    duration_s=int(duration.total_seconds()),
                    state=RES_WAITING,
                    requested_at=now,
                    request_key=request_key,
                )
                s.add(res)
                s.flush()
                self.grant_pass(s, now, quiet_id=res.id, counts=counts)
                info = self._info(s, res)
                if res.state == RES_ACTIVE:
                    return views.Reply(views.granted_view(info, now, self.settings.timezone))
                return views.Reply(views.waiting_view(info))
        except IntegrityError:
            if not request_key:
                raise
            # The same request delivered twice at once: the other copy won the insert.
            with transaction(self.engine, write=False) as s:
                prior = self._by_request_key(s, request_key)
                if prior is None:
                    raise
                return views.Reply(
                    views.already_view(
                        self._info(s, prior), self.clock.now(), self.settings.timezone
                    )
                )

    def _by_request_key(self, s: Session, key: str) -> Reservation | None:
        return s.exec(select(Reservation).where(Reservation.request_key == key)).first()

    def _check_feasible(self, model: str | None, count: int, counts: list[GpuCount]) -> None:
        """Refuses up front what could never be granted, instead of an endless wait.
        From the grouped counts (bot.app.held.gpu_counts) that the reserve's grant pass
        uses too, not the status read model: it runs in every reservation's transaction,
        under the pool lock, so a burst of them waits on its length."""
        if model is not None and self.supply.can_have(model, count):
            return
        per_host: dict[int, int] = {}
        seen: set[str] = set()
        for c in counts:
            seen.add(c.model)
            if model is None or c.model == model:
                per_host[c.host_id] = per_host.get(c.host_id, 0) + c.present
        biggest = max(per_host.values(), default=0)
        if biggest >= count:
            return
        have = sorted(seen)
        what = views.gpu_phrase(count, model)
        if biggest == 0:
            models = ", ".join(have) if have else "none"
            raise UserError(
                f"No host here has {model if model else 'any'} GPUs (this pool has: {models}).",
                "/gpu reserve [COUNT] [MODEL] [for DURATION]",
            )
        raise UserError(
            f"No single host has {what}; the most on one host is {biggest}.",
            "/gpu reserve [COUNT] [MODEL] [for DURATION]",
        )

    # --- the grant pass -------------------------------------------------------------

    def grant_pass(
        self,
        s: Session,
        now: datetime,
        quiet_id: int | None = None,
        counts: list[GpuCount] | None = None,
    ) -> int:
        """Grants waiting reservations in order while GPUs allow; returns how many.

        A request that cannot be granted blocks later requests for the same GPUs
        (first come, first served per model); a later request for another model
        may go ahead. `quiet_id` is the caller's own request: its reply says the
        result, so it gets no DM. `counts` are the fleet's GPU counts when the caller
        read them already under the pool (a reserve).
        """
        # Serializes grant passes; the callers took it already, first (db.session).
        lock_pool(s)
        # Most ticks and every release with nobody in line: one indexed query, no fleet.
        # A reserve (`quiet_id`) has just put its own request in line, so it skips that.
        if quiet_id is None:
            anyone = s.exec(select(Reservation.id).where(Reservation.state == RES_WAITING).limit(1))
            if anyone.first() is None:
                return 0
        # How many GPUs each ready host has free, per model, in one grouped query
        # (bot.app.held.gpu_counts): best fit needs no more to choose a host, and only the
        # chosen host's free GPUs are then read. The tick and each reserve stay flat as the
        # fleet grows: reading (and weighing) every GPU of a hundred hosts was most of a
        # reserve's time.
        free: dict[tuple[int, str], int] = {}  # (host, model): free GPUs, in fit order
        present: dict[int, int] = {}  # a host's price is shared by these
        for c in counts if counts is not None else gpu_counts(s):
            if c.host_state == HOST_READY:
                present[c.host_id] = present.get(c.host_id, 0) + c.present
                free[(c.host_id, c.model)] = c.free
        # Each waiting row is read under its lock (ids in order) before it is granted:
        # an extend or a cancel that committed meanwhile is seen, not written over.
        waiting = sorted(
            locked_rows(
                s,
                select(Reservation)
                .where(Reservation.state == RES_WAITING)
                .order_by(col(Reservation.id)),
            ),
            key=lambda r: (r.requested_at, r.id or 0),
        )
        blocked_models: set[str | None] = set()
        granted = 0
        for res in waiting:
            if (
                None in blocked_models
                or res.gpu_model in blocked_models
                or (res.gpu_model is None and blocked_models)
            ):
                continue
            choice = self._pick(free, res.gpu_model, res.gpu_count)
            if choice is None:
                blocked_models.add(res.gpu_model)
                continue
            host_id, gpu_model = choice
            host = s.get(Host, host_id)
            assert host is not None
            # Budget (bot.app.budgets): a grant that would go over is cancelled, with a DM.
            rate = Decimal(str(gpu_share(host.hourly_usd, present[host_id])))
            refusal = budgets.grant_refusal(s, res, rate * res.gpu_count, now, self.settings)
            if refusal is not None:
                if res.id == quiet_id:
                    raise UserError(refusal)
                self._end(s, res, RES_CANCELLED, now)
                info = self._info(s, res)
                text = f"Reservation #{res.id} was cancelled, not granted: {refusal}"
                self.notify_dm(
                    s,
                    info.user_key,
                    views.message(text).view,
                    now,
                    dedupe=f"budget-cancel:{res.id}",
                )
                continue
            # The chosen host's free GPUs of that model, by index (what this pass granted
            # already is flushed, so not among them).
            picked = [
                _FreeGpu(gpu_id, gpu_model, index)
                for gpu_id, index in free_gpus(s, host_id, gpu_model)[: res.gpu_count]
            ]
            assert len(picked) == res.gpu_count, "the counts and the GPUs disagree"
            self._grant(s, res, host, picked, now, present[host_id])
            free[(host_id, gpu_model)] -= res.gpu_count
            granted += 1
            if res.id != quiet_id:
                info = self._info(s, res)
                self.notify_dm(
                    s,
                    info.user_key,
                    views.granted_view(info, now, self.settings.timezone, was_waiting=True),
                    now,
                    dedupe=f"granted:{res.id}",
                )
        return granted

    @staticmethod
    def _pick(
        free: dict[tuple[int, str], int], model: str | None, count: int
    ) -> tuple[int, str] | None:
        """The host (its id) and the GPU model to take `count` free GPUs of, by best fit
        (bot.domain.best_fit) over each host's free GPUs per model, in host id order: a
        request for no model in particular may take any one model, never a mix."""
        options = [(key, n) for key, n in free.items() if model in (None, key[1])]
        return best_fit(options, count)

    def _grant(
        self,
        s: Session,
        res: Reservation,
        host: Host,
        gpus: list[_FreeGpu],
        now: datetime,
        present: int,
    ) -> None:
        assert host.id is not None and res.id is not None
        res.state = RES_ACTIVE
        res.granted_at = now
        res.ends_at = now + timedelta(seconds=res.duration_s)
        res.host_id = host.id
        s.add(res)
        self.open_usage(s, host, gpus, res.user_id, now, reservation_id=res.id, gpu_count=present)
        # What `_info` would read back for this reservation: its host (held here, as the
        # session keeps only weak references) and its GPUs' indexes and models.
        s.info.setdefault(_GRANTED, {})[res.id] = (host, sorted((g.index, g.model) for g in gpus))
        s.flush()

    def open_usage(
        self,
        s: Session,
        host: Host,
        gpus: Sequence[GpuRef],
        user_id: int,
        now: datetime,
        *,
        reservation_id: int | None = None,
        run_id: int | None = None,
        gpu_count: int | None = None,
    ) -> None:
        """Starts the clock on these GPUs for a reservation or a run: each at its share
        of the host's hourly price, in the host's market. The partial unique index
        refuses a GPU that is already held. A caller that has counted the host's present
        GPUs already (the grant pass) passes `gpu_count`, sparing the count query."""
        assert host.id is not None
        if gpu_count is None:
            gpu_count = self.gpu_count(s, host.id)
        per_gpu = gpu_share(host.hourly_usd, gpu_count)
        for g in gpus:
            assert g.id is not None
            s.add(
                UsageInterval(
                    gpu_id=g.id,
                    host_id=host.id,
                    user_id=user_id,
                    reservation_id=reservation_id,
                    run_id=run_id,
                    started_at=now,
                    usd_per_hour=per_gpu,
                    market=host.market,
                )
            )

    def gpu_count(self, s: Session, host_id: int) -> int:
        """The host's present GPUs, among which its price is shared; public because runs
        meter their GPUs by the same share (bot.app.ports.Core)."""
        n = s.exec(
            select(func.count())
            .select_from(Gpu)
            .where(Gpu.host_id == host_id, col(Gpu.present).is_(True))
        ).one()
        return int(n)

    # --- release and extend ---------------------------------------------------------

    @retrying
    def release(self, actor: Actor, cmd: Release) -> views.Reply:
        with transaction(self.engine) as s:
            # The pool, then each reservation under its lock: what is ended is the state
            # as it is now, never a "waiting" read before a grant pass made it active.
            lock_pool(s)
            user = self.user_row(s, actor.key, actor.name)
            now = self.clock.now()
            if cmd.reservation_id is not None:
                res = locked(s, Reservation, cmd.reservation_id)
                if res is None:
                    raise UserError(
                        f"There is no reservation #{cmd.reservation_id}.", "/gpu release [ID|all]"
                    )
                if res.user_id != user.id and not actor.admin:
                    raise UserError(
                        f"Reservation #{res.id} is not yours; only its holder or an admin can release it."
                    )
                if res.state not in RES_OPEN_STATES:
                    raise UserError(
                        f"Reservation #{res.id} is already {res.state}.", "/gpu release [ID|all]"
                    )
                targets = [res]
            else:
                targets = locked_rows(
                    s,
                    select(Reservation)
                    .where(
                        Reservation.user_id == user.id,
                        col(Reservation.state).in_(RES_OPEN_STATES),
                    )
                    .order_by(col(Reservation.id)),
                )
                if not targets:
                    raise UserError(
                        "You hold no GPUs and are not waiting for any.", "/gpu release [ID|all]"
                    )
                if len(targets) > 1 and not cmd.all:
                    ids = ", ".join(f"#{r.id}" for r in targets)
                    raise UserError(
                        f"You have {len(targets)} reservations ({ids}); say which, or `all`.",
                        "/gpu release [ID|all]",
                    )
            done = []
            for res in targets:
                self._end(s, res, RES_RELEASED if res.state == RES_ACTIVE else RES_CANCELLED, now)
                info = self._info(s, res)
                done.append(info)
                if res.user_id != user.id:
                    audit(actor, "release", f"reservation #{res.id} of {info.user_key}", session=s)
                    self.notify_dm(
                        s,
                        info.user_key,
                        views.released_by_admin_dm(info, actor.name),
                        now,
                        dedupe=f"admin-release:{res.id}",
                    )
            self.grant_pass(s, now)
            return views.Reply(views.released_view(done, actor.key))

    def _end(self, s: Session, res: Reservation, state: str, at: datetime) -> None:
        """Ends an open reservation: its usage closed, its state final. The caller holds
        the pool and read `res` under its lock, so the state checked is the current one."""
        if res.state not in RES_OPEN_STATES:
            raise RuntimeError(f"reservation #{res.id} is {res.state} already; not ended again")
        end_held(s, at, reservation_id=res.id)
        res.state = state
        res.ended_at = at
        s.add(res)
        s.flush()

    @retrying
    def extend(self, actor: Actor, cmd: Extend) -> views.Reply:
        usage = "/gpu extend [ID] DURATION"
        with transaction(self.engine) as s:
            # The length decides when it ends and what a grant sets: under the pool, with
            # the row read under its lock (db.session's lock order).
            lock_pool(s)
            user = self.user_row(s, actor.key, actor.name)
            now = self.clock.now()
            if cmd.reservation_id is not None:
                found = locked(s, Reservation, cmd.reservation_id)
                if found is None:
                    raise UserError(f"There is no reservation #{cmd.reservation_id}.", usage)
                res = found
                if res.user_id != user.id and not actor.admin:
                    raise UserError(
                        f"Reservation #{res.id} is not yours; only its holder or an admin can extend it."
                    )
            else:
                mine = list(
                    s.exec(
                        select(Reservation).where(
                            Reservation.user_id == user.id,
                            col(Reservation.state).in_(RES_OPEN_STATES),
                        )
                    )
                )
                if not mine:
                    raise UserError("You have no reservation to extend.", usage)
                if len(mine) > 1:
                    ids = ", ".join(f"#{r.id}" for r in mine)
                    raise UserError(f"You have {len(mine)} reservations ({ids}); say which.", usage)
                found = locked(s, Reservation, mine[0].id)
                assert found is not None  # the pool is held: nothing ended it meanwhile
                res = found
            if res.state not in RES_OPEN_STATES:
                raise UserError(f"Reservation #{res.id} is already {res.state}.", usage)
            total = timedelta(seconds=res.duration_s) + cmd.duration
            if total > self.settings.max_duration:
                left = self.settings.max_duration - timedelta(seconds=res.duration_s)
                can = f"at most {format_duration(left)} more" if left > timedelta(0) else "no more"
                raise UserError(
                    f"A reservation can last at most {format_duration(self.settings.max_duration)}; "
                    f"#{res.id} can take {can}.",
                    usage,
                )
            if res.user_id != user.id:
                holder = s.get(User, res.user_id)
                target = f"reservation #{res.id} of {holder.key if holder else res.user_id}"
                audit(actor, "extend", f"{target} by {format_duration(cmd.duration)}", session=s)
            res.duration_s = int(total.total_seconds())
            if res.state == RES_ACTIVE:
                assert res.granted_at is not None
                res.ends_at = res.granted_at + total
                res.warned_at = None
            s.add(res)
            s.flush()
            info = self._info(s, res)
            if res.state == RES_WAITING:
                text = f"Reservation #{res.id} is still waiting; it will last {format_duration(total)} once granted."
                return views.message(text)
            return views.Reply(views.extended_view(info, now, self.settings.timezone, cmd.duration))

    # --- status -----------------------------------------------------------------------

    def status(self, actor: Actor, cmd: Status) -> views.Reply:
        hosts, waiting, mine = self._status_data(actor.key)
        snap = StatusSnapshot(
            now=self.clock.now(),
            hosts=tuple(hosts),
            waiting=tuple(waiting),
            mine=tuple(mine),
            mine_only=cmd.mine_only,
            provider=self.settings.provider,
            tz=self.settings.timezone,
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
        ttl = self.settings.status_cache_s

        def fresh(entry: tuple[int, float] | None) -> bool:
            return entry is not None and entry[0] == generation and started - entry[1] < ttl

        # The shared part is computed by one thread at a time: when it expires, the
        # burst of requests waiting on it reuses one result instead of stampeding.
        with self._status_lock:
            shared = self._status_shared
            if shared is None or not fresh(shared[:2]):
                with transaction(self.engine, write=False) as s:
                    hosts = self._hosts(s)
                    shared = (generation, started, hosts, self._waiting(s, hosts))
                self._status_shared = shared
            mine_hit = self._status_mine.get(user_key)
        _, _, hosts, waiting = shared
        if mine_hit is not None and fresh(mine_hit[:2]):
            return hosts, waiting, mine_hit[2]
        mine: list[ReservationInfo] = []
        with transaction(self.engine, write=False) as s:
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
                mine = [self._info(s, r, hosts, position=pos.get(r.id)) for r in mine_rows]
        with self._status_lock:
            if len(self._status_mine) > 4096:
                self._status_mine.clear()
            # Stamped with the generation read before the queries: a write committed
            # meanwhile makes the next call recompute.
            self._status_mine[user_key] = (generation, started, mine)
        return hosts, waiting, mine

    # --- costs ------------------------------------------------------------------------

    def costs(
        self, period: str, user_key: str | None = None
    ) -> tuple[Window, dict[str, Decimal], dict[str, str]]:
        """Each user's cost over the calendar period (team time zone), from the usage
        intervals: every GPU-second held at its share of the host's price. Returns the
        window, cost per user key, and display names. Only `user_key` when given."""
        now = self.clock.now()
        window = period_window(period, now, self.settings.timezone)  # type: ignore[arg-type]
        with transaction(self.engine, write=False) as s:
            user_id: int | None = None
            if user_key is not None:
                user = s.exec(select(User).where(User.key == user_key)).first()
                if user is None:
                    return window, {}, {}
                user_id = user.id
            costs = window_costs(s, window, now, user_id).users()
            keys = set(costs)
            names = (
                {u.key: u.display_name for u in s.exec(select(User).where(col(User.key).in_(keys)))}
                if keys
                else {}
            )
        return window, costs, names

    def team_bill(self, period: str, catalog: Catalog | None = None) -> TeamBill:
        """`/gpu cost team`: users, idle overhead and the instances' bill (bot.app.billing)."""
        now = self.clock.now()
        window = period_window(period, now, self.settings.timezone)  # type: ignore[arg-type]
        with transaction(self.engine, write=False) as s:
            return team_bill(s, window, now, catalog)

    def _hosts(self, s: Session) -> list[HostState]:
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
        gpu_cols: tuple[Any, ...] = (Gpu.id, Gpu.host_id, Gpu.index, Gpu.model, Gpu.memory_gb)
        gpus = conn.execute(
            select(*gpu_cols)
            .where(col(Gpu.present).is_(True))
            .order_by(col(Gpu.host_id), col(Gpu.index))
        ).all()
        holder = {h.interval.gpu_id: h for h in who_holds(s)} if gpus else {}
        by_host: dict[int, list[GpuState]] = {}
        for gpu_id, host_id, index, model, memory_gb in gpus:
            h = holder.get(gpu_id)
            if h is None:
                state = GpuState(gpu_id=gpu_id, index=index, model=model, memory_gb=memory_gb)
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
            down_now = state_ == HOST_UNREACHABLE
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
                    down_since=down if down_now else None,
                    down_reason=why if down_now else None,
                )
            )
        return out

    def _waiting(self, s: Session, hosts: list[HostState] | None = None) -> list[ReservationInfo]:
        rows = s.exec(
            select(Reservation)
            .where(Reservation.state == RES_WAITING)
            .order_by(col(Reservation.requested_at), col(Reservation.id))
        ).all()
        return [self._info(s, r, hosts, position=i + 1) for i, r in enumerate(rows)]

    def _info(
        self,
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
            known_host: Host | None = None
            cached: tuple[Host, list[tuple[int, str]]] | None = s.info.get(_GRANTED, {}).get(res.id)
            if cached is not None:
                known_host, granted = cached
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
            host = known_host
            if host is None and res.host_id is not None:
                host = s.get(Host, res.host_id)
            if host is not None:
                known = {h.name: h for h in hosts} if hosts is not None else {}
                host_state = known.get(host.name) or _host_state(host, [])
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
        return ReservationInfo(
            id=res.id,
            user_key=user.key,
            user_name=user.display_name,
            state=res.state,
            gpu_model=res.gpu_model,
            gpu_count=res.gpu_count,
            duration_s=res.duration_s,
            requested_at=res.requested_at,
            granted_at=res.granted_at,
            ends_at=res.ends_at,
            ended_at=res.ended_at,
            host=host_state,
            gpu_indexes=indexes,
            gpu_models=models,
            position=position,
        )

    # --- the worker's tick -------------------------------------------------------------

    @retrying
    def tick(self) -> TickReport:
        """Ends what is due, warns what is near, grants what became free. Idempotent.

        Most ticks have nothing to do: one indexed read says so without the write
        transaction and the pool lock. What
        becomes due after that read is done by the next tick, as it would be had this
        tick run a moment earlier; a request that starts waiting runs its own grant pass.
        """
        now = self.clock.now()
        lead = self.settings.expiry_warning
        with transaction(self.engine, write=False) as s:
            due = s.exec(
                select(Reservation.id)
                .where(
                    or_(
                        col(Reservation.state) == RES_WAITING,
                        and_(
                            col(Reservation.state) == RES_ACTIVE,
                            or_(
                                col(Reservation.ends_at) <= now,
                                and_(
                                    col(Reservation.warned_at).is_(None),
                                    col(Reservation.ends_at) <= now + lead,
                                ),
                            ),
                        ),
                    )
                )
                .limit(1)
            ).first()
        if due is None:
            return TickReport(expired=0, warned=0, granted=0)
        with transaction(self.engine) as s:
            lock_pool(s)  # expiry frees GPUs: the pool first (db.session's lock order)
            now = self.clock.now()
            expired = 0
            for res in locked_rows(
                s,
                select(Reservation)
                .where(Reservation.state == RES_ACTIVE, col(Reservation.ends_at) <= now)
                .order_by(col(Reservation.id)),
            ):
                assert res.ends_at is not None
                self._end(s, res, RES_EXPIRED, res.ends_at)
                info = self._info(s, res)
                self.notify_dm(
                    s, info.user_key, views.expired_view(info), now, dedupe=f"expired:{res.id}"
                )
                expired += 1
            warned = 0
            lead = self.settings.expiry_warning
            for res in locked_rows(
                s,
                select(Reservation)
                .where(
                    Reservation.state == RES_ACTIVE,
                    col(Reservation.warned_at).is_(None),
                    col(Reservation.ends_at) <= now + lead,
                )
                .order_by(col(Reservation.id)),
            ):
                assert res.ends_at is not None and res.granted_at is not None
                res.warned_at = now
                s.add(res)
                # A reservation shorter than the warning lead needs no warning: its
                # holder asked for that little time a moment ago.
                if res.ends_at - res.granted_at <= lead:
                    continue
                info = self._info(s, res)
                self.notify_dm(
                    s,
                    info.user_key,
                    views.expiry_warning_view(info, now, self.settings.timezone),
                    now,
                    dedupe=f"warn:{res.id}:{res.ends_at.isoformat()}",
                )
                warned += 1
            granted = self.grant_pass(s, now)
            return TickReport(expired=expired, warned=warned, granted=granted)

    # --- the outbox ----------------------------------------------------------------------

    def notify_dm(
        self,
        s: Session,
        user_key: str,
        view: views.View,
        now: datetime,
        dedupe: str | None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        self._notify(s, "dm", user_key, view, now, dedupe, attachment)

    def notify_channel(
        self,
        view: views.View,
        dedupe: str | None = None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        """A post to the team channel; `attachment` is (file name, bytes), e.g. a chart."""
        with transaction(self.engine) as s:
            self._notify(
                s, "channel", self.settings.channel, view, self.clock.now(), dedupe, attachment
            )

    def _notify(
        self,
        s: Session,
        kind: str,
        target: str,
        view: views.View,
        now: datetime,
        dedupe: str | None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        enqueue(s, kind, target, view, now, dedupe, attachment)

    def pending_notifications(self, limit: int = 50) -> list[OutboxItem]:
        with transaction(self.engine, write=False) as s:
            now = self.clock.now()
            rows = s.exec(
                select(Notification)
                .where(col(Notification.sent_at).is_(None), col(Notification.deliver_after) <= now)
                .order_by(col(Notification.id))
                .limit(limit)
            ).all()
            return [
                OutboxItem(
                    id=n.id or 0,
                    kind=n.kind,
                    target=n.target,
                    view=views.View.from_dict(n.view),
                    attempts=n.attempts,
                    maybe_sent=n.last_error == IN_FLIGHT,
                    attachment=(n.attachment_name or "attachment", n.attachment)
                    if n.attachment is not None
                    else None,
                    edit_of=n.edit_of,
                )
                for n in rows
            ]

    def mark_attempt(self, item_id: int, lease: timedelta = timedelta(seconds=60)) -> bool:
        """Claims one notification for sending, before the send starts; False when
        another deliverer (a replica, the worker) claimed it first.

        The claim pushes `deliver_after` out by `lease`, so nobody else picks the item
        up meanwhile. If this process dies mid-send, the item becomes due again after
        the lease with `last_error` still "in flight": its outcome is unknown, and a
        notifier that can check (Slack: the message's metadata) must check before
        sending it again.
        """
        now = self.clock.now()
        with transaction(self.engine) as s:
            claimed = s.exec(
                update(Notification)
                .where(
                    col(Notification.id) == item_id,
                    col(Notification.sent_at).is_(None),
                    col(Notification.deliver_after) <= now,
                )
                .values(
                    attempts=Notification.attempts + 1,
                    last_error=IN_FLIGHT,
                    deliver_after=now + lease,
                )
            )
            return bool(claimed.rowcount == 1)

    def mark_sent(self, item_id: int) -> None:
        with transaction(self.engine) as s:
            n = s.get(Notification, item_id)
            if n is not None and n.sent_at is None:
                n.sent_at = self.clock.now()
                n.last_error = None
                s.add(n)

    def mark_failed(self, item_id: int, error: str, retry_after: timedelta) -> None:
        with transaction(self.engine) as s:
            n = s.get(Notification, item_id)
            if n is not None and n.sent_at is None:
                n.last_error = error[:500]
                n.deliver_after = self.clock.now() + retry_after
                s.add(n)


def _host_state(host: Host, gpus: list[GpuState]) -> HostState:
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
        down_since=host.down_since if host.state == HOST_UNREACHABLE else None,
        down_reason=host.down_reason if host.state == HOST_UNREACHABLE else None,
    )
