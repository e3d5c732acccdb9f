"""The cloud, offered with its price, to a run or a reservation that waits long for the
team's own GPUs.

Where the team's places are owned ones and a cloud after them (GPUBOT_PROVIDERS=
slurm,aws, ssh,aws: bot.app.places.Places.bursting), a request waits on the owned side
first. Once it has waited GPUBOT_BURST_AFTER (or at once, where the owned side itself
expects to take that long, or can never hold it) its owner gets a plan by DM: the instance
type, the request's share of its $/h, the estimate for its `--max` or its length (one hour
assumed for a run without one, as budgets count such a run) and the buttons [Run on EC2
now, about $X] [Keep waiting]. Nothing is bought before the owner takes it (`/gpu cloud
take ID`, or `/gpu run --cloud ok` in advance); the budget and the caps are checked then.

While an offer is open or taken, the run keeps its place on the owned side, and the first
place to start it wins:
- gpubot's own hosts (SSH, this machine) and the cloud are placed by one scheduler, which
  buys for the run only once it is taken (bot.app.runs.dispatch) and starts it wherever
  GPUs are free first;
- a cluster places its own queue, so the instance is launched while the job still pends
  there, and when the instance is ready the job is withdrawn only if it still pends
  (`scancel --state=PENDING`: the controller decides, so it is never both running there
  and moved here) and the run is placed on the instance.
A reservation gpubot grants itself (SSH hosts, this machine) is granted wherever GPUs free
first, the instance bought for it or the owned host; a cluster's reservations (Slurm's
holding jobs) are not offered the cloud. Whatever was bought for a request the owned side
started first is given back at once.

One offer per request (a unique row), each state left once (bot.app.burst.state): one
request is never bought twice, and a restarted worker picks up where the rows say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.burst import state as st
from bot.app.money.budgets import check_budget
from bot.app.ports import STAGES_UNREAD, Actor, Core, Provisioner
from bot.app.runs.records import back_in_line
from bot.domain import views
from bot.domain.durations import format_seconds
from bot.domain.errors import UserError
from bot.domain.timefmt import when
from db.models import (
    HOST_BILLED_RUNNING,
    HOST_READY,
    RES_ACTIVE,
    RES_WAITING,
    RUN_ON_HOST,
    RUN_QUEUED,
    RUN_STARTING,
    BurstOffer,
    Gpu,
    Host,
    LaunchRequest,
    Reservation,
    TrainingRun,
    User,
)
from db.session import locked, retrying, transaction
from provisioning.catalog import Catalog, InstanceType

if TYPE_CHECKING:
    from bot.app.runs import RunService

log = logging.getLogger(__name__)

ACTION_TAKE = "gpubot_cloud_take"
ACTION_WAIT = "gpubot_cloud_wait"
# The length priced for a run without `--max` (bot.app.money.budgets counts such a run so).
ASSUMED_HOURS = 1.0
# How often the queue's estimate is asked while no waiting run has reached the threshold.
ESTIMATE_EVERY_S = 60.0
# The owned side's "expected start" of a run none of its hosts can ever hold.
NEVER = datetime.max.replace(tzinfo=UTC)


@runtime_checkable
class Withdraws(Protocol):
    """A cluster's executor that can take a run's job out of its queue if it still waits
    there (bot.providers.slurm.runs.SlurmExecutor.withdraw)."""

    def withdraw(self, placement: dict[str, Any]) -> bool | None: ...


@dataclass(frozen=True)
class Ask:
    """A run or a reservation as the offers see it: what it asks for, who asked, and where
    it is now. Runs and reservations have their own ids: `kind` tells them apart."""

    kind: str  # "run" or "res"
    id: int
    owner: User
    model: str | None
    gpus: int
    spot: bool
    seconds: int | None  # a run's --max, a reservation's length
    asked_at: datetime
    # The request's own word on the cloud (a run's --cloud), beside the admin's (owner).
    cloud: str | None
    # It waits on the owned side (gpubot's line, a cluster's queue).
    waits: bool
    # The place it started on or was granted on, or None.
    where: str | None
    # It is over (ended, cancelled, released) without that.
    ended: bool
    started_at: datetime | None
    # What the owned side's queue says of it, and when it expects to start it (a cluster's
    # own estimate, kept on the run by the poll); "" and None where gpubot queues it.
    stage: str = ""
    expected: datetime | None = None

    @property
    def name(self) -> str:
        return f"Run #{self.id}" if self.kind == "run" else f"Reservation #{self.id}"

    @property
    def command(self) -> str:
        """How `/gpu cloud take|wait` names it."""
        return str(self.id) if self.kind == "run" else f"res {self.id}"


@dataclass(frozen=True)
class Plan:
    """Where a run could run on the cloud, and what it would cost its owner."""

    instance_type: InstanceType
    market: str
    usd_per_hour: float  # the run's GPUs' share of the instance
    hours: float
    assumed: bool  # a run without --max: `hours` is assumed

    @property
    def estimate_usd(self) -> float:
        return self.usd_per_hour * self.hours


def plan_for(
    catalog: Catalog, model: str | None, gpus: int, spot: bool, max_s: int | None
) -> Plan | None:
    """The cheapest instance type of the cloud that holds the request on one machine, or
    None (no such type: such a request is not offered, it waits)."""
    if not model or model == "cpu":
        return None
    market = "spot" if spot else "ondemand"
    fits = [t for t in catalog.for_model(model) if t.gpus >= gpus]
    if not fits:
        return None
    best = min(fits, key=lambda t: (t.gpu_hourly(market) * gpus, t.hourly(market)))
    hours = max_s / 3600.0 if max_s else ASSUMED_HOURS
    return Plan(best, market, best.gpu_hourly(market) * gpus, hours, not max_s)


class Bursts:
    """The offers: made and withdrawn on the worker's tick, answered by their owners."""

    def __init__(
        self,
        service: Core,
        runs: RunService,
        provider_of: Callable[[str], str | None],
        cloud: str,
        catalog: Catalog,
        label_of: Callable[[str], str] = str,
        owned: frozenset[str] = frozenset(),
        *,
        reservations: bool = True,
    ) -> None:
        """`runs`: the team's runs (where each waits or runs); `provider_of`: a host's
        provider by its name; `cloud` and `catalog`: the place that buys, and its prices;
        `label_of`: a place as a sentence names it (bot.app.places.Places.label);
        `owned`: the owned places that run (whose queue estimate an offer weighs);
        `reservations`: gpubot grants reservations itself (no cluster holds them), so they
        are offered too."""
        self.service = service
        self.runs = runs
        self.provider_of = provider_of
        self.label_of = label_of
        self.owned = owned
        self.reservations = reservations
        self._estimated_at: datetime | None = None
        self.cloud = cloud  # the cloud place's name (its hosts' provider)
        self.catalog = catalog

    @property
    def _fleet(self) -> Provisioner | None:
        return self.service.fleet

    # --- what the offers see -----------------------------------------------------------

    def _run_ask(self, run: TrainingRun, owner: User) -> Ask:
        assert run.id is not None
        waits = run.state == RUN_QUEUED or (
            run.state == RUN_STARTING and self.runs.ctx.places_itself(dict(run.placement))
        )
        where: str | None = None
        if run.state in RUN_ON_HOST and not waits:
            at = run.placement.get("at")
            host = run.placement.get("host")
            if isinstance(at, str) and at:
                where = at
            elif isinstance(host, str) and host:
                where = self.provider_of(host)
        said = run.placement.get("expected")
        return Ask(
            kind="run",
            id=run.id,
            owner=owner,
            model=run.gpu_model,
            gpus=run.gpu_count,
            spot=run.spot,
            seconds=run.max_seconds,
            asked_at=run.submitted_at,
            cloud=run.cloud,
            waits=waits,
            where=where,
            ended=not waits and where is None and run.state not in RUN_ON_HOST,
            started_at=run.started_at,
            stage=str(run.placement.get("stage") or "") if waits else "",
            expected=datetime.fromisoformat(said) if isinstance(said, str) else None,
        )

    def _res_ask(self, s: Session, res: Reservation, owner: User) -> Ask:
        assert res.id is not None
        host = s.get(Host, res.host_id) if res.host_id is not None else None
        granted = res.state == RES_ACTIVE
        return Ask(
            kind="res",
            id=res.id,
            owner=owner,
            model=res.gpu_model,
            gpus=res.gpu_count,
            spot=False,
            seconds=res.duration_s,
            asked_at=res.requested_at,
            cloud=None,
            waits=res.state == RES_WAITING,
            where=host.provider if granted and host is not None else None,
            ended=res.state not in (RES_WAITING, RES_ACTIVE),
            started_at=res.granted_at,
        )

    def _asks(
        self, s: Session, offers: list[BurstOffer] | None
    ) -> list[tuple[Ask, BurstOffer | None]]:
        """The live offers' requests (`offers`), or (None) every request that waits."""
        out: list[tuple[Ask, BurstOffer | None]] = []
        if offers is not None:
            for o in offers:
                row: TrainingRun | Reservation | None = (
                    s.get(TrainingRun, o.run_id)
                    if o.run_id is not None
                    else s.get(Reservation, o.reservation_id)
                )
                owner = s.get(User, o.user_id)
                if row is None or owner is None:
                    continue
                ask = (
                    self._run_ask(row, owner)
                    if isinstance(row, TrainingRun)
                    else self._res_ask(s, row, owner)
                )
                out.append((ask, o))
            return out
        for run, owner in s.exec(
            select(TrainingRun, User)
            .join(User, col(User.id) == col(TrainingRun.user_id))
            .where(col(TrainingRun.state).in_((RUN_QUEUED, RUN_STARTING)))
            .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
        ):
            out.append((self._run_ask(run, owner), None))
        if self.reservations:
            for res, owner in s.exec(
                select(Reservation, User)
                .join(User, col(User.id) == col(Reservation.user_id))
                .where(Reservation.state == RES_WAITING)
                .order_by(col(Reservation.requested_at), col(Reservation.id))
            ):
                out.append((self._res_ask(s, res, owner), None))
        return out

    # --- the worker's side ----------------------------------------------------------

    def tick(self) -> list[str]:
        """Offers made, withdrawn, taken forward and settled; returns what was done."""
        done: list[str] = []
        now = self.service.clock.now()
        with transaction(self.service.engine, write=False) as s:
            live = self._asks(
                s, list(s.exec(select(BurstOffer).where(col(BurstOffer.state).not_in(st.FINAL))))
            )
            waiting = [ask for ask, _ in self._asks(s, None)]
            offered = _offered(s, waiting)
        for ask, offer in live:
            assert offer is not None
            note = self._forward(offer, ask, now)
            if note:
                done.append(note)
        after = self.service.settings.burst_after_s
        if after is None:
            return done
        due = [
            ask
            for ask in waiting
            if (ask.kind, ask.id) not in offered
            and ask.waits
            and consent(ask) != "never"
            # A cluster's run is offered once its queue has been read: the plan quotes the
            # cluster's reason (and its expected start may make the offer at once).
            and not (ask.kind == "run" and ask.stage in STAGES_UNREAD)
            # What the cloud cannot hold on one machine is not offered: it waits.
            and plan_for(self.catalog, ask.model, ask.gpus, ask.spot, None) is not None
        ]
        expected = self._expected(due, now, after)
        for ask in due:
            waited = (now - ask.asked_at).total_seconds()
            when = expected.get((ask.kind, ask.id))
            # Offered once it has waited the threshold, or at once where the owned side
            # expects to take that long from when it was asked (or never fits it).
            predicted = when is not None and (when - ask.asked_at).total_seconds() >= after
            if waited < after and not predicted:
                continue
            note = self._offer(ask, waited, now, when)
            if note:
                done.append(note)
        return done

    def _expected(
        self, due: list[Ask], now: datetime, after: float
    ) -> dict[tuple[str, int], datetime]:
        """When the owned side expects to start each request (NEVER: no owned host can
        hold it): a cluster's own estimate, kept on its run by the poll; else gpubot's
        queue estimate over the owned hosts, one pass for all. Asked at most once a minute
        while nothing is old enough to be offered anyway (the estimate reads the queue)."""
        out: dict[tuple[str, int], datetime] = {}
        queued: list[Ask] = []
        for ask in due:
            if ask.kind == "run" and ask.stage:
                if ask.expected is not None:
                    out[(ask.kind, ask.id)] = ask.expected
            else:
                queued.append(ask)
        if not queued:
            return out
        oldest = max((now - a.asked_at).total_seconds() for a in queued)
        recent = self._estimated_at is not None and (
            (now - self._estimated_at).total_seconds() < ESTIMATE_EVERY_S
        )
        if oldest < after and recent:
            return out
        self._estimated_at = now
        owned = set(self.owned)
        starts = self.runs.board.expected_starts(owned)
        largest = self.runs.board.largest_hosts(owned)
        for ask in queued:
            start = starts.get((ask.kind, ask.id))
            if start is not None:
                out[(ask.kind, ask.id)] = start
            elif largest.get(ask.model or "", 0) < ask.gpus:
                out[(ask.kind, ask.id)] = NEVER
        return out

    @retrying
    def _offer(
        self, ask: Ask, waited_s: float, now: datetime, expected: datetime | None
    ) -> str | None:
        """The plan, written (one per request) and sent; taken at once for `--cloud ok`."""
        with transaction(self.service.engine) as s:
            if not self._still_waits(s, ask):
                return None
            plan = plan_for(self.catalog, ask.model, ask.gpus, ask.spot, ask.seconds)
            if plan is None:
                return None
            refusal = self._refusal(s, ask, plan, now)
            take = consent(ask) == "ok" and refusal is None
            offer = BurstOffer(
                run_id=ask.id if ask.kind == "run" else None,
                reservation_id=ask.id if ask.kind == "res" else None,
                user_id=ask.owner.id or 0,
                place=self.cloud,
                instance_type=plan.instance_type.instance_type,
                usd_per_hour=plan.usd_per_hour,
                hours=plan.hours,
                assumed=plan.assumed,
                estimate_usd=plan.estimate_usd,
                state=st.ACCEPTED if take else (st.REFUSED if refusal else st.OPEN),
                note=refusal or "",
                expected_start=None if expected == NEVER else expected,
                created_at=now,
                decided_at=now if take or refusal else None,
            )
            try:
                with s.begin_nested():
                    s.add(offer)
            except IntegrityError:
                return None  # another worker made it
            after = self.service.settings.burst_after_s or 0.0
            head = wait_words(ask, waited_s, after, expected, now)
            owned = (
                ""
                if expected == NEVER
                else _expected_words(expected, now, self.service.settings.timezone)
            )
            view = offer_view(offer, ask, head, ask.stage or owned, self.label_of(self.cloud))
            self.service.notify_dm(s, ask.owner.key, view, now, f"burst-offer:{_key(offer)}")
        self.service.nudge()
        return f"offered {self.cloud} to {ask.name} ({offer.state})"

    def _still_waits(self, s: Session, ask: Ask) -> bool:
        """The request, locked, as it is now: does it still wait on the owned side?"""
        if ask.kind == "run":
            run = locked(s, TrainingRun, ask.id)
            return run is not None and self._run_ask(run, ask.owner).waits
        res = locked(s, Reservation, ask.id)
        return res is not None and res.state == RES_WAITING

    def _refusal(self, s: Session, ask: Ask, plan: Plan, now: datetime) -> str | None:
        """Why taking the plan is refused now (budget, caps), in words; None if not."""
        try:
            check_budget(
                s,
                ask.owner,
                plan.estimate_usd,
                now,
                self.service.settings,
                what=f"{ask.name} on {plan.instance_type.instance_type}",
                skip_run=ask.id if ask.kind == "run" else None,
                skip_reservation=ask.id if ask.kind == "res" else None,
            )
        except UserError as exc:
            return exc.text
        cfg = self.service.settings
        price = plan.instance_type.hourly(plan.market)
        if cfg.burst_max_usd_per_hour and price > cfg.burst_max_usd_per_hour:
            return (
                f"{plan.instance_type.instance_type} costs {_usd(price)}/h, over the admin's cap "
                f"of {_usd(cfg.burst_max_usd_per_hour)}/h for an instance bought for a waiting "
                "request (GPUBOT_BURST_MAX_USD_PER_HOUR)."
            )
        if cfg.burst_max_instances:
            running = bought_running(s, self.cloud)
            if running >= cfg.burst_max_instances:
                return (
                    f"{running} instance{'s' if running != 1 else ''} bought for waiting "
                    f"requests {'are' if running != 1 else 'is'} running, the admin's cap "
                    "(GPUBOT_BURST_MAX_INSTANCES); the next is offered when one ends."
                )
        fleet = self._fleet
        caps = fleet.pool_refusal(plan.instance_type.instance_type) if fleet else None
        if caps is not None:
            return f"The pool allows no more now: {caps}."
        return None

    def _forward(self, offer: BurstOffer, ask: Ask, now: datetime) -> str | None:
        """One live offer moved on by what happened to its request."""
        where = ask.where
        if offer.state in (st.OPEN, st.REFUSED):
            if where is None and not ask.ended:
                return None
            said = (
                f"{ask.name} started on {self.label_of(where)}, so the offer of "
                f"{self.label_of(self.cloud)} is withdrawn; nothing was bought."
                if where is not None
                else None
            )
            return self._settle(offer, st.WITHDRAWN, said, now)
        if offer.state in st.BUYING:
            if where == self.cloud:
                return self._settle(offer, st.CLOUD, None, now, ask.started_at)
            if where is not None or ask.ended:
                return self._settle(offer, st.GIVING_BACK, None, now)
            cluster = self.runs.ctx.cluster
            if ask.kind == "run" and offer.state in (st.ACCEPTED, st.MOVING) and cluster:
                return self._race_the_cluster(offer, now)
            return None  # gpubot places or grants it: the first GPUs free win
        if offer.state == st.GIVING_BACK:
            fleet = self._fleet
            if fleet is None or fleet.give_back(ask.kind, ask.id):
                said = (
                    f"{ask.name} started on {self.label_of(where)} first, so what was "
                    f"bought for it on {self.label_of(self.cloud)} was given back."
                    if where is not None and where != self.cloud
                    else None
                )
                return self._settle(offer, st.OWNED, said, now)
        return None

    def _race_the_cluster(self, offer: BurstOffer, now: datetime) -> str | None:
        """A taken offer of a run in a cluster's queue: an instance is launched for it;
        once one is ready, the job is withdrawn if it still pends and the run is gpubot's
        to place there. The cluster starting it first wins instead. The withdrawal is
        written down first (MOVING), so a worker that dies after the cancel finishes the
        move when it comes back, before the poll could read the cancel as the run's end."""
        fleet = self._fleet
        with transaction(self.service.engine, write=False) as s:
            run = s.get(TrainingRun, offer.run_id)
        if fleet is None or run is None or run.id is None:
            return None
        if offer.state == st.ACCEPTED:
            if not self._cloud_ready_for(run):
                done = fleet.provision_for(
                    run.id,
                    offer.instance_type,
                    offer.usd_per_hour / run.gpu_count,
                    in_cluster=True,
                )
                return f"run {run.id}: {done}" if done else None
            if self._settle(offer, st.MOVING, None, now) is None:
                return None
        cluster = self.runs.ctx.cluster
        executor = cluster[1] if cluster is not None else None
        gone: bool | None = True
        if run.state == RUN_STARTING:
            if not isinstance(executor, Withdraws):
                return None
            gone = executor.withdraw(dict(run.placement))
        if gone is None:
            return None  # the controller cannot say now: asked again next tick
        if not gone:
            # It started there first: the poll sees it run, and the tick gives back.
            return self._settle(offer, st.GIVING_BACK, None, now, was=st.MOVING)
        self._move(run.id, dict(run.placement))
        self.service.nudge()
        return f"run {run.id} moved from the cluster's queue to {self.cloud}"

    def _cloud_ready_for(self, run: TrainingRun) -> bool:
        """A ready instance of the cloud with enough free GPUs of the run's model."""
        from bot.app.watching.held import held_gpu_ids

        with transaction(self.service.engine, write=False) as s:
            held = held_gpu_ids(s)
            for host in s.exec(
                select(Host).where(Host.provider == self.cloud, Host.state == HOST_READY)
            ):
                free = [
                    g
                    for g in s.exec(
                        select(Gpu).where(Gpu.host_id == host.id, col(Gpu.present).is_(True))
                    )
                    if g.id not in held and g.model == run.gpu_model
                ]
                if len(free) >= run.gpu_count:
                    return True
        return False

    @retrying
    def _move(self, run_id: int, withdrawn: dict[str, Any]) -> None:
        """The run, out of the cluster's queue, back in gpubot's line for the cloud."""
        with transaction(self.service.engine) as s:
            run = locked(s, TrainingRun, run_id)
            offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == run_id)).one()
            if run is None or offer.state != st.MOVING:
                return
            if run.state == RUN_STARTING and run.placement.get("job") == withdrawn.get("job"):
                back_in_line(run)  # a pending job holds no GPUs: nothing to close
                s.add(run)
            elif run.state != RUN_QUEUED:
                return
            offer.state = st.MOVED
            s.add(offer)

    @retrying
    def _settle(
        self,
        offer: BurstOffer,
        to: str,
        said: str | None,
        now: datetime,
        cloud_start: datetime | None = None,
        *,
        was: str | None = None,
    ) -> str | None:
        """The offer from the state it was read in (`was`, else its own) to `to`, once (a
        conditional update under its lock), with its DM."""
        was = was or offer.state
        with transaction(self.service.engine) as s:
            row = locked(s, BurstOffer, offer.id) if offer.id is not None else None
            if row is None or row.state != was:
                return None
            row.state = to
            row.decided_at = row.decided_at or now
            row.cloud_start = cloud_start or row.cloud_start
            s.add(row)
            if said:
                owner = s.get(User, row.user_id)
                if owner is not None:
                    self.service.notify_dm(
                        s, owner.key, views.message(said).view, now, f"burst-{to}:{_key(row)}"
                    )
        return f"{_key(row)}: offer {was} -> {to}"

    # --- the owner's side -----------------------------------------------------------

    def answer(
        self, actor: Actor, ref: int, take: bool, *, reservation: bool = False
    ) -> views.Reply:
        """`/gpu cloud take ID` (a button) or `wait ID`; `take res ID` for a reservation."""
        now = self.service.clock.now()
        kind = "res" if reservation else "run"
        with transaction(self.service.engine) as s:
            column = BurstOffer.reservation_id if reservation else BurstOffer.run_id
            offer = s.exec(select(BurstOffer).where(column == ref)).first()
            found = self._asks(s, [offer]) if offer is not None else []
            name = f"Run #{ref}" if kind == "run" else f"Reservation #{ref}"
            if offer is None or not found:
                raise UserError(
                    f"{name} has no offer of the cloud: a request is offered it once it has "
                    "waited long for the team's own GPUs. `/gpu cloud` lists yours."
                )
            ((ask, _),) = found
            if ask.owner.key != actor.key and not actor.admin:
                raise UserError(f"{name} is {ask.owner.display_name}'s; only they can answer.")
            if offer.state not in (st.OPEN, st.REFUSED):
                raise UserError(_answered(offer, name))
            offer = locked(s, BurstOffer, offer.id)
            assert offer is not None
            if not take:
                offer.state, offer.decided_at = st.DECLINED, now
                s.add(offer)
                return views.message(
                    f"{name} keeps waiting for the team's own GPUs; it is not offered the "
                    "cloud again."
                )
            plan = plan_for(self.catalog, ask.model, ask.gpus, ask.spot, ask.seconds)
            if plan is None:
                raise UserError(f"The cloud no longer sells {ask.model} for {name}.")
            refusal = self._refusal(s, ask, plan, now)
            if refusal is not None:
                offer.state, offer.note = st.REFUSED, refusal
                s.add(offer)
                raise UserError(f"Nothing was bought for {name}. {refusal}")
            offer.state, offer.decided_at = st.ACCEPTED, now
            offer.instance_type = plan.instance_type.instance_type
            offer.usd_per_hour, offer.estimate_usd = plan.usd_per_hour, plan.estimate_usd
            s.add(offer)
        self.service.nudge()
        return views.message(
            f"Taken: a {plan.instance_type.instance_type} is being bought for {name} "
            f"(about {_usd(plan.estimate_usd)} for {_hours(plan)}). It keeps its place on the "
            "team's own GPUs meanwhile and starts wherever GPUs are free first; the other side "
            "is given back. You get a DM when it starts."
        )

    def set_policy(self, actor: Actor, user_key: str, policy: str) -> views.Reply:
        """`/gpu cloud @alice ok|never|ask`: an admin's word on the cloud for a person."""
        if not actor.admin:
            raise UserError("Only an admin can say what the cloud is for someone.")
        key = user_key.strip().lstrip("@")
        with transaction(self.service.engine) as s:
            user = self.service.user_row(s, key)
            user.cloud = None if policy == "ask" else policy
            s.add(user)
            audit(actor, "cloud", f"{user.key} to {policy}", session=s)
            name = user.display_name
        said = {
            "ok": "offers of the cloud are taken for them in advance, within their budget",
            "never": "what they ask for waits for the team's own GPUs, never offered the cloud",
            "ask": "they are asked, with the price, when a request has waited long",
        }[policy]
        return views.message(f"Cloud for {name}: {policy} ({said}).")

    def list_for(self, actor: Actor) -> views.Reply:
        """`/gpu cloud`: the caller's offers that are still live, newest first."""
        with transaction(self.service.engine, write=False) as s:
            rows = list(
                s.exec(
                    select(BurstOffer)
                    .join(User, col(User.id) == col(BurstOffer.user_id))
                    .where(User.key == actor.key, col(BurstOffer.state).not_in(st.FINAL))
                    .order_by(col(BurstOffer.id).desc())
                )
            )
        if not rows:
            after = self.service.settings.burst_after_s
            when = (
                "never (GPUBOT_BURST_AFTER=never)"
                if after is None
                else f"once a request has waited {format_seconds(after)} for the team's own GPUs"
            )
            return views.message(
                f"No offers of the cloud for your runs or reservations. They are made {when}."
            )
        lines = [
            f"{_name(o)}: {o.instance_type} on {self.label_of(o.place)}, about "
            f"{_usd(o.estimate_usd)} ({_usd(o.usd_per_hour)}/h), {o.state}"
            + (f": {o.note}" if o.state == st.REFUSED and o.note else "")
            for o in rows
        ]
        return views.message("\n".join(lines))


