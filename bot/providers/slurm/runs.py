"""Runs on a Slurm cluster: each one a batch job (bot.app.runs.executor.RunExecutor).

`/gpu run` (the run form, `gpubot submit`) becomes a job named `gpubot-run-<id>` that runs
`python -m training.runner` with the same arguments as on a host, in the run's directory
under the work directory (GPUBOT_SLURM_WORKDIR, which every node and the bot can read
and write), with the cluster's Python environment, prepared once per cluster under the
work directory as a host's bootstrap prepares a host. Slurm orders it among the
cluster's jobs: gpubot hands it over at once and never reorders it; while it pends,
`/gpu queue` says Slurm's reason and expected start; when it runs, its GPUs are metered
from then at the team's rate for the model. Cancel is `scancel` (SIGTERM first, so a
recipe checkpoints); a run that checkpoints is submitted requeueable. Its status file,
log and checkpoints are read where the work directory is: this machine, or the login
node over SSH.

`ClusterSeat` is how the rest of the bot reaches a node (telemetry, the idle watch):
a command runs as a step inside a running gpubot job there (`srun --jobid N --overlap`),
so it sees that job's GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bot.app.hosts.agentwatch import download_checkpoints, upload_checkpoints
from bot.app.hosts.remote import PreparedHost
from bot.app.ports import STAGE_SUBMITTED, HostSeat, Interpreter, PlaceRequest
from bot.app.runs.command import runner_command
from bot.app.runs.executor import Look, PrepareCode, StartFailed, Unavailable
from bot.domain.clock import Clock
from bot.domain.durations import format_duration
from bot.domain.errors import UserError
from bot.providers.slurm.cluster import (
    GPUBOT_PREFIXES,
    RUN_PREFIX,
    SWEEP_PREFIX,
    ClusterView,
    Snapshot,
    job_name,
)
from bot.providers.slurm.fit import Fit
from bot.providers.slurm.holds import pending_words
from bot.providers.slurm.lab import Lab, Plan
from db.models import TrainingRun
from provisioning import shell
from provisioning.hostshell import HostShell
from provisioning.slurm import (
    JobEnd,
    JobSpec,
    SlurmError,
    SlurmJob,
    SlurmUnavailable,
    StartedLine,
    parse_started,
    started_line,
)
from provisioning.ssh import RunResult, SshError, SshTarget, UploadReport
from training.exitcodes import EXIT_TIME_LIMIT
from training.status import RunStatus, parse_status

log = logging.getLogger(__name__)

# How often the watcher looks at the files the runs write (one `stat`, no RPC).
WATCH_EVERY_S = 1.0
# The least time between two reads of one job to confirm what its files said.
CONFIRM_EVERY_S = 5.0
# slurmctld looks at time limits (and sends --signal's warning) about every 30 s; a stop
# this much before the warning was due is not the warning's.
LIMIT_SLACK_S = 60


def _signal_lead_s(signal: str | None) -> int | None:
    """`B:TERM@120` → 120: how long before its limit Slurm warns the job."""
    found = re.search(r"@(\d+)$", signal or "")
    return int(found.group(1)) if found else None


# A log's last line that says the run's interpreter could not start at all.
_CANNOT_START = re.compile(r"Permission denied|No such file or directory|not found|cannot execute")


class ClusterEnv:
    """The cluster's Python for `training`, prepared once (the first run's start) and
    remembered; `prepare` is the bootstrap into the work directory, or a test's own."""

    def __init__(self, prepare: Callable[[], PreparedHost]) -> None:
        self._prepare = prepare
        self._found: PreparedHost | None = None
        self._lock = threading.Lock()

    def interpreter(self) -> Interpreter:
        with self._lock:
            if self._found is None:
                self._found = self._prepare()
            return self._found.interpreter()


