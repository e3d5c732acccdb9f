"""Asking for a run: submit (one run or a sweep) and cancel. Every way a run starts
comes through Submissions.submit (/gpu run, the run form, gpubot submit); checks that
can refuse (who may, the recipe, the code source, the GPU model, the budget) happen
here, before anything is queued."""

from __future__ import annotations

import logging
import shlex
import uuid
from datetime import timedelta
from typing import Any

from sqlmodel import Session, col, select

from bot.app.access import audit
from bot.app.hosts import sources
from bot.app.hosts.agentwatch import checkpoint_dir, holds_files
from bot.app.money import budgets
from bot.app.ports import Actor, PlaceRequest
from bot.app.runs.context import RECIPES, USAGE_RUN, FleetHost, RunContext, read_fleet
from bot.domain import code_sources, views
from bot.domain.commands import Cancel, Run
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.domain.scheduling import split_hosts
from db.models import RUN_CANCELLED, RUN_CANCELLING, RUN_OPEN_STATES, RUN_QUEUED, TrainingRun, User
from db.session import locked, retrying, transaction
from provisioning import shell

log = logging.getLogger(__name__)


class Submissions:
    """What a user asks of the run queue: a run in, a run back out."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @retrying
    def submit(self, actor: Actor, cmd: Run, request_key: str | None = None) -> views.Reply:
        # Every way a run starts comes here (/gpu run, the run form, gpubot submit).
        if self.ctx.refusal is not None:
            raise UserError(self.ctx.refusal, USAGE_RUN)
        refusal = self.ctx.gate.run_refusal(actor)
        if refusal is not None:
            raise UserError(refusal)  # who may, not how: no usage line
        resume_from: dict[str, Any] | None = None
        if cmd.resume is not None:
            cmd, resume_from = self._resumed(actor, cmd)
        if cmd.interactive:
            raise UserError(
                "Say what to run: `--recipe digits` or `-- python train.py`.", USAGE_RUN
            )
        if cmd.recipe is not None and cmd.recipe not in RECIPES:
            raise UserError(
                f"There is no recipe `{cmd.recipe}`; recipes: {', '.join(RECIPES)}.", USAGE_RUN
            )
        self._check_source(cmd)  # bot.app.hosts.sources: git/path/staged code
        # The place's own rules (a cluster: who may, which partition allows it), before
        # anything is put in line; its note (the limit a run without --max gets) is said.
        note = self.ctx.executor.admit(
            PlaceRequest(
                user_key=actor.key,
                gpus=cmd.gpus,
                model=cmd.model,
                seconds=int(cmd.max_duration.total_seconds()) if cmd.max_duration else None,
                place=dict(cmd.place),
                kind="run",
            )
        )
        with transaction(self.ctx.engine) as s:
            if request_key is not None:
                prior = s.exec(
                    select(TrainingRun).where(TrainingRun.request_key == request_key)
                ).first()
                if prior is not None:
                    return self._queued_reply(s, prior)
            model, picked = self._resolve_model(s, cmd.model, cmd.gpus, cmd.recipe)
            user = self.ctx.core.user_row(s, actor.key, actor.name)
            max_s = int(cmd.max_duration.total_seconds()) if cmd.max_duration else None
            # Budget (bot.app.money.budgets): a run that cannot fit is refused before it queues.
            variants = len(cmd.sweep[1]) if cmd.sweep else 1
            budgets.check_budget(
                s,
                user,
                budgets.run_estimate(s, model, cmd.gpus, max_s) * variants,
                self.ctx.core.clock.now(),
                self.ctx.core.settings,
                what=(f"This sweep ({variants} runs of " if cmd.sweep else "This run (")
                + f"{views.gpu_phrase(cmd.gpus, model)}, "
                + (
                    f"up to {format_duration(cmd.max_duration)})"
                    if cmd.max_duration
                    else "no --max: counted as 1h)"
                ),
            )
            if cmd.sweep is not None:
                swept = self._submit_sweep(s, cmd, user, model, request_key)
                return swept.with_note(picked).with_note(note)
            run = TrainingRun(
                user_id=user.id,  # type: ignore[arg-type]
                command=command_text(cmd.command),
                recipe=cmd.recipe,
                gpu_count=cmd.gpus,
                gpu_model=model,
                precision=cmd.precision,
                spot=cmd.spot,
                checkpoints=cmd.checkpoints,
                max_seconds=int(cmd.max_duration.total_seconds()) if cmd.max_duration else None,
                state=RUN_QUEUED,
                submitted_at=self.ctx.core.clock.now(),
                request_key=request_key,
                source=cmd.source,
                options=dict(cmd.options),
                place=dict(cmd.place),
                cloud=cmd.cloud,
            )
            if resume_from is not None:  # bot.app.hosts.agentwatch: uploaded before it starts
                run.placement = {"resume_from": resume_from}
            s.add(run)
            s.flush()
            reply = self._queued_reply(s, run).with_note(picked).with_note(note)
            if resume_from is not None:
                reply = reply.with_note(
                    f"It goes on from run #{resume_from['of_run']}'s checkpoint at step "
                    f"{resume_from['step']}."
                )
            return reply

    def _resumed(self, actor: Actor, cmd: Run) -> tuple[Run, dict[str, Any]]:
        """`--resume ID`: run ID as it was asked for (its --max, or the one given now; its
        place options, or those given now), starting from the checkpoint the bot kept
        when it stopped at its time limit (RunPoller, bot.app.hosts.agentwatch.save_for_resume)."""
        assert cmd.resume is not None
        with transaction(self.ctx.engine, write=False) as s:
            old = s.get(TrainingRun, cmd.resume)
            owner = s.get(User, old.user_id) if old is not None else None
        if old is None or owner is None or owner.key != actor.key:
            raise UserError(f"You have no run #{cmd.resume} to resume.", USAGE_RUN)
        if old.state in RUN_OPEN_STATES:
            raise UserError(
                f"Run #{old.id} has not ended; a run is resumed after it stopped at its "
                "time limit.",
                USAGE_RUN,
            )
        step = (old.metrics.get("summary") or {}).get("resume_step")
        local = checkpoint_dir(self.ctx.core.settings.home, cmd.resume)
        if not isinstance(step, int) or not holds_files(local):
            raise UserError(
                f"Run #{old.id} left no checkpoint to go on from (only a run that stopped at "
                "its time limit after saving one does); start it afresh with `/gpu run`.",
                USAGE_RUN,
            )
        max_s = old.max_seconds
        again = Run(
            command=tuple(shlex.split(old.command)) if old.command else (),
            recipe=old.recipe,
            gpus=old.gpu_count,
            model=old.gpu_model,
            precision=old.precision,
            max_duration=cmd.max_duration or (timedelta(seconds=max_s) if max_s else None),
            spot=old.spot,
            source=old.source,
            options=tuple((k, float(v)) for k, v in old.options.items()),
            checkpoints=old.checkpoints,
            place=cmd.place or tuple((k, str(v)) for k, v in old.place.items()),
            cloud=cmd.cloud or old.cloud,
        )
        resume_from = {
            "dir": str(local),
            "step": step,
            "host": "",
            "reason": f"resumed from run #{old.id}",
            "count": 0,
            "of_run": old.id,
            "copied_files": 0,
            "lost_seen": [],
        }
        return again, resume_from

    def _submit_sweep(
        self, s: Session, cmd: Run, user: User, model: str, request_key: str | None
    ) -> views.Reply:
        """One queued run per value, under one sweep label, submitted together so that the
        scheduler places them side by side on the warm fleet; `RunRecords.finish` posts the table
        when the last one ends."""
        assert cmd.sweep is not None
        param, values = cmd.sweep
        label = f"s{uuid.uuid4().hex[:6]}"
        now = self.ctx.core.clock.now()
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
                place=dict(cmd.place),
                cloud=cmd.cloud,
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
            src = code_sources.parse_source(cmd.source, allow_file=self.ctx.allow_file_git)
        except code_sources.SourceError as exc:
            raise UserError(str(exc), USAGE_RUN) from None
        home = self.ctx.core.settings.home
        if (
            isinstance(src, code_sources.StagedSource)
            and not sources.staged_dir(home, src).is_dir()
        ):
            raise UserError(
                f"There is no staged upload {src.staged_id} here; `gpubot submit DIR` stages one.",
                USAGE_RUN,
            )

    def _resolve_model(
        self, s: Session, model: str | None, gpus: int, recipe: str | None = None
    ) -> tuple[str, str | None]:
        """A run needs one GPU model: the asked one, else the configured default, else
        the one model the pool has, else (a recipe, which runs on any GPU, on a cloud pool
        with nothing running) the cheapest the cloud can launch for it, said in the reply
        (the second value). Refuses what no host could ever run."""
        counts: dict[str, int] = {}
        fleet = read_fleet(s)
        for host in fleet:
            for m, n in host.models.items():
                counts[m] = max(counts.get(m, 0), n)
        wanted = model or self.ctx.core.settings.default_gpu
        if wanted is not None and self.ctx.core.supply.can_run(wanted, gpus):
            return str(wanted), None
        if wanted is None and not counts and recipe is not None:
            cheapest = self._cheapest_offered(gpus)
            if cheapest is not None:
                return cheapest
        if wanted is None:
            if len(counts) != 1:
                have = ", ".join(sorted(counts)) or "none"
                offered = self.ctx.core.supply.offered()
                # A cloud pool with nothing running yet: name what it can launch, not "none".
                more = (
                    f"; the cloud can launch: {', '.join(offered)} "
                    "(an admin sets a team default with GPUBOT_DEFAULT_GPU)"
                    if offered
                    else ""
                )
                raise UserError(
                    f"Say which GPU model to run on (`--gpu MODEL`); this pool has: {have}{more}.",
                    USAGE_RUN,
                )
            wanted = next(iter(counts))
        if wanted not in counts:
            have = ", ".join(sorted(counts)) or "none"
            raise UserError(f"No host here has {wanted} GPUs (this pool has: {have}).", USAGE_RUN)
        if gpus > counts[wanted] and not fits_across(fleet, wanted, gpus):
            raise UserError(
                f"No host has {gpus} {wanted} GPUs; the most on one host is {counts[wanted]}, "
                f"and no hosts of one kind hold {gpus} between them in equal shares.",
                USAGE_RUN,
            )
        return wanted, None

    def _cheapest_offered(self, gpus: int) -> tuple[str, str] | None:
        """The GPU model the cloud can launch for `gpus` GPUs at the lowest on-demand price
        per GPU-hour, with the sentence that says it was picked; None when it offers none."""
        supply = self.ctx.core.supply
        options = []
        for offered in supply.offered():
            itype = self.ctx.catalog.cheapest(offered, 1)
            if itype is not None and supply.can_run(offered, gpus):
                options.append((itype.ondemand_per_gpu_hr, offered, itype.instance_type))
        if not options:
            return None
        per_gpu, chosen, itype_name = min(options)
        return chosen, (
            f"No GPU model asked for and none running, so {chosen}: the cheapest the cloud "
            f"can launch for this recipe (${per_gpu:.2f} per GPU-hour on {itype_name}). "
            "`--gpu MODEL` picks another."
        )

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

    @retrying
    def cancel(self, actor: Actor, cmd: Cancel) -> views.Reply:
        """Marks the run; its GPUs go back when poll sees it end (`RunRecords.finish`). One row
        under its lock and nothing after it (db.session): a dispatch that claimed the
        run meanwhile is seen ("starting" → cancelling), never written over."""
        if cmd.sweep is not None:
            return self._cancel_sweep(actor, cmd.sweep)
        with transaction(self.ctx.engine) as s:
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
                run.finished_at = self.ctx.core.clock.now()
                s.add(run)
                return views.message(f"Run #{run.id} cancelled before it started.")
            run.state = RUN_CANCELLING
            s.add(run)
            # A recipe checkpoints on SIGTERM; a command does whatever its script does.
            saves = ", saves a checkpoint," if run.recipe else ""
            return views.message(
                f"Stopping run #{run.id}: it gets SIGTERM{saves} and its GPUs go back when it exits."
            )

    @retrying
    def _cancel_sweep(self, actor: Actor, label: str) -> views.Reply:
        """Every open run of a sweep, marked in one transaction: the queued ones end at
        once, the started ones stop as `cancel` stops one; poll tells a cluster's array
        in one call (bot.app.runs.poll)."""
        usage = "/gpu cancel ID|SWEEP"
        with transaction(self.ctx.engine) as s:
            ids = [
                i
                for i in s.exec(
                    select(TrainingRun.id)
                    .where(TrainingRun.sweep == label)
                    .order_by(col(TrainingRun.id))
                )
                if i is not None
            ]
            if not ids:
                raise UserError(f"There is no sweep {label}.", usage)
            runs = [r for r in (locked(s, TrainingRun, i) for i in ids) if r is not None]
            owner = s.get(User, runs[0].user_id)
            if owner is None or (owner.key != actor.key and not actor.admin):
                raise UserError(
                    f"Sweep {label} is not yours; only its owner or an admin can cancel it."
                )
            open_runs = [r for r in runs if r.state in RUN_OPEN_STATES]
            if not open_runs:
                raise UserError(f"Every run of sweep {label} has already ended.", usage)
            if owner.key != actor.key:
                audit(actor, "cancel", f"sweep {label} of {owner.key}", session=s)
            now = self.ctx.core.clock.now()
            dropped, stopping = [], []
            for run in open_runs:
                if run.state == RUN_QUEUED:
                    run.state = RUN_CANCELLED
                    run.finished_at = now
                    dropped.append(run.id)
                elif run.state != RUN_CANCELLING:
                    run.state = RUN_CANCELLING
                    stopping.append(run.id)
                s.add(run)
            parts = []
            if dropped:
                parts.append(f"{len(dropped)} that had not started cancelled")
            if stopping:
                saves = ", each saves a checkpoint," if runs[0].recipe else ""
                parts.append(
                    f"{len(stopping)} started ("
                    + ", ".join(f"#{i}" for i in stopping)
                    + f") stopping: they get SIGTERM{saves} and their GPUs go back as they exit"
                )
            said = "; ".join(parts) or "its runs are already stopping"
            return views.message(f"Sweep {label}: {said}.")


def command_text(argv: tuple[str, ...] | list[str]) -> str:
    """The run's command as one shell line whose words are exactly what the user gave
    ("" for a recipe, which has none)."""
    if not argv:
        return ""
    try:
        return shell.join(argv)
    except ValueError:
        raise UserError("A command cannot hold a NUL character.", USAGE_RUN) from None


def fits_across(fleet: list[FleetHost], model: str, gpus: int) -> bool:
    """Whether hosts of one kind could hold a run of `gpus` GPUs of `model` in equal
    shares, by the scheduler's own split (bot.domain.scheduling: the fewest hosts of the
    kind's largest size), so a run is refused only where no placement could ever exist."""
    by_kind: dict[str, list[int]] = {}
    for host in fleet:
        if host.models.get(model):
            by_kind.setdefault(host.kind, []).append(host.models[model])
    for sizes in by_kind.values():
        k = split_hosts(gpus, max(sizes))
        if sum(1 for n in sizes if n >= gpus // k) >= k:
            return True
    return False
