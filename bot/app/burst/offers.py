"""The cloud, offered with its price, to a run that waits long for the team's own GPUs.

Where the team's places are owned ones and a cloud after them (GPUBOT_PROVIDERS=
slurm,aws, ssh,aws: bot.app.places.Places.bursting), a run waits on the owned side first.
Once it has waited GPUBOT_BURST_AFTER its owner gets a plan by DM: the instance type, the
run's share of its $/h, the estimate for its `--max` (one hour assumed without one, as
budgets count such a run) and the buttons [Run on EC2 now, about $X] [Keep waiting].
Nothing is bought before the owner takes it (`/gpu cloud take ID`, or `/gpu run --cloud
ok` in advance); the budget and the pool's caps are checked when it is taken.

While an offer is open or taken, the run keeps its place on the owned side, and the first
place to start it wins:
- gpubot's own hosts (SSH, this machine) and the cloud are placed by one scheduler, which
  buys for the run only once it is taken (bot.app.runs.dispatch) and starts it wherever
  GPUs are free first;
- a cluster places its own queue, so the instance is launched while the job still pends
  there, and when the instance is ready the job is withdrawn only if it still pends
  (`scancel --state=PENDING`: the controller decides, so it is never both running there
  and moved here) and the run is placed on the instance.
Whatever was bought for a run the owned side started first is given back at once.

One offer per run (a unique row), each state left once (bot.app.burst.state): one request
is never bought twice, and a restarted worker picks up where the rows say.
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
from bot.app.ports import Actor, Core, Provisioner
from bot.app.runs.records import back_in_line
from bot.domain import views
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.domain.timefmt import when
from db.models import (
    HOST_BILLED_RUNNING,
    HOST_READY,
    RUN_ON_HOST,
    RUN_QUEUED,
    RUN_STARTING,
    BurstOffer,
    Gpu,
    Host,
    LaunchRequest,
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
class Plan:
    """Where a run could run on the cloud, and what it would cost its owner."""

    instance_type: InstanceType
    market: str
    usd_per_hour: float  # the run's GPUs' share of the instance
    hours: float
    assumed: bool  # no --max: `hours` is assumed

    @property
    def estimate_usd(self) -> float:
        return self.usd_per_hour * self.hours


def plan_for(
    catalog: Catalog, model: str | None, gpus: int, spot: bool, max_s: int | None
) -> Plan | None:
    """The cheapest instance type of the cloud that holds the run on one machine, or None
    (no such type: such a run is not offered, it waits)."""
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
    ) -> None:
        """`runs`: the team's runs (where each waits or runs); `provider_of`: a host's
        provider by its name; `cloud` and `catalog`: the place that buys, and its prices;
        `label_of`: a place as a sentence names it (bot.app.places.Places.label);
        `owned`: the owned places that run (whose queue estimate an offer weighs)."""
        self.service = service
        self.runs = runs
        self.provider_of = provider_of
        self.label_of = label_of
        self.owned = owned
        self._estimated_at: datetime | None = None
        self.cloud = cloud  # the cloud place's name (its hosts' provider)
        self.catalog = catalog

    @property
    def _fleet(self) -> Provisioner | None:
        return self.service.fleet

    # --- the worker's side ----------------------------------------------------------

    def tick(self) -> list[str]:
        """Offers made, withdrawn, taken forward and settled; returns what was done."""
        done: list[str] = []
        now = self.service.clock.now()
        with transaction(self.service.engine, write=False) as s:
            live = list(
                s.exec(
                    select(BurstOffer, TrainingRun)
                    .join(TrainingRun, col(TrainingRun.id) == col(BurstOffer.run_id))
                    .where(col(BurstOffer.state).not_in(st.FINAL))
                )
            )
            offered = set(s.exec(select(BurstOffer.run_id)))
            waiting = list(
                s.exec(
                    select(TrainingRun, User)
                    .join(User, col(User.id) == col(TrainingRun.user_id))
                    .where(col(TrainingRun.state).in_((RUN_QUEUED, RUN_STARTING)))
                    .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
                )
            )
        for offer, run in live:
            note = self._forward(offer, run, now)
            if note:
                done.append(note)
        after = self.service.settings.burst_after_s
        if after is None:
            return done
        due = [
            (run, user)
            for run, user in waiting
            if run.id is not None
            and run.id not in offered
            and consent(run, user) != "never"
            and self._waits_on_owned(run)
            # A run the cloud cannot hold on one machine is not offered: it waits.
            and plan_for(self.catalog, run.gpu_model, run.gpu_count, run.spot, None) is not None
        ]
        expected = self._expected(due, now, after)
        for run, user in due:
            assert run.id is not None
            waited = (now - _aware(run.submitted_at)).total_seconds()
            when = expected.get(run.id)
            # Offered once it has waited the threshold, or at once where the owned side
            # expects to take that long from when it was asked (or never fits it).
            predicted = (
                when is not None and (when - _aware(run.submitted_at)).total_seconds() >= after
            )
            if waited < after and not predicted:
                continue
            at = None if when is None or when == NEVER else when
            note = self._offer(run.id, user.key, waited, now, at, never=when == NEVER)
            if note:
                done.append(note)
        return done

    def _waits_on_owned(self, run: TrainingRun) -> bool:
        """In gpubot's queue, or claimed by a cluster that has not started it."""
        if run.state == RUN_QUEUED:
            return True
        ctx = self.runs.ctx
        return run.state == RUN_STARTING and ctx.places_itself(dict(run.placement))

    def _where(self, run: TrainingRun) -> str | None:
        """The place a started run runs on (its placement's `at`), or None."""
        if run.state not in RUN_ON_HOST or self._waits_on_owned(run):
            return None
        at = run.placement.get("at")
        if isinstance(at, str) and at:
            return at
        host = run.placement.get("host")
        return self.provider_of(host) if isinstance(host, str) and host else None

    def _expected(
        self, due: list[tuple[TrainingRun, User]], now: datetime, after: float
    ) -> dict[int, datetime]:
        """When the owned side expects to start each run (NEVER: no owned host fits it): a
        cluster's own estimate, kept on its placement by the poll; else gpubot's queue
        estimate over the owned hosts, one pass for all. Asked at most once a minute while
        no run is old enough to be offered anyway (the estimate reads the whole queue)."""
        out: dict[int, datetime] = {}
        queued: list[TrainingRun] = []
        for run, _ in due:
            assert run.id is not None
            if run.state != RUN_QUEUED:
                said = run.placement.get("expected")
                if isinstance(said, str):
                    out[run.id] = _aware(datetime.fromisoformat(said))
            else:
                queued.append(run)
        if not queued:
            return out
        oldest = max((now - _aware(r.submitted_at)).total_seconds() for r in queued)
        if (
            oldest < after
            and self._estimated_at is not None
            and (now - self._estimated_at).total_seconds() < ESTIMATE_EVERY_S
        ):
            return out
        self._estimated_at = now
        owned = set(self.owned)
        starts = self.runs.board.expected_starts(owned)
        for run in queued:
            assert run.id is not None
            start = starts.get(run.id)
            if start is not None:
                out[run.id] = start
            elif not self.runs.board.fits_on(owned, run.gpu_model or "", run.gpu_count):
                out[run.id] = NEVER
        return out

    @retrying
    def _offer(
        self,
        run_id: int,
        owner: str,
        waited_s: float,
        now: datetime,
        expected: datetime | None,
        *,
        never: bool = False,
    ) -> str | None:
        """The plan, written (one per run) and sent; taken at once for `--cloud ok`."""
        with transaction(self.service.engine) as s:
            run = locked(s, TrainingRun, run_id)
            user = s.exec(select(User).where(User.key == owner)).one()
            if run is None or not self._waits_on_owned(run):
                return None
            plan = plan_for(self.catalog, run.gpu_model, run.gpu_count, run.spot, run.max_seconds)
            if plan is None:
                return None
            refusal = self._refusal(s, user, run, plan, now)
            take = consent(run, user) == "ok" and refusal is None
            offer = BurstOffer(
                run_id=run_id,
                user_id=user.id or 0,
                place=self.cloud,
                instance_type=plan.instance_type.instance_type,
                usd_per_hour=plan.usd_per_hour,
                hours=plan.hours,
                assumed=plan.assumed,
                estimate_usd=plan.estimate_usd,
                state=st.ACCEPTED if take else (st.REFUSED if refusal else st.OPEN),
                note=refusal or "",
                expected_start=expected,
                created_at=now,
                decided_at=now if take or refusal else None,
            )
            try:
                with s.begin_nested():
                    s.add(offer)
            except IntegrityError:
                return None  # another worker made it
            stage = str(run.placement.get("stage") or "")
            after = self.service.settings.burst_after_s or 0.0
            head = wait_words(run, waited_s, after, NEVER if never else expected, now)
            owned = "" if never else _expected_words(expected, now, self.service.settings.timezone)
            view = offer_view(offer, run, head, stage or owned, self.label_of(self.cloud))
            self.service.notify_dm(s, owner, view, now, f"burst-offer:{run_id}")
        self.service.nudge()
        return f"offered {self.cloud} to run {run_id} ({offer.state})"

    def _refusal(
        self, s: Session, user: User, run: TrainingRun, plan: Plan, now: datetime
    ) -> str | None:
        """Why taking the plan is refused now (budget, pool caps), in words; None if not."""
        try:
            check_budget(
                s,
                user,
                plan.estimate_usd,
                now,
                self.service.settings,
                what=f"Run #{run.id} on {plan.instance_type.instance_type}",
                skip_run=run.id,
            )
        except UserError as exc:
            return exc.text
        cfg = self.service.settings
        price = plan.instance_type.hourly(plan.market)
        if cfg.burst_max_usd_per_hour and price > cfg.burst_max_usd_per_hour:
            return (
                f"{plan.instance_type.instance_type} costs {_usd(price)}/h, over the admin's cap "
                f"of {_usd(cfg.burst_max_usd_per_hour)}/h for an instance bought for a waiting "
                "run (GPUBOT_BURST_MAX_USD_PER_HOUR)."
            )
        if cfg.burst_max_instances:
            running = bought_running(s, self.cloud)
            if running >= cfg.burst_max_instances:
                return (
                    f"{running} instance{'s' if running != 1 else ''} bought for waiting runs "
                    f"{'are' if running != 1 else 'is'} running, the admin's cap "
                    "(GPUBOT_BURST_MAX_INSTANCES); the next is offered when one ends."
                )
        fleet = self._fleet
        caps = fleet.pool_refusal(plan.instance_type.instance_type) if fleet else None
        if caps is not None:
            return f"The pool allows no more now: {caps}."
        return None

    def _forward(self, offer: BurstOffer, run: TrainingRun, now: datetime) -> str | None:
        """One live offer moved on by what happened to its run."""
        assert run.id is not None
        where = self._where(run)
        ended = run.state not in (RUN_QUEUED, *RUN_ON_HOST)
        if offer.state in (st.OPEN, st.REFUSED):
            if where is None and not ended:
                return None
            said = (
                f"Run #{run.id} started on {self.label_of(where)}, so the offer of "
                f"{self.label_of(self.cloud)} is withdrawn; nothing was bought."
                if where is not None
                else None
            )
            return self._settle(run.id, offer.state, st.WITHDRAWN, said, now)
        if offer.state in st.BUYING:
            if where == self.cloud:
                started = run.started_at
                return self._settle(run.id, offer.state, st.CLOUD, None, now, started)
            if where is not None or ended:
                return self._settle(run.id, offer.state, st.GIVING_BACK, None, now)
            if offer.state in (st.ACCEPTED, st.MOVING) and self.runs.ctx.cluster is not None:
                return self._race_the_cluster(offer, run, now)
            return None
        if offer.state == st.GIVING_BACK:
            fleet = self._fleet
            if fleet is None or fleet.give_back(run.id):
                said = (
                    f"Run #{run.id} started on {self.label_of(where)} first, so what was "
                    f"bought for it on {self.label_of(self.cloud)} was given back."
                    if where is not None and where != self.cloud
                    else None
                )
                return self._settle(run.id, st.GIVING_BACK, st.OWNED, said, now)
        return None

    def _race_the_cluster(self, offer: BurstOffer, run: TrainingRun, now: datetime) -> str | None:
        """A taken offer of a run in a cluster's queue: an instance is launched for it;
        once one is ready, the job is withdrawn if it still pends and the run is gpubot's
        to place there. The cluster starting it first wins instead. The withdrawal is
        written down first (MOVING), so a worker that dies after the cancel finishes the
        move when it comes back, before the poll could read the cancel as the run's end."""
        assert run.id is not None
        fleet = self._fleet
        if fleet is None:
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
            if self._settle(run.id, st.ACCEPTED, st.MOVING, None, now) is None:
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
            return self._settle(run.id, st.MOVING, st.GIVING_BACK, None, now)
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
        run_id: int,
        was: str,
        to: str,
        said: str | None,
        now: datetime,
        cloud_start: datetime | None = None,
    ) -> str | None:
        """`was` -> `to`, once (a conditional update), with its DM."""
        with transaction(self.service.engine) as s:
            offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == run_id)).first()
            if offer is None or offer.state != was:
                return None
            offer.state = to
            offer.decided_at = offer.decided_at or now
            offer.cloud_start = cloud_start or offer.cloud_start
            s.add(offer)
            if said:
                owner = s.get(User, offer.user_id)
                if owner is not None:
                    self.service.notify_dm(
                        s, owner.key, views.message(said).view, now, f"burst-{to}:{run_id}"
                    )
        return f"run {run_id}: offer {was} -> {to}"

    # --- the owner's side -----------------------------------------------------------

    def answer(self, actor: Actor, run_id: int, take: bool) -> views.Reply:
        """`/gpu cloud take ID` (a button) or `wait ID`."""
        now = self.service.clock.now()
        with transaction(self.service.engine) as s:
            offer = s.exec(select(BurstOffer).where(BurstOffer.run_id == run_id)).first()
            run = locked(s, TrainingRun, run_id)
            owner = s.get(User, offer.user_id) if offer is not None else None
            if offer is None or run is None or owner is None:
                raise UserError(
                    f"Run #{run_id} has no offer of the cloud: runs are offered it once they "
                    "have waited long for the team's own GPUs. `/gpu cloud` lists yours."
                )
            if owner.key != actor.key and not actor.admin:
                raise UserError(f"Run #{run_id} is {owner.display_name}'s; only they can answer.")
            if offer.state not in (st.OPEN, st.REFUSED):
                raise UserError(_answered(offer, run_id))
            if not take:
                offer.state, offer.decided_at = st.DECLINED, now
                s.add(offer)
                return views.message(
                    f"Run #{run_id} keeps waiting for the team's own GPUs; it is not offered "
                    "the cloud again."
                )
            plan = plan_for(self.catalog, run.gpu_model, run.gpu_count, run.spot, run.max_seconds)
            if plan is None:
                raise UserError(f"The cloud no longer sells {run.gpu_model} for run #{run_id}.")
            refusal = self._refusal(s, owner, run, plan, now)
            if refusal is not None:
                offer.state, offer.note = st.REFUSED, refusal
                s.add(offer)
                raise UserError(f"Nothing was bought for run #{run_id}. {refusal}")
            offer.state, offer.decided_at = st.ACCEPTED, now
            offer.instance_type = plan.instance_type.instance_type
            offer.usd_per_hour, offer.estimate_usd = plan.usd_per_hour, plan.estimate_usd
            s.add(offer)
        self.service.nudge()
        return views.message(
            f"Taken: a {plan.instance_type.instance_type} is being bought for run #{run_id} "
            f"(about {_usd(plan.estimate_usd)} for {_hours(plan)}). It keeps its place on the "
            "team's own GPUs meanwhile and runs wherever it can start first; the other side is "
            "given back. You get a DM when it starts."
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
            "never": "their runs wait for the team's own GPUs and are never offered the cloud",
            "ask": "they are asked, with the price, when a run has waited long",
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
                else f"once a run has waited {_span(after)} for the team's own GPUs"
            )
            return views.message(f"No offers of the cloud for your runs. They are made {when}.")
        lines = [
            f"Run #{o.run_id}: {o.instance_type} on {o.place}, about {_usd(o.estimate_usd)} "
            f"({_usd(o.usd_per_hour)}/h), {o.state}"
            + (f": {o.note}" if o.state == st.REFUSED and o.note else "")
            for o in rows
        ]
        return views.message("\n".join(lines))


