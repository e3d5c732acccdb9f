"""The waiting line → instances: reuse before buying. Free GPUs on a ready host are the
grant pass's business and a booting host counts as supply on the way; then a stopped
instance is started (its disk keeps the bootstrap); only then a launch, within the pool
limits and the owner's budget, written down (LaunchRequest) and committed before the
cloud is called with the same request key."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.app.burst import state as burst_state
from bot.app.fleet.common import (
    LAUNCH_READY_MIN,
    LAUNCH_RETRY_AFTER,
    REQ_FAILED,
    REQ_LAUNCHED,
    REQ_PENDING,
    RUNNING_STATES,
    START_READY_MIN,
    FleetContext,
    Limits,
    Want,
    dm,
    mark_failed,
    mark_launched,
    text_view,
)
from bot.app.fleet.pool import instances_for
from bot.app.money.budgets import check_budget
from bot.app.watching.held import held_gpu_ids
from bot.domain import views
from bot.domain.best_fit import best_fit
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_TERMINATED,
    RES_WAITING,
    RUN_QUEUED,
    RUN_STARTING,
    Gpu,
    Host,
    LaunchRequest,
    PoolLimit,
    Reservation,
    TrainingRun,
    User,
)
from db.session import transaction
from provisioning.base import Compute, Instance, ProvisioningError
from provisioning.catalog import Catalog, InstanceType
from provisioning.compute import LaunchSpec
from provisioning.costs import gpu_share

log = logging.getLogger(__name__)


class Buyer:
    """Starts or launches instances for reservations and runs nothing else can serve."""

    def __init__(self, ctx: FleetContext) -> None:
        self.ctx = ctx

    def provision(self) -> list[str]:
        """For each waiting reservation no ready or booting host can serve: start a stopped
        instance of its model, else launch one within the pool limits. Returns what was
        done, in words (for the log and tests)."""
        bursting = self.ctx.service.places.bursting
        now = self.ctx.service.clock.now()
        with transaction(self.ctx.engine, write=False) as s:
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
            # Owned places first: only a reservation whose owner took the cloud's offer
            # (bot.app.burst) is bought for, at no more than the price shown.
            taken = burst_state.taken_reservations(s) if bursting else {}
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
        stopped = [
            h for h in hosts if h.state == HOST_STOPPED and h.provider == self.ctx.compute.name
        ]
        done: list[str] = []
        for res, user in waiting:
            model = res.gpu_model
            if model is None or model == "cpu":
                continue  # "any GPU" is served by whatever frees up; nothing to buy for it
            offered, cap = taken.get(res.id or -1, (None, None))
            if bursting and offered is None:
                continue
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
            want = Want(kind="res", id=res.id or 0, owner=user.key, model=model, gpus=res.gpu_count)
            cheap = [
                h for h in stopped if _within(cap, _gpu_hourly(self.ctx.catalog, h, want.market))
            ]
            started = self._start_stopped(want, cheap, hosts, gpus)
            if started is not None:
                stopped = [h for h in stopped if h.id != started.id]
                assert started.id is not None
                supply[started.id] = {model: len(gpus.get(started.id, [])) - res.gpu_count}
                done.append(f"started {started.instance_id} for reservation {res.id}")
                continue
            launched = self._launch(want, len(reqs), hosts, prefer=offered, price_cap=cap)
            if launched is not None:
                done.append(f"launched {launched.instance_id} for reservation {res.id}")
        return done

    def provision_run(
        self,
        run_id: int,
        instance_type: str | None = None,
        *,
        in_cluster: bool = False,
        price_cap: float | None = None,
    ) -> str | None:
        """Carries out the scheduler's Launch/Start for a queued run through the same path
        as reservations: a stopped instance first, else a launch (one per request key).
        `in_cluster`: the run waits in a cluster's queue, not gpubot's (its owner took the
        cloud: bot.app.burst), so it is claimed there and still counts as waiting.
        `price_cap`: the most a GPU-hour may cost (the price its owner was shown), so a
        type the offer did not name is bought only where it is no dearer."""
        now = self.ctx.service.clock.now()
        with transaction(self.ctx.engine, write=False) as s:
            found = s.exec(
                select(TrainingRun, User)
                .join(User, col(User.id) == col(TrainingRun.user_id))
                .where(TrainingRun.id == run_id)
            ).first()
            if found is None:
                return None
            run, user = found
            waiting = (RUN_QUEUED, RUN_STARTING) if in_cluster else (RUN_QUEUED,)
            if run.state not in waiting or not run.gpu_model or run.gpu_model == "cpu":
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
        # A run larger than one instance gets several of one type (torchrun spans them):
        # up to that many requests live at once, each one instance.
        split = instances_for(self.ctx.catalog, run.gpu_model, run.gpu_count, instance_type)
        if split is not None and split[0] > 1 and split[2] == instance_type:
            # The scheduler prices types but not the pool's cap per type: where its pick
            # needs more instances than the cap allows, the fewest (the largest type).
            with transaction(self.ctx.engine, write=False) as s:
                cap = self.limits(s, str(instance_type)).max_instances
            if cap is not None and split[0] > cap:
                split = instances_for(self.ctx.catalog, run.gpu_model, run.gpu_count)
        if split is None:
            return None
        count, per, instance_type = split
        live = 0
        for req in reqs:
            if req.state == REQ_PENDING:
                live += 1  # in flight, or reconcile settles it
                continue
            booted = by_id.get(req.instance_id) if req.instance_id else None
            if req.state == REQ_LAUNCHED and booted is not None and booted.state in RUNNING_STATES:
                # its instance is booting or in use; a stopped one does not count, or the
                # run would wait for its terminate (days) before anything is bought for it
                live += 1
        if live >= count:
            return None
        last = reqs[-1] if reqs else None
        if (
            last is not None
            and last.state == REQ_FAILED
            and now - last.updated_at < LAUNCH_RETRY_AFTER
        ):
            return None
        want = Want(
            kind="run",
            id=run_id,
            owner=user.key,
            model=run.gpu_model,
            gpus=per,
            market="spot" if run.spot else "ondemand",
        )
        stopped = [
            h
            for h in hosts
            if h.state == HOST_STOPPED
            and h.provider == self.ctx.compute.name
            and (count == 1 or h.instance_type == instance_type)
            and _within(price_cap, _gpu_hourly(self.ctx.catalog, h, want.market))
        ]
        started = self._start_stopped(want, stopped, hosts, gpus)
        if started is not None:
            return f"started {started.instance_id} for run {run_id}"
        inst = self._launch(
            want, len(reqs), hosts, prefer=instance_type, only=count > 1, price_cap=price_cap
        )
        return None if inst is None else f"launched {inst.instance_id} for run {run_id}"

    def give_back(self, kind: str, ref: int) -> bool:
        """What was bought for a run ("run") or reservation ("res") that started elsewhere
        first (bot.app.burst): each instance launched for it that nobody holds anything on
        is terminated at once (it never ran anything, so its disk is worth nothing). True
        once nothing is left to give back; False while a launch for it is still unsettled
        (reconcile settles it)."""
        column = LaunchRequest.run_id if kind == "run" else LaunchRequest.reservation_id
        what = f"run #{ref}" if kind == "run" else f"reservation #{ref}"
        with transaction(self.ctx.engine, write=False) as s:
            reqs = list(s.exec(select(LaunchRequest).where(column == ref)))
            ids = [r.instance_id for r in reqs if r.state == REQ_LAUNCHED and r.instance_id]
            hosts = list(s.exec(select(Host).where(col(Host.instance_id).in_(ids)))) if ids else []
            busy = {h.id for h in hosts if held_gpu_ids(s, host_id=h.id)}
        settled = all(r.state != REQ_PENDING for r in reqs)
        for host in hosts:
            if host.id in busy or host.state not in RUNNING_STATES or not host.instance_id:
                continue  # in use by another run now, or already stopped
            try:
                inst = self.ctx.compute.terminate(host.instance_id)
            except ProvisioningError as exc:
                log.warning("give back %s: %s", host.instance_id, exc)
                settled = False
                continue
            self.ctx.service.sync_hosts([inst])
            self.ctx.service.notify_channel(
                text_view(
                    f"Terminated {host.instance_id} ({host.instance_type}): it was launched "
                    f"for {what}, which the team's own GPUs started first."
                ),
                dedupe=f"fleet-give-back:{host.instance_id}",
            )
        return settled

    def pool_refusal(self, instance_type: str) -> str | None:
        """Why the pool's caps allow no more `instance_type` now, in words; None if one fits."""
        itype = self.ctx.catalog.get(instance_type)
        if itype is None:
            return f"{instance_type} is not in the price catalog"
        with transaction(self.ctx.engine, write=False) as s:
            hosts = list(s.exec(select(Host).where(Host.state != HOST_TERMINATED)))
        return self._refusal(itype, hosts)

    def limits(self, s: Session, instance_type: str) -> Limits:
        row = s.get(PoolLimit, instance_type)
        max_n = self.ctx.settings.pool_max_instances
        spend = self.ctx.settings.pool_max_usd_per_hour
        if row is not None and row.max_instances is not None:
            max_n = row.max_instances
        if row is not None and row.max_usd_per_hour is not None:
            spend = row.max_usd_per_hour
        return Limits(max_instances=max_n, max_usd_per_hour=spend or None)

    def _refusal(self, itype: InstanceType, hosts: Sequence[Host]) -> str | None:
        """Why one more `itype` would break the pool limits, in plain words; None if it fits."""
        with transaction(self.ctx.engine, write=False) as s:
            lim = self.limits(s, itype.instance_type)
        mine = [
            h
            for h in hosts
            if h.instance_type == itype.instance_type
            and h.provider == self.ctx.compute.name
            and h.state in RUNNING_STATES
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

    def _start_stopped(
        self, want: Want, stopped: list[Host], hosts: list[Host], gpus: dict[int, list[Gpu]]
    ) -> Host | None:
        """Starts a stopped instance with room for `want`, within the pool limits."""
        for host in stopped:
            assert host.id is not None and host.instance_id is not None
            if sum(1 for g in gpus.get(host.id, []) if g.model == want.model) < want.gpus:
                continue
            itype = self.ctx.catalog.get(host.instance_type or "")
            if itype is not None and self._refusal(itype, hosts) is not None:
                continue
            try:
                inst = self.ctx.compute.start(host.instance_id)
            except ProvisioningError as exc:
                log.warning("could not start %s: %s", host.instance_id, exc)
                continue
            # Booting until SSH answers (refresh makes it ready).
            self.ctx.service.sync_hosts([replace(inst, state=HOST_PENDING)])
            host.state = HOST_PENDING
            text = (
                f"No {want.model} GPUs are free for {want.label}, so I am starting a "
                f"stopped {want.model} instance ({host.instance_id}, {host.instance_type}); it "
                f"should be ready in ~{START_READY_MIN} min. {want.then}"
            )
            dm(self.ctx, want.owner, text, f"fleet-start:{want.kind}:{want.id}:{host.instance_id}")
            return host
        return None

    def _launch(
        self,
        want: Want,
        attempt: int,
        hosts: list[Host],
        prefer: str | None = None,
        *,
        only: bool = False,
        price_cap: float | None = None,
    ) -> Instance | None:
        """Writes the launch request, commits, then asks the cloud with the same key.
        `only`: `prefer` and no other type (the instances of a run over several hosts
        must be of one type)."""
        fits = [t for t in self.ctx.catalog.for_model(want.model) if t.gpus >= want.gpus]
        if only:
            fits = [t for t in fits if t.instance_type == prefer]
        fits = [t for t in fits if _within(price_cap, t.gpu_hourly(want.market))]
        if not fits:
            dm(
                self.ctx,
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
            dm(
                self.ctx,
                want.owner,
                f"No {want.model} GPUs are free for {want.label}, and I may not launch "
                f"another instance: {why}. It stays in line and gets GPUs when some free up.",
                f"fleet-pool:{want.kind}:{want.id}",
            )
            return None
        if prefer is not None and any(t.instance_type == prefer for t in allowed):
            allowed = [t for t in allowed if t.instance_type == prefer]
        key = f"{want.kind}-{want.id}-{attempt}"
        now = self.ctx.service.clock.now()
        try:
            with transaction(self.ctx.engine) as s:
                # Money is committed here, so the owner's budget is checked here, in the
                # transaction that writes the intent (DESIGN: before, never after).
                refused = self._over_budget(s, want, min(allowed, key=_per_gpu_hour), now)
                if refused is not None:
                    self.ctx.service.notify_dm(
                        s, want.owner, text_view(refused), now, f"fleet-budget:{key}"
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
            inst = self.ctx.compute.launch(spec)
        except ProvisioningError as exc:
            mark_failed(self.ctx, key, str(exc))
            dm(
                self.ctx,
                want.owner,
                f"I could not launch an instance for {want.label}: {exc} It stays in line; "
                f"I will try again in {format_duration(LAUNCH_RETRY_AFTER)}.",
                f"fleet-failed:{key}",
            )
            return None
        if self.ctx.after_launch is not None:
            self.ctx.after_launch(inst)
        self.ctx.service.sync_hosts([replace(inst, state=HOST_PENDING)])
        mark_launched(self.ctx, key, inst, adopted=False)
        zone = _zone(self.ctx.compute, inst)
        where = f" in {zone}" if zone else ""
        market = " (spot)" if inst.market == "spot" else ""
        dm(
            self.ctx,
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
        self, s: Session, want: Want, itype: InstanceType, now: datetime
    ) -> str | None:
        """The refusal text when launching for `want` would take its owner over budget.

        The request itself is left out of "committed" (it waits at no known price yet) and
        priced here instead: its GPUs' share of the cheapest allowed type for its length
        (a run without `--max`: one hour, as bot.app.money.budgets counts queued runs)."""
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
                self.ctx.service.settings,
                what=f"Launching an instance for {want.label}",
                skip_reservation=want.id if want.kind == "res" else None,
                skip_run=want.id if want.kind == "run" else None,
            )
        except UserError as exc:
            return f"{exc.text} It stays in line and gets GPUs only if some free up."
        return None


def _within(cap: float | None, gpu_hourly: float) -> bool:
    """A GPU-hour at no more than `cap` (the price an offer showed; None: no cap), to the
    float's rounding."""
    return cap is None or gpu_hourly <= cap + 1e-9


def _gpu_hourly(catalog: Catalog, host: Host, market: str) -> float:
    """A stopped host's GPU-hour at its type's price (unknown types: its own share)."""
    itype = catalog.get(host.instance_type or "")
    return float("inf") if itype is None else itype.gpu_hourly(market)


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


def _zone(compute: Compute, inst: Instance) -> str | None:
    finder = getattr(compute, "zone", None)
    if finder is None or not inst.instance_id:
        return None
    try:
        zone = finder(inst.instance_id)
    except ProvisioningError:
        return None
    return str(zone) if zone else None
