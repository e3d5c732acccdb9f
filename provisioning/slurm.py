"""A lab's Slurm cluster, read and driven through Slurm's own command-line tools.

The bot never links Slurm: it runs `sinfo`, `squeue`, `sbatch`, `scontrol`, `scancel`
(and `sacct` where the cluster keeps accounting) on its own machine, or over SSH on a
login node, and `provisioning.slurm_parse` turns what they print into plain dataclasses
(re-exported here). Rules:

- Every command has a timeout. A controller that does not answer makes client tools
  retry for many seconds (9 s for a refused connection, longer for a silent host), so
  the timeout is what bounds a status request; either way it is `SlurmUnavailable`.
- `SLURM_CONF` is honoured as Slurm's tools honour it: given (or read from the bot's
  environment), it is put in each command's environment, and over SSH in the remote
  command's `env` prefix (SSH does not pass it). Nothing else of the bot's environment
  reaches a command: a job must never see the bot's secrets, and an `SBATCH_*` or
  `SQUEUE_*` variable of the bot's must not change what a command means.
- Shell words are built only by `provisioning.shell`.
- Finished jobs: squeue shows them for MinJobAge (default 300 s) after their end;
  later `final_state` asks `sacct` (a real cluster's answer: slurmdbd keeps every job)
  and falls back to the jobcomp/filetxt file where the bot can read it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from provisioning import shell
from provisioning.base import ProvisioningError
from provisioning.hostshell import HostShell
from provisioning.slurm_parse import (
    FINISHED_STATES,
    NODE_STATES,
    Associations,
    JobEnd,
    SlurmJob,
    SlurmNode,
    SlurmPartition,
    format_duration,
    gres_type_for,
    load_json,
    model_of,
    parse_array_tasks,
    parse_associations,
    parse_indexes,
    parse_job_gpu_indexes,
    parse_jobcomp,
    parse_jobs,
    parse_nodes,
    parse_partitions,
    parse_sacct,
    parse_sacct_attempts,
    parse_time_s,
)
from provisioning.ssh import RunResult, SshError, SshTarget

__all__ = [
    "FINISHED_STATES",
    "NODE_STATES",
    "Associations",
    "JobEnd",
    "JobSpec",
    "SlurmClient",
    "SlurmError",
    "SlurmJob",
    "SlurmNode",
    "SlurmPartition",
    "SlurmUnavailable",
    "StartedLine",
]

DEFAULT_TIMEOUT_S = 15.0
# JobIDRaw: an array task's own id; JobID (last) its "ARRAY_TASK", which is all the bot
# knows of a task cancelled before it started.
SACCT_FIELDS = "JobIDRaw,JobName,User,Partition,State,ExitCode,Start,End,NodeList,AllocTRES,JobID"
SUBMIT_MODES = ("sudo", "uid")
# What Slurm's tools need of the bot's environment through sudo.
_KEPT_THROUGH_SUDO = "SLURM_CONF,SLURM_TIME_FORMAT"
# What client tools print when the controller does not answer.
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Zero Bytes were transmitted"
    r"|Communication connection failure|Connection refused",
    re.IGNORECASE,
)


# What sudo says when it will not run a command as someone (no rule, a password asked).
_SUDO_REFUSED = re.compile(
    r"^sudo: |is not allowed to execute|not in the sudoers|password is required", re.MULTILINE
)


class SlurmError(ProvisioningError):
    """Slurm refused or could not do what was asked; the message is fit for a user."""


class SlurmUnavailable(SlurmError):
    """The controller (or the login node in front of it) did not answer in time."""


@dataclass(frozen=True)
class JobSpec:
    """One batch job, on one node or `nodes` (one task each; the batch script runs on
    the first, and starts the others' part with srun). `argv` is exec'd by a `#!/bin/sh` script, so the job's
    process is the program itself (signals reach it). Its environment is Slurm's
    `SLURM_*` (and CUDA_VISIBLE_DEVICES), USER/LOGNAME/HOME/PATH of the account it runs
    as, and `env`: never the bot's, and not the account's login scripts."""

    name: str
    argv: tuple[str, ...]
    workdir: str
    time_limit_s: int
    gpus: int = 0  # on each node
    nodes: int = 1
    # Slurm's gres type ("a100") or a model name ("A100"): mapped onto the cluster's type.
    gpu_type: str | None = None
    partition: str | None = None
    output: str | None = None  # Slurm's %j etc. allowed; default slurm-%j.out in workdir
    error: str | None = None  # default: with the output
    requeue: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    # Run as this unix account: submitted through `sudo -n -u USER` (the client's
    # "sudo" mode) or with --uid/--gid by a root bot ("uid" mode); None: the bot's own.
    user: str | None = None
    group: str | None = None  # "uid" mode: default the user's primary group
    cpus: int | None = None
    memory_mb: int | None = None
    # Per GPU, so jobs share a node: a job that asks no memory on a cluster that counts
    # it (CR_*_Memory) with no DefMemPerGPU is given the whole node's.
    cpus_per_gpu: int | None = None
    mem_per_gpu_mb: int | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    # Who asked, for the cluster's admins (`--comment`; squeue/sacct show it).
    comment: str = ""
    # Slurm's warning before it ends the job ("B:TERM@120": SIGTERM to the batch
    # script, which is the program itself, 120 s before the limit).
    signal: str | None = None
    # A file in the shared work directory the job appends "JOBID NODE GPUS RESTARTS" to
    # as it starts: the bot learns a start from it without asking the controller.
    started_file: str | None = None
    hold: bool = False  # submitted held (the doctor's check submits one and cancels it)
    # A job array (`--array`, "0-99%4": tasks 0 to 99, at most 4 running): one job a
    # task, each with SLURM_ARRAY_TASK_ID; the batch script picks its task's work.
    array: str | None = None


def _slurm_message(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "no message"
    return re.sub(r"^(\w+: )?(error: )?(Batch job submission failed: )?", "", last)


def explain_denial(stderr: str) -> str:
    """Why scancel or scontrol said no, with what to do about a permission."""
    said = _slurm_message(stderr)
    if re.search(r"permission denied|Invalid user id", said, re.IGNORECASE):
        return (
            "the bot's account is not a Slurm operator, and the job is not the bot's own "
            f"or may only be changed by one ({said}; an admin can grant it: sacctmgr "
            "modify user NAME set adminlevel=operator)"
        )
    return said


def explain_refusal(
    stderr: str,
    spec: JobSpec,
    nodes: Sequence[SlurmNode],
    normalize: Callable[[str], str | None] | None = None,
) -> str:
    """An sbatch refusal in words a person acts on, from what the cluster has."""
    said = _slurm_message(stderr)
    partitions = sorted({p for n in nodes for p in n.partitions})
    if "Invalid partition" in said and spec.partition:
        return (
            f"there is no partition {spec.partition!r}; the partitions are {', '.join(partitions)}"
        )
    if "uid" in said.lower() and spec.user:
        return f"the bot cannot submit jobs as {spec.user}: Slurm allows that only to root ({said})"
    if "node configuration is not available" in said or "Invalid generic resource" in said:
        pool = [n for n in nodes if spec.partition is None or spec.partition in n.partitions]
        where = f"partition {spec.partition}" if spec.partition else "the cluster"
        if spec.gpus:
            asked = spec.gpu_type or ""
            fits = [
                n.gpus.get(m, 0)
                for n in pool
                for m in n.gpus
                if not asked or asked.lower() in (m.lower(), n.gres_types.get(m, "").lower())
            ]
            label = model_of(asked, normalize) if asked else ""
            if not fits:
                have = sorted({m for n in pool for m in n.gpus})
                return (
                    f"{where} has no {label} GPUs (it has: {', '.join(have) or 'no GPUs'})"
                    if asked
                    else f"{where} has no GPUs"
                )
            if spec.gpus > max(fits):
                gpus = " ".join(w for w in (str(spec.gpus), label, "GPUs") if w)
                scope = "no partition" if spec.partition is None else f"partition {spec.partition}"
                return f"{scope} has {gpus} on one node (the most is {max(fits)})"
        if spec.cpus and all(n.cpus < spec.cpus for n in pool):
            return f"no node of {where} has {spec.cpus} CPUs"
        if spec.memory_mb and all(n.memory_mb < spec.memory_mb for n in pool):
            return f"no node of {where} has {spec.memory_mb} MB of memory"
    if spec.array and "Invalid job array specification" in said:
        return (
            f"the cluster takes job arrays of fewer tasks than {array_size(spec.array)} "
            f"(its MaxArraySize): give the sweep fewer values ({said})"
        )
    if spec.array and re.search(r"job submit limit|MaxSubmit|SubmitJob", said, re.I):
        return (
            f"its {array_size(spec.array)} jobs are more than {spec.user or 'the account'} may "
            f"have queued at once (the cluster's MaxSubmitJobs): give the sweep fewer values, "
            f"or wait for jobs of yours to end ({said})"
        )
    if "time limit" in said.lower():
        return f"the time limit is longer than partition {spec.partition or '(default)'} allows"
    return f"Slurm refused the job: {said}"


def array_size(array: str) -> int:
    """How many tasks an `--array` list names ("0-99%4" → 100)."""
    return len(parse_array_tasks(array))


# The job starts with no environment but Slurm's own (--export-file=/dev/null): these
# are what a program expects of a login, for the account the job runs as.
_BASICS = (
    'USER=$(id -un); LOGNAME=$USER; HOME=$(getent passwd "$USER" | cut -d: -f6); '
    "PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}; "
    "export USER LOGNAME HOME PATH; "
)


# What a job appends to its started file: its id, node, GPU indexes (the node's, as
# Slurm numbers them; "-" for none), how many times it was requeued before this start,
# and when it started (epoch seconds, the node's clock).
_STARTED = (
    'printf \'%s %s %s %s %s\\n\' "$SLURM_JOB_ID" "${SLURMD_NODENAME:-}" '
    '"${SLURM_JOB_GPUS:-${SLURM_STEP_GPUS:--}}" "${SLURM_RESTART_COUNT:-0}" "$(date +%s)" >> '
)


def started_line(started_file: str) -> str:
    """The shell line a job runs first to append its start to `started_file`."""
    return _STARTED + shell.path(started_file)


def batch_line(argv: Sequence[str], env: Mapping[str, str], started_file: str | None = None) -> str:
    """The body of the job's `#!/bin/sh` script (sbatch --wrap adds the #! line)."""
    started = started_line(started_file) + "; " if started_file else ""
    return _BASICS + started + "exec " + shell.env_prefix(dict(env)) + shell.join(argv)


def parse_started(text: str) -> StartedLine | None:
    """The last start a job's started file records (a requeued job appends one a start)."""
    found: StartedLine | None = None
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or not words[0].isdigit():
            continue
        gpus = words[2] if len(words) > 2 else ""
        restarts = words[3] if len(words) > 3 else "0"
        epoch = words[4] if len(words) > 4 else ""
        found = StartedLine(
            job_id=int(words[0]),
            node=words[1],
            gpu_indexes=parse_indexes(gpus),
            restarts=int(restarts) if restarts.isdigit() else 0,
            started_at=datetime.fromtimestamp(int(epoch), UTC) if epoch.isdigit() else None,
        )
    return found


@dataclass(frozen=True)
class StartedLine:
    job_id: int
    node: str
    gpu_indexes: tuple[int, ...]
    restarts: int
    started_at: datetime | None = None


# --- the client -----------------------------------------------------------------------

# What a local command keeps of the bot's environment (see the module's docstring).
_KEEP_ENV = ("PATH", "HOME", "USER", "LOGNAME", "TZ")


class SlurmClient:
    """Slurm's tools on this machine, or on a login node over SSH (`login` + `runner`)."""

    def __init__(
        self,
        *,
        conf: str | None = None,
        login: SshTarget | None = None,
        runner: HostShell | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        normalize: Callable[[str], str | None] | None = None,
        submit_as: str = "sudo",
    ) -> None:
        if (login is None) != (runner is None):
            raise ValueError("a login node needs both its SshTarget and an HostShell")
        if submit_as not in SUBMIT_MODES:
            raise ValueError(f"submit_as must be one of {', '.join(SUBMIT_MODES)}")
        # How a job becomes a person's: "sudo" (sudo -n -u PERSON sbatch/scancel/scontrol,
        # restricted to those tools by the cluster's sudoers) or "uid" (the bot is root
        # and passes --uid/--gid; newer Slurm deprecates it).
        self.submit_as = submit_as
        self.conf = conf if conf is not None else os.environ.get("SLURM_CONF") or None
        self.login = login
        self.runner = runner
        self.timeout_s = timeout_s
        self.normalize = normalize
        self._gids: dict[str, str] = {}
        self._jobcomp: tuple[str, str] | None = None
        self._users: dict[int, str] = {}

    @property
    def where(self) -> str:
        return f"on {self.login.label}" if self.login else "on this machine"

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {"LC_ALL": "C"}
        if self.conf:
            env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """One Slurm command; a non-zero exit is a result, a silent controller is not."""
        limit = self.timeout_s if timeout is None else timeout
        # Through sudo (as_person): the tool is what follows `sudo … -u USER --`.
        tool = str(argv[6]) if len(argv) > 6 and argv[0] == "sudo" else ""
        what = tool or argv[0]
        if self.login is not None and self.runner is not None:
            try:
                result = self.runner.run(self.login, shell.join(argv), limit, env=self._env(env))
            except SshError as exc:
                raise SlurmUnavailable(
                    f"Slurm is not answering: `{what}` {self.where} failed ({exc})"
                ) from exc
            if result.exit_code == 127:
                raise SlurmError(f"Slurm's `{what}` is not installed {self.where}")
        else:
            local = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
            try:
                done = subprocess.run(
                    list(argv),
                    env=local | self._env(env),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=limit,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise SlurmUnavailable(
                    f"the Slurm controller is not answering (`{what}` took over {limit:g} s)"
                ) from exc
            except FileNotFoundError as exc:
                raise SlurmError(f"Slurm's `{what}` is not installed {self.where}") from exc
            result = RunResult(done.returncode, done.stdout, done.stderr)
        if tool and not result.ok and _SUDO_REFUSED.search(result.stderr):
            said = _slurm_message(result.stderr)
            raise SlurmError(
                f"the bot's account may not run `{what}` as {argv[4]} {self.where} ({said}): "
                "an admin adds the sudoers lines of docs/SLURM.md for that account"
            )
        if not result.ok and "fetch config" in result.stderr:
            raise SlurmError(
                f"Slurm's tools {self.where} find no configuration: set SLURM_CONF to the "
                "cluster's slurm.conf (or install it as /etc/slurm/slurm.conf)"
            )
        if not result.ok and _UNREACHABLE.search(result.stderr):
            raise SlurmUnavailable(
                f"the Slurm controller is not answering ({_slurm_message(result.stderr)})"
            )
        return result

    def _checked(self, argv: Sequence[str], doing: str, **kw: Any) -> str:
        result = self.run(argv, **kw)
        if not result.ok:
            raise SlurmError(f"Slurm could not {doing}: {_slurm_message(result.stderr)}")
        return result.stdout

    def as_person(self, user: str | None, argv: Sequence[str]) -> list[str]:
        """`argv` run as `user` in "sudo" mode (never as root: the sudoers lines name
        the people, and this refuses uid 0 by name too); unchanged otherwise."""
        if not user or self.submit_as != "sudo":
            return list(argv)
        if user == "root":
            raise SlurmError("the bot never runs Slurm's tools as root for a person")
        # SLURM_CONF must reach the tool: sudo's env_reset drops it unless kept, and the
        # sudoers' env_keep names it for the bot's account (root needs it asked for).
        return ["sudo", "-n", f"--preserve-env={_KEPT_THROUGH_SUDO}", "-u", user, "--", *argv]

    # reading

    def ping(self, timeout: float | None = None) -> None:
        """Returns when the controller answers; SlurmUnavailable saying why otherwise."""
        result = self.run(["scontrol", "ping"], timeout=timeout)
        if result.ok and " is UP" in result.stdout:
            return
        said = (result.stdout + result.stderr).strip().splitlines()
        raise SlurmUnavailable(
            f"the Slurm controller is not answering ({said[0] if said else 'scontrol ping failed'})"
        )

    def controller_up(self, timeout: float | None = None) -> bool:
        try:
            self.ping(timeout)
        except SlurmUnavailable:
            return False
        return True

    def _listing(self, argv: Sequence[str], doing: str) -> dict[str, Any] | None:
        """A `--json` listing; None when Slurm says the job id is unknown."""
        result = self.run(argv)
        if not result.ok:
            said = _slurm_message(result.stderr)
            if "Invalid job id" in said:
                return None
            raise SlurmError(f"Slurm could not {doing} ({argv[0]}: {said})")
        doc, errors = load_json(result.stdout)
        if not errors:
            return doc
        said = "; ".join(errors)
        if "Invalid job id" in said:
            return None
        # 22.05 says a controller that does not answer only here, with an empty list.
        raise SlurmUnavailable(f"the Slurm controller is not answering ({argv[0]}: {said})")

    def nodes(self) -> list[SlurmNode]:
        doc = self._listing(["sinfo", "--all", "--Node", "--json"], "list its nodes")
        return parse_nodes(doc or {}, self.normalize)

    def jobs(self) -> list[SlurmJob]:
        """Every job Slurm still knows (ended ones for MinJobAge), in one squeue call."""
        doc = self._listing(["squeue", "--all", "--states=all", "--json"], "list its jobs")
        return parse_jobs(doc or {}, self.normalize)

    def job(self, job_id: int) -> SlurmJob | None:
        """The job, or None once Slurm has forgotten it (see `final_state`)."""
        argv = ["squeue", "--all", "--states=all", "--json", f"--jobs={int(job_id)}"]
        doc = self._listing(argv, f"show job {job_id}")
        # 22.05 ignores --jobs with --json and returns every job.
        found = [j for j in parse_jobs(doc or {}, self.normalize) if j.job_id == job_id]
        return found[0] if found else None

    def gpu_indexes(self, job_id: int) -> dict[str, tuple[int, ...]]:
        """Node → GPU indexes of a running job, from `scontrol show job -d` (for Slurm
        versions whose squeue JSON lacks gres_detail; jobs() fills them where it has it)."""
        out = self._checked(
            ["scontrol", "show", "job", "-d", str(int(job_id))], f"show job {job_id}"
        )
        return parse_job_gpu_indexes(out)

    def final_state(self, job_id: int, task: int | None = None) -> JobEnd | None:
        """A finished job's end from accounting (sacct, when slurmdbd runs), else from the
        jobcomp/filetxt file (readable only where the controller's file is); None when
        neither knows it. `task`: that task of the array `job_id` (its own id unknown)."""
        ref = f"{int(job_id)}_{int(task)}" if task is not None else None
        # -a: every user's (the bot's account reads its people's jobs). A task that never
        # started is in the array's own record (`-j JOB_TASK` does not find it there).
        argv = ["sacct", "-a", "-X", "-n", "-P", "-j", str(int(job_id)), "-o", SACCT_FIELDS]
        try:
            sacct = self.run(argv, env={"SLURM_TIME_FORMAT": "%s"})
        except SlurmUnavailable:
            raise
        except SlurmError:  # no sacct here: the jobcomp file may still know
            sacct = RunResult(127, "", "")
        if sacct.ok and (end := parse_sacct(sacct.stdout, job_id, ref)) is not None:
            return end
        if task is not None:
            return None  # the jobcomp file names tasks by their own ids only
        kind, path = self.jobcomp()
        if kind != "jobcomp/filetxt" or not path:
            return None
        found = self.run(["grep", "-a", "-E", "--", f"^JobId={int(job_id)} ", path])
        return parse_jobcomp(found.stdout, job_id) if found.ok else None

    def attempts(self, job_id: int) -> list[JobEnd]:
        """Each start of a job Slurm requeued, oldest first, as accounting keeps them
        (`sacct -D`): how each earlier one ended (NODE_FAIL, PREEMPTED, REQUEUED) and on
        which nodes. Empty without accounting."""
        argv = ["sacct", "-a", "-X", "-D", "-n", "-P", "-j", str(int(job_id)), "-o", SACCT_FIELDS]
        try:
            sacct = self.run(argv, env={"SLURM_TIME_FORMAT": "%s"})
        except SlurmUnavailable:
            raise
        except SlurmError:
            return []
        return parse_sacct_attempts(sacct.stdout, job_id) if sacct.ok else []

    def partitions(self) -> list[SlurmPartition]:
        """Every partition with its limits and job defaults (one partition-info RPC)."""
        out = self._checked(["scontrol", "show", "partition", "--oneliner"], "list its partitions")
        return parse_partitions(out)

    def associations(self, user: str) -> Associations | None:
        """What Slurm's accounting lets `user` use (accounts, QOS, defaults); None where
        the cluster keeps no accounting (sacctmgr talks to slurmdbd, not the controller)."""
        argv = ["sacctmgr", "-n", "-P", "show", "assoc", "where", f"users={user}"]
        try:
            assoc = self.run([*argv, "format=Account,Partition,QOS,DefaultQOS"])
            default = self.run(
                ["sacctmgr", "-n", "-P", "show", "user", user, "format=DefaultAccount"]
            )
        except SlurmUnavailable:
            raise
        except SlurmError:
            return None  # no sacctmgr here
        if not assoc.ok or not default.ok:
            if re.search(r"slurmdbd|Problem talking to the database", assoc.stderr, re.I):
                return None
            raise SlurmError(f"Slurm's accounting could not list {user}: {assoc.stderr.strip()}")
        return parse_associations(assoc.stdout, default.stdout)

    def qos_limits(self) -> dict[str, int | None]:
        """Each QOS's MaxWall in seconds (None: none); empty without accounting."""
        try:
            result = self.run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxWall"])
        except SlurmUnavailable:
            raise
        except SlurmError:
            return {}
        if not result.ok:
            return {}
        found: dict[str, int | None] = {}
        for line in result.stdout.splitlines():
            name, _, wall = line.partition("|")
            if name.strip():
                found[name.strip()] = parse_time_s(wall.strip())
        return found

    def user_name(self, uid: int) -> str:
        """A uid as its account's name where the commands run (sacct's "CANCELLED by 0")."""
        if uid not in self._users:
            result = self.run(["getent", "passwd", str(int(uid))])
            name = result.stdout.split(":", 1)[0] if result.ok else ""
            self._users[uid] = name or f"uid {uid}"
        return self._users[uid]

    def jobcomp(self) -> tuple[str, str]:
        """(JobCompType, JobCompLoc) of the cluster, read once."""
        if self._jobcomp is None:
            out = self._checked(["scontrol", "show", "config"], "show its configuration")
            conf = dict(re.findall(r"^(JobComp(?:Type|Loc))\s*=\s*(\S*)", out, re.MULTILINE))
            self._jobcomp = (conf.get("JobCompType", ""), conf.get("JobCompLoc", ""))
        return self._jobcomp

    # acting

    def submit(self, spec: JobSpec, nodes: Sequence[SlurmNode] | None = None) -> int:
        """The new job's id. `nodes` (as just read for status) maps a model name in
        spec.gpu_type onto the cluster's gres type; without it they are read here."""
        if not spec.argv:
            raise SlurmError("a job needs a command")
        argv = ["sbatch", "--parsable", f"--nodes={int(spec.nodes)}", f"--job-name={spec.name}"]
        if spec.nodes > 1:  # one task a node: the run's launcher there (training.across_nodes)
            argv.append("--ntasks-per-node=1")
        argv += [f"--time={format_duration(spec.time_limit_s)}", f"--chdir={spec.workdir}"]
        # Not --export=NONE: that makes slurmd run the account's login scripts (`su -`)
        # before each job, which took 60 s here under load; /dev/null is a clean start.
        argv += ["--export-file=/dev/null", "--requeue" if spec.requeue else "--no-requeue"]
        for flag, value in (
            ("partition", spec.partition),
            ("account", spec.account),
            ("qos", spec.qos),
            ("constraint", spec.constraint),
            ("signal", spec.signal),
            ("comment", spec.comment),
        ):
            if value:
                argv.append(f"--{flag}={value}")
        if spec.hold:
            argv.append("--hold")
        if spec.array:
            argv.append(f"--array={spec.array}")
        if spec.gpus:
            gres = "gpu"
            if spec.gpu_type:
                if nodes is None:
                    nodes = self.nodes()
                gres += ":" + (gres_type_for(spec.gpu_type, nodes) or spec.gpu_type)
            argv.append(f"--gres={gres}:{int(spec.gpus)}")
        if spec.cpus:
            argv.append(f"--cpus-per-task={int(spec.cpus)}")
        elif spec.cpus_per_gpu and spec.gpus:
            argv.append(f"--cpus-per-gpu={int(spec.cpus_per_gpu)}")
        if spec.memory_mb:
            argv.append(f"--mem={int(spec.memory_mb)}M")
        elif spec.mem_per_gpu_mb and spec.gpus:
            argv.append(f"--mem-per-gpu={int(spec.mem_per_gpu_mb)}M")
        if spec.output:
            argv.append(f"--output={spec.output}")
        if spec.error:
            argv.append(f"--error={spec.error}")
        if spec.user and self.submit_as == "uid":
            argv += [f"--uid={spec.user}", f"--gid={spec.group or self._gid_of(spec.user)}"]
        argv.append(f"--wrap={batch_line(spec.argv, spec.env, spec.started_file)}")
        result = self.run(self.as_person(spec.user, argv))
        if not result.ok:
            try:
                known = list(nodes) if nodes is not None else self.nodes()
            except SlurmError:
                known = []  # the refusal is still said, without what the cluster has
            why = explain_refusal(result.stderr, spec, known, self.normalize)
            raise SlurmError(f"Slurm refused job {spec.name!r}: {why}")
        first = result.stdout.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmError(f"sbatch gave no job id: {result.stdout.strip()[:200]!r}")
        return int(first)

    def _gid_of(self, user: str) -> str:
        """The account's primary group where the jobs run (without --gid Slurm uses 0)."""
        if user not in self._gids:
            result = self.run(["id", "-g", "--", user])
            if not result.ok or not result.stdout.strip().isdigit():
                raise SlurmError(f"there is no account {user!r} {self.where}")
            self._gids[user] = result.stdout.strip()
        return self._gids[user]

    def cancel(
        self,
        job_id: int,
        signal: str | None = None,
        *,
        user: str | None = None,
        pending_only: bool = False,
        running_only: bool = False,
        batch_only: bool = False,
        task: int | None = None,
    ) -> None:
        """End the job (or, with `signal`, signal its batch script and steps; with
        `batch_only` the batch script alone), as `user` (its owner) where jobs are people's.
        An id Slurm has forgotten is already over: no error. `pending_only`
        (`--state=PENDING`): only if it has not started; the controller decides, so a job
        it starts meanwhile is left running, never killed; `running_only`
        (`--state=RUNNING`) the converse. `task`: that task of the job array `job_id`
        alone (`JOB_TASK`); without, an array's id is every task of it."""
        argv = ["scancel"]
        if signal:
            argv += [f"--signal={signal}", "--batch" if batch_only else "--full"]
        if pending_only:
            argv.append("--state=PENDING")
        if running_only:
            argv.append("--state=RUNNING")
        target = str(int(job_id)) + (f"_{int(task)}" if task is not None else "")
        result = self.run(self.as_person(user, [*argv, target]))
        if not result.ok and "Invalid job id" not in result.stderr:
            raise SlurmError(
                f"Slurm refused to cancel job {job_id}: {explain_denial(result.stderr)}"
            )

    def set_time_limit(self, job_id: int, seconds: int, *, user: str | None = None) -> None:
        """Raising a running job's limit needs a Slurm operator or admin (or root); a
        pending one's its owner (`user`) may raise within the partition's MaxTime."""
        limit = f"TimeLimit={format_duration(seconds)}"
        argv = ["scontrol", "update", f"JobId={int(job_id)}", limit]
        # The bot's own account first (a Slurm operator may raise any limit); else as the
        # job's owner, who may raise a pending job's within the partition's MaxTime.
        result = self.run(argv)
        if not result.ok and user and self.submit_as == "sudo":
            result = self.run(self.as_person(user, argv))
        if not result.ok:
            raise SlurmError(
                f"Slurm refused to change job {job_id}'s time limit: {explain_denial(result.stderr)}"
            )

    def run_in_job(
        self,
        job_id: int,
        argv: Sequence[str],
        *,
        node: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> RunResult:
        """`argv` as a step inside a running job's allocation (`srun --overlap`): it
        sees the job's GPUs (CUDA_VISIBLE_DEVICES), e.g. for telemetry. As `user`, the
        job's owner (only its owner or root may add a step); a non-zero exit is a result."""
        step = ["srun", f"--jobid={int(job_id)}", "--overlap", "--nodes=1", "--ntasks=1"]
        if node:
            step.append(f"--nodelist={node}")
        return self.run(self.as_person(user, [*step, *argv]), timeout=timeout)

    def requeue(self, job_id: int) -> None:
        """Back to pending (a running job submitted with requeue=True); it starts again
        after AuthInfo's cred_expire (default 120 s) with SLURM_RESTART_COUNT set."""
        result = self.run(["scontrol", "requeue", str(int(job_id))])
        if not result.ok:
            raise SlurmError(
                f"Slurm refused to requeue job {job_id}: {explain_denial(result.stderr)}"
            )
