"""Health of the team's own SSH hosts, checked off the tick.

A static host is someone's server: it reboots, its network drops, its disk fills. The
bot must neither grant GPUs on a host that does not answer nor hang its tick dialling
one. So each host is checked by a job of its own, on a small thread pool, at most one
check per host in flight (`HostChecker.tick` only hands work out and returns):

- A check dials the host, prepares it (the bootstrap: minutes the first time, a marker
  read after) and reads its inventory with the host's own venv and code. A host given
  without a GPU list gets its GPUs from that inventory, so it is probed after its
  bootstrap, never with a bare `python3` that cannot import `training`.
- A failed check counts; after `DOWN_AFTER` in a row (at once when the bootstrap itself
  fails: retrying pip does not fix a full disk) the host is marked unreachable with the
  time it stopped answering and why, so grants and placements (which take ready hosts
  only) pass it by, and the owners of work on it or waiting for its GPUs are told once.
- A failing host is dialled again after a backoff that doubles per failure, capped, so a
  host that refuses connections costs a dial every few minutes, not one a tick.
- The first check that succeeds brings it back as ready; nobody has to do anything.

The state lives on the host row (`down_since`, `down_reason`, `check_failures`,
`next_check_at`), so `/gpu status` reads it and a restarted worker keeps backing off.

Cloud instances are set up on the same pool (`cloud=` the provider's name): the fleet's
job only launches and reconciles, leaving a running instance *pending*, and a check here
dials it and bootstraps it (about 70 s from nothing) off the tick and off the fleet's
lock. It becomes ready (grantable, placeable) when its setup finishes. An instance whose
SSH does not answer yet is booting, not failing: it is dialled again soon, without
backoff (the fleet stops one that never answers, `BOOT_TIMEOUT`). A failed setup marks it
"setup failed: <reason>" at once, tells whoever waits, and is retried with the backoff.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, or_
from sqlmodel import Session, col, select

from bot.app.hosts import room
from bot.app.hosts.remote import RemoteAccess
from bot.app.money.billing import note_host_state
from bot.app.service import GpuService
from bot.domain import views
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_TERMINATED,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RES_WAITING,
    Gpu,
    Host,
    Reservation,
    TrainingRun,
    User,
)
from db.session import transaction
from provisioning.base import GpuDevice, Instance, ProvisioningError
from provisioning.hosts import StaticHost, parse_inventory
from provisioning.ssh import SshError, SshTarget

log = logging.getLogger(__name__)

# Failed checks in a row before a host is marked down: one lost packet is not an outage.
DOWN_AFTER = 3
# How often a healthy host is checked, and the backoff for a failing one.
CHECK_EVERY = timedelta(minutes=1)
BACKOFF_FIRST = timedelta(seconds=30)
BACKOFF_MAX = timedelta(minutes=15)
# A liveness dial and an inventory read; the bootstrap has its own, longer, timeouts.
DIAL_TIMEOUT_S = 15.0
INVENTORY_TIMEOUT_S = 120.0
# How soon a booting cloud instance (SSH not answering yet) is dialled again.
BOOT_POLL = timedelta(seconds=15)
_RUN_ON_HOST = ("starting", "running", "cancelling")


def backoff(failures: int) -> timedelta:
    """The wait before the next check after `failures` failed ones in a row: 30 s, 1 min,
    2 min, … up to 15 min."""
    if failures <= 0:
        return CHECK_EVERY
    return min(BACKOFF_FIRST * (1 << min(failures - 1, 16)), BACKOFF_MAX)


@dataclass(frozen=True)
class CheckResult:
    host: str
    ok: bool
    # What the check found wrong, in the words the status shows; "" when ok.
    reason: str = ""
    gpus: tuple[GpuDevice, ...] = ()
    # A cloud instance still booting (or gone meanwhile): nothing failed, nothing changes
    # but the time of its next check.
    booting: bool = False
    # It answers, but has less free disk than `min_free_mb` where runs live (bot.app.hosts.room):
    # out of the pool at once, its SSH still used for the runs on it.
    full: bool = False


def cpu_only(gpus: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
    """A host whose inventory lists no NVIDIA GPU still runs CPU work: one CPU slot,
    modelled "cpu" as on this machine, rather than a host nobody can use."""
    return gpus or (GpuDevice(index=0, model="cpu"),)


class HostChecker:
    """Checks every static host on its own thread; one check per host at a time; `owner`:
    the provider the static hosts are listed under. With `cloud` (a provider's name), also
    sets up that provider's instances that are not ready yet (pending, or down after a
    failed setup, or ready but not answering their last dial)."""

    def __init__(
        self,
        service: GpuService,
        access: RemoteAccess,
        hosts: tuple[StaticHost, ...],
        *,
        owner: str = "",
        cloud: str | None = None,
        down_after: int = DOWN_AFTER,
        workers: int = 4,
    ) -> None:
        self.service = service
        self.access = access
        self.hosts = {h.name: h for h in hosts}
        self.owner = owner
        self.cloud = cloud
        self.down_after = down_after
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hostcheck")
        self._inflight: dict[str, Future[CheckResult]] = {}
        self._lock = threading.Lock()

    # --- the job ----------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Hands a check to the pool for every host that is due and has none in flight;
        returns their names. Never waits for a host."""
        now = self.service.clock.now()
        with transaction(self.service.engine, write=False) as s:
            due_at = {
                h.name: h.next_check_at
                for h in s.exec(select(Host).where(col(Host.name).in_(list(self.hosts))))
            }
            unready = []
            if self.cloud is not None:
                for h in s.exec(
                    select(Host)
                    .where(
                        Host.provider == self.cloud,
                        or_(
                            col(Host.state).in_((HOST_PENDING, HOST_UNREACHABLE)),
                            # ready, but its last dial was not answered (bot.app.hosts.remote)
                            and_(col(Host.state) == HOST_READY, col(Host.down_since).is_not(None)),
                        ),
                    )
                    .order_by(col(Host.id))
                ):
                    due_at[h.name] = h.next_check_at
                    unready.append(h.name)
        started = []
        with self._lock:
            for name in [*self.hosts, *unready]:
                running = self._inflight.get(name)
                if running is not None and not running.done():
                    continue
                when = due_at.get(name)
                if when is not None and now < when:
                    continue
                self._inflight[name] = self._pool.submit(self.check, name)
                started.append(name)
        return started

    def in_flight(self) -> list[str]:
        with self._lock:
            return sorted(n for n, f in self._inflight.items() if not f.done())

    def wait(
        self, timeout: float | None = None, names: tuple[str, ...] | None = None
    ) -> list[CheckResult]:
        """Every check in flight (or those of `names`), finished (tests, and a worker
        shutting down)."""
        with self._lock:
            futures = [f for n, f in self._inflight.items() if names is None or n in names]
        return [f.result(timeout) for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- one check ----------------------------------------------------------------------

    def check(self, name: str) -> CheckResult:
        static = name in self.hosts
        try:
            result = self._probe(name) if static else self._setup(name)
        except Exception as exc:  # a check must never die silently on its thread
            log.exception("checking host %s failed", name)
            result = CheckResult(name, ok=False, reason=f"check failed: {exc}")
        if result.booting:
            self._booting(result)
        elif result.ok:
            self._up(result) if static else self._ready(result)
        else:
            self._failed(result, at_once=result.reason.startswith("setup failed") or result.full)
        return result

    def _probe(self, name: str) -> CheckResult:
        static = self.hosts[name]
        target = self.access.resolver.resolve(name)
        runner = self.access.runner
        try:
            alive = runner.run(target, "true", timeout=DIAL_TIMEOUT_S)
        except SshError as exc:
            return CheckResult(name, ok=False, reason=f"unreachable: {exc}")
        if not alive.ok:
            return CheckResult(
                name, ok=False, reason=f"unreachable: `true` exited {alive.exit_code}"
            )
        try:
            prepared = self.access.prepare_now(name, target)
        except SshError as exc:
            return CheckResult(name, ok=False, reason=f"unreachable: {exc}")
        except ProvisioningError as exc:
            return CheckResult(name, ok=False, reason=f"setup failed: {exc}")
        full = self._room(name, target, prepared.runs_dir)
        if full is not None:
            return full
        if static.gpus:
            return CheckResult(name, ok=True, gpus=static.gpus)
        python = prepared.interpreter()  # the host's own venv and code
        command = python.module("training.inventory", "--json")
        try:
            found = runner.run(target, command, INVENTORY_TIMEOUT_S, env=python.env() or None)
        except SshError as exc:
            return CheckResult(name, ok=False, reason=f"unreachable: {exc}")
        if not found.ok:
            said = (found.stderr.strip() or found.stdout.strip()).splitlines()
            why = said[-1][:200] if said else f"exit {found.exit_code}"
            return CheckResult(name, ok=False, reason=f"inventory failed: {why}")
        try:
            lines = [ln for ln in found.stdout.splitlines() if ln.strip()]
            gpus = tuple(parse_inventory(lines[-1])) if lines else ()
        except (ValueError, KeyError, TypeError) as exc:
            return CheckResult(name, ok=False, reason=f"inventory unreadable: {exc}")
        return CheckResult(name, ok=True, gpus=cpu_only(gpus))

    def _setup(self, name: str) -> CheckResult:
        """A cloud instance: dial it, then prepare it (the bootstrap) with the host's own
        timeouts. Its GPUs are the catalog's, synced by the fleet; nothing to read here."""
        inst = self.access.instance_of(name)
        if inst is None:  # stopped or ended since the tick: nothing to set up
            return CheckResult(name, ok=False, booting=True)
        try:
            target = self.access.target_for(inst)
            alive = self.access.runner.run(target, "true", timeout=DIAL_TIMEOUT_S)
        except SshError as exc:
            if inst.state == HOST_PENDING:
                return CheckResult(name, ok=False, reason=f"booting: {exc}", booting=True)
            return CheckResult(name, ok=False, reason=f"unreachable: {exc}")
        if not alive.ok:
            return CheckResult(
                name, ok=False, reason=f"unreachable: `true` exited {alive.exit_code}"
            )
        try:
            prepared = self.access.prepare_now(name, target)
        except SshError as exc:
            return CheckResult(name, ok=False, reason=f"setup failed: {exc}")
        except ProvisioningError as exc:
            return CheckResult(name, ok=False, reason=f"setup failed: {exc}")
        return self._room(name, target, prepared.runs_dir) or CheckResult(name, ok=True)

    def _room(self, name: str, target: SshTarget, runs: str) -> CheckResult | None:
        """A failed check when the disk where runs live has less than `min_free_mb` free;
        None when it has room, or cannot tell."""
        try:
            free = room.free_mb(self.access.runner, target, runs)
        except SshError as exc:
            return CheckResult(name, ok=False, reason=f"unreachable: {exc}")
        if not room.is_full(free, self.service.settings):
            return None
        assert free is not None
        return CheckResult(name, ok=False, reason=room.full_reason(name, runs, free), full=True)

    # --- what a check changes ---------------------------------------------------------------

    def _booting(self, result: CheckResult) -> None:
        with transaction(self.service.engine) as s:
            row = s.exec(select(Host).where(Host.name == result.host)).first()
            if row is None:
                return
            row.next_check_at = self.service.clock.now() + BOOT_POLL
            s.add(row)

    def _ready(self, result: CheckResult) -> None:
        """A cloud instance set up: ready (granted on and placed from the next tick on),
        its down marks cleared; the channel hears it when it had been marked down. One
        that was ready and only missed a dial answers again: its marks are cleared."""
        now = self.service.clock.now()
        with transaction(self.service.engine) as s:
            row = s.exec(select(Host).where(Host.name == result.host)).first()
            if row is None or row.state not in (HOST_PENDING, HOST_UNREACHABLE, HOST_READY):
                return  # stopped or ended while it was being set up
            was_down = row.state == HOST_UNREACHABLE
            if row.state != HOST_READY:
                row.ready_at = now
            row.state = HOST_READY
            row.updated_at = now
            row.down_since = None
            row.down_reason = None
            row.check_failures = 0
            row.next_check_at = None
            s.add(row)
            s.flush()
            note_host_state(s, row, now, self.service.settings)
        log.info("instance %s is set up; it is ready", result.host)
        if was_down:
            self.service.notify_channel(
                _text(f"Host {result.host} is set up now and is back in the pool."),
                dedupe=f"host-up:{result.host}:{now.isoformat()}",
            )

    def _instance(self, name: str, gpus: tuple[GpuDevice, ...], state: str) -> Instance:
        target = self.hosts[name].target
        return Instance(
            name=name,
            provider=self.owner,
            state=state,
            gpus=gpus,
            market="owned",
            address=target.host,
            ssh_user=target.user,
            ssh_port=target.port,
        )

    def _up(self, result: CheckResult) -> None:
        now = self.service.clock.now()
        with transaction(self.service.engine, write=False) as s:
            host = s.exec(select(Host).where(Host.name == result.host)).first()
            present = (
                sorted(
                    (g.index, g.model)
                    for g in s.exec(
                        select(Gpu).where(Gpu.host_id == host.id, col(Gpu.present).is_(True))
                    )
                )
                if host is not None
                else None
            )
        wanted = sorted((g.index, g.model) for g in result.gpus)
        was_down = host is not None and host.state == HOST_UNREACHABLE
        was_full = (
            was_down and host is not None and (host.down_reason or "").startswith(room.FULL_PREFIX)
        )
        if host is None or host.state != HOST_READY or present != wanted:
            self.service.sync_hosts([self._instance(result.host, result.gpus, HOST_READY)])
        with transaction(self.service.engine) as s:
            row = s.exec(select(Host).where(Host.name == result.host)).one()
            row.down_since = None
            row.down_reason = None
            row.check_failures = 0
            row.next_check_at = now + CHECK_EVERY
            s.add(row)
        if was_down:
            log.warning("host %s answers again; it is ready", result.host)
            again = "has room on its disk again" if was_full else "answers again"
            self.service.notify_channel(
                _text(f"Host {result.host} {again} and is back in the pool."),
                dedupe=f"host-up:{result.host}:{now.isoformat()}",
            )

    def _failed(self, result: CheckResult, *, at_once: bool) -> None:
        now = self.service.clock.now()
        with transaction(self.service.engine, write=False) as s:
            listed = s.exec(select(Host).where(Host.name == result.host)).first() is not None
        if not listed and result.host in self.hosts:
            # its first check failed before it was ever listed: list it down
            self.service.sync_hosts(
                [self._instance(result.host, self.hosts[result.host].gpus, HOST_UNREACHABLE)]
            )
        announce: str | None = None
        with transaction(self.service.engine) as s:
            row = s.exec(select(Host).where(Host.name == result.host)).one()
            if row.state in (HOST_STOPPED, HOST_TERMINATED):
                return  # stopped or ended while it was checked: nothing is down
            row.check_failures += 1
            # A full host answers: its runs are still read through it (runner_for).
            row.down_since = None if result.full else row.down_since or now
            row.down_reason = result.reason[:300]
            row.next_check_at = now + backoff(row.check_failures)
            failures = row.check_failures
            # A host that never answered is not flapping: down at its first failed check.
            never = row.ready_at is None
            if row.state != HOST_UNREACHABLE and (at_once or never or failures >= self.down_after):
                row.state = HOST_UNREACHABLE
                row.updated_at = now
                s.add(row)
                s.flush()
                note_host_state(s, row, now, self.service.settings)
                if result.full:
                    announce = (
                        f"Host {row.name}: {result.reason}. Nothing new is granted or started "
                        "there until it has room; the runs on it go on."
                    )
                else:
                    announce = self._tell_waiting(s, row, now)
            s.add(row)
            dedupe = f"host-down:{row.name}:{(row.down_since or now).isoformat()}"
        if announce is not None:
            self.service.notify_channel(_text(announce), dedupe=dedupe)
        log.warning(
            "host %s: check %d failed: %s (next in %s)",
            result.host,
            failures,
            result.reason,
            backoff(failures),
        )

    def _tell_waiting(self, s: Session, host: Host, now: datetime) -> str:
        """Once per outage: whoever holds GPUs or runs there, or waits for its GPUs, by DM;
        returns the text, for the channel (posted after this transaction commits)."""
        assert host.down_since is not None
        models = {
            g.model
            for g in s.exec(select(Gpu).where(Gpu.host_id == host.id, col(Gpu.present).is_(True)))
        }
        told: set[int] = set()
        users: list[int] = []
        for res in s.exec(
            select(Reservation).where(
                Reservation.host_id == host.id, Reservation.state == RES_ACTIVE
            )
        ):
            users.append(res.user_id)
        for run in s.exec(
            select(TrainingRun).where(
                TrainingRun.host_id == host.id, col(TrainingRun.state).in_(_RUN_ON_HOST)
            )
        ):
            users.append(run.user_id)
        for res in s.exec(select(Reservation).where(Reservation.state == RES_WAITING)):
            if res.gpu_model is None or res.gpu_model in models:
                users.append(res.user_id)
        for run in s.exec(select(TrainingRun).where(TrainingRun.state == "queued")):
            if not run.gpu_model or run.gpu_model in models:
                users.append(run.user_id)
        since = f"{host.down_since:%H:%M} UTC"
        text = (
            f"Host {host.name} is down since {since} ({host.down_reason}). Nothing new is "
            "granted or started there until it answers again; I keep checking and say so "
            "when it is back."
        )
        for user_id in users:
            if user_id in told:
                continue
            told.add(user_id)
            user = s.get(User, user_id)
            if user is None:
                continue
            self.service.notify_dm(
                s,
                user.key,
                _text(text),
                now,
                dedupe=f"host-down:{host.name}:{host.down_since.isoformat()}:{user.key}",
            )
        return text


def _text(text: str) -> views.View:
    return views.View(text=text, blocks=(views.Text(text),))


# --- the worker's job ---------------------------------------------------------------------


def hostcheck_job(service: GpuService) -> None:
    """The worker's periodic pass: each place's checker hands out its due checks and
    returns at once."""
    for checker in service.places.checkers:
        checker.tick()


def hostcheck_trigger(settings: object) -> dict[str, object]:
    """Every 15 s, and once right away: a host's bootstrap starts at worker start, on the
    checker's threads, before the first tick would want the host."""
    return {"seconds": 15.0, "next_run_time": datetime.now(UTC)}