def consent(run: TrainingRun, user: User) -> str | None:
    """What the run's owner said of the cloud, with the admin's word for them: "never"
    from either wins, then "ok" from either; None: ask with the price."""
    words = (run.cloud, user.cloud)
    if "never" in words:
        return "never"
    return "ok" if "ok" in words else None


def bought_running(s: Session, cloud: str) -> int:
    """Instances of the cloud bought for waiting runs (an offer's launches) that run now."""
    ids = select(LaunchRequest.instance_id).where(
        col(LaunchRequest.run_id).in_(select(BurstOffer.run_id)),
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
    run: TrainingRun, waited_s: float, after_s: float, expected: datetime | None, now: datetime
) -> str:
    """The plan's first words: how long the run has waited, or (offered before the
    threshold because the owned side expects to take that long) how long it would."""
    mine = f"the team's own {run.gpu_model} GPUs"
    if waited_s >= after_s or expected is None:
        return f"Run #{run.id} has waited {_span(waited_s)} for {mine}."
    if expected == NEVER:
        return f"Run #{run.id} would wait for good for {mine}: none of them can hold it."
    return f"Run #{run.id} would wait about {_span((expected - now).total_seconds())} for {mine}."


def offer_view(
    offer: BurstOffer, run: TrainingRun, head: str, stage: str, cloud: str
) -> views.View:
    """The plan as its owner reads it, with the two buttons (Block Kit keeps their labels
    within 75 characters: bot.faces.slack.blocks). `head`: `wait_words`; `stage`: what the
    owned side's queue says of it; `cloud`: the cloud as people name it."""
    take = f"/gpu cloud take {offer.run_id}"
    wait = f"/gpu cloud wait {offer.run_id}"
    length = (
        f"{_span(offer.hours * 3600)} (no --max given: {ASSUMED_HOURS:g}h assumed)"
        if offer.assumed
        else f"its --max of {_span(offer.hours * 3600)}"
    )
    if stage and stage != "handed to the cluster":
        head = f"{head} Their queue says: {stage}."
    plan = (
        f"It could run on {cloud} now: {offer.instance_type}, {_usd(offer.usd_per_hour)}/h for "
        f"its {run.gpu_count} GPU{'s' if run.gpu_count != 1 else ''}, about "
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
            "You took it in advance (--cloud ok): it is being bought now, and the run starts "
            "wherever it can first."
        )
        return views.View(
            text=f"{head} {plan} {tail}",
            blocks=(views.Text(head), views.Text(plan), views.Text(tail)),
        )
    tail = "It keeps its place in the team's queue either way, and runs wherever it starts first."
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


def _answered(offer: BurstOffer, run_id: int) -> str:
    said = {
        st.ACCEPTED: "it was taken already: the cloud is being bought for it",
        st.MOVING: "it was taken: its job is leaving the cluster's queue for the cloud",
        st.MOVED: "it was taken: it runs on the cloud as soon as it is placed there",
        st.CLOUD: "it runs on the cloud",
        st.DECLINED: "you chose to keep waiting",
        st.WITHDRAWN: "the run started on the team's own GPUs, or ended, before an answer",
        st.GIVING_BACK: "the team's own GPUs started it first",
        st.OWNED: "the team's own GPUs started it first",
    }
    return f"The offer for run #{run_id} is closed: {said.get(offer.state, offer.state)}."


def _usd(x: float) -> str:
    return f"${x:,.2f}"


def _span(seconds: float) -> str:
    from datetime import timedelta

    return format_duration(timedelta(seconds=round(seconds)))


def _hours(plan: Plan) -> str:
    span = _span(plan.hours * 3600)
    return f"{span}, assumed (no --max)" if plan.assumed else span


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
