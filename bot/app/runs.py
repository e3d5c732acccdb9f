"""Training runs: submit, queue, cancel, logs — and the worker's side of them,
dispatch (place queued runs with the scheduler and start them on their host) and
poll (read each running run's status file and finish it).

The same `bot.domain.scheduling.decide` that `gpubot simulate` measures places the runs:
hosts become `FleetInstance`s, the GPUs that reservations hold become allocations
with known ends, queued runs become `QueuedRun`s. Only `Place` actions can be
carried out on hosts the team owns; `Launch`/`Start`/`Stop` need a cloud provider
and are logged and skipped until one is configured.

A run is dispatched exactly once: the move from `queued` to `starting` is a
conditional update that only one worker can win, and the GPUs it takes are
claimed by usage intervals in the same transaction (the partial unique index
refuses a GPU held twice). A process that dies between claiming and starting
leaves a `starting` run with no process id, which the next poll puts back in line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, or_, update
from sqlmodel import Session, col, select

from bot.app import budgets, runwatch, sources
from bot.app.access import RunGate, StaticMembership, audit
from bot.app.agentwatch import requeue_resumable, resumable_stop, upload_checkpoints, watch_hosts
from bot.app.config import Settings
from bot.app.held import end_held, held_gpu_ids, who_holds
from bot.app.outbox import enqueue
from bot.app.ports import Actor, Core, HostAccess, HostSeat, Interpreter, bot_python
from bot.app.rollups import fair_share_usage
from bot.domain import code_sources, estimates, views
from bot.domain.commands import Cancel, Logs, Queue, Run
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.domain.scheduling import (
    LAS_AFTER_S,
    Allocation,
    FleetInstance,
    InstanceState,
    Launch,
    Place,
    Preempt,
    QueuedRun,
    RunHistory,
    SchedulerConfig,
    Start,
    decide,
    preempt_slot,
)
from db.models import (
    HOST_PENDING,
    HOST_READY,
    HOST_STOPPED,
    HOST_UNREACHABLE,
    RES_WAITING,
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_FAILED,
    RUN_OPEN_STATES,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    RUN_SUCCEEDED,
    Gpu,
    Host,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import lock_pool, locked, retrying, transaction
from provisioning import shell
from provisioning.catalog import Catalog
from provisioning.costs import gpu_share
from provisioning.ssh import SshError, SshRunner, SshTarget
from training.exitcodes import EXIT_OOM
from training.status import TERMINAL_STATES, RunStatus, parse_status

log = logging.getLogger(__name__)

RECIPES = ("digits",)
# A run claimed but not started within this long is presumed orphaned by a crash.
STARTING_GRACE = timedelta(seconds=90)
USAGE_RUN = "/gpu run [--gpus N] [--gpu MODEL] [--precision auto|bf16|fp16|fp32] [--max DURATION] [--spot] [--git URL[@REF] | --path DIR] [--recipe NAME [--lr LR] [--batch-size N] [--epochs N] [--sweep lr=V1,V2]] -- COMMAND"


@dataclass
class LocalAccess:
    """This machine only: runs live under $GPUBOT_HOME/runs (or the run account's home),
    started with the bot's interpreter unless `interpreter` names another (the run
    account's, bot.faces.runtime, prepared on first use)."""

    runner: SshRunner
    target: SshTarget
    runs_dir: Path
    interpreter: Callable[[], Interpreter] = bot_python

    def runner_for(self, host_name: str) -> HostSeat | None:
        if host_name != "local":
            return None
        return HostSeat(self.runner, self.target, self.runs_dir, self.interpreter)


def _hosts_with_gpus(s: Session, which: Any) -> list[tuple[Host, list[Gpu]]]:
    """The hosts `which` selects, by id, each with its present GPUs: two queries whatever
    the number of hosts (a GPU query per host made the queue and the tick grow with
    the fleet)."""
    hosts = list(s.exec(select(Host).where(which).order_by(col(Host.id))))
    ids = [h.id for h in hosts]
    by_host: dict[int, list[Gpu]] = {}
    if ids:
        for g in s.exec(
            select(Gpu)
            .where(col(Gpu.host_id).in_(ids), col(Gpu.present).is_(True))
            .order_by(col(Gpu.id))
        ):
            by_host.setdefault(g.host_id, []).append(g)
    return [(h, by_host.get(h.id or -1, [])) for h in hosts]


@dataclass(frozen=True)
class _FleetHost:
    """What the queue needs of a host that is not terminated: plain columns and its
    present GPUs counted by model, not ORM objects (the queue and App Home read the
    whole fleet on every call; building a Host and eight Gpu objects per host was most
    of their time at a hundred hosts)."""

    id: int
    name: str
    state: str
    hourly_usd: float
    created_at: datetime | None
    down_since: datetime | None
    down_reason: str | None
    models: dict[str, int]  # present GPUs by model, models sorted

    @property
    def gpus(self) -> int:
        return sum(self.models.values())


def _fleet(s: Session) -> list[_FleetHost]:
    """Every host not terminated, by name (the database's collation, as the down hosts
    are listed), with its present GPUs by model: two queries of plain columns whatever
    the size of the fleet."""
    host_columns: tuple[Any, ...] = (
        Host.id,
        Host.name,
        Host.state,
        Host.hourly_usd,
        Host.created_at,
        Host.down_since,
        Host.down_reason,
    )
    hosts = s.exec(
        select(*host_columns).where(Host.state != "terminated").order_by(col(Host.name))
    ).all()
    counts: dict[int, dict[str, int]] = {}
    gpu_columns: tuple[Any, ...] = (Gpu.host_id, Gpu.model, func.count())
    for host_id, model, n in s.exec(
        select(*gpu_columns)
        .where(col(Gpu.present).is_(True))
        .group_by(col(Gpu.host_id), col(Gpu.model))
    ):
        counts.setdefault(host_id, {})[model] = int(n)
    return [
        _FleetHost(
            id=hid,
            name=name,
            state=state,
            hourly_usd=hourly,
            created_at=created,
            down_since=down_since,
            down_reason=reason,
            models=dict(sorted(counts.get(hid, {}).items())),
        )
        for hid, name, state, hourly, created, down_since, reason in hosts
    ]


def scheduler_config(settings: Settings, catalog: Catalog) -> SchedulerConfig:
    """The worker's scheduler knobs from Settings, so that `gpubot simulate` and the worker
    can be run with the same ones: idle stop and terminate as the fleet applies them, the
    stopped volume's price, and a quota no larger than the pools allow (each type's
    instance cap times its GPUs, the largest; bot.app.fleet enforces the exact caps when it
    buys). No run time is known here, so least attained service is on (LAS_AFTER_S)."""
    biggest = max((t.gpus for t in catalog.types), default=8)
    ebs_usd_s = settings.ebs_gb * settings.ebs_usd_gb_month / (730.0 * 3600.0)
    return SchedulerConfig(
        policy="fair",
        max_gpus=max(1, settings.pool_max_instances * biggest),
        idle_stop_s=settings.idle_stop_after.total_seconds(),
        terminate_after_s=settings.terminate_after.total_seconds(),
        ebs_usd_s=ebs_usd_s,
        las_after_s=LAS_AFTER_S,
    )


def host_view(
    *,
    name: str,
    state: str,
    instance_type: str | None,
    market: str,
    usd_hr: float,
    created_s: float,
    updated_s: float,
    now: float,
    catalog: Catalog,
    config: SchedulerConfig,
) -> FleetInstance | None:
    """A booting or stopped instance as the scheduler sees it, from its host row.

    Why: a scheduler that sees only ready hosts launches again for every run queued while
    the first instance boots (the simulator, which sees the booting one, waits for it).
    A pending host is usable boot + setup after it was launched; a stopped one has been
    stopped since its row last changed. Its GPUs come from the catalog (the host reports
    them only once it is up); a type the catalog does not know is left out."""
    t = catalog.get(instance_type) if instance_type else None
    if t is None:
        return None
    st: InstanceState
    if state == HOST_PENDING:
        st = "pending"
        ready = max(now, created_s + config.boot_s + config.setup_s)
        stopped_since = None
    elif state == HOST_STOPPED:
        st, ready, stopped_since = "stopped", updated_s, updated_s
    else:
        return None
    return FleetInstance(
        instance_id=name,
        instance_type=t.instance_type,
        gpu_model=t.gpu_model,
        gpus=t.gpus,
        usd_hr=usd_hr or t.ondemand_usd_hr,
        market="spot" if market == "spot" else "ondemand",
        state=st,
        ready_at_s=ready,
        stopped_since_s=stopped_since,
    )


class RunService:
    def __init__(
        self, core: Core, access: HostAccess, catalog: Catalog, *, refusal: str | None = None
    ) -> None:
        self.core = core
        self.access = access
        self.catalog = catalog
        # Why runs are not accepted here at all (`gpubot serve` on this machine without
        # GPUBOT_RUN_AS), or None: submit says it, dispatch starts nothing, and what ran
        # already is still polled and shown.
        self.refusal = refusal
        self.config = scheduler_config(core.settings, catalog)
        self._preempt_slot = -(2**62)  # the last preemption slot dispatch looked at
        # file:// git URLs: tests only (a bare repository in tmp); never in production.
        self.allow_file_git = False
        # Who may start runs and read logs (bot.app.access); the Slack app puts in a gate that
        # knows Slack's user groups, the shell keeps this one (no groups).
        self.gate = RunGate(core.settings, StaticMembership())

    @property
    def engine(self) -> Any:
        return self.core.engine

    # --- submit ----------------------------------------------------------------------

    @retrying
    def submit(self, actor: Actor, cmd: Run, request_key: str | None = None) -> views.Reply:
        # Every way a run starts comes here (/gpu run, the run form, gpubot submit).
        if self.refusal is not None:
            raise UserError(self.refusal, USAGE_RUN)
        refusal = self.gate.run_refusal(actor)
        if refusal is not None:
            raise UserError(refusal)  # who may, not how: no usage line
        if cmd.interactive:
            raise UserError(
                "Say what to run: `--recipe digits` or `-- python train.py`.", USAGE_RUN
            )
        if cmd.recipe is not None and cmd.recipe not in RECIPES:
            raise UserError(
                f"There is no recipe `{cmd.recipe}`; recipes: {', '.join(RECIPES)}.", USAGE_RUN
            )
        self._check_source(cmd)  # bot.app.sources: git/path/staged code
        with transaction(self.engine) as s:
            if request_key is not None:
                prior = s.exec(
                    select(TrainingRun).where(TrainingRun.request_key == request_key)
                ).first()
                if prior is not None:
                    return self._queued_reply(s, prior)
            model = self._resolve_model(s, cmd.model, cmd.gpus)
            user = self.core.user_row(s, actor.key, actor.name)
            max_s = int(cmd.max_duration.total_seconds()) if cmd.max_duration else None
            # Budget (bot.app.budgets): a run that cannot fit is refused before it queues.
            variants = len(cmd.sweep[1]) if cmd.sweep else 1
            budgets.check_budget(
                s,
                user,
                budgets.run_estimate(s, model, cmd.gpus, max_s) * variants,
                self.core.clock.now(),
                self.core.settings,
                what=(f"This sweep ({variants} runs of " if cmd.sweep else "This run (")
                + f"{views.gpu_phrase(cmd.gpus, model)}, "
                + (
                    f"up to {format_duration(cmd.max_duration)})"
                    if cmd.max_duration
                    else "no --max: counted as 1h)"
                ),
            )
            if cmd.sweep is not None:
                return self._submit_sweep(s, cmd, user, model, request_key)
            run = TrainingRun(
                user_id=user.id,  # type: ignore[arg-type]
                command=_command_text(cmd.command),
                recipe=cmd.recipe,
                gpu_count=cmd.gpus,
                gpu_model=model,
                precision=cmd.precision,
                spot=cmd.spot,
                checkpoints=cmd.checkpoints,
                max_seconds=int(cmd.max_duration.total_seconds()) if cmd.max_duration else None,
                state=RUN_QUEUED,
                submitted_at=self.core.clock.now(),
                request_key=request_key,
                source=cmd.source,
                options=dict(cmd.options),
            )
            s.add(run)
            s.flush()
            return self._queued_reply(s, run)

    def _submit_sweep(
        self, s: Session, cmd: Run, user: User, model: str, request_key: str | None
    ) -> views.Reply:
        """One queued run per value, under one sweep label, submitted together so that the
        scheduler places them side by side on the warm fleet; `_finish` posts the table
        when the last one ends."""
        assert cmd.sweep is not None
        param, values = cmd.sweep
        label = f"s{uuid.uuid4().hex[:6]}"
        now = self.core.clock.now()
        ids = []
        for n, value in enumerate(values):
            run = TrainingRun(
                user_id=user.id,  # type: ignore[arg-type]
                command="",
                recipe=cmd.recipe,
                gpu_count=cmd.gpus,
                gpu_model=model,
                precision=cmd.precision,
                spot=cmd.spot,
                max_seconds=int(cmd.max_duration.total_seconds()) if cmd.max_duration else None,
                state=RUN_QUEUED,
                submitted_at=now,
                # The first variant carries the request key: a retried delivery finds it.
                request_key=request_key if n == 0 else None,
                options={**dict(cmd.options), param: value},
                sweep=label,
            )
            s.add(run)
            s.flush()
            ids.append(run.id)
        listed = ", ".join(f"#{i} ({param} {v:g})" for i, v in zip(ids, values, strict=True))
        text = (
            f"Sweep {label} queued: recipe {cmd.recipe} on "
            f"{views.gpu_phrase(cmd.gpus, model)} per variant, {listed}. Each run DMs you as it "
            "starts and ends; when the last one ends you get one table comparing them."
        )
        return views.Reply(views.message(text).view, extra={"run_id": ids[0], "run_ids": ids})

    def _check_source(self, cmd: Run) -> None:
        """A source is checked where it is accepted (a Run built by code skips the
        grammar); a staged one must still be on this machine's disk."""
        if not cmd.source:
            return
        if cmd.recipe is not None:
            raise UserError(
                "A recipe brings its own code; a source goes with a command.", USAGE_RUN
            )
        try:
            src = code_sources.parse_source(cmd.source, allow_file=self.allow_file_git)
        except code_sources.SourceError as exc:
            raise UserError(str(exc), USAGE_RUN) from None
        home = self.core.settings.home
        if (
            isinstance(src, code_sources.StagedSource)
            and not sources.staged_dir(home, src).is_dir()
        ):
            raise UserError(
                f"There is no staged upload {src.staged_id} here; `gpubot submit DIR` stages one.",
                USAGE_RUN,
            )

    def _resolve_model(self, s: Session, model: str | None, gpus: int) -> str:
        """A run needs one GPU model: the asked one, else the configured default, else
        the one model the pool has. Refuses what no host could ever run."""
        counts: dict[str, int] = {}
        for host in _fleet(s):
            for m, n in host.models.items():
                counts[m] = max(counts.get(m, 0), n)
        wanted = model or self.core.settings.default_gpu
        if wanted is not None and self.core.supply.can_have(wanted, gpus):
            return str(wanted)
        if wanted is None:
            if len(counts) != 1:
                have = ", ".join(sorted(counts)) or "none"
                raise UserError(
                    f"Say which GPU model to run on (`--gpu MODEL`); this pool has: {have}.",
                    USAGE_RUN,
                )
            wanted = next(iter(counts))
        if wanted not in counts:
            have = ", ".join(sorted(counts)) or "none"
            raise UserError(f"No host here has {wanted} GPUs (this pool has: {have}).", USAGE_RUN)
        if gpus > counts[wanted]:
            raise UserError(
                f"No host has {gpus} {wanted} GPUs; the most on one host is {counts[wanted]}. "
                "Runs across several hosts need a cloud provider.",
                USAGE_RUN,
            )
        return wanted

    def _queued_reply(self, s: Session, run: TrainingRun) -> views.Reply:
        queue = self._queued(s)
        position = next((i + 1 for i, r in enumerate(queue) if r.id == run.id), None)
        what = views.run_what(run.recipe, run.command)
        if run.state == RUN_QUEUED:
            place = "next in line" if position == 1 else f"position {position}"
            text = (
                f"Run #{run.id} queued ({place}): {what} on {views.gpu_phrase(run.gpu_count, run.gpu_model)}, "
                f"precision {run.precision}. I'll DM you when it starts and when it ends. "
                f"`/gpu cancel {run.id}` takes it back."
            )
        else:
            text = f"Run #{run.id} ({what}) is {run.state}."
        blocks: tuple[views.Block, ...] = (views.Text(text),)
        if run.state in RUN_OPEN_STATES and run.id is not None:
            blocks += (views.cancel_run_button(run.id),)
        return views.Reply(views.View(text=text, blocks=blocks), extra={"run_id": run.id})

    # --- queue, cancel, logs -----------------------------------------------------------

    def _queued(self, s: Session) -> list[TrainingRun]:
        return list(
            s.exec(
                select(TrainingRun)
                .where(TrainingRun.state == RUN_QUEUED)
                .order_by(
                    col(TrainingRun.priority).desc(),
                    col(TrainingRun.submitted_at),
                    col(TrainingRun.id),
                )
            )
        )

    def queue(self, actor: Actor, cmd: Queue) -> views.Reply:
        with transaction(self.engine, write=False) as s:
            now = self.core.clock.now()
            rows = list(
                s.exec(
                    select(TrainingRun, User)
                    .join(User)
                    .where(col(TrainingRun.state).in_(RUN_OPEN_STATES))
                    .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
                )
            )
            fleet = _fleet(s)
            prices = self._per_gpu_prices(fleet)
            ahead = self._estimates(s, now, [run for run, _ in rows], fleet)  # bot.domain.estimates
            down, ready_models = self._down_hosts(fleet)
            table = []
            waiting = 0  # the line position: counts everyone's queued runs
            shown_waiting = 0  # the summary counts only the rows shown (`queue me`)
            for run, user in rows:
                if run.state == RUN_QUEUED:
                    waiting += 1
                if cmd.mine_only and user.key != actor.key:
                    continue
                if run.state == RUN_QUEUED:
                    shown_waiting += 1
                start = "started"
                if run.state == RUN_QUEUED:
                    where = f"#{waiting} in line"
                else:
                    where = f"{run.state} on {run.placement.get('host', '?')}"
                price = prices.get(run.gpu_model or "", 0.0) * run.gpu_count
                if run.max_seconds:
                    cost = f"≤ ${price * run.max_seconds / 3600:.2f}" if price else "$0 (owned)"
                else:
                    cost = f"${price:.2f}/h" if price else "$0 (owned)"
                if run.id in ahead:
                    start = estimates.start_phrase(ahead[run.id], now.timestamp())
                    cost = estimates.cost_phrase(ahead[run.id])
                waits_on = [
                    h
                    for h, models in down
                    if run.gpu_model in models or (not run.gpu_model and models)
                ]
                if run.state == RUN_QUEUED and waits_on and run.gpu_model not in ready_models:
                    h = waits_on[0]
                    assert h.down_since is not None
                    start = f"waits: {h.name} {views.down_phrase(h.down_since, h.down_reason, now, self.core.settings.timezone)}"
                age = format_duration(now - run.submitted_at)
                progress = "–"
                if run.state == RUN_RUNNING and run.id is not None:
                    # The live message's line (bot.app.runwatch), from the last poll's figures.
                    usd, _ = runwatch.cost_so_far(s, run.id, now)
                    progress = runwatch.progress_line(s, run, None, now, usd)
                table.append(
                    (
                        f"#{run.id}",
                        user.display_name,
                        run.recipe or views.command_phrase(run.command, 40),
                        views.gpu_phrase(run.gpu_count, run.gpu_model),
                        where,
                        start,
                        age,
                        progress,
                        cost,
                    )
                )
        if not table:
            text = (
                "No runs are queued or running."
                if not cmd.mine_only
                else "You have no runs queued or running."
            )
            return views.message(text)
        summary = f"{shown_waiting} waiting, {len(table) - shown_waiting} running"
        blocks: tuple[views.Block, ...] = (
            views.Header("Training queue"),
            views.Context(summary),
            views.Table(
                (
                    "run",
                    "who",
                    "what",
                    "needs",
                    "where",
                    "est. start",
                    "age",
                    "progress",
                    "est. cost",
                ),
                tuple(table),
            ),
        )
        for h, _models in down:
            assert h.down_since is not None
            blocks += (
                views.Context(
                    f"{h.name} is {views.down_phrase(h.down_since, h.down_reason, now, self.core.settings.timezone)}"
                ),
            )
        return views.Reply(views.View(text=summary, blocks=blocks))

    @staticmethod
    def _down_hosts(
        fleet: list[_FleetHost],
    ) -> tuple[list[tuple[_FleetHost, set[str]]], set[str]]:
        """Hosts marked down (bot.app.hostcheck) with their GPU models, and the models some
        ready host offers: a run waits on a down host when only that host has its model."""
        down: list[tuple[_FleetHost, set[str]]] = []
        ready: set[str] = set()
        for host in fleet:
            models = set(host.models)
            if host.state == HOST_UNREACHABLE and host.down_since is not None:
                down.append((host, models))
            elif host.state == HOST_READY:
                ready |= models
        return down, ready

    def _estimates(
        self, s: Session, now: datetime, runs: list[TrainingRun], fleet: list[_FleetHost]
    ) -> dict[int, estimates.Estimate]:
        """The queue as `bot.domain.estimates` sees it: who holds which host's GPUs until when
        (a run's ETA from its status, else its --max; a reservation's end), and the
        waiting runs in line order."""
        holds: dict[tuple[int, str], tuple[int, float | None]] = {}
        for hold in who_holds(s):
            iv, res, held_by = hold.interval, hold.reservation, hold.run
            until: float | None = None
            if res is not None:
                key = (iv.host_id, f"res:{res.id}")
                until = res.ends_at.timestamp() if res.ends_at else None
            else:
                key = (iv.host_id, f"run:{iv.run_id}")
                eta = held_by.metrics.get("eta_s") if held_by is not None else None
                if isinstance(eta, int | float):
                    until = now.timestamp() + float(eta)
                elif held_by is not None and held_by.max_seconds and held_by.started_at:
                    until = held_by.started_at.timestamp() + held_by.max_seconds
            n, _ = holds.get(key, (0, until))
            holds[key] = (n + 1, until)
        # Each host's holds, in the order first seen, so a picture is built without
        # walking every hold of the fleet.
        host_holds: dict[int, list[estimates.Hold]] = {}
        for (hid, _), (n, until) in holds.items():
            host_holds.setdefault(hid, []).append(estimates.Hold(n, until))
        pictures = []
        # A booting instance is part of the picture: its GPUs are taken until it should be
        # ready (launch + boot + setup), so a run of its model gets a start and a price.
        boot = timedelta(seconds=self.config.boot_s + self.config.setup_s)
        for host in sorted(fleet, key=lambda h: h.id):
            if host.state not in (HOST_READY, HOST_PENDING):
                continue
            per_gpu = gpu_share(host.hourly_usd, host.gpus)
            for model, count in host.models.items():
                booting: tuple[estimates.Hold, ...] = ()
                if host.state == HOST_PENDING:
                    since = host.created_at or now
                    booting = (estimates.Hold(count, (since + boot).timestamp()),)
                pictures.append(
                    estimates.HostPicture(
                        name=host.name,
                        gpu_model=model,
                        gpus=count,
                        usd_per_gpu_hour=per_gpu,
                        holds=booting + tuple(host_holds.get(host.id, ())),
                    )
                )
        # Waiting reservations are granted before runs are placed: they go first.
        waiting = [
            estimates.WaitingRun(
                f"res:{r.id}", r.gpu_count, r.gpu_model or "", r.duration_s, holds_line=True
            )
            for r in s.exec(
                select(Reservation)
                .where(Reservation.state == RES_WAITING)
                .order_by(col(Reservation.requested_at), col(Reservation.id))
            )
        ]
        waiting += [
            estimates.WaitingRun(r.id, r.gpu_count, r.gpu_model or "", r.max_seconds)
            for r in runs
            if r.state == RUN_QUEUED and r.id is not None
        ]
        found = estimates.estimate_queue(waiting, pictures, now.timestamp())
        return {e.run_id: e for e in found if isinstance(e.run_id, int)}

    @staticmethod
    def _per_gpu_prices(fleet: list[_FleetHost]) -> dict[str, float]:
        """Per-GPU hourly price of each model on the hosts we have (0 for owned hosts)."""
        out: dict[str, float] = {}
        for host in fleet:
            share = gpu_share(host.hourly_usd, host.gpus)
            for model in host.models:
                out[model] = max(out.get(model, 0.0), share)
        return out

    @retrying
    def cancel(self, actor: Actor, cmd: Cancel) -> views.Reply:
        """Marks the run; its GPUs go back when poll sees it end (`_finish`). One row
        under its lock and nothing after it (db.session): a dispatch that claimed the
        run meanwhile is seen ("starting" → cancelling), never written over."""
        with transaction(self.engine) as s:
            run = locked(s, TrainingRun, cmd.run_id)
            if run is None:
                raise UserError(f"There is no run #{cmd.run_id}.", "/gpu cancel ID")
            owner = s.get(User, run.user_id)
            if owner is None or (owner.key != actor.key and not actor.admin):
                raise UserError(
                    f"Run #{run.id} is not yours; only its owner or an admin can cancel it."
                )
            if run.state not in RUN_OPEN_STATES:
                raise UserError(f"Run #{run.id} already {run.state}.", "/gpu cancel ID")
            if owner.key != actor.key:
                audit(actor, "cancel", f"run #{run.id} of {owner.key}", session=s)
            if run.state == RUN_QUEUED:
                run.state = RUN_CANCELLED
                run.finished_at = self.core.clock.now()
                s.add(run)
                return views.message(f"Run #{run.id} cancelled before it started.")
            run.state = RUN_CANCELLING
            s.add(run)
            # A recipe checkpoints on SIGTERM; a command does whatever its script does.
            saves = ", saves a checkpoint," if run.recipe else ""
            return views.message(
                f"Stopping run #{run.id}: it gets SIGTERM{saves} and its GPUs go back when it exits."
            )

    def logs(self, actor: Actor, cmd: Logs) -> views.Reply:
        with transaction(self.engine, write=False) as s:
            run = s.get(TrainingRun, cmd.run_id)
            if run is None:
                raise UserError(f"There is no run #{cmd.run_id}.", "/gpu logs ID [LINES]")
            owner = s.get(User, run.user_id)
            # A log may hold what its owner printed (data, paths, tokens): theirs unless
            # the team shares logs (GPUBOT_SHARED_LOGS).
            if owner is None or not self.gate.may_read_log(actor, owner.key):
                raise UserError(
                    f"Run #{cmd.run_id} is not yours; only its owner or an admin can read its log."
                )
            placement = dict(run.placement)
            run_state = run.state
        if owner.key != actor.key and actor.admin and not self.gate.settings.shared_logs:
            audit(actor, "read-log", f"run #{cmd.run_id} of {owner.key}")
        if "log" not in placement:
            why = {
                RUN_QUEUED: "has not started yet",
                RUN_CANCELLED: "was cancelled before it started",
            }.get(run_state, f"is {run_state} and never started")
            return views.message(f"Run #{cmd.run_id} {why}, so it has no log.")
        seat = self.access.runner_for(placement["host"])
        if seat is None:
            raise UserError(
                f"Host {placement['host']} is not reachable from here.", "/gpu logs ID [LINES]"
            )
        runner, target = seat.runner, seat.target
        try:
            text = runner.tail(target, placement["log"], cmd.lines)
        except SshError as exc:
            raise UserError(f"Could not read the log of run #{cmd.run_id}: {exc}") from None
        body = text.strip() or "(the log is empty so far)"
        return views.Reply(
            views.View(
                text=f"Last lines of run #{cmd.run_id}",
                blocks=(
                    views.Text(f"*Run #{cmd.run_id}*, last {cmd.lines} lines"),
                    views.Code(body[-2800:]),
                ),
            )
        )

    def open_runs(self, run_ids: set[int] | None = None) -> int:
        with transaction(self.engine, write=False) as s:
            q = select(TrainingRun.id).where(col(TrainingRun.state).in_(RUN_OPEN_STATES))
            ids = set(s.exec(q).all())
        return len(ids if run_ids is None else ids & run_ids)

    # --- the worker: dispatch -------------------------------------------------------------

    def dispatch(self) -> int:
        """Places queued runs with the scheduler and starts them; returns how many started."""
        if self.refusal is not None:
            return 0
        now = self.core.clock.now()
        with transaction(self.engine, write=False) as s:
            if not self._anything_to_decide(s):
                return 0  # the common idle tick: one indexed query, nothing loaded
            queue, fleet, hosts, usage = self._scheduler_inputs(s, now)
        if not queue and not any(a.preemptible for i in fleet for a in i.allocations):
            return 0  # nothing to place and nothing the scheduler could move
        # Preemption is looked at once per preempt_period_s, as the simulator does.
        slot = preempt_slot(now.timestamp(), self.config)
        due = slot > self._preempt_slot
        if due:
            self._preempt_slot = slot
        actions = decide(
            queue,
            fleet,
            now.timestamp(),
            catalog=self.catalog,
            config=self.config,
            usage=usage,
            preempt_due=due,
        )
        started = 0
        for action in actions:
            if isinstance(action, Launch | Start):
                self._provision(action)
                continue
            if isinstance(action, Preempt):
                self._preempt(int(action.run_id), action.for_run)
                continue
            if not isinstance(action, Place):
                # Stop/Terminate: bot.app.fleet owns instance lifetimes (idle stop, terminate)
                log.debug("scheduler wants %s; the fleet decides that, skipped", action)
                continue
            if len(action.instance_ids) != 1 or action.instance_ids[0] not in hosts:
                log.info("placement %s needs hosts this provider does not have; skipped", action)
                continue
            if self._start(int(action.run_id), action.instance_ids[0], action.gpus_per_instance):
                started += 1
        return started

    @retrying
    def _preempt(self, run_id: int, for_run: str) -> None:
        """Stops a running run with a checkpoint so its GPUs go elsewhere (scheduler's call).

        The same path as a spot notice: the run is marked interrupted, gets SIGTERM, saves
        a checkpoint and exits 75; poll then copies the checkpoint off and requeues it
        (bot.app.agentwatch), and the owner gets a DM saying why and from which step it will
        resume. Its GPUs are placed on a later tick, once they are really free."""
        now = self.core.clock.now()
        with transaction(self.engine) as s:
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_RUNNING:
                return
            placement = dict(run.placement)
            if "pgid" not in placement or "interrupted" in placement:
                return
            if for_run.startswith("consolidate:"):
                reason = "moved so that a half-empty instance can stop"
            else:
                other = s.get(TrainingRun, int(for_run)) if for_run.isdigit() else None
                owner = s.get(User, other.user_id) if other is not None else None
                who = f" of {owner.key}" if owner is not None else ""
                reason = f"preempted for run #{for_run}{who}: fair share of the GPUs"
            placement["interrupted"] = {
                "reason": reason,
                "action": "preempt",
                "at": now.isoformat(),
            }
            run.placement = placement
            s.add(run)
        seat = self.access.runner_for(placement["host"])
        if seat is None:
            log.warning("preempt: host %s of run %s is not reachable", placement["host"], run_id)
            return
        runner, target = seat.runner, seat.target
        try:
            runner.kill_group(target, int(placement["pgid"]), "TERM")
            self._update_placement(run_id, term_sent=True)
            log.info("run %s preempted (%s)", run_id, reason)
        except SshError as exc:
            log.warning("preempt of run %s on %s failed: %s", run_id, placement["host"], exc)

    def _provision(self, action: Launch | Start) -> None:
        """A Launch/Start goes to the fleet (bot.app.fleet), which buys within the pool limits
        and once per request; without a cloud provider there is nothing to buy."""
        fleet = self.core.fleet
        if fleet is None:
            log.info("scheduler wants %s; no cloud provider is configured, skipped", action)
            return
        itype = action.instance_type if isinstance(action, Launch) else None
        done = fleet.provision_run(int(action.for_run), itype)
        if done:
            log.info("fleet: %s", done)

    def _anything_to_decide(self, s: Session) -> bool:
        """Whether a run is queued or one that could be preempted is running: without
        either the scheduler has nothing to place or move (dispatch's own test below),
        so an idle tick need not load the fleet and the usage."""
        movable = or_(
            col(TrainingRun.state) == RUN_QUEUED,
            and_(
                col(TrainingRun.state) == RUN_RUNNING,
                or_(col(TrainingRun.recipe).is_not(None), col(TrainingRun.spot).is_(True)),
            ),
        )
        return s.exec(select(TrainingRun.id).where(movable).limit(1)).first() is not None

    def _scheduler_inputs(
        self, s: Session, now: datetime
    ) -> tuple[list[QueuedRun], list[FleetInstance], dict[str, Host], dict[str, float]]:
        waiting_models = {
            r.gpu_model for r in s.exec(select(Reservation).where(Reservation.state == RES_WAITING))
        }
        history = self._history(s, now)
        queue = []
        for run, user in s.exec(
            select(TrainingRun, User)
            .join(User)
            .where(TrainingRun.state == RUN_QUEUED)
            .order_by(col(TrainingRun.id))
        ):
            # Someone waiting for a reservation of this model goes first: people at a
            # keyboard before batch work.
            if run.gpu_model in waiting_models or None in waiting_models:
                continue
            queue.append(
                QueuedRun(
                    run_id=str(run.id),
                    user=user.key,
                    gpus=run.gpu_count,
                    gpu_model=run.gpu_model or "",
                    submit_s=run.submitted_at.timestamp(),
                    # the user's --max, else what the team's finished runs predict
                    est_duration_s=float(run.max_seconds)
                    if run.max_seconds
                    else history.predict_duration(user.key, run.gpu_count),
                    priority=run.priority,
                    spot=run.spot,
                    preemptible=run.recipe is not None or run.spot or run.checkpoints,
                )
            )
        hosts: dict[str, Host] = {}
        fleet = []
        now_s = now.timestamp()
        # Booting and stopped instances too: the scheduler must see what is on its way.
        for host in s.exec(
            select(Host)
            .where(col(Host.state).in_((HOST_PENDING, HOST_STOPPED)))
            .order_by(col(Host.id))
        ):
            view = host_view(
                name=host.name,
                state=host.state,
                instance_type=host.instance_type,
                market=host.market,
                usd_hr=host.hourly_usd,
                created_s=host.created_at.timestamp(),
                updated_s=host.updated_at.timestamp(),
                now=now_s,
                catalog=self.catalog,
                config=self.config,
            )
            if view is not None:
                fleet.append(view)
        last_use = {
            host_id: ended
            for host_id, ended in s.exec(
                select(UsageInterval.host_id, func.max(UsageInterval.ended_at)).group_by(
                    col(UsageInterval.host_id)
                )
            )
        }
        open_rows = who_holds(s)
        for host, gpus in _hosts_with_gpus(s, Host.state == HOST_READY):
            if not gpus:
                continue
            hosts[host.name] = host
            by_holder: dict[str, tuple[str, int, float | None]] = {}
            # run -> (preemptible, stopping, started_s), as Allocation takes them
            flags: dict[str, tuple[bool, bool, float | None]] = {}
            for hold in open_rows:
                iv, user, res, held_by = hold.interval, hold.user, hold.reservation, hold.run
                if iv.host_id != host.id:
                    continue
                if res is not None:
                    key, end = f"res:{res.id}", res.ends_at.timestamp() if res.ends_at else None
                else:
                    started = (
                        held_by.started_at
                        if held_by is not None and held_by.started_at
                        else iv.started_at
                    )
                    limit = held_by.max_seconds if held_by is not None else None
                    key, end = f"{iv.run_id}", (started.timestamp() + limit) if limit else None
                    if end is None and held_by is not None:
                        end = history.predict_end(
                            user.key, held_by.gpu_count, started.timestamp(), now_s
                        )
                    if held_by is not None:
                        # Recipes checkpoint on SIGTERM (training.loop); a --spot or
                        # --checkpoints run's owner said it resumes. Nothing else moves.
                        flags[key] = (
                            held_by.state == RUN_RUNNING
                            and (held_by.recipe is not None or held_by.spot or held_by.checkpoints),
                            held_by.state == RUN_CANCELLING or "interrupted" in held_by.placement,
                            started.timestamp(),
                        )
                _, n, _ = by_holder.get(key, (user.key, 0, end))
                by_holder[key] = (user.key, n + 1, end)
            models = sorted({g.model for g in gpus})
            fleet.append(
                FleetInstance(
                    instance_id=host.name,
                    instance_type=host.instance_type or host.provider,
                    gpu_model=models[0],
                    gpus=len(gpus),
                    usd_hr=host.hourly_usd,
                    market="spot" if host.market == "spot" else "ondemand",
                    state="running",
                    ready_at_s=host.created_at.timestamp(),
                    allocations=tuple(
                        Allocation(k, u, n, e, *flags.get(k, (False, False, None)))
                        for k, (u, n, e) in by_holder.items()
                    ),
                    # idle since its last GPU was let go (or since it came up)
                    idle_since_s=None
                    if by_holder
                    else _ts_or(last_use.get(host.id or -1), host.created_at).timestamp(),
                )
            )
        return queue, fleet, hosts, self._usage(s, now)

    def _history(self, s: Session, now: datetime) -> RunHistory:
        """The run times of the runs that finished in the last 30 days, per user and
        size: the same predictions the simulator makes under --estimates none."""
        history = RunHistory()
        since = now - timedelta(days=30)
        for run, user in s.exec(
            select(TrainingRun, User)
            .join(User)
            .where(
                col(TrainingRun.state).in_((RUN_SUCCEEDED, RUN_FAILED)),
                col(TrainingRun.finished_at).is_not(None),
                col(TrainingRun.started_at).is_not(None),
                TrainingRun.finished_at > since,  # type: ignore[operator]
            )
            .order_by(col(TrainingRun.finished_at), col(TrainingRun.id))
        ):
            if run.started_at is not None and run.finished_at is not None:
                took = (run.finished_at - run.started_at).total_seconds()
                history.add(user.key, run.gpu_count, took)
        return history

    def _usage(self, s: Session, now: datetime) -> dict[str, float]:
        """Each user's GPU-seconds, decayed with the scheduler's half-life (Slurm's fair
        share): the counters kept as intervals close (bot.app.rollups), plus what is held now.
        Only a half-life other than the counters' reads the intervals themselves."""
        kept = fair_share_usage(s, now, self.config.half_life_s)
        if kept is not None:
            return kept
        horizon = now - timedelta(seconds=self.config.half_life_s * 8)
        usage: dict[str, float] = {}
        for iv, user in s.exec(
            select(UsageInterval, User)
            .join(User)
            .where(
                (col(UsageInterval.ended_at).is_(None)) | (col(UsageInterval.ended_at) > horizon)
            )
        ):
            end = iv.ended_at or now
            secs = max(0.0, (end - iv.started_at).total_seconds())
            age = max(0.0, (now - end).total_seconds())
            usage[user.key] = usage.get(user.key, 0.0) + secs * math.pow(
                0.5, age / self.config.half_life_s
            )
        return usage

    def _start(self, run_id: int, host_name: str, gpus: int) -> bool:
        """Claims GPUs and the run in one transaction, then starts the process."""
        seat = self.access.runner_for(host_name)
        if seat is None:
            log.warning("no way to reach host %s; run %s stays queued", host_name, run_id)
            return False
        runner, target, runs_dir = seat.runner, seat.target, seat.runs_dir
        claimed = self._claim(run_id, host_name, gpus, runs_dir)
        if claimed is None:
            return False
        placement, run = claimed
        run_dir = runs_dir / str(run_id)
        env = {
            "CUDA_VISIBLE_DEVICES": ""
            if placement["cpu"]
            else ",".join(map(str, placement["gpu_indexes"])),
            "GPUBOT_PGID_FILE": str(placement["pgid_file"]),
        }
        try:
            runner.run(target, shell.join(["mkdir", "-p", "--", str(run_dir)]), timeout=30)
            if placement.get("resume_from"):  # the checkpoint it resumes from, first
                upload_checkpoints(
                    runner, target, placement["resume_from"], str(placement["checkpoints"])
                )
            # Code source (bot.app.sources): clone / check / upload, before the runner starts.
            self._prepare_code(run_id, runner, target, str(run_dir), str(placement["log"]))
            # The host's interpreter last: the run account's is prepared here on first use.
            python = seat.interpreter()
            pgid = runner.start_detached(
                target,
                _runner_command(run, placement, python.python),
                str(placement["log"]),
                cwd=str(run_dir),
                env={**env, **python.env()},
            )
        except SshError as exc:
            self._finish(
                run_id, RUN_FAILED, None, {"error": f"could not start: {exc}"}, log_tail=""
            )
            return False
        self._mark_started(run_id, pgid, host_name, placement)
        return True

    @retrying
    def _claim(
        self, run_id: int, host_name: str, gpus: int, runs_dir: Path
    ) -> tuple[dict[str, Any], TrainingRun] | None:
        """The run and its GPUs in one transaction: the pool first (db.session's lock
        order), then the run, claimed only while it is still queued (a cancel or another
        worker that got there first wins). Returns its placement and the run as claimed."""
        now = self.core.clock.now()
        with transaction(self.engine) as s:
            lock_pool(s)
            won = s.exec(
                update(TrainingRun)
                .where(col(TrainingRun.id) == run_id, col(TrainingRun.state) == RUN_QUEUED)
                .values(state=RUN_STARTING)
            )
            if won.rowcount != 1:
                return None  # another worker got it, or it was cancelled
            host = s.exec(select(Host).where(Host.name == host_name)).one()
            held = held_gpu_ids(s)
            run = locked(s, TrainingRun, run_id)
            assert run is not None and host.id is not None
            free = [
                g
                for g in s.exec(
                    select(Gpu)
                    .where(Gpu.host_id == host.id, col(Gpu.present).is_(True))
                    .order_by(col(Gpu.index))
                )
                if g.id not in held and g.model == run.gpu_model
            ][:gpus]
            if len(free) < gpus:
                run.state = RUN_QUEUED  # the scheduler's view was stale; try next tick
                s.add(run)
                return None
            # Budget (bot.app.budgets): re-checked before placing; over budget → cancelled, DM.
            rate = Decimal(str(gpu_share(host.hourly_usd, self.core.gpu_count(s, host.id))))
            refusal = budgets.run_refusal(s, run, rate * len(free), now, self.core.settings)
            if refusal is not None:
                run.state, run.finished_at = RUN_CANCELLED, now
                s.add(run)
                owner = s.get(User, run.user_id)
                assert owner is not None
                text = f"Run #{run.id} was cancelled, not started: {refusal}"
                self.core.notify_dm(
                    s,
                    owner.key,
                    views.message(text).view,
                    now,
                    dedupe=f"budget-cancel-run:{run.id}",
                )
                return None
            self.core.open_usage(s, host, free, run.user_id, now, run_id=run.id)
            run_dir = runs_dir / str(run.id)
            placement: dict[str, Any] = {
                "host": host_name,
                "gpu_indexes": [g.index for g in free],
                "cpu": all(g.model == "cpu" for g in free),
                "dir": str(run_dir),
                "status": str(run_dir / "status.json"),
                "log": str(run_dir / "run.log"),
                "checkpoints": str(run_dir / "checkpoints"),
                # The runner writes its group id here, so a run started by a worker that
                # died before recording it is found, not started twice (_requeue_orphan).
                "pgid_file": str(run_dir / "pgid"),
            }
            if run.placement.get("resume_from"):  # bot.app.agentwatch: its saved checkpoint
                placement["resume_from"] = run.placement["resume_from"]
            run.placement = placement
            run.host_id = host.id
            run.started_at = now
            s.add(run)
            return placement, run

    @retrying
    def _mark_started(
        self, run_id: int, pgid: int, host_name: str, placement: dict[str, Any]
    ) -> None:
        """Its group id recorded and its owner told. One row under its lock: a cancel
        that landed while it started stays "cancelling"."""
        with transaction(self.engine) as s:
            run = locked(s, TrainingRun, run_id)
            assert run is not None
            run.placement = {**run.placement, "pgid": pgid}
            if run.state == RUN_STARTING:
                run.state = RUN_RUNNING
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            where = (
                f"{host_name}, "
                + ("CPU slot" if placement["cpu"] else "GPU")
                + ("s " if len(placement["gpu_indexes"]) != 1 else " ")
                + ", ".join(map(str, placement["gpu_indexes"]))
            )
            text = (
                f"Run #{run_id} started on {where}. This message shows its progress, "
                f"updated about once a minute; `/gpu logs {run_id}` shows its log."
            )
            # The run's live message (bot.app.runwatch edits it in place while it runs).
            message = enqueue(
                s,
                "dm",
                owner.key,
                views.View(text=text, blocks=(views.Text(text), views.cancel_run_button(run_id))),
                self.core.clock.now(),
                # A resumed run says it started again (bot.app.agentwatch's resume count).
                dedupe=f"run-started:{run_id}"
                + (f":{placement['resume_from']['count']}" if "resume_from" in placement else ""),
            )
            runwatch.started_live(s, run, message)
            s.add(run)

    def _prepare_code(
        self, run_id: int, runner: SshRunner, target: SshTarget, run_dir: str, log_path: str
    ) -> None:
        """Puts the run's code on the host (bot.app.sources); `_runner_command` starts the
        command in it (the runner itself stays in the run's directory, where the host
        agent looks for it). A failure is an SshError whose text says why, so the run
        fails with it and the owner is told."""
        with transaction(self.engine, write=False) as s:
            run = s.get(TrainingRun, run_id)
            text = run.source if run is not None else ""
        if not text:
            return
        try:
            src = code_sources.parse_source(text, allow_file=self.allow_file_git)
            assert src is not None
            done = sources.prepare_code(runner, target, src, run_dir, home=self.core.settings.home)
        except code_sources.SourceError as exc:
            raise SshError(f"could not get the code: {exc}") from None
        upload = done.upload
        if upload is not None:
            self._update_placement(
                run_id, code={"uploaded": list(upload.uploaded), "skipped": len(upload.skipped)}
            )
        with contextlib.suppress(SshError):
            line = shell.join(["printf", "%s\\n", f"[gpubot] {done.note}"])
            runner.run(target, f"{line} >> {shell.path(log_path)}", timeout=30)

    # --- the worker: poll ------------------------------------------------------------------

    def poll(self) -> int:
        """Reads every running run's status; finishes those that ended. Returns how many."""
        # Host agents (bot.app.agentwatch): lease renewal, spot notices, runs lost in a reboot —
        # before the runs are read, so a lost run is requeued rather than failed below.
        try:
            watched = watch_hosts(self)
            if watched.interrupted or watched.requeued or watched.draining:
                log.info("host agents: %s", watched)
        except Exception:  # never fatal: the runs are still polled
            log.exception("host agent watch failed")
        with transaction(self.engine, write=False) as s:
            rows = list(
                s.exec(
                    select(TrainingRun).where(
                        col(TrainingRun.state).in_((RUN_STARTING, RUN_RUNNING, RUN_CANCELLING))
                    )
                )
            )
        finished = 0
        now = self.core.clock.now()
        for run in rows:
            assert run.id is not None
            placement = dict(run.placement)
            if "pgid" not in placement:
                if run.started_at is not None and now - run.started_at > STARTING_GRACE:
                    self._requeue_orphan(run.id)
                continue
            seat = self.access.runner_for(placement["host"])
            if seat is None:
                continue
            runner, target = seat.runner, seat.target
            try:
                if run.state == RUN_CANCELLING and not placement.get("term_sent"):
                    runner.kill_group(target, int(placement["pgid"]), "TERM")
                    self._update_placement(run.id, term_sent=True)
                raw = runner.read_file(target, placement["status"])
                alive = runner.is_alive(target, int(placement["pgid"]))
            except SshError as exc:
                log.warning("poll of run %s on %s failed: %s", run.id, placement["host"], exc)
                continue
            status = parse_status(raw.decode("utf-8", "replace")) if raw else None
            if status is not None:
                self._update_metrics(run.id, status, live_runs=len(rows))
            if alive and (status is None or status.state not in TERMINAL_STATES):
                continue
            if alive:
                continue  # final status written; the process is exiting
            # Stopped for a resume (exit 75) or reclaimed: back in line with its checkpoint.
            if (
                run.state != RUN_CANCELLING
                and resumable_stop(placement, status)
                and requeue_resumable(self, run.id, placement, runner, target, status)
            ):
                continue
            tail = ""
            with contextlib.suppress(SshError):
                tail = runner.tail(target, placement["log"], 15)
            if run.state == RUN_CANCELLING:
                state = RUN_CANCELLED
            elif status is not None and status.state == "done":
                state = RUN_SUCCEEDED
            else:
                state = RUN_FAILED
            summary: dict[str, Any] = {}
            exit_code = None
            if status is not None:
                exit_code = status.exit_code
                summary = {
                    "state": status.state,
                    "precision": status.precision,
                    "error": status.error,
                }
                if status.summary is not None:
                    summary.update(
                        final_metrics=status.summary.final_metrics,
                        final_loss=status.summary.final_loss,
                        wall_s=status.summary.wall_s,
                    )
            elif state == RUN_FAILED:
                summary = {"error": "the process ended without writing a final status"}
            # Out of GPU memory (exit 77): once more with half the batch; then the advice.
            if state == RUN_FAILED and exit_code == EXIT_OOM:
                if self._retry_oom(run.id, status, runner, target, placement):
                    continue
                summary["error"] = f"{summary.get('error') or 'out of GPU memory'}. {OOM_ADVICE}"
            self._finish(run.id, state, exit_code, summary, tail, status)
            finished += 1
        return finished

    @retrying
    def _retry_oom(
        self,
        run_id: int,
        status: Any,
        runner: SshRunner,
        target: SshTarget,
        placement: dict[str, Any],
    ) -> bool:
        """Puts a run that ran out of GPU memory back in line with half the batch it used
        (from its status; `GPUBOT_BATCH_SCALE=0.5` tells a script that did not say), and
        tells its owner. False when it was retried already or the batch was 1: then it
        fails, with the advice."""
        used = getattr(status, "batch_size", None) if status is not None else None
        if used is None and status is not None:  # a script's training.report(batch_size=...)
            said = status.metrics.get("batch_size")
            used = int(said) if isinstance(said, int | float) and said >= 1 else None
        with transaction(self.engine, write=False) as s:
            run = s.get(TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False
            if run.metrics.get("oom_retry") or (isinstance(used, int) and used <= 1):
                return False
        # The old attempt's status and group id must not be read as the new one's.
        with contextlib.suppress(SshError):
            old = [placement.get("status"), placement.get("pgid_file")]
            runner.run(
                target, shell.join(["rm", "-f", "--", *(str(p) for p in old if p)]), timeout=30
            )
        half = used // 2 if isinstance(used, int) else None
        now = self.core.clock.now()
        with transaction(self.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False
            self._close_intervals(s, run_id, now)
            run.metrics = {
                **run.metrics,
                "oom_retry": {"from_batch": used, "batch_size": half, "at": now.isoformat()},
            }
            run.state = RUN_QUEUED
            run.placement = {}
            run.host_id = None
            run.started_at = None
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            was = f"at batch {used}" if used else "(its batch size was not reported)"
            now_with = f"batch {half}" if half else "half the batch (GPUBOT_BATCH_SCALE=0.5)"
            text = (
                f"Run #{run_id} ran out of GPU memory {was}. It is back in line and will be "
                f"retried once with {now_with}."
            )
            self.core.notify_dm(
                s,
                owner.key,
                views.View(text=text, blocks=(views.Text(text), views.cancel_run_button(run_id))),
                now,
                dedupe=f"run-oom-retry:{run_id}",
            )
            self.core.grant_pass(s, now)
        return True

    @retrying
    def _update_placement(self, run_id: int, **changes: Any) -> None:
        with transaction(self.engine) as s:
            run = locked(s, TrainingRun, run_id)  # one row, nothing after it (db.session)
            if run is not None:
                run.placement = {**run.placement, **changes}
                s.add(run)

    @retrying
    def _update_metrics(self, run_id: int, status: RunStatus, live_runs: int = 1) -> None:
        """Stores the run's latest figures and watches it (bot.app.runwatch: health alerts
        to its owner, once each; its live message edited about once a minute)."""
        with transaction(self.engine) as s:
            run = locked(s, TrainingRun, run_id)  # one row, nothing after it (db.session)
            if run is not None and run.state in RUN_OPEN_STATES:
                run.metrics = {**run.metrics, **runwatch.metrics_of(status)}
                owner = s.get(User, run.user_id)
                if run.state == RUN_RUNNING and owner is not None:
                    runwatch.watch(s, run, owner, status, self.core.clock.now(), live_runs)
                s.add(run)

    def _started_by_the_dead(self, placement: dict[str, Any]) -> int | bool | None:
        """The group id the runner wrote when the worker that claimed the run died after
        launching it; None when it never launched; False when the host cannot say now."""
        path = placement.get("pgid_file")
        seat = self.access.runner_for(str(placement.get("host", "")))
        if not path or seat is None:
            return None
        runner, target = seat.runner, seat.target
        try:
            raw = runner.read_file(target, str(path), max_bytes=64)
        except SshError as exc:
            log.warning("cannot check whether run on %s started: %s", placement["host"], exc)
            return False
        text = (raw or b"").decode(errors="replace").strip()
        return int(text) if text.isdigit() else None

    @retrying
    def _requeue_orphan(self, run_id: int) -> None:
        with transaction(self.engine, write=False) as s:
            claimed = s.get(TrainingRun, run_id)
            placement = dict(claimed.placement) if claimed is not None else {}
        started = self._started_by_the_dead(placement)
        if started is False:
            return  # the host is unreachable: ask again next poll, never start twice
        with transaction(self.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_STARTING or "pgid" in run.placement:
                return
            if isinstance(started, int):
                run.placement = {**run.placement, "pgid": started}
                run.state = RUN_RUNNING
                s.add(run)
                log.warning("run %s was started by a worker that died; adopted it", run_id)
                return
            self._close_intervals(s, run_id, self.core.clock.now())
            run.state = RUN_QUEUED
            # A resumed run keeps where its checkpoint is (bot.app.agentwatch).
            resume = run.placement.get("resume_from")
            run.placement = {"resume_from": resume} if resume else {}
            run.started_at = None
            s.add(run)
            log.warning("run %s was claimed but never started (crash?); back in line", run_id)

    @retrying
    def requeue(
        self, run_id: int, resume_from: dict[str, Any], view: views.View, dedupe: str
    ) -> bool:
        """Back in line with its checkpoint (bot.app.agentwatch): a stop for a resume is not a
        failure. Its GPUs go back, its place in line is its old one (submitted_at)."""
        now = self.core.clock.now()
        with transaction(self.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in (RUN_STARTING, RUN_RUNNING):
                return False  # cancelled meanwhile, or already moved on
            self._close_intervals(s, run_id, now)
            run.state = RUN_QUEUED
            run.placement = {"resume_from": resume_from}
            run.host_id = None
            run.started_at = None
            s.add(run)
            owner = s.get(User, run.user_id)
            assert owner is not None
            self.core.notify_dm(s, owner.key, view, now, dedupe=f"run-requeued:{dedupe}")
            self.core.grant_pass(s, now)
        return True

    def _close_intervals(self, s: Session, run_id: int, at: datetime) -> float:
        cost = 0.0
        end_held(s, at, run_id=run_id)
        for iv in s.exec(select(UsageInterval).where(UsageInterval.run_id == run_id)):
            if iv.ended_at is not None:
                cost += iv.usd_per_hour * (iv.ended_at - iv.started_at).total_seconds() / 3600
        return cost

    @retrying
    def _finish(
        self,
        run_id: int,
        state: str,
        exit_code: int | None,
        summary: dict[str, Any],
        log_tail: str,
        status: RunStatus | None = None,
    ) -> None:
        now = self.core.clock.now()
        with transaction(self.engine) as s:
            lock_pool(s)  # its GPUs go back: the pool first (db.session's lock order)
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state not in RUN_OPEN_STATES:
                return
            cost = self._close_intervals(s, run_id, now)
            run.state = state
            run.finished_at = now
            run.exit_code = exit_code
            run.metrics = {**run.metrics, "summary": summary, "cost_usd": round(cost, 4)}
            owner = s.get(User, run.user_id)
            assert owner is not None
            # bot.app.runwatch: metrics, precision and batch and why, GPU-hours, cost, the
            # health summary and the loss curve; for a failure the exit status in words.
            outcome = runwatch.Outcome(state, exit_code, status, log_tail, summary.get("error"))
            view, chart = runwatch.result_view(s, run, outcome, now)
            runwatch.close_live(s, run, owner, now)
            self.core.notify_dm(
                s, owner.key, view, now, dedupe=f"run-finished:{run_id}", attachment=chart
            )
            s.add(run)
            if run.sweep is not None:
                done = runwatch.sweep_done(s, run.sweep)
                if done is not None:
                    param = next(iter(set(done[0][0].options) - set(_base_options(done))), "lr")
                    self.core.notify_dm(
                        s,
                        owner.key,
                        runwatch.sweep_view(run.sweep, param, done),
                        now,
                        dedupe=f"sweep-finished:{run.sweep}",
                    )
            self.core.grant_pass(s, now)


def _base_options(rows: list[tuple[TrainingRun, float]]) -> set[str]:
    """The settings every variant of a sweep shares (same name and value): the swept
    one is the other."""
    first = rows[0][0].options
    return {k for k, v in first.items() if all(r.options.get(k) == v for r, _ in rows)}


OOM_ADVICE = (
    "It ran out of GPU memory again after a retry with half the batch: use a smaller "
    "`--batch-size` (or `--effective-batch` with gradient accumulation), `--precision bf16`, "
    "or a GPU with more memory (`--gpu h100`)"
)


def _oom_batch(run: TrainingRun) -> tuple[int | None, bool]:
    """(batch size, is a retry) for a run retried after running out of GPU memory."""
    retry = run.metrics.get("oom_retry")
    if not isinstance(retry, dict):
        return None, False
    size = retry.get("batch_size")
    return (size if isinstance(size, int) and size > 0 else None), True


def _runner_command(run: TrainingRun, placement: dict[str, Any], python: str) -> str:
    """The runner's line, started with `python`: the host's interpreter (HostSeat)."""
    batch, retried = _oom_batch(run)
    parts = [
        python,
        "-m",
        "training.runner",
        "--precision",
        run.precision,
        "--status-file",
        placement["status"],
        "--checkpoint-dir",
        placement["checkpoints"],
        "--run-id",
        str(run.id),
    ]
    if run.max_seconds:
        parts += ["--max-minutes", f"{run.max_seconds / 60:.2f}"]
    if run.gpu_count > 1:
        parts += ["--gpus", str(run.gpu_count)]
    if run.recipe:
        parts += ["--recipe", run.recipe]
        for name in ("lr", "epochs"):  # the recipe's settings as asked (bot.domain.commands)
            if isinstance(run.options.get(name), int | float):
                parts += [f"--{name}", f"{run.options[name]:g}"]
        asked = run.options.get("batch-size")
        if batch is not None:  # an OOM retry; without a known batch `auto` probes again
            parts += ["--batch-size", str(batch)]
        elif isinstance(asked, int | float):
            parts += ["--batch-size", str(int(asked))]
        return shell.join(parts)
    head = ""
    if retried:
        # The runner hands its own --batch-size to recipes only; a script reads these.
        env = {"GPUBOT_OOM_RETRY": "1", "GPUBOT_BATCH_SCALE": "0.5"}
        if batch is not None:
            env["GPUBOT_BATCH_SIZE"] = str(batch)
        head += shell.env_prefix(env)
    if run.source:  # bot.app.sources: the command starts in its code directory
        head += sources.in_code_dir(run.source, placement["dir"]) + " "
    # run.command is the owner's own shell text (`_command_text`), run as they typed it.
    return shell.join(parts) + " -- " + head + run.command


def _command_text(argv: tuple[str, ...] | list[str]) -> str:
    """The run's command as one shell line whose words are exactly what the user gave
    ("" for a recipe, which has none)."""
    if not argv:
        return ""
    try:
        return shell.join(argv)
    except ValueError:
        raise UserError("A command cannot hold a NUL character.", USAGE_RUN) from None


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _ts_or(value: datetime | None, default: datetime) -> datetime:
    return value if value is not None else default