def _offered(s: Session, asks: list[Ask]) -> set[tuple[str, int]]:
    """Which of these requests has an offer already (made once, in whatever state)."""
    runs = [a.id for a in asks if a.kind == "run"]
    reservations = [a.id for a in asks if a.kind == "res"]
    found: set[tuple[str, int]] = set()
    if runs:
        q = select(BurstOffer.run_id).where(col(BurstOffer.run_id).in_(runs))
        found |= {("run", i) for i in s.exec(q) if i is not None}
    if reservations:
        q = select(BurstOffer.reservation_id).where(
            col(BurstOffer.reservation_id).in_(reservations)
        )
        found |= {("res", i) for i in s.exec(q) if i is not None}
    return found


def consent(ask: Ask) -> str | None:
    """What the request's owner said of the cloud (a run's --cloud), with the admin's word
    for them: "never" from either wins, then "ok" from either; None: ask with the price."""
    words = (ask.cloud, ask.owner.cloud)
    if "never" in words:
        return "never"
    return "ok" if "ok" in words else None


def bought_running(s: Session, cloud: str) -> int:
    """Instances of the cloud bought for waiting requests (an offer's launches) that run now."""
    ids = select(LaunchRequest.instance_id).where(
        col(LaunchRequest.run_id).in_(select(BurstOffer.run_id))
        | col(LaunchRequest.reservation_id).in_(select(BurstOffer.reservation_id)),
        col(LaunchRequest.instance_id).is_not(None),
    )
    hosts = s.exec(
        select(Host.id).where(
            Host.provider == cloud,
            col(Host.state).in_(HOST_BILLED_RUNNING),
            col(Host.instance_id).in_(ids),
        )
    )
    return len(list(hosts))


