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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bot.app.agentwatch import download_checkpoints, upload_checkpoints
from bot.app.ports import HostSeat, Interpreter
from bot.app.remote import PreparedHost
from bot.app.runs.command import runner_command
from bot.app.runs.executor import Look, PrepareCode, StartFailed, Unavailable
from bot.domain.clock import Clock
from bot.providers.slurm.cluster import RUN_PREFIX, ClusterView, gpubot_id, job_name
from bot.providers.slurm.holds import pending_words
from db.models import TrainingRun
from provisioning import shell
from provisioning.slurm import JobSpec, SlurmError, SlurmJob, SlurmUnavailable
from provisioning.ssh import RunResult, SshError, SshRunner, SshTarget, UploadReport
from training.status import parse_status

log = logging.getLogger(__name__)

# A run without --max is given this long by Slurm (a cluster needs a time limit).
DEFAULT_LIMIT_S = 24 * 3600
# How often a watcher looks at the cluster while gpubot jobs are watched.
WATCH_EVERY_S = 1.0


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
    """`RunExecutor` of a Slurm cluster: batch jobs it places itself."""

    places = True

    def __init__(
        self,
        cluster: ClusterView,
        files: SshRunner,
        target: SshTarget,
        *,
        workdir: str,
        env: ClusterEnv,
        clock: Clock,
        nudge: Callable[[], None],
        owner_of: Callable[[int], str | None],
        rates: Mapping[str, float],
        users: Mapping[str, str],
        partitions: Sequence[str],
        tz: str,
    ) -> None:
        self.cluster = cluster
        self.files = files
        self.target = target
        self.workdir = workdir
        self.env = env
        self.clock = clock
        self.nudge = nudge
        self.owner_of = owner_of
        self.rates = dict(rates)
        self.users = dict(users)
        self.partitions = tuple(partitions)
        self.tz = tz
        self._watched: dict[int, tuple[int, str]] = {}  # run id → (job id, last state)
        self._ended: dict[int, datetime] = {}
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    # --- where ----------------------------------------------------------------------

    def runs_dir(self, host: str) -> Path | None:
        return Path(self.workdir) / "runs"

    def address(self, host: str) -> str:
        return host

    # --- starting -------------------------------------------------------------------

    def start(
        self, run: TrainingRun, placement: dict[str, Any], code: PrepareCode
    ) -> dict[str, Any]:
        assert run.id is not None
        run_dir = str(placement["dir"])
        user = self.users.get(self.owner_of(run.user_id) or "")
        try:
            made = [shell.join(["mkdir", "-p", "--", run_dir, str(placement["checkpoints"])])]
            if user:  # the job runs as the owner's account: its directory is theirs
                made.append(shell.join(["chown", "-R", "--", f"{user}:", run_dir]))
            done = self.files.run(self.target, " && ".join(made), timeout=30)
            if not done.ok:
                raise SshError(f"cannot make {run_dir}: {done.stderr.strip()[-200:]}")
            resume = run.placement.get("resume_from")
            if resume:
                upload_checkpoints(self.files, self.target, resume, str(placement["checkpoints"]))
            code(self.files, self.target, run_dir, str(placement["log"]))
            python = self.env.interpreter()
        except Exception as exc:
            raise StartFailed(exc) from exc
        limit = (run.max_seconds + 300) if run.max_seconds else DEFAULT_LIMIT_S
        line = runner_command(run, {**placement, "gpu_indexes": []}, python.python)
        spec = JobSpec(
            name=job_name("run", run.id),
            argv=("/bin/sh", "-c", line),
            workdir=run_dir,
            time_limit_s=limit,
            gpus=run.gpu_count,
            gpu_type=run.gpu_model,
            partition=",".join(self.partitions) or None,
            output=str(placement["log"]),
            requeue=bool(run.checkpoints or run.recipe),
            env=python.env(),
            user=user,
        )
        try:
            job_id = self.cluster.client.submit(spec, self._nodes())
        except SlurmUnavailable as exc:
            raise Unavailable(f"the Slurm controller is not answering: {exc}") from None
        except SlurmError as exc:
            raise StartFailed(exc) from exc
        self.cluster.forget()
        return {"job": int(job_id), "stage": "submitted to Slurm"}

    def _nodes(self) -> Any:
        snap = self.cluster.read()
        return list(snap.nodes) if snap is not None else None

    def stop_started(self, placement: dict[str, Any]) -> None:
        with contextlib.suppress(SlurmError):
            self.cluster.client.cancel(int(placement["job"]))

    def started(self, placement: dict[str, Any]) -> bool:
        return isinstance(placement.get("job"), int)

    def orphan(self, placement: dict[str, Any]) -> dict[str, Any] | bool | None:
        """A run whose submission a dead worker never recorded: its job, found by name."""
        snap = self.cluster.read(fresh=True)
        if snap is None or self.cluster.down_since is not None:
            return False
        run_id = Path(str(placement.get("dir", ""))).name
        mine = [j for j in snap.jobs if j.name == f"{RUN_PREFIX}{run_id}" and not j.finished]
        return {"job": mine[0].job_id} if mine else None

    # --- looking and stopping -------------------------------------------------------

    def _job(self, placement: dict[str, Any]) -> SlurmJob | None:
        return self.cluster.job(int(placement["job"]))

    def look(self, placement: dict[str, Any]) -> Look:
        snap = self.cluster.read()
        if snap is None or self.cluster.down_since is not None:
            raise SshError(f"the Slurm controller is not answering ({self.cluster.down_reason})")
        job = self._job(placement)
        if job is not None and job.state == "PENDING":
            return Look(
                alive=True, status=None, waiting=pending_words(job, self.clock.now(), self.tz)
            )
        where = tuple((node, tuple(ix)) for node, ix in (job.gpu_indexes.items() if job else ()))
        model = job.gpu_model if job is not None else None
        rate = self.rates.get(model) if model else None
        alive = job is not None and not job.finished
        raw = self.files.read_file(self.target, str(placement["status"]))
        status = parse_status(raw.decode("utf-8", "replace")) if raw else None
        return Look(alive=alive, status=status, where=where, usd_per_gpu_hour=rate or 0.0)

    def failed_node(self, placement: dict[str, Any]) -> str | None:
        return None  # one job, one node: Slurm ends it whole

    def signal(self, placement: dict[str, Any], signal: str, *, others_only: bool = False) -> None:
        if others_only:
            return
        job = self._job(placement)
        try:
            if signal == "KILL" or job is None or job.state == "PENDING":
                self.cluster.client.cancel(int(placement["job"]))
            else:  # SIGTERM to the runner: a recipe checkpoints and exits
                self.cluster.client.cancel(int(placement["job"]), signal=signal)
        except SlurmUnavailable as exc:
            raise SshError(f"the Slurm controller is not answering: {exc}") from None
        except SlurmError as exc:
            raise SshError(str(exc)) from None
        self.cluster.forget()

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
        with self._lock:
            if run_id not in self._watched and run_id not in self._ended:
                self._watched[run_id] = (int(placement["job"]), "")
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
            for rid in [r for r in self._ended if r not in wanted]:
                del self._ended[rid]

    def ended_at(self, run_id: int, placement: dict[str, Any]) -> datetime | None:
        with self._lock:
            seen = self._ended.get(run_id)
        if seen is not None:
            return seen
        job = self._job(placement) if self.started(placement) else None
        return job.end_time if job is not None and job.finished else None

    def _watch_loop(self) -> None:
        """One thread for every watched job: a fresh read about once a second while any
        is watched; a job that starts or ends asks for a tick (its end time, Slurm's
        own, is what its GPUs are billed to)."""
        while True:
            with self._lock:
                watched = dict(self._watched)
            if not watched:
                return
            snap = self.cluster.read(fresh=True)
            changed = False
            if snap is not None and self.cluster.down_since is None:
                jobs = {j.job_id: j for j in snap.jobs}
                with self._lock:
                    for rid, (job_id, last) in watched.items():
                        job = jobs.get(job_id)
                        state = job.state if job is not None else "GONE"
                        if state == last or rid not in self._watched:
                            continue
                        self._watched[rid] = (job_id, state)
                        changed = changed or last != ""
                        if job is None or job.finished:
                            end = job.end_time if job is not None else None
                            self._ended[rid] = end or self.clock.now()
                            del self._watched[rid]
                            changed = True
                        elif state == "RUNNING":
                            changed = True
            if changed:
                self.nudge()
            time.sleep(WATCH_EVERY_S)


