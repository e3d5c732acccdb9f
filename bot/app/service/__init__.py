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

The parts, one module each: `reservations` (reserve, release, extend, tick), `grants`
(the grant pass, usage intervals), `status` (status, costs), `notices` (the outbox);
`common` holds what they share. GpuService keeps users and hosts and composes the parts;
it is the `Core` port the runs, the fleet and the faces hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.app.burst.offers import Bursts
from bot.app.burst.summary import BurstWeek
from bot.app.config import Settings
from bot.app.money.billing import TeamBill, note_host_state
from bot.app.places import Places, Wiring
from bot.app.ports import Actor as Actor  # re-exported: the faces take it with the service
from bot.app.ports import (
    GpuRef,
    Holder,
    HostDisplay,
    HostSeat,
    NoHolder,
    Provisioner,
    Supply,
)
from bot.app.runs import RunService
from bot.app.runs.processes import ProcessExecutor
from bot.app.service.common import IN_FLIGHT, OutboxItem, TickReport
from bot.app.service.grants import Grants
from bot.app.service.notices import Notices
from bot.app.service.reservations import Reservations
from bot.app.service.status import StatusBoard
from bot.app.watching.held import GpuCount
from bot.domain import views
from bot.domain.clock import Clock
from bot.domain.commands import Extend, Release, Reserve, Status
from bot.domain.errors import UserError
from bot.domain.metering import Window
from bot.domain.readmodels import HomeSnapshot, HostState
from db.models import HOST_READY, Gpu, Host, User
from db.session import is_postgres, lock_pool, retrying, transaction
from provisioning.base import Instance
from provisioning.catalog import Catalog

__all__ = ["IN_FLIGHT", "NO_RUNS", "Actor", "GpuService", "OutboxItem", "TickReport", "Wire"]

# The composition root's connect: the providers' wirings, made with the service they serve.
Wire = Callable[["GpuService"], Sequence[Wiring]]

# What `/gpu run` says where no configured place can run anything (a bot of listed hosts).
NO_RUNS = "`/gpu run` needs hosts that can run training; none is configured here."