def wait_words(
    ask: Ask, waited_s: float, after_s: float, expected: datetime | None, now: datetime
) -> str:
    """The plan's first words: how long the request has waited, or (offered before the
    threshold because the owned side expects to take that long) how long it would."""
    mine = f"the team's own {ask.model} GPUs"
    if waited_s >= after_s or expected is None:
        return f"{ask.name} has waited {format_seconds(waited_s)} for {mine}."
    if expected == NEVER:
        return f"{ask.name} would wait for good for {mine}: none of them can hold it."
    return f"{ask.name} would wait about {format_seconds((expected - now).total_seconds())} for {mine}."


def offer_view(offer: BurstOffer, ask: Ask, head: str, stage: str, cloud: str) -> views.View:
    """The plan as its owner reads it, with the two buttons (Block Kit keeps their labels
    within 75 characters: bot.faces.slack.blocks). `head`: `wait_words`; `stage`: what the
    owned side's queue says of it; `cloud`: the cloud as people name it."""
    take = f"/gpu cloud take {ask.command}"
    wait = f"/gpu cloud wait {ask.command}"
    if ask.kind == "res":
        length = f"its {format_seconds(offer.hours * 3600)}"
    elif offer.assumed:
        length = (
            f"{format_seconds(offer.hours * 3600)} (no --max given: {ASSUMED_HOURS:g}h assumed)"
        )
    else:
        length = f"its --max of {format_seconds(offer.hours * 3600)}"
    if stage and stage not in STAGES_UNREAD:
        head = f"{head} Their queue says: {stage}."
    verb = "run" if ask.kind == "run" else "be held"
    plan = (
        f"It could {verb} on {cloud} now: {offer.instance_type}, {_usd(offer.usd_per_hour)}/h "
        f"for its {ask.gpus} GPU{'s' if ask.gpus != 1 else ''}, about "
        f"{_usd(offer.estimate_usd)} for {length}."
    )
    if offer.state == st.REFUSED:
        tail = f"{offer.note} It keeps waiting for the team's own GPUs."
        return views.View(
            text=f"{head} {plan} {tail}",
            blocks=(views.Text(head), views.Text(plan), views.Text(tail)),
        )
    if offer.state == st.ACCEPTED:
        tail = (
            "You took it in advance (--cloud ok): it is being bought now, and it starts "
            "wherever it can first."
        )
        return views.View(
            text=f"{head} {plan} {tail}",
            blocks=(views.Text(head), views.Text(plan), views.Text(tail)),
        )
    tail = "It keeps its place in the team's queue either way, and starts wherever it can first."
    label = f"Run on {cloud} now, about {_usd(offer.estimate_usd)}"
    return views.View(
        text=f"{head} {plan} {tail}",
        blocks=(
            views.Text(head),
            views.Text(plan),
            views.Context(tail),
            views.Actions(
                (
                    views.Button(label, ACTION_TAKE, take, "primary", take),
                    views.Button("Keep waiting", ACTION_WAIT, wait, None, wait),
                )
            ),
        ),
    )


