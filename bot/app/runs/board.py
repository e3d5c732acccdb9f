"""Reading the runs: `/gpu queue` with each waiting run's estimated start and cost,
`/gpu logs`, and how many runs are open. Nothing here writes a run."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.ports import Actor
from bot.app.runs.context import FleetHost, RunContext, read_fleet
from bot.app.runs.routed import group_of
from bot.app.watching import runwatch
from bot.app.watching.held import who_holds
from bot.app.watching.runfigures import costs_so_far, gpus_now
from bot.domain import estimates, views
from bot.domain.commands import Logs, Queue
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from db.models import (
    HOST_CHECKING,
    HOST_PENDING,
    HOST_READY,
    HOST_UNREACHABLE,
    RES_WAITING,
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_OPEN_STATES,
    RUN_QUEUED,
    RUN_RUNNING,
    Reservation,
    TrainingRun,
    User,
)
from db.session import transaction
from provisioning.costs import gpu_share
from provisioning.ssh import SshError

log = logging.getLogger(__name__)

_NONE = "No runs are queued or running."
_NONE_MINE = "You have no runs queued or running."


class RunBoard:
    """The read side of the run queue."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def queue(self, actor: Actor, cmd: Queue) -> views.Reply:
        with transaction(self.ctx.engine, write=False) as s:
            now = self.ctx.core.clock.now()
            rows = list(
                s.exec(
                    select(TrainingRun, User)
                    .join(User)
                    .where(col(TrainingRun.state).in_(RUN_OPEN_STATES))
                    .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
                )
            )
            shown = [r for r, u in rows if not cmd.mine_only or u.key == actor.key]
            if not shown:
                # Nothing to show (App Home asks `queue me` of everyone who opens it, and
                # most have no run): the fleet and the estimates would be read for nothing.
                return views.message(_NONE_MINE if cmd.mine_only else _NONE)
            fleet = read_fleet(s)
            prices = self._per_gpu_prices(fleet)
            # The estimates (bot.domain.estimates) only where a waiting run is shown.
            ahead = (
                self._estimates(s, now, [run for run, _ in rows], fleet)
                if any(r.state == RUN_QUEUED for r in shown)
                else {}
            )
            down, ready_models = self._down_hosts(fleet)
            # The running runs' figures, all at once (bot.app.watching.runfigures): two statements,
            # not two per run.
            going = {r.id for r in shown if r.state == RUN_RUNNING and r.id is not None}
            going -= {r.id for r in shown if r.placement.get("stage")}
            spent = costs_so_far(s, going, now)
            gpus = gpus_now(s, going)
            table = []
            waiting = 0  # the line position: counts everyone's queued runs
            shown_waiting = 0  # the summary counts only the rows shown (`queue me`)
            shown_runs = 0
            # A sweep started as one job array (bot.providers.slurm): one line for all.
            arrays: dict[tuple[str, str], list[TrainingRun]] = {}
            for run in shown:
                if (group := group_of(run.placement)) is not None:
                    arrays.setdefault(group, []).append(run)
            for run, user in rows:
                if run.state == RUN_QUEUED:
                    waiting += 1
                if cmd.mine_only and user.key != actor.key:
                    continue
                shown_runs += 1
                if run.state == RUN_QUEUED:
                    shown_waiting += 1
                if (group := group_of(run.placement)) is not None:
                    members = arrays[group]
                    if run is members[0]:
                        table.append(_array_line(run, user, members, now, prices))
                    continue
                start = "started"
                if run.state == RUN_QUEUED:
                    where = f"#{waiting} in line"
                elif "host" in run.placement:
                    where = f"{run.state} on {run.placement['host']}"
                else:  # handed to a cluster, whose scheduler has not started it
                    where = run.state
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
                    start = f"waits: {h.name} {self._trouble(h, now)}"
                age = format_duration(now - run.submitted_at)
                progress = "–"
                if run.placement.get("stage"):
                    progress = str(run.placement["stage"])  # "uploading code" (dispatch)
                elif run.state == RUN_RUNNING and run.id is not None:
                    # The live message's line (bot.app.watching.runwatch), from the last poll's figures.
                    usd, _ = spent[run.id]
                    progress = runwatch.progress_line(s, run, None, now, usd, gpus.get(run.id, ""))
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
        summary = f"{shown_waiting} waiting, {shown_runs - shown_waiting} running"
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
            blocks += (views.Context(f"{h.name} is {self._trouble(h, now)}"),)
        return views.Reply(views.View(text=summary, blocks=blocks))

    def _trouble(self, host: FleetHost, now: datetime) -> str:
        tz = self.ctx.core.settings.timezone
        said = views.host_trouble(host.state, host.down_since, host.down_reason, now, tz)
        return said or host.state

    @staticmethod
    def _down_hosts(
        fleet: list[FleetHost],
    ) -> tuple[list[tuple[FleetHost, set[str]]], set[str]]:
        """Hosts marked down (bot.app.hosts.hostcheck) or not answered yet, with their GPU models,
        and the models some ready host offers: a run waits on such a host when only it
        has its model."""
        down: list[tuple[FleetHost, set[str]]] = []
        ready: set[str] = set()
        for host in fleet:
            models = set(host.models)
            if host.state == HOST_CHECKING or (
                host.state == HOST_UNREACHABLE and host.down_since is not None
            ):
                down.append((host, models))
            elif host.state == HOST_READY:
                ready |= models
        return down, ready

    def _estimates(
        self, s: Session, now: datetime, runs: list[TrainingRun], fleet: list[FleetHost]
    ) -> dict[int, estimates.Estimate]:
        """The queued runs' estimates by run id (`_estimate_all`)."""
        found = self._estimate_all(s, now, runs, fleet)
        return {e.run_id: e for e in found if isinstance(e.run_id, int)}

    def _estimate_all(
        self, s: Session, now: datetime, runs: list[TrainingRun], fleet: list[FleetHost]
    ) -> list[estimates.Estimate]:
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
        boot = timedelta(seconds=self.ctx.config.boot_s + self.ctx.config.setup_s)
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
        return estimates.estimate_queue(waiting, pictures, now.timestamp())

    def expected_starts(self, places: set[str]) -> dict[tuple[str, int], datetime | None]:
        """When each queued run ("run", id) and waiting reservation ("res", id) is expected
        to start on the hosts of `places` alone (the owned ones: what it would wait without
        the cloud), by the queue's own estimate, in one pass; None where that depends on a
        holder of unknown length, or it never fits there (`largest_hosts` tells the two apart)."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine, write=False) as s:
            runs = list(
                s.exec(
                    select(TrainingRun)
                    .where(TrainingRun.state == RUN_QUEUED)
                    .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
                )
            )
            fleet = [h for h in read_fleet(s) if h.provider in places]
            found = self._estimate_all(s, now, runs, fleet)
        out: dict[tuple[str, int], datetime | None] = {}
        for e in found:
            key: tuple[str, int] = (
                ("run", e.run_id) if isinstance(e.run_id, int) else ("res", int(e.run_id[4:]))
            )
            out[key] = datetime.fromtimestamp(e.start_s, tz=UTC) if e.start_s is not None else None
        return out

    def largest_hosts(self, places: set[str]) -> dict[str, int]:
        """The most GPUs of each model one host of `places` has (hosts not gone): what
        a request of that model can ever get there."""
        with transaction(self.ctx.engine, write=False) as s:
            fleet = [h for h in read_fleet(s) if h.provider in places]
        out: dict[str, int] = {}
        for h in fleet:
            for model, n in h.models.items():
                out[model] = max(out.get(model, 0), n)
        return out

    @staticmethod
    def _per_gpu_prices(fleet: list[FleetHost]) -> dict[str, float]:
        """Per-GPU hourly price of each model on the hosts we have (0 for owned hosts)."""
        out: dict[str, float] = {}
        for host in fleet:
            share = gpu_share(host.hourly_usd, host.gpus)
            for model in host.models:
                out[model] = max(out.get(model, 0.0), share)
        return out

    def logs(self, actor: Actor, cmd: Logs) -> views.Reply:
        with transaction(self.ctx.engine, write=False) as s:
            run = s.get(TrainingRun, cmd.run_id)
            if run is None:
                raise UserError(f"There is no run #{cmd.run_id}.", "/gpu logs ID [LINES]")
            owner = s.get(User, run.user_id)
            # A log may hold what its owner printed (data, paths, tokens): theirs unless
            # the team shares logs (GPUBOT_SHARED_LOGS).
            if owner is None or not self.ctx.gate.may_read_log(actor, owner.key):
                raise UserError(
                    f"Run #{cmd.run_id} is not yours; only its owner or an admin can read its log."
                )
            placement = dict(run.placement)
            run_state = run.state
        if owner.key != actor.key and actor.admin and not self.ctx.gate.settings.shared_logs:
            audit(actor, "read-log", f"run #{cmd.run_id} of {owner.key}")
        if "log" not in placement:
            why = {
                RUN_QUEUED: "has not started yet",
                RUN_CANCELLED: "was cancelled before it started",
            }.get(run_state, f"is {run_state} and never started")
            return views.message(f"Run #{cmd.run_id} {why}, so it has no log.")
        try:
            text = self.ctx.executor.tail(placement, cmd.lines)
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
        with transaction(self.ctx.engine, write=False) as s:
            q = select(TrainingRun.id).where(col(TrainingRun.state).in_(RUN_OPEN_STATES))
            ids = set(s.exec(q).all())
        return len(ids if run_ids is None else ids & run_ids)


def _array_line(
    run: TrainingRun,
    user: User,
    members: list[TrainingRun],
    now: datetime,
    prices: dict[str, float],
) -> tuple[str, ...]:
    """One `/gpu queue` line for a sweep's runs in one job array: how many of them run,
    wait and have ended, and why the waiting ones wait (Slurm's throttle, its reason)."""
    placement = run.placement
    size = int(placement.get("array_size") or len(members))
    running = [m for m in members if m.state == RUN_RUNNING]
    stopping = [m for m in members if m.state == RUN_CANCELLING]
    pending = [m for m in members if m.state not in (RUN_RUNNING, RUN_CANCELLING)]
    counts = [f"{len(running)} running", f"{len(pending)} waiting"]
    if stopping:
        counts.append(f"{len(stopping)} stopping")
    counts.append(f"{size - len(members)} ended")
    why = next((str(m.placement["stage"]) for m in pending if m.placement.get("stage")), "–")
    ids = ", ".join(f"#{m.id}" for m in members)
    price = prices.get(run.gpu_model or "", 0.0) * run.gpu_count
    if not price:
        cost = "$0 (owned)"
    elif run.max_seconds:
        cost = f"≤ ${price * run.max_seconds / 3600 * len(members):.2f} for the {len(members)}"
    else:
        cost = f"${price:.2f}/h each"
    return (
        f"sweep {run.sweep or '?'} ({ids})",
        user.display_name,
        f"{run.recipe or views.command_phrase(run.command, 40)} ×{size}",
        views.gpu_phrase(run.gpu_count, run.gpu_model) + " each",
        f"Slurm array {placement.get('job')}: " + ", ".join(counts),
        "–",
        format_duration(now - run.submitted_at),
        why,
        cost,
    )
