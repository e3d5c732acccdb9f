"""The fleet: the bot's side of provisioning — reuse before launch, reconcile, idle stop.

Money is spent here, so the order of every step is chosen for what survives a crash:

- A launch is written down (`LaunchRequest`, pending) and committed *before* the cloud
  is called, with a request key made from the reservation; the provider passes the same
  key to EC2 (tag and ClientToken). A worker killed between the cloud's answer and its
  own commit leaves a pending request, which reconcile resolves by looking the key up:
  the instance is adopted, never launched a second time.
- Reconcile compares the cloud's tagged instances with the host rows: an unknown tagged
  one is adopted, a host whose instance the cloud no longer lists is marked terminated,
  and what it held (reservations, runs) is ended or requeued with a DM. The provider only
  ever lists instances carrying `gpubot:managed`, so a foreign machine is never touched.
- Reuse comes first: free GPUs on a ready host are the grant pass's business; a host that
  is already booting counts as supply on the way; a stopped instance is started (its disk
  keeps the bootstrap, so it is faster and cheaper than a new one); only then a launch,
  within the pool limits (per instance type: instances running or booting, and spend per
  hour; `PoolLimit` rows over the settings).
- An instance is granted on only once SSH answers and it is bootstrapped: the cloud's
  "running" is not a usable host. Idle time is read from the bill (the host's open `HostPeriod`) and the usage
  intervals, so "idle since" is a time, not a counter that a restart would reset.

The work runs in the worker (`fleet_job`, a periodic job), never in a slash command:
provisioning takes minutes. One lock per fleet keeps its steps from overlapping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, func, select

from bot.app.access import audit
from bot.app.billing import note_host_state
from bot.app.budgets import check_budget
from bot.app.held import end_held, held_gpu_ids
from bot.app.remote import RemoteAccess
from bot.app.service import Actor, GpuService
from bot.domain import views
from bot.domain.best_fit import best_fit
from bot.domain.commands import Pool
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_TERMINATED,
    HOST_UNREACHABLE,
    RES_ACTIVE,
    RES_RELEASED,
    RES_WAITING,
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    Gpu,
    Host,
    HostPeriod,
    LaunchRequest,
    PoolLimit,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import lock_pool, locked_rows, retrying, transaction
from provisioning.base import Compute, Instance, ProvisioningError
from provisioning.catalog import Catalog, InstanceType
from provisioning.compute import LaunchSpec, RentingCompute
from provisioning.costs import gpu_share, storage_usd_per_hour

log = logging.getLogger(__name__)

REQ_PENDING = "pending"
REQ_LAUNCHED = "launched"
REQ_FAILED = "failed"

# States in which an instance is billed as running and counts against the pool.
_RUNNING_STATES = (HOST_READY, HOST_PENDING, HOST_UNREACHABLE)
# After a failed launch (no capacity, a quota), the next try for that reservation waits
# this long: EC2 capacity comes back in minutes, and each try costs API calls and a DM.
LAUNCH_RETRY_AFTER = timedelta(minutes=10)
# A launched or started instance that is still not SSH-ready after this long is stopped
# like an idle one (with a note saying so), rather than billed while it can serve nobody.
BOOT_TIMEOUT = timedelta(minutes=30)
# A pending request the cloud has no instance for, older than this, launched nothing.
PENDING_GRACE = timedelta(minutes=5)
# What a person is told to expect: boot to SSH, and the first bootstrap.
LAUNCH_READY_MIN = 7
START_READY_MIN = 2
POOL_USAGE = "/gpu pool  |  /gpu pool set TYPE max=N spend=USD"


# --- the fleet ------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The caps on one instance type; None: no cap of that kind."""

    max_instances: int | None
    max_usd_per_hour: float | None