def _expected_words(expected: datetime | None, now: datetime, tz: str) -> str:
    """The owned side's estimate as the plan says it."""
    if expected is None:
        return "no start is known on them yet (a holder without a known end)"
    return f"expected to start on them {when(expected, now, tz)}"


def _answered(offer: BurstOffer, name: str) -> str:
    said = {
        st.ACCEPTED: "it was taken already: the cloud is being bought for it",
        st.MOVING: "it was taken: its job is leaving the cluster's queue for the cloud",
        st.MOVED: "it was taken: it runs on the cloud as soon as it is placed there",
        st.CLOUD: "it runs on the cloud",
        st.DECLINED: "you chose to keep waiting",
        st.WITHDRAWN: "it started on the team's own GPUs, or ended, before an answer",
        st.GIVING_BACK: "the team's own GPUs started it first",
        st.OWNED: "the team's own GPUs started it first",
    }
    return f"The offer for {name.lower()} is closed: {said.get(offer.state, offer.state)}."


def _key(offer: BurstOffer) -> str:
    """The offer's request, as dedupe keys and logs name it: `run:12`, `res:3`."""
    return f"run:{offer.run_id}" if offer.run_id is not None else f"res:{offer.reservation_id}"


def _name(offer: BurstOffer) -> str:
    return (
        f"Run #{offer.run_id}"
        if offer.run_id is not None
        else f"Reservation #{offer.reservation_id}"
    )


def _usd(x: float) -> str:
    return f"${x:,.2f}"


def _hours(plan: Plan) -> str:
    span = format_seconds(plan.hours * 3600)
    return f"{span}, assumed (no --max)" if plan.assumed else span