class SlurmExecutor:
    """`RunExecutor` of a Slurm cluster: batch jobs it places itself, each as its owner's
    account (bot.providers.slurm.lab), in a partition that allows it."""

    places = True

    def __init__(
        self,
        cluster: ClusterView,
        lab: Lab,
        files: HostShell,
        target: SshTarget,
        *,
        workdir: str,
        env: ClusterEnv,
        clock: Clock,
        nudge: Callable[[], None],
        owner_of: Callable[[int], str | None],
        rates: Mapping[str, float],
        tz: str,
        submit_as: str = "sudo",
        array_running: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.lab = lab
        self.files = files
        self.target = target
        self.workdir = workdir
        self.env = env
        self.clock = clock
        self.nudge = nudge
        self.owner_of = owner_of
        self.rates = dict(rates)
        self.tz = tz
        self.submit_as = submit_as
        # At most this many of one sweep's runs at once (its array's %K); None: the
        # person's share of the partition's GPUs (`_throttle`).
        self.array_running = array_running
        # (array, task) → the task's own job id, once Slurm gave it one.
        self._tasks: dict[tuple[int, int], int] = {}
        self._watched: dict[int, tuple[str, ...]] = {}  # run id -> the files it writes
        self._seen: dict[str, str] = {}  # file -> its last (mtime, size)
        self._confirmed: dict[int, tuple[float, SlurmJob | None]] = {}
        self._ends: dict[str, JobEnd] = {}
        # (job, restarts) → why Slurm requeued it, read once from accounting.
        self._requeues: dict[tuple[int, int], str] = {}
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    # --- where ----------------------------------------------------------------------

    def runs_dir(self, host: str) -> Path | None:
        return Path(self.workdir) / "runs"

    def address(self, host: str) -> str:
        return host

    # --- starting -------------------------------------------------------------------

    def admit(self, request: PlaceRequest) -> str | None:
        snap = self.cluster.read()
        model = request.model
        if snap is not None and model is not None and not any(model in n.gpus for n in snap.nodes):
            return None  # not the cluster's model: the run's own checks say so
        try:
            plan = self.lab.plan(request)
        except SlurmError:  # the controller is not answering: checked at its start
            return None
        return self.lab.note(plan, request)

    def _request(self, run: TrainingRun) -> PlaceRequest:
        return PlaceRequest(
            user_key=self.owner_of(run.user_id) or "",
            gpus=run.gpu_count,
            model=run.gpu_model,
            seconds=run.max_seconds,
            place=dict(run.place or {}),
            kind="run",
        )

    def start(
        self, run: TrainingRun, placement: dict[str, Any], code: PrepareCode
    ) -> dict[str, Any]:
        assert run.id is not None
        run_dir = str(placement["dir"])
        plan = self._plan(run)
        started = f"{run_dir}/slurm.started"
        try:
            self._make_dirs(plan.person, [run_dir, str(placement["checkpoints"])], [started], 30)
            resume = run.placement.get("resume_from")
            if resume:
                upload_checkpoints(self.files, self.target, resume, str(placement["checkpoints"]))
            code(self.files, self.target, run_dir, str(placement["log"]))
            python = self.env.interpreter()
        except Exception as exc:
            raise StartFailed(exc) from exc
        fit = plan.fit
        limit = _limit(run, fit)
        if fit.nodes > 1:
            # One task a node, each the runner with its node's place in the run
            # (training.across_nodes); the batch script is the launcher on the first.
            runner = runner_command(
                run, {**placement, "gpu_indexes": []}, python.python, per_node=fit.gpus_per_node
            )
            line = shell.join([python.python, "-m", "training.across_nodes", "--"]) + " " + runner
        else:
            line = runner_command(run, {**placement, "gpu_indexes": []}, python.python)
        spec = self.lab.spec(
            plan,
            name=job_name("run", run.id),
            # exec: the batch script becomes the runner itself, so Slurm's warning before
            # the limit or a preemption (--signal=B:…, to the batch shell alone) reaches
            # it; dash would otherwise keep the shell as the runner's parent and die.
            argv=("/bin/sh", "-c", "exec " + line),
            workdir=run_dir,
            who=f"run {run.id} of {self.owner_of(run.user_id) or run.user_id}",
            gpus=fit.gpus_per_node or run.gpu_count,
            nodes=fit.nodes,
            model=run.gpu_model,
            time_limit_s=limit,
            output=str(placement["log"]),
            requeue=bool(run.checkpoints or run.recipe),
            env=python.env(),
            signal=self.lab.signal,
            started_file=started,
        )
        job_id = self._submit(spec)
        return {
            "job": int(job_id),
            "stage": STAGE_SUBMITTED,
            "as": plan.person,
            "partition": fit.partition,
            "slurm_nodes": fit.nodes,
            "limit_s": limit,
            "started_file": started,
            "submitted": self.clock.now().isoformat(),
        }

    def start_group(
        self,
        runs: Sequence[TrainingRun],
        placements: Sequence[dict[str, Any]],
        code: Callable[[int], PrepareCode],
    ) -> list[dict[str, Any]] | None:
        """A sweep's runs as one job array (`sbatch --array=0-N-1%K`): task i is runs[i],
        in its own directory, with its own log, status and started file, as a run alone
        would be; K (`_throttle`) of them at most run at once. One submission, so a
        cluster's MaxSubmitJobs or MaxArraySize refuses the sweep as one, in words."""
        first = runs[0]
        assert first.id is not None
        plan = self._plan(first)
        fit = plan.fit
        if fit.nodes > 1:
            return None  # each variant over several nodes: one job each
        root = f"{Path(str(placements[0]['dir'])).parent}/sweep-{first.id}"
        script = f"{root}/tasks.sh"
        started = [f"{p['dir']}/slurm.started" for p in placements]
        try:
            dirs = [root]
            for placement in placements:
                dirs += [str(placement["dir"]), str(placement["checkpoints"])]
            self._make_dirs(plan.person, dirs, started, 60)
            python = self.env.interpreter()
            branches = []
            for i, (run, placement) in enumerate(zip(runs, placements, strict=True)):
                assert run.id is not None
                resume = run.placement.get("resume_from")
                if resume:
                    upload_checkpoints(
                        self.files, self.target, resume, str(placement["checkpoints"])
                    )
                code(run.id)(self.files, self.target, str(placement["dir"]), str(placement["log"]))
                line = runner_command(run, {**placement, "gpu_indexes": []}, python.python)
                branches.append(
                    f"{i}) {started_line(started[i])}; cd {shell.path(str(placement['dir']))} "
                    f"&& exec {line} >> {shell.path(str(placement['log']))} 2>&1 ;;"
                )
            # exec in each branch: the task's process is the runner itself, so Slurm's
            # warning before the limit (--signal=B:…) and a cancel's SIGTERM reach it.
            # Each branch names its run's directory: how `orphan` finds a run's task.
            body = "\n".join(
                [
                    'case "${SLURM_ARRAY_TASK_ID:-}" in',
                    *branches,
                    '*) echo "gpubot: this array has no task ${SLURM_ARRAY_TASK_ID:-}" >&2; '
                    "exit 64 ;;",
                    "esac",
                    "",
                ]
            )
            self.files.write_file(self.target, script, body.encode())
        except Exception as exc:
            raise StartFailed(exc) from exc
        limit = _limit(first, fit)
        throttle = self._throttle(plan, first, len(runs))
        array = f"0-{len(runs) - 1}%{throttle}"
        spec = self.lab.spec(
            plan,
            name=f"{SWEEP_PREFIX}{first.id}",
            argv=("/bin/sh", script),
            workdir=root,
            who=(
                f"sweep {first.sweep or ''} of {self.owner_of(first.user_id) or first.user_id}: "
                f"runs {', '.join(str(r.id) for r in runs)}"
            ),
            gpus=first.gpu_count,
            model=first.gpu_model,
            time_limit_s=limit,
            # Each task's own output goes to its run's log (the script); Slurm's own
            # words about a task (a cancel, its limit) to one file a task here.
            output=f"{root}/slurm-%a.out",
            requeue=bool(first.checkpoints or first.recipe),
            env=python.env(),
            signal=self.lab.signal,
            array=array,
        )
        job_id = self._submit(spec)
        now = self.clock.now().isoformat()
        return [
            {
                "job": int(job_id),
                "array_task": i,
                "array_size": len(runs),
                "array_running": throttle,
                "stage": STAGE_SUBMITTED,
                "as": plan.person,
                "partition": fit.partition,
                "slurm_nodes": 1,
                "limit_s": limit,
                "started_file": started[i],
                "submitted": now,
            }
            for i in range(len(runs))
        ]

    def _plan(self, run: TrainingRun) -> Plan:
        """The account and job shape a start asks for: a controller that does not answer
        leaves the run in line (Unavailable), a refusal ends it with its words."""
        try:
            return self.lab.plan(self._request(run))
        except SlurmUnavailable as exc:
            raise Unavailable(f"the Slurm controller is not answering: {exc}") from None
        except (UserError, SlurmError) as exc:
            raise StartFailed(exc) from exc

    def _make_dirs(
        self, person: str, dirs: Sequence[str], started: Sequence[str], timeout: float
    ) -> None:
        """The run directories made, in one command, for the jobs of `person` to write
        in, and an earlier attempt's started files gone; SshError saying why not."""
        made = [shell.join(["mkdir", "-p", "--", *dirs])]
        if self.submit_as == "uid":  # a root bot: the directories are the owner's
            made.append(shell.join(["chown", "-R", "--", f"{person}:", *dirs]))
        else:  # the job (the owner's account) writes there through the group
            made.append(shell.join(["chmod", "2770", "--", *dirs]))
        made.append(shell.join(["rm", "-f", "--", *started]))
        done = self.files.run(self.target, " && ".join(made), timeout=timeout)
        if not done.ok:
            raise SshError(f"cannot make {dirs[0]}: {done.stderr.strip()[-200:]}")

    def _submit(self, spec: JobSpec) -> int:
        """sbatch, its failures as a start's: the controller silent, or Slurm's refusal."""
        try:
            return self.cluster.client.submit(spec, self._nodes())
        except SlurmUnavailable as exc:
            raise Unavailable(f"the Slurm controller is not answering: {exc}") from None
        except SlurmError as exc:
            raise StartFailed(exc) from exc

    def _throttle(self, plan: Plan, run: TrainingRun, size: int) -> int:
        """How many of a sweep's runs Slurm runs at once: the setting, else the
        person's share of the partition's GPUs of the model (split evenly among the
        people the bot knows on the cluster), never less than one run."""
        if self.array_running:
            return max(1, min(size, self.array_running))
        snap = self.cluster.read()
        gpus = 0
        if snap is not None:
            for node in snap.nodes:
                if plan.fit.partition and plan.fit.partition not in node.partitions:
                    continue
                gpus += node.gpus.get(run.gpu_model, 0) if run.gpu_model else node.gpu_count
        people = max(1, len(set(self.lab.users.values())))
        share = gpus // people // max(1, run.gpu_count)
        return max(1, min(size, share))

    def _nodes(self) -> Any:
        snap = self.cluster.read()
        return list(snap.nodes) if snap is not None else None

    def stop_started(self, placement: dict[str, Any]) -> None:
        with contextlib.suppress(SlurmError):
            self.cluster.client.cancel(
                int(placement["job"]), user=placement.get("as"), task=_task_index(placement)
            )

    def started(self, placement: dict[str, Any]) -> bool:
        return isinstance(placement.get("job"), int)

    def withdraw(self, placement: dict[str, Any]) -> bool | None:
        """Takes the run's job out of the cluster's queue if it still waits there (its
        owner took the cloud instead): True when it is gone without having started,
        False when the cluster started it first (it keeps it), None when the controller
        cannot say now. The controller decides between the two, so never both."""
        job_id = placement.get("job")
        if not isinstance(job_id, int):
            return None  # its submission is still under way
        person = placement.get("as")
        task = _task_index(placement)
        try:
            self.cluster.client.cancel(job_id, user=person, pending_only=True, task=task)
            if task is None:
                job = self.cluster.client.job(job_id)
            else:  # its own id, if it started; else it is one of the array's pending
                snap = self.cluster.read(fresh=True)
                own, job = self._task_of(placement, snap, self._start_line(placement))
                if job is not None and own is None and task in job.array_pending:
                    return None  # still pending in its array as the controller sees it
                if own is None and job is None:
                    return True  # cancelled before it ever had a job of its own
        except SlurmError as exc:
            log.warning("could not withdraw Slurm job %s: %s", job_id, exc)
            return None
        # Cancelled while pending: no node was ever allocated to it.
        if job is None or (job.state == "CANCELLED" and not job.nodes):
            return True
        if job.state == "PENDING":
            return None  # not yet cancelled as the controller sees it; asked again
        return False

    def orphan(self, placement: dict[str, Any]) -> dict[str, Any] | bool | None:
        """A run whose submission a dead worker never recorded: its job, found by name."""
        snap = self.cluster.read(fresh=True)
        if snap is None or self.cluster.down_since is not None:
            return False
        run_id = Path(str(placement.get("dir", ""))).name
        mine = [j for j in snap.jobs if j.name == f"{RUN_PREFIX}{run_id}" and not j.finished]
        if mine:
            return {"job": mine[0].job_id, "as": mine[0].user or None}
        return self._orphan_task(placement, snap)

    def _orphan_task(self, placement: dict[str, Any], snap: Snapshot) -> dict[str, Any] | None:
        """A sweep's run in an array a dead worker submitted: its task is the branch of
        the array's script (`start_group`) that goes into the run's directory."""
        arrays = {
            j.array_job_id or j.job_id: j
            for j in snap.jobs
            if j.name.startswith(SWEEP_PREFIX) and not j.finished
        }
        wanted = f"cd {shell.path(str(placement.get('dir', '')))} "
        for array, job in arrays.items():
            first = job.name.removeprefix(SWEEP_PREFIX)
            script = f"{Path(str(placement.get('dir', ''))).parent}/sweep-{first}/tasks.sh"
            try:
                raw = self.files.read_file(self.target, script)
            except SshError:
                continue
            for branch in (raw or b"").decode("utf-8", "replace").splitlines():
                index, _, rest = branch.partition(") ")
                if index.isdigit() and wanted in rest:
                    return {
                        "job": array,
                        "array_task": int(index),
                        "as": job.user or None,
                        "started_file": f"{placement.get('dir')}/slurm.started",
                    }
        return None

    # --- looking and stopping -------------------------------------------------------

    def _start_line(self, placement: dict[str, Any]) -> StartedLine | None:
        """This attempt's start as the job wrote it (a requeued job appends a line with
        its restart count; an earlier attempt's line is not this one's)."""
        path = placement.get("started_file")
        if not path:
            return None
        raw = self.files.read_file(self.target, str(path))
        line = parse_started(raw.decode("utf-8", "replace")) if raw else None
        if line is None:
            return None
        # An array task's line has the task's own id (each run's file is its own).
        if _task_index(placement) is None and line.job_id != int(placement["job"]):
            return None
        return line if line.restarts >= int(placement.get("requeued") or 0) else None

    def _newest(self, job_id: int, snap: Snapshot) -> SlurmJob | None:
        """The job as last seen: a confirmation newer than the shared read wins (so a
        start confirmed once is not read again until the shared read catches up);
        confirmations the shared read has overtaken are dropped."""
        job = next((j for j in snap.jobs if j.job_id == job_id), None)
        with self._lock:
            for key in [k for k, (at, _) in self._confirmed.items() if at <= snap.at]:
                del self._confirmed[key]
            held = self._confirmed.get(job_id)
        return held[1] if held is not None else job

    def _task_of(
        self, placement: dict[str, Any], snap: Snapshot | None, line: StartedLine | None
    ) -> tuple[int | None, SlurmJob | None]:
        """An array task's own job id (None while it pends in its array's record,
        which Slurm splits a task off only as it starts it) and the newest sight of
        it: its own record, else the array's pending record that stands for it."""
        array, task = int(placement["job"]), int(placement["array_task"])
        with self._lock:
            own = self._tasks.get((array, task))
        if own is None and line is not None:
            own = line.job_id
        if own is None and snap is not None:
            own = next(
                (
                    j.job_id
                    for j in snap.jobs
                    if j.array_job_id == array and j.array_task_id == task
                ),
                None,
            )
        if own is not None:
            with self._lock:
                self._tasks[(array, task)] = own
            return own, self._newest(own, snap) if snap is not None else None
        if snap is None:
            return None, None
        pending = next(
            (
                j
                for j in snap.jobs
                if array in (j.job_id, j.array_job_id) and task in j.array_pending
            ),
            None,
        )
        return None, pending

    def _job_of(self, placement: dict[str, Any], line: StartedLine | None) -> SlurmJob | None:
        """The run's job as the shared read has it: its own, or its task of an array
        (`line`, its started line, names a started task's own id where the read is old)."""
        if _task_index(placement) is None:
            return self.cluster.job(int(placement["job"]))
        return self._task_of(placement, self.cluster.read(), line)[1]

    def _confirm(self, job_id: int, job: SlurmJob | None) -> SlurmJob | None:
        """One read of the job (a file said it started or ended and `job`, the newest
        sight of it, does not agree), at most every CONFIRM_EVERY_S per job: the end a
        status file says is Slurm's too."""
        now = time.monotonic()
        with self._lock:
            held = self._confirmed.get(job_id)
        if held is not None and now - held[0] < CONFIRM_EVERY_S:
            return job
        job = self.cluster.job_now(job_id)
        with self._lock:
            self._confirmed[job_id] = (now, job)
        return job

    def look(self, placement: dict[str, Any]) -> Look:
        snap = self.cluster.read()
        if snap is None or self.cluster.down_since is not None:
            raise SshError(f"the Slurm controller is not answering ({self.cluster.down_reason})")
        job_id = int(placement["job"])
        raw = self.files.read_file(self.target, str(placement["status"]))
        status = parse_status(raw.decode("utf-8", "replace")) if raw else None
        line = self._start_line(placement)
        own: int | None = job_id
        if _task_index(placement) is not None:
            own, job = self._task_of(placement, snap, line)
        else:
            job = self._newest(job_id, snap)
        if job is None and line is None and _after(placement.get("submitted"), snap.taken):
            return Look(alive=True, status=None, waiting=STAGE_SUBMITTED)
        # The files are newer than the shared read when they say it started (and the read
        # has it pending, or not yet) or ended (and the read has it running): one read of
        # the job confirms it. A job Slurm no longer lists has ended.
        finished = status is not None and status.exit_code is not None
        stale_start = line is not None and (job is None or job.state == "PENDING")
        stale_end = finished and job is not None and not job.finished
        if (stale_start or stale_end) and own is not None:
            job = self._confirm(own, job)
        if (
            job is not None
            and job.state == "PENDING"
            and (line is None or job.restarts > line.restarts)
        ):
            now = self.clock.now()
            expected = job.start_time if job.start_time and job.start_time > now else None
            waiting = pending_words(job, now, self.tz)
            if own is None:  # a task of a sweep's array that Slurm has not started
                waiting = self._array_words(placement, job, now)
            if line is not None:  # it ran, and Slurm put it back: say why
                waiting = f"{self._requeued_words(job, snap)}; {waiting}"
            return Look(alive=True, status=None, waiting=waiting, expected_start=expected)
        spans = int(placement.get("slurm_nodes") or 1) > 1
        if spans and line is not None and (job is None or len(job.gpu_indexes) < 2):
            job = self._confirm(job_id, job)  # the started line names the first node only
        if spans and job is not None and len(job.gpu_indexes) > 1:
            where: tuple[tuple[str, tuple[int, ...]], ...] = tuple(
                (node, tuple(ix)) for node, ix in job.gpu_indexes.items()
            )
            started_at = line.started_at if line is not None else job.start_time
        elif line is not None:
            where = ((line.node, line.gpu_indexes),)
            started_at = line.started_at
        elif job is not None and job.gpu_indexes:
            where = tuple((node, tuple(ix)) for node, ix in job.gpu_indexes.items())
            started_at = job.start_time
        else:
            where, started_at = (), None
        alive = job is not None and not job.finished
        if (
            spans
            and alive
            and "host" not in placement
            and len(where) < int(placement["slurm_nodes"])
        ):
            # Started on its first node, the others not yet seen: metered once all are.
            # (Not once it runs: a node that dies drops out of the job's listing first.)
            return Look(alive=True, status=None, waiting=f"Slurm is starting job {job_id}")
        model = job.gpu_model if job is not None else None
        rate = self.rates.get(model or "") if model else None
        if rate is None and where:
            rate = next(iter(self.rates.values()), None) if len(self.rates) == 1 else None
        ended = None if alive else self._ending(placement, job, status)
        if not alive and status is not None and self._warned_of_limit(placement, line, status):
            # Slurm's warning before its limit (--signal) looks like a preemption to the
            # runner (SIGTERM: save, exit 75); near the limit it was the limit: the run
            # ends there, with its checkpoint kept for `/gpu run --resume`.
            status = dataclasses.replace(status, state="time_limit", exit_code=EXIT_TIME_LIMIT)
            limit = format_duration(timedelta(seconds=int(placement.get("limit_s") or 0)))
            ended = f"Slurm's limit in partition {placement.get('partition', '?')}, {limit}"
        return Look(
            alive=alive,
            status=status,
            where=where,
            usd_per_gpu_hour=rate or 0.0,
            started_at=started_at,
            ended=ended,
        )

    def _requeued_words(self, job: SlurmJob, snap: Snapshot) -> str:
        """Why Slurm put a started job back in its queue, from accounting's record of
        the start that ended (`sacct -D`, read once per requeue): a node that failed
        is named (the one the controller marks down, of the attempt's nodes)."""
        key = (job.job_id, job.restarts)
        with self._lock:
            known = self._requeues.get(key)
        if known is not None:
            return known
        try:
            ends = [e for e in self.cluster.client.attempts(job.job_id) if e.end_time]
        except SlurmError as exc:
            log.warning("could not read why Slurm requeued job %s: %s", job.job_id, exc)
            ends = []
        words = f"Slurm requeued job {job.job_id}"
        if ends and ends[-1].state == "NODE_FAIL":
            nodes = self._failed_nodes(ends[-1].nodes, snap)
            words = f"node {', '.join(nodes)} failed (NODE_FAIL) and {words}"
        elif ends and ends[-1].state == "PREEMPTED":
            words = f"{words} (preempted)"
        with self._lock:
            self._requeues[key] = words
        return words

    @staticmethod
    def _failed_nodes(nodes: Sequence[str], snap: Snapshot | None) -> list[str]:
        """Of a job's nodes, those the controller has down (the one that failed); all of
        them when none is down now (back already, or not listed)."""
        known = {n.name: n for n in snap.nodes} if snap is not None else {}
        down = [n for n in nodes if n in known and known[n].state == "down"]
        return down or list(nodes)

    def _warned_of_limit(
        self, placement: dict[str, Any], line: StartedLine | None, status: RunStatus
    ) -> bool:
        """The runner stopped on SIGTERM (exit 75) at about the time Slurm warns of its
        limit (--signal's lead before `limit_s`, give or take slurmctld's 30-s check)."""
        if status.state != "preempted" or line is None or line.started_at is None:
            return False
        lead = _signal_lead_s(self.lab.signal)
        limit = int(placement.get("limit_s") or 0)
        if lead is None or not limit or status.heartbeat_at is None:
            return False
        ran = status.heartbeat_at - line.started_at.timestamp()
        return ran >= limit - lead - LIMIT_SLACK_S

    def _ending(
        self, placement: dict[str, Any], job: SlurmJob | None, status: RunStatus | None
    ) -> str | None:
        """How Slurm ended the job, in words, where it was not the run's own finish: its
        state from accounting (TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, CANCELLED by whom, …),
        and, when the runner never wrote a status, the log's last line (an interpreter
        that could not start)."""
        end = self._final(placement, job)
        state = end.state if end is not None else (job.state if job is not None else "")
        words = ""
        if state and state != "COMPLETED":
            who = ""
            if end is not None and end.by.isdigit():
                who = f" by {self.cluster.client.user_name(int(end.by))}"
            words = f"Slurm ended its job {_ref(placement)}: {state}{who}"
            if state == "TIMEOUT":
                words += f" (its time limit in partition {placement.get('partition', '?')})"
            if state == "NODE_FAIL" and end is not None and end.nodes:
                failed = self._failed_nodes(end.nodes, self.cluster.read())
                words += f" (node {', '.join(failed)} failed)"
        if status is None:
            with contextlib.suppress(SshError):
                tail = self.files.tail(self.target, str(placement["log"]), 5).strip()
                last = tail.splitlines()[-1] if tail else ""
                if last and _CANNOT_START.search(last):
                    reason = f"the run's Python could not start as {placement.get('as')}: {last}"
                    words = f"{words}; {reason}" if words else reason
        return words or None

    def _final(self, placement: dict[str, Any], job: SlurmJob | None) -> JobEnd | None:
        """Slurm's record of the job's end: accounting (sacct) first, else squeue's."""
        job_id, task = int(placement["job"]), _task_index(placement)
        if task is not None:
            with self._lock:
                own = self._tasks.get((job_id, task))
            if own is None and job is not None and job.array_task_id == task:
                own = job.job_id
            if own is None:
                job = None  # the array's pending record is not this task's end
            else:
                job_id, task = own, None
        ref = f"{job_id}_{task}" if task is not None else str(job_id)
        with self._lock:
            kept = self._ends.get(ref)
        if kept is not None:
            return kept
        try:
            end = self.cluster.client.final_state(job_id, task)
        except SlurmError as exc:
            log.warning("could not read the end of Slurm job %s: %s", ref, exc)
            end = None
        if end is None and job is not None and job.finished:
            end = JobEnd(
                job_id=job_id,
                state=job.state,
                exit_code=job.exit_code,
                signal=job.signal,
                start_time=job.start_time,
                end_time=job.end_time,
                source="squeue",
            )
        if end is not None and end.state not in ("RUNNING", "PENDING", "REQUEUED"):
            with self._lock:
                self._ends[ref] = end
        return end

    def failed_node(self, placement: dict[str, Any]) -> str | None:
        return None  # one job on one node or several: Slurm ends it whole (NODE_FAIL)

    def signal(self, placement: dict[str, Any], signal: str, *, others_only: bool = False) -> None:
        if others_only:
            return
        task = _task_index(placement)
        job = self._job_of(placement, self._start_line(placement) if task is not None else None)
        person = placement.get("as")
        try:
            if signal == "KILL" or job is None or job.state == "PENDING":
                self.cluster.client.cancel(int(placement["job"]), user=person, task=task)
            else:  # SIGTERM to the runner: a recipe checkpoints and exits
                # Over several nodes, to the batch script alone: srun would turn it into
                # SIGKILL for every node; training.across_nodes passes it on as SIGTERM.
                spans = int(placement.get("slurm_nodes") or 1) > 1
                self.cluster.client.cancel(
                    int(placement["job"]), signal=signal, user=person, batch_only=spans, task=task
                )
        except SlurmUnavailable as exc:
            raise SshError(f"the Slurm controller is not answering: {exc}") from None
        except SlurmError as exc:
            raise SshError(str(exc)) from None

    def signal_group(self, placements: Sequence[dict[str, Any]], signal: str) -> bool:
        """Every open run of one sweep's array, signalled as one: the tasks that have not
        started are cancelled first (so none starts meanwhile), then the running tasks'
        runners get `signal` (a recipe checkpoints and exits): two scancel calls
        whatever the sweep's size; one (the whole array) for KILL."""
        arrays = {int(p["job"]) for p in placements}
        if len(arrays) != 1 or any(_task_index(p) is None for p in placements):
            return False
        array = arrays.pop()
        person = placements[0].get("as")
        client = self.cluster.client
        try:
            if signal == "KILL":
                client.cancel(array, user=person)
            else:
                client.cancel(array, user=person, pending_only=True)
                client.cancel(array, signal=signal, user=person, running_only=True)
        except SlurmUnavailable as exc:
            raise SshError(f"the Slurm controller is not answering: {exc}") from None
        except SlurmError as exc:
            raise SshError(str(exc)) from None
        return True

    def _array_words(self, placement: dict[str, Any], job: SlurmJob, now: datetime) -> str:
        """Why a sweep's run still waits in its array, in `/gpu queue`'s words."""
        ref = _ref(placement)
        if job.reason == "JobArrayTaskLimit":
            running = placement.get("array_running") or job.array_max_running
            return (
                f"Slurm job {ref} waits for its sweep: at most {running} of its "
                f"{placement.get('array_size', '?')} runs at once"
            )
        words = pending_words(job, now, self.tz)
        return words.replace(f"Slurm job {job.job_id} ", f"Slurm job {ref} ", 1)

    def tail(self, placement: dict[str, Any], lines: int) -> str:
        return self.files.tail(self.target, str(placement["log"]), lines)

    def save_checkpoint(self, placement: dict[str, Any], local: Path) -> int:
        return download_checkpoints(self.files, self.target, str(placement["checkpoints"]), local)

    def forget_attempt(self, placement: dict[str, Any]) -> None:
        with contextlib.suppress(SshError):
            line = shell.join(["rm", "-f", "--", str(placement["status"])])
            self.files.run(self.target, line, timeout=30)

    def tend(self, records: Any) -> None:
        return None  # the cluster's upkeep is the provider's (bot.providers.slurm)

    # --- watching -------------------------------------------------------------------

    def watch(self, run_id: int, placement: dict[str, Any], figures_due: bool) -> None:
        if not self.started(placement):
            return
        files = tuple(str(p) for p in (placement.get("status"), placement.get("started_file")) if p)
        with self._lock:
            self._watched[run_id] = files
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(
                    target=self._watch_loop, name="slurm-watch", daemon=True
                )
                self._watcher.start()

    def keep_watching(self, run_ids: Iterable[int]) -> None:
        wanted = set(run_ids)
        with self._lock:
            for rid in [r for r in self._watched if r not in wanted]:
                del self._watched[rid]

    def free_mb(self, placement: dict[str, Any]) -> float | None:
        return None  # the cluster's disks are its admins' (a job's own error says)

    def watched(self, run_id: int, placement: dict[str, Any]) -> bool:
        # Its look is one cached squeue read for all jobs (not one SSH read a run): the
        # poll looks at every job each tick.
        return False

    def ended_at(self, run_id: int, placement: dict[str, Any]) -> datetime | None:
        """Slurm's own end of the job (accounting, else squeue): what its GPUs are billed
        to, also when the bot was down across it."""
        if not self.started(placement):
            return None
        end = self._final(placement, self._job_of(placement, None))
        return end.end_time if end is not None else None

    def _watch_loop(self) -> None:
        """One thread for every watched run: once a second, one `stat` of the files the
        runs write (their status and started files, in the shared work directory); a
        change asks for a tick. No RPC: what only Slurm knows (a job it ended itself) is
        seen at the shared read of the cluster, once a cache period."""
        while True:
            with self._lock:
                files = [f for fs in self._watched.values() for f in fs]
            if not files:
                return
            line = "stat -c '%Y.%s %n' -- " + " ".join(shell.path(f) for f in files)
            try:
                out = self.files.run(self.target, line + " 2>/dev/null", timeout=30).stdout
            except SshError:
                out = ""
            seen = dict(ln.split(" ", 1)[::-1] for ln in out.splitlines() if " " in ln)
            with self._lock:
                changed = any(self._seen.get(f) != v for f, v in seen.items())
                self._seen = seen
            if changed:
                self.nudge()
            time.sleep(WATCH_EVERY_S)


def _limit(run: TrainingRun, fit: Fit) -> int:
    """The job's time limit: the partition's choice, or where the run asked `--max` (the
    runner stops itself there) a little later than that."""
    limit = fit.time_limit_s
    if run.max_seconds and not fit.defaulted:
        limit = min(limit + 300, fit.max_time_s or limit + 300)
    return limit


def _task_index(placement: Mapping[str, Any]) -> int | None:
    """The run's task in its sweep's job array; None for a job of its own."""
    task = placement.get("array_task")
    return task if isinstance(task, int) else None


def _ref(placement: Mapping[str, Any]) -> str:
    """The run's job as Slurm's tools name it: `123`, or `123_4` for an array's task."""
    task = _task_index(placement)
    return f"{placement['job']}_{task}" if task is not None else str(placement["job"])


def _after(iso: object, taken: datetime) -> bool:
    """Whether a job's submission (its ISO time) came after a shared read of the cluster."""
    if not isinstance(iso, str):
        return False
    try:
        return datetime.fromisoformat(iso) >= taken
    except ValueError:
        return False


class ClusterSeat:
    """`HostAccess` of a cluster's nodes: a command on a node runs as a step inside a
    running gpubot job there (`srun --jobid N --overlap`), seeing that job's GPUs; files
    are read where the work directory is."""

    def __init__(
        self,
        cluster: ClusterView,
        files: HostShell,
        target: SshTarget,
        env: ClusterEnv,
        workdir: str,
    ) -> None:
        self.cluster = cluster
        self.files = files
        self.target = target
        self.env = env
        self.workdir = workdir

    def runner_for(self, host_name: str) -> HostSeat | None:
        seats = self.seats_for(host_name)
        return seats[0] if seats else None

    def seats_for(self, host_name: str) -> list[HostSeat]:
        """A seat per running gpubot job on the node (runs and reservations' holding
        jobs), each a step inside that job: on a cluster with ConstrainDevices a step
        sees its job's GPUs alone, renumbered from 0, and `gpu_map` maps them back."""
        snap = self.cluster.read()
        if snap is None or self.cluster.down_since is not None:
            return []
        return [
            HostSeat(
                _StepRunner(self.cluster, self.files, job.job_id, host_name, job.user or None),
                self.target,
                Path(self.workdir) / "runs",
                self.env.interpreter,
                gpu_map=tuple(sorted(job.gpu_indexes[host_name])),
            )
            for job in snap.jobs
            if job.state == "RUNNING"
            and host_name in job.gpu_indexes
            and job.name.startswith(GPUBOT_PREFIXES)
        ]


class _StepRunner:
    """An HostShell whose commands run as steps of one job on one node; its file
    operations are the work directory's (the files runner)."""

    def __init__(
        self, cluster: ClusterView, files: HostShell, job_id: int, node: str, owner: str | None
    ) -> None:
        self.cluster = cluster
        self.files = files
        self.job_id = job_id
        self.node = node
        self.owner = owner  # the job's account: a step in it is that account's

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        line = shell.env_prefix(env) + (shell.in_dir(cwd, command) if cwd else command)
        try:
            return self.cluster.client.run_in_job(
                self.job_id,
                ["/bin/sh", "-c", line],
                node=self.node,
                timeout=timeout,
                user=self.owner,
            )
        except SlurmError as exc:
            raise SshError(str(exc)) from None

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        return self.files.upload_dir(target, local_dir, remote_dir, exclude=exclude)

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None:
        self.files.put_file(target, local_path, remote_path, mode=mode)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self.files.write_file(target, remote_path, data, mode=mode)

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        return self.files.read_file(target, path, max_bytes=max_bytes)

    def start_detached(
        self,
        target: SshTarget,
        command: str,
        log_path: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pid_file: str | None = None,
    ) -> int:
        raise SshError("a cluster's node runs nothing detached outside its jobs")

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return self.files.tail(target, path, lines)

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        return False

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        return False

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        return True

    def close(self, target: SshTarget | None = None) -> None:
        return None