@dataclass
class Fleet:
    service: GpuService
    compute: RentingCompute
    access: RemoteAccess
    catalog: Catalog = field(default_factory=Catalog.load)
    # How often a cycle also reconciles (the first cycle always does).
    reconcile_every_s: float = 180.0
    # Called right after the cloud answered a launch, before anything is committed: the
    # seam the crash test uses to die exactly there.
    after_launch: Callable[[Instance], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last_reconcile: float | None = field(default=None, repr=False)

    @property
    def engine(self) -> Any:
        return self.service.engine

    @property
    def settings(self) -> Any:
        return self.service.settings

    def cycle(self) -> None:
        """One periodic pass: reconcile (at start and every few minutes) or refresh,
        then provision for the waiting line, then stop or end what sits idle."""
        with self._lock:
            due = (
                self._last_reconcile is None
                or time.monotonic() - self._last_reconcile >= self.reconcile_every_s
            )
            if due:
                self.reconcile()
                self._last_reconcile = time.monotonic()
            else:
                self.refresh()
            self.provision()
            self.idle()

    # --- cloud → database -------------------------------------------------------------

    def refresh(self) -> list[Instance]:
        """Syncs the cloud's live instances into host rows; returns them as listed.

        A running instance becomes a ready host only once SSH answers and the host is
        prepared (bootstrap, once per host and process); until then it is pending (billed,
        not grantable). A host already ready is not probed again.
        """
        live = self.compute.list_instances()
        with transaction(self.engine, write=False) as s:
            known = {
                h.instance_id: h.state
                for h in s.exec(select(Host).where(Host.provider == self.compute.name))
                if h.instance_id
            }
        synced = []
        for inst in live:
            if (
                inst.state == HOST_READY
                and known.get(inst.instance_id or "") != HOST_READY
                and not self.access.reachable(inst)
            ):
                inst = replace(inst, state=HOST_PENDING)
            synced.append(inst)
        if synced:
            self.service.sync_hosts(synced)
        return live

    def reconcile(self) -> ReconcileReport:
        """Cloud vs database: adopt what we launched but did not record, end what vanished."""
        live = self.refresh()
        now = self.service.clock.now()
        live_ids = {i.instance_id for i in live if i.instance_id}
        adopted: list[str] = []
        failed: list[str] = []
        with transaction(self.engine, write=False) as s:
            pending = list(s.exec(select(LaunchRequest).where(LaunchRequest.state == REQ_PENDING)))
        for req in pending:
            inst = self.compute.find_by_request_key(req.request_key)
            if inst is not None:
                if inst.state != HOST_TERMINATED and inst.instance_id not in live_ids:
                    self.service.sync_hosts([replace(inst, state=HOST_PENDING)])
                self._mark_launched(req.request_key, inst, adopted=True)
                adopted.append(inst.instance_id or inst.name)
                log.warning(
                    "adopted %s, launched for %s but never recorded (a crash?)",
                    inst.instance_id,
                    req.request_key,
                )
            elif now - req.created_at > PENDING_GRACE:
                self._mark_failed(req.request_key, "no instance was launched (the worker stopped)")
                failed.append(req.request_key)
        lost: list[str] = []
        with transaction(self.engine, write=False) as s:
            gone = [
                h
                for h in s.exec(
                    select(Host).where(
                        Host.provider == self.compute.name, Host.state != HOST_TERMINATED
                    )
                )
                if h.instance_id and h.instance_id not in live_ids
            ]
        for host in gone:
            # A listing can lag a launch (describe is eventually consistent on EC2): ask
            # for the one instance before declaring it gone.
            assert host.instance_id is not None
            again = self.compute.get(host.instance_id)
            if again is not None and again.state != HOST_TERMINATED:
                continue
            self._lost(host.name)
            lost.append(host.instance_id or host.name)
        return ReconcileReport(adopted=tuple(adopted), lost=tuple(lost), failed=tuple(failed))

    @retrying
    def _lost(self, host_name: str) -> None:
        """The cloud ended this instance (spot reclaim, someone in the console): whatever
        held it is over — reservations end, runs go back in line, each owner is told."""
        with transaction(self.engine) as s:
            # Usage closes and states end here: the pool first, then every row read after
            # it is current (db.session's lock order).
            lock_pool(s)
            now = self.service.clock.now()
            host = s.exec(select(Host).where(Host.name == host_name)).one()
            if host.state == HOST_TERMINATED:
                return
            host.state = HOST_TERMINATED
            host.updated_at = now
            s.add(host)
            s.flush()
            note_host_state(s, host, now, self.settings)
            what = f"{host.instance_id} ({host.instance_type})"
            for res in locked_rows(
                s,
                select(Reservation)
                .where(Reservation.host_id == host.id, Reservation.state == RES_ACTIVE)
                .order_by(col(Reservation.id)),
            ):
                end_held(s, now, reservation_id=res.id)
                res.state = RES_RELEASED
                res.ended_at = now
                s.add(res)
                owner = s.get(User, res.user_id)
                assert owner is not None
                text = (
                    f"Your reservation #{res.id} has ended: its instance {what} was terminated "
                    "by the cloud. `/gpu reserve` asks again."
                )
                self.service.notify_dm(
                    s, owner.key, _text_view(text), now, dedupe=f"fleet-lost-res:{res.id}"
                )
            # Under their locks: a cancel that landed meanwhile is seen, not overwritten.
            for run in locked_rows(
                s,
                select(TrainingRun)
                .where(
                    TrainingRun.host_id == host.id,
                    col(TrainingRun.state).in_((RUN_STARTING, RUN_RUNNING, RUN_CANCELLING)),
                )
                .order_by(col(TrainingRun.id)),
            ):
                end_held(s, now, run_id=run.id)
                owner = s.get(User, run.user_id)
                assert owner is not None
                if run.state == RUN_CANCELLING:
                    run.state = RUN_CANCELLED
                    run.finished_at = now
                    text = f"Run #{run.id} is cancelled: its instance {what} was terminated."
                else:
                    run.state = RUN_QUEUED
                    run.started_at = None
                    run.host_id = None
                    # A checkpoint the worker already copied off (bot.app.agentwatch) goes with it.
                    resume = run.placement.get("resume_from")
                    run.placement = {"resume_from": resume} if resume else {}
                    start = (
                        "It resumes from the checkpoint saved off that instance."
                        if resume
                        else "It starts again from the beginning (or its last checkpoint, "
                        "if it saves them elsewhere)."
                    )
                    text = (
                        f"Run #{run.id} is back in line: its instance {what} was terminated by "
                        f"the cloud. {start}"
                    )
                s.add(run)
                self.service.notify_dm(
                    s,
                    owner.key,
                    _text_view(text),
                    now,
                    dedupe=f"fleet-lost-run:{run.id}:{host.instance_id}",
                )
            # Anything else still open on it (a safety net): nobody can hold a GPU that is gone.
            end_held(s, now, host_id=host.id)
        log.warning("host %s: its instance is gone from the cloud; marked terminated", host_name)

    # --- the waiting line → instances -------------------------------------------------

    def provision(self) -> list[str]:
        """For each waiting reservation no ready or booting host can serve: start a stopped
        instance of its model, else launch one within the pool limits. Returns what was
        done, in words (for the log and tests)."""
        now = self.service.clock.now()
        with transaction(self.engine, write=False) as s:
            waiting = list(
                s.exec(
                    select(Reservation, User)
                    .join(User, col(User.id) == col(Reservation.user_id))
                    .where(Reservation.state == RES_WAITING)
                    .order_by(col(Reservation.requested_at), col(Reservation.id))
                )
            )
            if not waiting:
                return []
            hosts = list(
                s.exec(select(Host).where(Host.state != HOST_TERMINATED).order_by(col(Host.id)))
            )
            held = held_gpu_ids(s)
            gpus: dict[int, list[Gpu]] = {}
            for g in s.exec(select(Gpu).where(col(Gpu.present).is_(True)).order_by(col(Gpu.index))):
                gpus.setdefault(g.host_id, []).append(g)
            requests: dict[int, list[LaunchRequest]] = {}
            for req in s.exec(
                select(LaunchRequest)
                .where(col(LaunchRequest.reservation_id).is_not(None))
                .order_by(col(LaunchRequest.id))
            ):
                assert req.reservation_id is not None
                requests.setdefault(req.reservation_id, []).append(req)
        # Free GPUs of each model per host, as supply: ready hosts now, booting ones soon.
        supply: dict[int, dict[str, int]] = {}
        for h in hosts:
            assert h.id is not None
            if h.state not in (HOST_READY, HOST_PENDING):
                continue
            counts: dict[str, int] = {}
            for g in gpus.get(h.id, []):
                if g.id not in held:
                    counts[g.model] = counts.get(g.model, 0) + 1
            supply[h.id] = counts
        stopped = [h for h in hosts if h.state == HOST_STOPPED and h.provider == self.compute.name]
        done: list[str] = []
        for res, user in waiting:
            model = res.gpu_model
            if model is None or model == "cpu":
                continue  # "any GPU" is served by whatever frees up; nothing to buy for it
            if _take(supply, model, res.gpu_count):
                continue
            reqs = requests.get(res.id or -1, [])
            if any(r.state == REQ_PENDING for r in reqs):
                continue  # a launch is in flight (or reconcile will settle it)
            last = reqs[-1] if reqs else None
            if (
                last is not None
                and last.state == REQ_FAILED
                and now - last.updated_at < LAUNCH_RETRY_AFTER
            ):
                continue
            want = _Want(
                kind="res", id=res.id or 0, owner=user.key, model=model, gpus=res.gpu_count
            )
            started = self._start_stopped(want, stopped, hosts, gpus)
            if started is not None:
                stopped = [h for h in stopped if h.id != started.id]
                assert started.id is not None
                supply[started.id] = {model: len(gpus.get(started.id, [])) - res.gpu_count}
                done.append(f"started {started.instance_id} for reservation {res.id}")
                continue
            launched = self._launch(want, len(reqs), hosts)
            if launched is not None:
                done.append(f"launched {launched.instance_id} for reservation {res.id}")
        return done

    def _start_stopped(
        self, want: _Want, stopped: list[Host], hosts: list[Host], gpus: dict[int, list[Gpu]]
    ) -> Host | None:
        """Starts a stopped instance with room for `want`, within the pool limits."""
        for host in stopped:
            assert host.id is not None and host.instance_id is not None
            if sum(1 for g in gpus.get(host.id, []) if g.model == want.model) < want.gpus:
                continue
            itype = self.catalog.get(host.instance_type or "")
            if itype is not None and self._refusal(itype, hosts) is not None:
                continue
            try:
                inst = self.compute.start(host.instance_id)
            except ProvisioningError as exc:
                log.warning("could not start %s: %s", host.instance_id, exc)
                continue
            # Booting until SSH answers (refresh makes it ready).
            self.service.sync_hosts([replace(inst, state=HOST_PENDING)])
            host.state = HOST_PENDING
            text = (
                f"No {want.model} GPUs are free for {want.label}, so I am starting a "
                f"stopped {want.model} instance ({host.instance_id}, {host.instance_type}); it "
                f"should be ready in ~{START_READY_MIN} min. {want.then}"
            )
            self._dm(want.owner, text, f"fleet-start:{want.kind}:{want.id}:{host.instance_id}")
            return host
        return None

    def _launch(
        self, want: _Want, attempt: int, hosts: list[Host], prefer: str | None = None
    ) -> Instance | None:
        """Writes the launch request, commits, then asks the cloud with the same key."""
        fits = [t for t in self.catalog.for_model(want.model) if t.gpus >= want.gpus]
        if not fits:
            self._dm(
                want.owner,
                f"{want.label.capitalize()} waits for {views.gpu_phrase(want.gpus, want.model)}, "
                f"but no instance type offers that many {want.model} GPUs on one machine, so "
                f"none can be launched. {want.ask_less}",
                f"fleet-nofit:{want.kind}:{want.id}",
            )
            return None
        refusals = [(t, self._refusal(t, hosts)) for t in fits]
        allowed = [t for t, why in refusals if why is None]
        if not allowed:
            why = refusals[0][1]
            self._dm(
                want.owner,
                f"No {want.model} GPUs are free for {want.label}, and I may not launch "
                f"another instance: {why}. It stays in line and gets GPUs when some free up.",
                f"fleet-pool:{want.kind}:{want.id}",
            )
            return None
        if prefer is not None and any(t.instance_type == prefer for t in allowed):
            allowed = [t for t in allowed if t.instance_type == prefer]
        key = f"{want.kind}-{want.id}-{attempt}"
        now = self.service.clock.now()
        try:
            with transaction(self.engine) as s:
                # Money is committed here, so the owner's budget is checked here, in the
                # transaction that writes the intent (DESIGN: before, never after).
                refused = self._over_budget(s, want, min(allowed, key=_per_gpu_hour), now)
                if refused is not None:
                    self.service.notify_dm(
                        s, want.owner, _text_view(refused), now, f"fleet-budget:{key}"
                    )
                    return None
                s.add(
                    LaunchRequest(
                        request_key=key,
                        gpu_model=want.model,
                        gpus=want.gpus,
                        market=want.market,
                        owner=want.owner,
                        reservation_id=want.id if want.kind == "res" else None,
                        run_id=want.id if want.kind == "run" else None,
                        state=REQ_PENDING,
                        created_at=now,
                        updated_at=now,
                    )
                )
        except IntegrityError:
            return None  # written by another pass: that one launches
        spec = LaunchSpec(
            gpu_model=want.model,
            gpus=want.gpus,
            market=want.market,
            owner=want.owner,
            request_key=key,
            reservation_id=str(want.id) if want.kind == "res" else None,
            job_id=str(want.id) if want.kind == "run" else None,
            instance_types=tuple(t.instance_type for t in allowed),
        )
        try:
            inst = self.compute.launch(spec)
        except ProvisioningError as exc:
            self._mark_failed(key, str(exc))
            self._dm(
                want.owner,
                f"I could not launch an instance for {want.label}: {exc} It stays in line; "
                f"I will try again in {format_duration(LAUNCH_RETRY_AFTER)}.",
                f"fleet-failed:{key}",
            )
            return None
        if self.after_launch is not None:
            self.after_launch(inst)
        self.service.sync_hosts([replace(inst, state=HOST_PENDING)])
        self._mark_launched(key, inst, adopted=False)
        zone = _zone(self.compute, inst)
        where = f" in {zone}" if zone else ""
        market = " (spot)" if inst.market == "spot" else ""
        self._dm(
            want.owner,
            f"No {want.model} GPUs are free for {want.label}, so I am launching "
            f"{inst.instance_type}{market}{where} ({inst.instance_id}, "
            f"${inst.hourly_usd:.2f}/h); it should be ready in ~{LAUNCH_READY_MIN} min. "
            f"{want.then}",
            f"fleet-launch:{key}",
        )
        hosts.append(
            Host(
                name=inst.name,
                provider=inst.provider,
                instance_type=inst.instance_type,
                state=HOST_PENDING,
                hourly_usd=inst.hourly_usd,
            )
        )
        return inst

    def _over_budget(
        self, s: Session, want: _Want, itype: InstanceType, now: datetime
    ) -> str | None:
        """The refusal text when launching for `want` would take its owner over budget.

        The request itself is left out of "committed" (it waits at no known price yet) and
        priced here instead: its GPUs' share of the cheapest allowed type for its length
        (a run without `--max`: one hour, as bot.app.budgets counts queued runs)."""
        user = s.exec(select(User).where(User.key == want.owner)).first()
        if user is None or user.budget_usd is None:
            return None
        if want.kind == "res":
            res = s.get(Reservation, want.id)
            seconds = float(res.duration_s) if res is not None else 3600.0
        else:
            run = s.get(TrainingRun, want.id)
            seconds = float(run.max_seconds or 3600) if run is not None else 3600.0
        add = itype.gpu_hourly(want.market) * want.gpus * seconds / 3600.0
        try:
            check_budget(
                s,
                user,
                add,
                now,
                self.service.settings,
                what=f"Launching an instance for {want.label}",
                skip_reservation=want.id if want.kind == "res" else None,
                skip_run=want.id if want.kind == "run" else None,
            )
        except UserError as exc:
            return f"{exc.text} It stays in line and gets GPUs only if some free up."
        return None

    def provision_run(self, run_id: int, instance_type: str | None = None) -> str | None:
        """Carries out the scheduler's Launch/Start for a queued run through the same path
        as reservations: a stopped instance first, else a launch (one per request key)."""
        with self._lock:
            now = self.service.clock.now()
            with transaction(self.engine, write=False) as s:
                found = s.exec(
                    select(TrainingRun, User)
                    .join(User, col(User.id) == col(TrainingRun.user_id))
                    .where(TrainingRun.id == run_id)
                ).first()
                if found is None:
                    return None
                run, user = found
                if run.state != RUN_QUEUED or not run.gpu_model or run.gpu_model == "cpu":
                    return None
                reqs = list(
                    s.exec(
                        select(LaunchRequest)
                        .where(LaunchRequest.run_id == run_id)
                        .order_by(col(LaunchRequest.id))
                    )
                )
                hosts = list(s.exec(select(Host).where(Host.state != HOST_TERMINATED)))
                by_id = {h.instance_id: h for h in hosts if h.instance_id}
                gpus: dict[int, list[Gpu]] = {}
                for g in s.exec(select(Gpu).where(col(Gpu.present).is_(True))):
                    gpus.setdefault(g.host_id, []).append(g)
            for req in reqs:
                if req.state == REQ_PENDING:
                    return None  # in flight, or reconcile settles it
                booted = by_id.get(req.instance_id) if req.instance_id else None
                if req.state == REQ_LAUNCHED and booted is not None:
                    return None  # its instance exists: it is booting or in use
            last = reqs[-1] if reqs else None
            if (
                last is not None
                and last.state == REQ_FAILED
                and now - last.updated_at < LAUNCH_RETRY_AFTER
            ):
                return None
            want = _Want(
                kind="run",
                id=run_id,
                owner=user.key,
                model=run.gpu_model,
                gpus=run.gpu_count,
                market="spot" if run.spot else "ondemand",
            )
            stopped = [
                h for h in hosts if h.state == HOST_STOPPED and h.provider == self.compute.name
            ]
            started = self._start_stopped(want, stopped, hosts, gpus)
            if started is not None:
                return f"started {started.instance_id} for run {run_id}"
            inst = self._launch(want, len(reqs), hosts, prefer=instance_type)
            return None if inst is None else f"launched {inst.instance_id} for run {run_id}"

    def limits(self, s: Session, instance_type: str) -> Limits:
        row = s.get(PoolLimit, instance_type)
        max_n = self.settings.pool_max_instances
        spend = self.settings.pool_max_usd_per_hour
        if row is not None and row.max_instances is not None:
            max_n = row.max_instances
        if row is not None and row.max_usd_per_hour is not None:
            spend = row.max_usd_per_hour
        return Limits(max_instances=max_n, max_usd_per_hour=spend or None)

    def _refusal(self, itype: InstanceType, hosts: Sequence[Host]) -> str | None:
        """Why one more `itype` would break the pool limits, in plain words; None if it fits."""
        with transaction(self.engine, write=False) as s:
            lim = self.limits(s, itype.instance_type)
        mine = [
            h
            for h in hosts
            if h.instance_type == itype.instance_type
            and h.provider == self.compute.name
            and h.state in _RUNNING_STATES
        ]
        name = itype.instance_type
        if lim.max_instances is not None and len(mine) + 1 > lim.max_instances:
            return (
                f"the pool allows at most {lim.max_instances} {name} instance"
                f"{'s' if lim.max_instances != 1 else ''} and {len(mine)} "
                f"{'is' if len(mine) == 1 else 'are'} running or booting (an admin can change "
                f"it with `/gpu pool set {name} max=N`)"
            )
        spend = sum(h.hourly_usd for h in mine)
        if (
            lim.max_usd_per_hour is not None
            and spend + itype.ondemand_usd_hr > lim.max_usd_per_hour
        ):
            return (
                f"the pool allows at most ${lim.max_usd_per_hour:.2f}/h on {name}; "
                f"${spend:.2f}/h runs now and one more costs ${itype.ondemand_usd_hr:.2f}/h "
                f"(an admin can change it with `/gpu pool set {name} spend=USD`)"
            )
        return None

    def _mark_launched(self, key: str, inst: Instance, *, adopted: bool) -> None:
        with transaction(self.engine) as s:
            req = s.exec(select(LaunchRequest).where(LaunchRequest.request_key == key)).one()
            if req.state == REQ_LAUNCHED:
                return
            now = self.service.clock.now()
            req.state = REQ_LAUNCHED
            req.instance_id = inst.instance_id
            req.updated_at = now
            s.add(req)
            if adopted and inst.state != HOST_TERMINATED:
                text = (
                    f"The instance for your request {key} ({inst.instance_id}, "
                    f"{inst.instance_type}) is booting; you will get a DM when your GPUs are yours."
                )
                self.service.notify_dm(
                    s, req.owner, _text_view(text), now, dedupe=f"fleet-adopted:{key}"
                )

    def _mark_failed(self, key: str, error: str) -> None:
        with transaction(self.engine) as s:
            req = s.exec(select(LaunchRequest).where(LaunchRequest.request_key == key)).one()
            req.state = REQ_FAILED
            req.error = error[:500]
            req.updated_at = self.service.clock.now()
            s.add(req)

    def _dm(self, user_key: str, text: str, dedupe: str) -> None:
        with transaction(self.engine) as s:
            self.service.notify_dm(s, user_key, _text_view(text), self.service.clock.now(), dedupe)

    # --- idle stop and terminate --------------------------------------------------------

    def idle(self) -> list[str]:
        """Stops rented instances idle for `idle_stop_after` (spot ones, which cannot stop,
        are terminated), those still booting after BOOT_TIMEOUT, and terminates those
        stopped for `terminate_after`."""
        now = self.service.clock.now()
        stop_after = self.settings.idle_stop_after
        end_after = self.settings.terminate_after
        to_stop: list[tuple[Host, datetime]] = []
        to_end: list[tuple[Host, datetime]] = []
        with transaction(self.engine, write=False) as s:
            for host in s.exec(
                select(Host).where(
                    Host.provider == self.compute.name,
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
                    self.compute.terminate(host.instance_id)
                    if spot
                    else self.compute.stop(host.instance_id)
                )
            except ProvisioningError as exc:
                log.warning("idle %s: %s", host.instance_id, exc)
                continue
            self.service.sync_hosts([inst])
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
                storage = _storage_usd_per_hour(self.settings)
                text = (
                    f"Stopped idle instance {host.instance_id} ({host.instance_type}, "
                    f"${host.hourly_usd:.2f}/h): no reservation or run for {idle_for}. Its disk "
                    f"stays (about ${storage:.2f}/h) so the next `/gpu reserve` starts it "
                    f"quickly; it is terminated after {format_duration(end_after)} stopped." + never
                )
                key = f"fleet-stop:{host.instance_id}:{since.isoformat()}"
            self.service.notify_channel(_text_view(text), dedupe=key)
            done.append(f"{'terminated' if spot else 'stopped'} {host.instance_id}")
        for host, since in to_end:
            assert host.instance_id is not None
            try:
                inst = self.compute.terminate(host.instance_id)
            except ProvisioningError as exc:
                log.warning("terminate %s: %s", host.instance_id, exc)
                continue
            self.service.sync_hosts([inst])
            text = (
                f"Terminated instance {host.instance_id} ({host.instance_type}): stopped for "
                f"{format_duration(now - since)} with nobody asking for it, so its disk is "
                "no longer worth paying for."
            )
            self.service.notify_channel(
                _text_view(text), dedupe=f"fleet-terminate:{host.instance_id}"
            )
            done.append(f"terminated {host.instance_id}")
        return done


@dataclass(frozen=True)
class _Want:
    """What one waiting reservation or queued run needs bought, and whom to tell."""

    kind: str  # "res" or "run": the request key's prefix
    id: int
    owner: str
    model: str
    gpus: int
    market: str = "ondemand"

    @property
    def label(self) -> str:
        return f"your reservation #{self.id}" if self.kind == "res" else f"your run #{self.id}"

    @property
    def then(self) -> str:
        if self.kind == "res":
            return "You will get a DM when your GPUs are yours."
        return "Your run starts there as soon as it is ready."

    @property
    def ask_less(self) -> str:
        if self.kind == "res":
            return "`/gpu release` it and ask for fewer."
        return "`/gpu cancel` it and ask for fewer."


@dataclass(frozen=True)
class ReconcileReport:
    # Instance ids adopted from pending launch requests.
    adopted: tuple[str, ...] = ()
    # Instance ids the cloud no longer lists, marked terminated.
    lost: tuple[str, ...] = ()
    # Request keys that launched nothing, marked failed.
    failed: tuple[str, ...] = ()


def _per_gpu_hour(itype: InstanceType) -> float:
    return gpu_share(itype.ondemand_usd_hr, itype.gpus)


def _take(supply: dict[int, dict[str, int]], model: str, count: int) -> bool:
    """Claims `count` GPUs of `model` on one host of the supply, if any, by the grant
    pass's own rule (bot.domain.best_fit), so supply is used up the way grants will use it."""
    host_id = best_fit(((h, counts.get(model, 0)) for h, counts in supply.items()), count)
    if host_id is None:
        return False
    supply[host_id][model] = supply[host_id].get(model, 0) - count
    return True


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _storage_usd_per_hour(settings: Any) -> float:
    return storage_usd_per_hour(float(settings.ebs_gb), float(settings.ebs_usd_gb_month))


def _zone(compute: Compute, inst: Instance) -> str | None:
    finder = getattr(compute, "zone", None)
    if finder is None or not inst.instance_id:
        return None
    try:
        zone = finder(inst.instance_id)
    except ProvisioningError:
        return None
    return str(zone) if zone else None


def _text_view(text: str) -> views.View:
    return views.View(text=text, blocks=(views.Text(text),))


# --- a pool that can grow ------------------------------------------------------------------


class CatalogSupply:
    """The Supply of a cloud pool (`bot.app.ports.Supply`): a model the catalog can launch
    is a model the pool can have, so a reservation or a run for it waits for the fleet
    (the scheduler's Launch buys it) where a fixed pool must refuse it up front. Only
    what one instance type can hold counts; the rest is refused as before."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def can_have(self, model: str, gpus: int) -> bool:
        return launchable(self.catalog, model, gpus)


def launchable(catalog: Catalog, model: str, gpus: int) -> bool:
    """True when some instance type carries `gpus` GPUs of `model` on one machine."""
    return any(t.gpus >= gpus for t in catalog.for_model(model))


# --- the service's fleet and the worker's job -----------------------------------------


def attach(service: GpuService, fleet: Fleet) -> None:
    """Makes `fleet` the one the worker's job drives for this service, and the one its
    runs hand the scheduler's Launch/Start to (through `GpuService.fleet`, a port)."""
    service.fleet = fleet


def fleet_trigger(settings: Any) -> dict[str, Any]:
    """Every tick, and once right away: reconcile runs at worker start (a crash between a
    launch and its commit is settled before anything else is launched)."""
    return {"seconds": max(5.0, float(settings.tick_seconds)), "next_run_time": datetime.now(UTC)}


def fleet_job(service: GpuService) -> None:
    """The worker's periodic fleet pass; nothing to do where no cloud provider is set."""
    if service.fleet is not None:
        service.fleet.cycle()


# --- /gpu pool --------------------------------------------------------------------------


def pool(service: GpuService, actor: Actor, cmd: Pool) -> views.Reply:
    if cmd.instance_type is None:
        return views.Reply(pool_view(service))
    if not actor.admin:
        raise UserError("Only an admin can change the pool limits.")
    if cmd.max_instances is None and cmd.max_usd_per_hour is None:
        raise UserError(
            "Say what to set: `max=N` instances and/or `spend=USD` per hour.", POOL_USAGE
        )
    catalog = Catalog.load()
    if catalog.get(cmd.instance_type) is None:
        raise UserError(
            f"`{cmd.instance_type}` is not an instance type the catalog knows; "
            "`/gpu prices` lists them.",
            POOL_USAGE,
        )
    now = service.clock.now()
    with transaction(service.engine) as s:
        row = s.get(PoolLimit, cmd.instance_type) or PoolLimit(instance_type=cmd.instance_type)
        if cmd.max_instances is not None:
            row.max_instances = cmd.max_instances
        if cmd.max_usd_per_hour is not None:
            row.max_usd_per_hour = cmd.max_usd_per_hour
        row.updated_by = actor.key
        row.updated_at = now
        s.add(row)
        caps = f"max={row.max_instances} spend={row.max_usd_per_hour}"
        audit(actor, "pool-set", f"{cmd.instance_type} {caps}", session=s)
    return views.Reply(pool_view(service, changed=cmd.instance_type), ephemeral=False)


def pool_view(service: GpuService, changed: str | None = None) -> views.View:
    """Each instance type in use or limited: instances running/stopped, GPUs, $/h now, caps."""
    settings = service.settings
    rows: dict[str, dict[str, Any]] = {}
    with transaction(service.engine, write=False) as s:
        limits = {p.instance_type: p for p in s.exec(select(PoolLimit))}
        for h in s.exec(
            select(Host).where(Host.state != HOST_TERMINATED, col(Host.instance_type).is_not(None))
        ):
            assert h.instance_type is not None
            r = rows.setdefault(h.instance_type, {"run": 0, "stop": 0, "gpus": 0, "usd": 0.0})
            n_gpus = s.exec(
                select(func.count())
                .select_from(Gpu)
                .where(Gpu.host_id == h.id, col(Gpu.present).is_(True))
            ).one()
            if h.state in _RUNNING_STATES:
                r["run"] += 1
                r["gpus"] += int(n_gpus)
                r["usd"] += h.hourly_usd
            elif h.state == HOST_STOPPED:
                r["stop"] += 1
        for itype in limits:
            rows.setdefault(itype, {"run": 0, "stop": 0, "gpus": 0, "usd": 0.0})
    table_rows = []
    total = 0.0
    for itype in sorted(rows):
        r = rows[itype]
        lim = limits.get(itype)
        max_n = lim.max_instances if lim and lim.max_instances is not None else None
        spend = lim.max_usd_per_hour if lim and lim.max_usd_per_hour is not None else None
        n_text = str(max_n) if max_n is not None else f"{settings.pool_max_instances} (default)"
        cap = spend if spend is not None else settings.pool_max_usd_per_hour
        s_text = f"${cap:.2f}/h" if cap else "no cap"
        if spend is None:
            s_text += " (default)"
        total += r["usd"]
        table_rows.append(
            (
                itype,
                str(r["run"]),
                str(r["stop"]),
                str(r["gpus"]),
                f"${r['usd']:.2f}",
                n_text,
                s_text,
            )
        )
    blocks: list[views.Block] = [views.Header("GPU pool")]
    if changed is not None:
        blocks.append(views.Text(f"Pool limit for `{changed}` updated."))
    if table_rows:
        blocks.append(
            views.Table(
                ("type", "running", "stopped", "GPUs", "$/h now", "max instances", "max spend"),
                tuple(table_rows),
            )
        )
    else:
        blocks.append(views.Text("No instances and no limits yet."))
    default_spend = (
        f"${settings.pool_max_usd_per_hour:.2f}/h" if settings.pool_max_usd_per_hour else "no cap"
    )
    blocks.append(
        views.Context(
            f"Running now: ${total:.2f}/h. Defaults per type: {settings.pool_max_instances} "
            f"instances, {default_spend}. Admins: `/gpu pool set TYPE max=N spend=USD`."
        )
    )
    summary = ", ".join(f"{t[0]}: {t[1]} running, {t[2]} stopped" for t in table_rows)
    text = f"GPU pool: {summary or 'no instances'}; ${total:.2f}/h now."
    if changed is not None:
        text = f"Pool limit for {changed} updated. " + text
    return views.View(text=text, blocks=tuple(blocks))
