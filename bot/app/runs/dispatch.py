"""The worker's dispatch: place queued runs with the scheduler (the same
bot.domain.scheduling.decide that `gpubot simulate` measures) and start them on their
host; carry out its preemptions; hand launches to the fleet.

A run is dispatched exactly once: the move from `queued` to `starting` is a
conditional update that only one worker can win, and the GPUs it takes are
claimed by usage intervals in the same transaction (the partial unique index
refuses a GPU held twice). A process that dies between claiming and starting
leaves a `starting` run with no process id, which the next poll puts back in line.
A run with code to fetch or upload is started off the tick (bot.app.runs.starts)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from bot.app.burst import state as burst_state
from bot.app.hosts import sources
from bot.app.money import budgets
from bot.app.ports import STAGE_HANDED
from bot.app.runs.context import RunContext
from bot.app.runs.executor import (
    GroupStarts,
    PrepareCode,
    RunExecutor,
    StartFailed,
    Unavailable,
)
from bot.app.runs.inputs import anything_to_decide, scheduler_inputs
from bot.app.runs.records import RunRecords, back_in_line
from bot.app.runs.routed import AT
from bot.app.watching.held import held_gpu_ids
from bot.domain import code_sources, views
from bot.domain.scheduling import Launch, Place, Preempt, Start, decide, preempt_slot
from db.models import (
    RUN_CANCELLED,
    RUN_CANCELLING,
    RUN_FAILED,
    RUN_ON_HOST,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_STARTING,
    Gpu,
    Host,
    TrainingRun,
    User,
)
from db.session import lock_pool, locked, retrying, transaction
from provisioning import shell
from provisioning.costs import gpu_share
from provisioning.hostshell import HostShell
from provisioning.ssh import SshError, SshTarget

log = logging.getLogger(__name__)


class Dispatcher:
    """Queued runs onto hosts."""

    def __init__(self, ctx: RunContext, records: RunRecords) -> None:
        self.ctx = ctx
        self.records = records
        self.preempt_slot = -(2**62)  # the last preemption slot dispatch looked at

    def dispatch(self) -> int:
        """Places queued runs with the scheduler and starts them; returns how many started.
        Where the place's own scheduler places runs (a cluster), every queued run is
        handed to it instead."""
        if self.ctx.refusal is not None:
            return 0
        handed = 0
        cluster = self.ctx.cluster
        if cluster is not None:
            handed = self._hand_over(*cluster)
            if not self.ctx.schedules:
                return handed
        return handed + self._schedule()

    def _schedule(self) -> int:
        """gpubot's own scheduler over the hosts it places on (not a cluster's nodes)."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine, write=False) as s:
            if not anything_to_decide(s):
                return 0  # the common idle tick: one indexed query, nothing loaded
            queue, fleet, hosts, usage = scheduler_inputs(self.ctx, s, now)
        if not queue and not any(a.preemptible for i in fleet for a in i.allocations):
            return 0  # nothing to place and nothing the scheduler could move
        # Preemption is looked at once per preempt_period_s, as the simulator does.
        slot = preempt_slot(now.timestamp(), self.ctx.config)
        due = slot > self.preempt_slot
        if due:
            self.preempt_slot = slot
        actions = decide(
            queue,
            fleet,
            now.timestamp(),
            catalog=self.ctx.catalog,
            config=self.ctx.config,
            usage=usage,
            preempt_due=due,
        )
        # Each host's kind as the scheduler saw it (its instance type, else its provider).
        kinds = {i.instance_id: i.instance_type for i in fleet}
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
            names = list(action.instance_ids)
            if not names or any(n not in hosts for n in names):
                log.info("placement %s needs hosts this provider does not have; skipped", action)
                continue
            if len({kinds[n] for n in names}) != 1:
                log.info("placement %s spans instance types; skipped", action)
                continue
            if self._start(int(action.run_id), names, action.gpus_per_instance):
                started += 1
        return started

    def _hand_over(self, place: str, cluster: RunExecutor) -> int:
        """Every queued run to the cluster, oldest first: claimed (no GPUs: its scheduler
        gives them when it starts it, and poll meters them from then) and submitted. One
        the cluster refuses fails with the cluster's words; a controller that does not
        answer leaves the rest in line for the next tick. A run taken out of its queue
        for the cloud (bot.app.burst) is gpubot's scheduler's, not handed back."""
        with transaction(self.ctx.engine, write=False) as s:
            rows = [
                (int(i), sweep)
                for i, sweep in s.exec(
                    select(TrainingRun.id, TrainingRun.sweep)
                    .where(TrainingRun.state == RUN_QUEUED)
                    .order_by(col(TrainingRun.submitted_at), col(TrainingRun.id))
                )
                if i is not None
            ]
            if rows and self.ctx.bursting:
                elsewhere = burst_state.on_cloud(s)
                rows = [(i, sweep) for i, sweep in rows if i not in elsewhere]
        runs_dir = cluster.runs_dir("")
        if not rows or runs_dir is None:
            return 0
        # A sweep's queued runs go together, where the cluster starts a group as one (a
        # Slurm job array: one submission, one throttle, one cancel), at its first's turn.
        together: dict[str, list[int]] = {}
        if isinstance(cluster, GroupStarts):
            for run_id, sweep in rows:
                if sweep is not None:
                    together.setdefault(sweep, []).append(run_id)
        handed = 0
        for run_id, sweep in rows:
            group = together.get(sweep or "", [run_id])
            if run_id != group[0]:
                continue
            started = self._claim_and_start(cluster, group, runs_dir, place)
            if started is None:
                return handed  # the cluster does not answer: the rest wait for the next tick
            handed += started
        return handed

    def _claim_and_start(
        self, cluster: RunExecutor, run_ids: list[int], runs_dir: Path, place: str
    ) -> int | None:
        """Runs handed to the cluster (one, or a sweep's queued ones): claimed, then
        started as one group where the cluster starts groups (`GroupStarts`), else a run
        at a time. How many started; None when the cluster does not answer (the rest
        are back in line)."""
        claims = [c for c in (self._claim_for_cluster(i, runs_dir, place) for i in run_ids) if c]
        runs = [run for _, run in claims]
        ids = [int(run.id or 0) for run in runs]
        changes = None
        # (Of a sweep, the others may have been cancelled or claimed meanwhile.)
        if len(claims) > 1 and isinstance(cluster, GroupStarts):
            try:
                changes = cluster.start_group(runs, [p for p, _ in claims], self._code_for)
            except Unavailable as exc:
                log.warning("runs %s stay in line: %s", ids, exc)
                for run_id in ids:
                    self._unclaim(run_id)
                return None
            except Exception as exc:
                self._start_failed(ids, exc)
                return 0
        started = 0
        if changes is None:  # a run at a time
            for n, (placement, run) in enumerate(claims):
                one = self._run_start(ids[n], run, [], placement)
                if one is None:  # the rest back in line with it
                    for later in ids[n + 1 :]:
                        self._unclaim(later)
                    return None
                started += int(one)
            return started
        for run_id, (placement, run), change in zip(ids, claims, changes, strict=True):
            started += self._recorded(run_id, change, [], placement, run.started_at)
        return started

    @retrying
    def _preempt(self, run_id: int, for_run: str) -> None:
        """Stops a running run with a checkpoint so its GPUs go elsewhere (scheduler's call).

        The same path as a spot notice: the run is marked interrupted, gets SIGTERM, saves
        a checkpoint and exits 75; poll then copies the checkpoint off and requeues it
        (bot.app.hosts.agentwatch), and the owner gets a DM saying why and from which step it will
        resume. Its GPUs are placed on a later tick, once they are really free."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_RUNNING:
                return
            placement = dict(run.placement)
            if not self.ctx.executor.started(placement) or "interrupted" in placement:
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
        try:
            # A run over several hosts: every node checkpoints and stops, not node 0 alone
            # (the others would fail in their next collective, and the run with them).
            self.ctx.executor.signal(placement, "TERM")
            self.records.update_placement(run_id, term_sent=True)
            log.info("run %s preempted (%s)", run_id, reason)
        except SshError as exc:
            log.warning("preempt of run %s on %s failed: %s", run_id, placement["host"], exc)

    def _provision(self, action: Launch | Start) -> None:
        """A Launch/Start goes to the fleet (bot.app.fleet), which buys within the pool limits
        and once per request; without a cloud provider there is nothing to buy."""
        fleet = self.ctx.core.fleet
        if fleet is None:
            log.info("scheduler wants %s; no cloud provider is configured, skipped", action)
            return
        itype = action.instance_type if isinstance(action, Launch) else None
        if self.ctx.bursting:
            # Owned GPUs first: the cloud is bought only for a run whose owner took the
            # priced offer (bot.app.burst), never on the scheduler's word alone, and
            # nothing dearer than the price shown.
            with transaction(self.ctx.engine, write=False) as s:
                taken = burst_state.taken(s, int(action.for_run))
            if taken is None:
                log.debug("scheduler wants %s; its owner has not taken the cloud", action)
                return
            offered, cap = taken
            done = fleet.provision_for(int(action.for_run), offered, cap, in_cluster=False)
            if done:
                log.info("fleet: %s", done)
            return
        done = fleet.provision_run(int(action.for_run), itype)
        if done:
            log.info("fleet: %s", done)

    def _start(self, run_id: int, host_names: list[str], gpus: int) -> bool:
        """Claims GPUs and the run in one transaction, then starts it through the executor:
        on each host of a placement over several (one run, node 0 on the first, whose
        address is torchrun's rendezvous), or the one host."""
        executor = self.ctx.executor
        dirs = [executor.runs_dir(name) for name in host_names]
        if any(d is None for d in dirs):
            log.warning("no way to reach one of %s; run %s stays queued", host_names, run_id)
            return False
        try:
            rendezvous = executor.address(host_names[0]) if len(host_names) > 1 else None
        except SshError as exc:
            log.warning("run %s stays queued: %s", run_id, exc)
            return False
        claimed = self._claim(
            run_id,
            [(n, d) for n, d in zip(host_names, dirs, strict=True) if d is not None],
            gpus,
            rendezvous,
        )
        if claimed is None:
            return False
        placement, run = claimed
        if run.source or placement.get("resume_from"):
            # Its code or the checkpoint it resumes from goes up first: off the tick
            # (bot.app.runs.starts), as either may be gigabytes.
            self.ctx.starts.submit(
                run_id, lambda: self._run_start(run_id, run, host_names, placement)
            )
            return True
        return bool(self._run_start(run_id, run, host_names, placement))

    def _run_start(
        self, run_id: int, run: TrainingRun, host_names: list[str], placement: dict[str, Any]
    ) -> bool | None:
        """The claimed run started on each of its hosts (code first, then the runner), or
        ended with the reason when it cannot start; True when it started. None: the place
        does not answer now, and the run is back in line, as it was."""
        try:
            changes = self.ctx.executor.start(run, placement, self._code_for(run_id))
        except Unavailable as exc:
            log.warning("run %s stays in line: %s", run_id, exc)
            self._unclaim(run_id)
            return None
        except Exception as exc:
            self._start_failed([run_id], exc)
            return False
        return self._recorded(run_id, changes, host_names, placement, run.started_at)

    def _code_for(self, run_id: int) -> PrepareCode:
        """How the executor puts this run's code where it starts (`_prepare_code`)."""

        def code(runner: HostShell, target: SshTarget, run_dir: str, log_path: str) -> None:
            self._prepare_code(run_id, runner, target, run_dir, log_path)

        return code

    def _start_failed(self, run_ids: list[int], exc: Exception) -> None:
        """Runs whose start failed end with the reason (off the tick nobody else would
        say it): one run's, or a group's started as one."""
        cause = exc.cause if isinstance(exc, StartFailed) else exc
        if not isinstance(cause, SshError):
            log.exception("starting run(s) %s failed", ", ".join(map(str, run_ids)))
        where = f" on {exc.host}" if isinstance(exc, StartFailed) and exc.host else ""
        for run_id in run_ids:
            self.records.finish(
                run_id, RUN_FAILED, None, {"error": f"could not start{where}: {exc}"}, log_tail=""
            )

    def _recorded(
        self,
        run_id: int,
        changes: dict[str, Any],
        host_names: list[str],
        placement: dict[str, Any],
        claimed_at: datetime | None,
    ) -> bool:
        """What started recorded and watched; False when the run was put back in line
        while this start was under way (another worker leads now and requeued it past the
        starting grace): what started here is stopped, or the run would run twice once it
        is placed again."""
        executor = self.ctx.executor
        if not self._mark_started(run_id, changes, host_names, placement, claimed_at):
            executor.stop_started({**placement, **changes})
            log.warning("run %s was requeued while it started here; stopped what started", run_id)
            return False
        # Its end is learnt as it happens, and its first figures as they come.
        executor.watch(run_id, {**placement, **changes}, True)
        return True

    @retrying
    def _claim_for_cluster(
        self, run_id: int, runs_dir: Path, place: str = ""
    ) -> tuple[dict[str, Any], TrainingRun] | None:
        """The run claimed for a cluster's scheduler: `starting`, with where its files go
        and no GPUs yet (its scheduler gives them when it starts it: poll then meters
        them). None when another worker or a cancel got there first."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            won = s.exec(
                update(TrainingRun)
                .where(col(TrainingRun.id) == run_id, col(TrainingRun.state) == RUN_QUEUED)
                .values(state=RUN_STARTING)
            )
            if won.rowcount != 1:
                return None
            run = locked(s, TrainingRun, run_id)
            assert run is not None
            node = _node_placement("", [], runs_dir / str(run_id))
            placement = {k: v for k, v in node.items() if k not in ("host", "gpu_indexes", "cpu")}
            if run.placement.get("resume_from"):  # bot.app.hosts.agentwatch: its saved checkpoint
                placement["resume_from"] = run.placement["resume_from"]
            placement["stage"] = STAGE_HANDED
            if place:
                placement[AT] = place
            run.placement = placement
            run.started_at = now
            s.add(run)
            return placement, run

    @retrying
    def _unclaim(self, run_id: int) -> None:
        """A claim that could not start (its place does not answer): back in line as it
        was, its resume point kept."""
        with transaction(self.ctx.engine) as s:
            lock_pool(s)  # its GPUs, if it took any, go back: the pool first
            run = locked(s, TrainingRun, run_id)
            if run is None or run.state != RUN_STARTING:
                return
            self.records.close_intervals(s, run_id, self.ctx.core.clock.now())
            back_in_line(run)
            s.add(run)

    @retrying
    def _claim(
        self,
        run_id: int,
        hosts: list[tuple[str, Path]],
        gpus: int,
        rendezvous_host: str | None = None,
    ) -> tuple[dict[str, Any], TrainingRun] | None:
        """The run and its GPUs in one transaction: the pool first (db.session's lock
        order), then the run, claimed only while it is still queued (a cancel or another
        worker that got there first wins). `hosts`: each host's name and runs dir, `gpus`
        on each. Returns its placement and the run as claimed: node 0's paths at the top
        (what logs, cancel and the agents read), and for a run over several hosts every
        node's under "nodes" with the rendezvous endpoint: node 0's address
        (`rendezvous_host`) and a port no other open run there has (`rendezvous_port`),
        chosen under the pool, so two claims never pick the same one."""
        now = self.ctx.core.clock.now()
        with transaction(self.ctx.engine) as s:
            lock_pool(s)
            won = s.exec(
                update(TrainingRun)
                .where(col(TrainingRun.id) == run_id, col(TrainingRun.state) == RUN_QUEUED)
                .values(state=RUN_STARTING)
            )
            if won.rowcount != 1:
                return None  # another worker got it, or it was cancelled
            held = held_gpu_ids(s)
            run = locked(s, TrainingRun, run_id)
            assert run is not None
            taken: list[tuple[Host, list[Gpu], Path]] = []
            rate = Decimal(0)  # what it costs an hour, all its hosts together
            for host_name, runs_dir in hosts:
                host = s.exec(select(Host).where(Host.name == host_name)).one()
                assert host.id is not None
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
                taken.append((host, free, runs_dir))
                share = gpu_share(host.hourly_usd, self.ctx.core.gpu_count(s, host.id))
                rate += Decimal(str(share)) * len(free)
            # Budget (bot.app.money.budgets): re-checked before placing; over budget → cancelled, DM.
            refusal = budgets.run_refusal(s, run, rate, now, self.ctx.core.settings)
            if refusal is not None:
                run.state, run.finished_at = RUN_CANCELLED, now
                s.add(run)
                owner = s.get(User, run.user_id)
                assert owner is not None
                text = f"Run #{run.id} was cancelled, not started: {refusal}"
                self.ctx.core.notify_dm(
                    s,
                    owner.key,
                    views.message(text).view,
                    now,
                    dedupe=f"budget-cancel-run:{run.id}",
                )
                return None
            # Usage on every host it holds: its cost is theirs summed (runwatch.cost_so_far).
            nodes = []
            for h, free, runs_dir in taken:
                self.ctx.core.open_usage(s, h, free, run.user_id, now, run_id=run.id)
                nodes.append(_node_placement(h.name, free, runs_dir / str(run.id)))
            placement: dict[str, Any] = dict(nodes[0])
            placement[AT] = taken[0][0].provider
            if len(nodes) > 1:
                assert rendezvous_host is not None
                placement["nodes"] = nodes
                port = rendezvous_port(run_id, _ports_in_use(s, rendezvous_host))
                placement["rdzv"] = f"{rendezvous_host}:{port}"
            if run.placement.get("resume_from"):  # bot.app.hosts.agentwatch: its saved checkpoint
                placement["resume_from"] = run.placement["resume_from"]
            # What `/gpu queue` says until the runner starts (bot.app.runs.starts).
            if run.source:
                placement["stage"] = "uploading code"
            elif placement.get("resume_from"):
                placement["stage"] = "uploading its checkpoint"
            run.placement = placement
            run.host_id = taken[0][0].id
            run.started_at = now
            s.add(run)
            return placement, run

    @retrying
    def _mark_started(
        self,
        run_id: int,
        changes: dict[str, Any],
        host_names: list[str],
        placement: dict[str, Any],
        claimed_at: datetime | None,
    ) -> bool:
        """What the executor started recorded on the placement (its `changes`) and its
        owner told; False, recording nothing, when the run is no longer this claim's
        (requeued or claimed again meanwhile). One row under its lock: a cancel that
        landed while it started stays "cancelling". A cluster's job is only recorded:
        it runs (and its owner hears) when the cluster's scheduler starts it (poll)."""
        with transaction(self.ctx.engine) as s:
            run = locked(s, TrainingRun, run_id)
            assert run is not None
            if run.state not in (RUN_STARTING, RUN_CANCELLING) or run.started_at != claimed_at:
                return False
            if self.ctx.places_itself(placement):
                run.placement = {**run.placement, **changes}
                s.add(run)
                return True
            run.placement = {**run.placement, **changes}
            run.placement.pop("stage", None)
            if run.state == RUN_STARTING:
                run.state = RUN_RUNNING
            s.add(run)
            self.records.tell_started(s, run, host_names, self.ctx.core.clock.now())
        return True

    def _prepare_code(
        self, run_id: int, runner: HostShell, target: SshTarget, run_dir: str, log_path: str
    ) -> None:
        """Puts the run's code on the host (bot.app.hosts.sources); `runner_command` starts the
        command in it (the runner itself stays in the run's directory, where the host
        agent looks for it). A failure is an SshError whose text says why, so the run
        fails with it and the owner is told."""
        with transaction(self.ctx.engine, write=False) as s:
            run = s.get(TrainingRun, run_id)
            text = run.source if run is not None else ""
        if not text:
            return
        try:
            src = code_sources.parse_source(text, allow_file=self.ctx.allow_file_git)
            assert src is not None
            done = sources.prepare_code(
                runner, target, src, run_dir, home=self.ctx.core.settings.home
            )
        except code_sources.SourceError as exc:
            raise SshError(f"could not get the code: {exc}") from None
        upload = done.upload
        if upload is not None:
            self.records.update_placement(
                run_id, code={"uploaded": list(upload.uploaded), "skipped": len(upload.skipped)}
            )
        with contextlib.suppress(SshError):
            line = shell.join(["printf", "%s\\n", f"[gpubot] {done.note}"])
            runner.run(target, f"{line} >> {shell.path(log_path)}", timeout=30)


# torchrun's rendezvous port on node 0 of a run over several hosts: in a range above
# torchrun's default (29400), one that no other open run on that host has.
RENDEZVOUS_PORT_BASE = 29500
RENDEZVOUS_PORTS = 500


def rendezvous_port(run_id: int, in_use: Collection[int] = ()) -> int:
    """The run's own port (base + id mod the range), or the next one up (wrapping in the
    range) that `in_use` does not hold: two runs whose ids differ by a multiple of the
    range, with node 0 on one host at once, would otherwise both listen there and join
    each other's torchrun."""
    for step in range(RENDEZVOUS_PORTS):
        port = RENDEZVOUS_PORT_BASE + (run_id + step) % RENDEZVOUS_PORTS
        if port not in in_use:
            return port
    raise RuntimeError(f"every rendezvous port {RENDEZVOUS_PORT_BASE}+ is in use on this host")


def _ports_in_use(s: Session, host: str) -> set[int]:
    """The rendezvous ports of the open runs whose node 0 is `host` (an address)."""
    ports = set()
    for placement in s.exec(
        select(TrainingRun.placement).where(col(TrainingRun.state).in_(RUN_ON_HOST))
    ):
        where, _, port = str((placement or {}).get("rdzv") or "").rpartition(":")
        if where == host and port.isdigit():
            ports.add(int(port))
    return ports


def _node_placement(host_name: str, free: list[Gpu], run_dir: Path) -> dict[str, Any]:
    """One host's part of a run: its GPUs and where its files are."""
    return {
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