# Built once: every command reads its user by key, and building the query was a tenth
# of a reserve's CPU.
_USER_BY_KEY = select(User).where(col(User.key) == bindparam("key"))

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key for host syncs ("gpubsync" in ASCII, far from the leader's).
_SYNC_LOCK_KEY = 0x6770756273796E63


class GpuService:
    """Users and hosts, and the use cases each handed to its part (a facade, not a base
    class: the parts reach each other only through it)."""

    def __init__(
        self, engine: Engine, settings: Settings, clock: Clock, wire: Wire | None = None
    ) -> None:
        """`wire`: the places, connected to this service while it is made (the
        composition root's, bot.faces.runtime; a test's own); none: a pool of whatever
        hosts are synced, reservations only."""
        self.engine = engine
        self.settings = settings
        self.clock = clock
        # Who wants to hear that work appeared or GPUs came free (the worker in this
        # process: it places runs at once instead of on its next tick).
        self._on_work: list[Callable[[], None]] = []
        # The parts (bot.app.service.*): each holds this facade as its core.
        self.grants = Grants(self)
        self.reservations = Reservations(self, self.grants)
        self.board = StatusBoard(self)
        self.notices = Notices(self)
        # The places, connected once (a provider lists its hosts on the service as it
        # connects, so the parts above come first) and never changed after.
        self.places = Places(
            wire(self) if wire is not None else (),
            provider_of=self._provider_of,
            executor_for=lambda access: ProcessExecutor(access, self.clock, self.nudge),
        )
        own = self.places.runs
        self._runs = (
            RunService(
                self,
                own.access,
                own.catalog,
                refusal=own.refusal,
                executor=own.executor,
                bursting=self.places.bursting,
            )
            if own is not None
            # No place runs: it quotes nothing, so the shipped catalog (model names), which
            # a broken refreshed price file cannot make fail at start.
            else RunService(self, _NoHosts(), Catalog.load(), refusal=NO_RUNS)
        )

        # Owned places with a cloud after them: a long wait is offered the cloud, priced.
        cloud = self.places.cloud
        self.bursts: Bursts | None = (
            Bursts(
                self,
                self._runs,
                self._provider_of,
                cloud.name,
                cloud.runs.catalog,
                self.places.label,
                frozenset(w.name for w in self.places.owned),
                # A cluster that holds reservations itself (its holding jobs) keeps them.
                reservations=isinstance(self.places.holder, NoHolder),
            )
            if self.places.bursting and cloud is not None and cloud.runs is not None
            else None
        )

    # --- what the places decide (read-only: bot.app.places) ---------------------------

    @property
    def runs(self) -> RunService:
        """Training runs on the place that runs them; where none can, a run service that
        refuses `/gpu run` (NO_RUNS) and shows an empty line."""
        return self._runs

    @property
    def supply(self) -> Supply:
        """What the pool can grow into (a cloud's catalog); a fixed pool refuses what no
        host fits, a cloud queues it for the fleet to launch."""
        return self.places.supply

    @property
    def display(self) -> HostDisplay:
        """How hosts read in replies: each in its own provider's words."""
        return self.places.display

    @property
    def holder(self) -> Holder:
        """Who holds GPUs for reservations a cluster grants; nobody where gpubot grants
        every GPU itself."""
        return self.places.holder

    @property
    def fleet(self) -> Provisioner | None:
        """The fleet of the place that buys machines: runs hand it the scheduler's
        Launch/Start. None where no place buys."""
        return self.places.fleet

    @property
    def upkeep(self) -> tuple[Callable[[], object], ...]:
        """The places' periodic upkeep, which the worker runs every few seconds."""
        return self.places.upkeep

    def place_lines(self, hosts: Sequence[HostState]) -> list[str]:
        return self.places.lines(hosts, self.settings.burst_after_s)

    def _provider_of(self, host_name: str) -> str | None:
        """The provider of a host row, by its name (several places route by it)."""
        with transaction(self.engine, write=False) as s:
            return s.exec(select(Host.provider).where(Host.name == host_name)).first()

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

    @retrying
    def actor(
        self,
        key: str,
        display_name: str | None = None,
        *,
        name_if_new: str | None = None,
        create: bool = True,
    ) -> Actor:
        """Creates the user on first sight; admins come from configuration only.
        `display_name` renames a known user; `name_if_new` only names a new one (the
        Slack face's payload name, until users.info answers after the ack). `create=False`
        (a command that only reads): someone new is answered as they will be named, and
        their row is left for the caller to make after the answer, off its latency."""
        key = key.strip().lstrip("@")
        if not key:
            raise UserError("Who are you? A user name is needed.")
        # Read first: nearly every request comes from someone known, and a read does
        # not queue on SQLite's write lock or drop the status cache.
        with transaction(self.engine, write=False) as s:
            user = s.exec(_USER_BY_KEY, params={"key": key}).first()
        if user is None and not create:
            return Actor(
                key=key, name=display_name or name_if_new or key, admin=self.settings.is_admin(key)
            )
        if user is None or (display_name and user.display_name != display_name):
            name = display_name or (name_if_new if user is None else None)
            # A new person's row alone changes no view another person has cached (they
            # hold nothing yet): /gpu status's cache stays for the burst of first commands.
            renames = user is not None
            with transaction(self.engine, seen=renames) as s:
                user = self.user_row(s, key, name, rename=bool(display_name))
        return Actor(key=user.key, name=user.display_name, admin=self._is_admin(user))

    def _is_admin(self, user: User) -> bool:
        # Only Settings.admins (GPUBOT_ADMINS, the config file): `user.role` is a database
        # row, and anything that can write a row (a run that once read DATABASE_URL, a
        # psql session) must not be able to make itself an admin. The column stays unread.
        return self.settings.is_admin(user.key)

    def user_row(
        self, s: Session, key: str, name: str | None = None, *, rename: bool = False
    ) -> User:
        """The user's row, made on first sight and named `name` (else the key). Only
        `rename` gives a known user `name`: a verb passes the name its actor was made
        with, which can be older than the name Slack's users.info has since written,
        and a verb that renamed would put the old name back."""
        user = s.exec(_USER_BY_KEY, params={"key": key}).first()
        if user is None:
            user = User(key=key, display_name=name or key, created_at=self.clock.now())
            try:
                with s.begin_nested():
                    s.add(user)
            except IntegrityError:  # created by a concurrent first request
                user = s.exec(_USER_BY_KEY, params={"key": key}).one()
        elif rename and name and user.display_name != name:
            user.display_name = name
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
                was = host.state if host is not None else None
                if host is None:
                    host = Host(name=inst.name, provider=inst.provider, created_at=now)
                host.provider = inst.provider
                host.instance_id = inst.instance_id
                host.instance_type = inst.instance_type
                host.market = inst.market
                if inst.state == HOST_READY and was != HOST_READY:
                    host.ready_at = now  # idle from here (db.models.Host.ready_at)
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

    # --- the parts' verbs -------------------------------------------------------------

    def reserve(self, actor: Actor, cmd: Reserve, request_key: str | None = None) -> views.Reply:
        return self.reservations.reserve(actor, cmd, request_key)

    def release(self, actor: Actor, cmd: Release) -> views.Reply:
        return self.reservations.release(actor, cmd)

    def extend(self, actor: Actor, cmd: Extend) -> views.Reply:
        return self.reservations.extend(actor, cmd)

    def tick(self) -> TickReport:
        """Ends what is due, warns what is near, grants what became free. Idempotent."""
        return self.reservations.tick()

    def grant_pass(
        self,
        s: Session,
        now: datetime,
        counts: list[GpuCount] | None = None,
    ) -> int:
        """Grants waiting reservations in order while GPUs allow; returns how many."""
        return self.grants.grant_pass(s, now, counts=counts)

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
        usd_per_gpu_hour: float | None = None,
    ) -> None:
        """Starts the clock on these GPUs for a reservation or a run: each at its share
        of the host's hourly price, in the host's market. The partial unique index
        refuses a GPU that is already held. A caller that has counted the host's present
        GPUs already (the grant pass) passes `gpu_count`, sparing the count query."""
        return self.grants.open_usage(
            s,
            host,
            gpus,
            user_id,
            now,
            reservation_id=reservation_id,
            run_id=run_id,
            gpu_count=gpu_count,
            usd_per_gpu_hour=usd_per_gpu_hour,
        )

    def gpu_count(self, s: Session, host_id: int) -> int:
        """The host's present GPUs, among which its price is shared; public because runs
        meter their GPUs by the same share (bot.app.ports.Core)."""
        return self.grants.gpu_count(s, host_id)

    def status(self, actor: Actor, cmd: Status) -> views.Reply:
        return self.board.status(actor, cmd)

    def home(self, actor: Actor) -> HomeSnapshot:
        """App Home's read: the pool summed up, the line, the caller's reservations and
        cost this week (bot.app.service.status.StatusBoard.home)."""
        return self.board.home(actor)

    def costs(
        self, period: str, user_key: str | None = None
    ) -> tuple[Window, dict[str, Decimal], dict[str, str]]:
        """Each user's cost over the calendar period (team time zone), from the usage
        intervals: every GPU-second held at its share of the host's price. Returns the
        window, cost per user key, and display names. Only `user_key` when given."""
        return self.board.costs(period, user_key)

    def cost_sides(
        self, period: str, user_key: str | None = None
    ) -> tuple[dict[str, tuple[Decimal, Decimal]], dict[str, str], BurstWeek | None]:
        """Each user's cost split (the team's own GPUs, bought ones), their names, and
        the bursting."""
        return self.board.cost_sides(period, user_key)

    def team_bill(self, period: str, catalog: Catalog | None = None) -> TeamBill:
        """`/gpu cost team`: users, idle overhead and the instances' bill (bot.app.money.billing)."""
        return self.board.team_bill(period, catalog)

    def notify_dm(
        self,
        s: Session,
        user_key: str,
        view: views.View,
        now: datetime,
        dedupe: str | None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        return self.notices.notify_dm(s, user_key, view, now, dedupe, attachment)

    def notify_channel(
        self,
        view: views.View,
        dedupe: str | None = None,
        attachment: tuple[str, bytes] | None = None,
    ) -> None:
        """A post to the team channel; `attachment` is (file name, bytes), e.g. a chart."""
        return self.notices.notify_channel(view, dedupe, attachment)

    def pending_notifications(self, limit: int = 50) -> list[OutboxItem]:
        return self.notices.pending_notifications(limit)

    def mark_attempt(self, item_id: int, lease: timedelta = timedelta(seconds=60)) -> bool:
        """Claims one notification for sending, before the send starts; False when
        another deliverer (a replica, the worker) claimed it first."""
        return self.notices.mark_attempt(item_id, lease)

    def mark_sent(self, item_id: int) -> None:
        return self.notices.mark_sent(item_id)

    def mark_failed(self, item_id: int, error: str, retry_after: timedelta) -> None:
        return self.notices.mark_failed(item_id, error, retry_after)


class _NoHosts:
    """The host access of a service no place runs for: it reaches nothing."""

    def runner_for(self, host_name: str) -> HostSeat | None:
        return None
