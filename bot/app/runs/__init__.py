"""Training runs: submit, queue, cancel, logs — and the worker's side of them,
dispatch (place queued runs with the scheduler and start them on their host) and
poll (read each running run's status file and finish it).

The parts, one module each over one shared RunContext: `submit` (Submissions),
`board` (RunBoard: queue, logs), `inputs` (what the scheduler is told), `dispatch`
(Dispatcher), `poll` (Poller) and `records` (RunRecords: a started run's row, ended
or requeued). RunService composes them and is what the faces and the worker hold.

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

from typing import Any

from bot.app.access import RunGate
from bot.app.ports import Actor, Core, HostAccess
from bot.app.runs.board import RunBoard
from bot.app.runs.command import runner_command
from bot.app.runs.context import (
    RECIPES,
    STARTING_GRACE,
    USAGE_RUN,
    LocalAccess,
    RunContext,
    host_view,
    scheduler_config,
)
from bot.app.runs.dispatch import Dispatcher
from bot.app.runs.executor import RunExecutor
from bot.app.runs.poll import OOM_ADVICE, Poller
from bot.app.runs.records import RunRecords
from bot.app.runs.submit import Submissions, command_text
from bot.domain import views
from bot.domain.commands import Cancel, Logs, Queue, Run
from bot.domain.scheduling import SchedulerConfig
from provisioning.catalog import Catalog

__all__ = [
    "OOM_ADVICE",
    "RECIPES",
    "STARTING_GRACE",
    "USAGE_RUN",
    "LocalAccess",
    "RunService",
    "command_text",
    "host_view",
    "runner_command",
    "scheduler_config",
]


class RunService:
    """The run verbs and the worker's two steps, each handed to its part. A facade, not a
    base class: the parts share state only through `ctx`."""

    def __init__(
        self,
        core: Core,
        access: HostAccess,
        catalog: Catalog,
        *,
        refusal: str | None = None,
        executor: RunExecutor | None = None,
        bursting: bool = False,
    ) -> None:
        """`executor`: where its runs run (a provider's); process groups on the hosts
        `access` reaches when None. `bursting`: owned places with a cloud after them, so
        the cloud is bought for a run only on its owner's word (bot.app.burst)."""
        self.ctx = RunContext.build(core, access, catalog, refusal, executor, bursting)
        self.records = RunRecords(self.ctx)
        self.submissions = Submissions(self.ctx)
        self.board = RunBoard(self.ctx)
        self.dispatcher = Dispatcher(self.ctx, self.records)
        self.poller = Poller(self.ctx, self.records)

    # --- what the faces and the host agents' watch read ------------------------------

    @property
    def core(self) -> Core:
        return self.ctx.core

    @property
    def access(self) -> HostAccess:
        return self.ctx.access

    @property
    def catalog(self) -> Catalog:
        return self.ctx.catalog

    @property
    def config(self) -> SchedulerConfig:
        return self.ctx.config

    @property
    def refusal(self) -> str | None:
        return self.ctx.refusal

    @property
    def engine(self) -> Any:
        return self.ctx.engine

    @property
    def gate(self) -> RunGate:
        return self.ctx.gate

    @gate.setter
    def gate(self, gate: RunGate) -> None:
        self.ctx.gate = gate

    @property
    def allow_file_git(self) -> bool:
        return self.ctx.allow_file_git

    @allow_file_git.setter
    def allow_file_git(self, allow: bool) -> None:
        self.ctx.allow_file_git = allow

    # --- the verbs -------------------------------------------------------------------

    def submit(self, actor: Actor, cmd: Run, request_key: str | None = None) -> views.Reply:
        return self.submissions.submit(actor, cmd, request_key)

    def cancel(self, actor: Actor, cmd: Cancel) -> views.Reply:
        return self.submissions.cancel(actor, cmd)

    def queue(self, actor: Actor, cmd: Queue) -> views.Reply:
        return self.board.queue(actor, cmd)

    def logs(self, actor: Actor, cmd: Logs) -> views.Reply:
        return self.board.logs(actor, cmd)

    def open_runs(self, run_ids: set[int] | None = None) -> int:
        return self.board.open_runs(run_ids)

    # --- the worker ------------------------------------------------------------------

    def dispatch(self) -> int:
        """Places queued runs with the scheduler and starts them; returns how many started."""
        return self.dispatcher.dispatch()

    def poll(self) -> int:
        """Reads every running run's status; finishes those that ended. Returns how many."""
        return self.poller.poll()

    def requeue(
        self, run_id: int, resume_from: dict[str, Any], view: views.View, dedupe: str
    ) -> bool:
        return self.records.requeue(run_id, resume_from, view, dedupe)