class ClusterSeat:
    """`HostAccess` of a cluster's nodes: a command on a node runs as a step inside a
    running gpubot job there (`srun --jobid N --overlap`), seeing that job's GPUs; files
    are read where the work directory is."""

    def __init__(
        self,
        cluster: ClusterView,
        files: SshRunner,
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
        snap = self.cluster.read()
        if snap is None or self.cluster.down_since is not None:
            return None
        job = next(
            (
                j
                for j in snap.jobs
                if j.state == "RUNNING"
                and host_name in j.gpu_indexes
                and (gpubot_id(j, RUN_PREFIX) is not None or j.name.startswith("gpubot-res-"))
            ),
            None,
        )
        if job is None:
            return None
        runner = _StepRunner(self.cluster, self.files, job.job_id, host_name)
        return HostSeat(runner, self.target, Path(self.workdir) / "runs", self.env.interpreter)


class _StepRunner:
    """An SshRunner whose commands run as steps of one job on one node; its file
    operations are the work directory's (the files runner)."""

    def __init__(self, cluster: ClusterView, files: SshRunner, job_id: int, node: str) -> None:
        self.cluster = cluster
        self.files = files
        self.job_id = job_id
        self.node = node

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
                self.job_id, ["/bin/sh", "-c", line], node=self.node, timeout=timeout
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
