"""A real Slurm cluster for tests, configured as a lab configures theirs: slurmctld, two
slurmd (two nodes on this machine), slurmdbd on MariaDB, and munge, from Debian (Slurm
22.05).

What a lab admin allows, and the bot must live with:
- memory is a consumable (CR_Core_Memory, RealMemory=2000) with no default per GPU or
  node: a job that asks for no memory holds the whole node (MEMORY_MB);
- partitions `short` (default; 10 min by default, 30 at most), `long` (1 h, 2 days) and
  `urgent` (1 h at most), which preempts (requeues) short and long jobs (GRACE_S), all on
  the first node; `wide` (1 h at most) holds both nodes, for jobs across nodes: the
  second node (SECOND_NODE, its own address on loopback, port, spool and log, as
  ../shared/slurm/NOTES.md has it) is in no other partition, so the tests of one node
  see the cluster they always saw (tests/slurm_lab.py names those partitions);
- accounting in slurmdbd, with associations, limits and QOS enforced: accounts `lab`
  (everyone's default) and `vision` (alice's only), QOS `normal` and `high` (bob's
  only); a unix account with no association cannot submit (ACCOUNTS, QOS);
- unix accounts: two people, a shared account for people mapped to none, the bot's own
  non-root account, which may run sbatch, scancel and scontrol as them through sudo and
  nothing else (SUDOERS_TEXT), and the group of the shared work directory
  (`lab_workdir`).

`scripts/slurm_cluster.sh` installs the packages and prepares what needs root (munge
key, state directories, four fake GPU device files, MariaDB's data directory, the unix
accounts and the sudoers file); this module writes the config and runs the daemons
(mariadbd on its own port and socket, then slurmdbd, slurmctld, slurmd: about 3.4 s
here, most of it `sacctmgr`; stopped in the reverse order, about 2 s). Slurm's ports
(6817/6818/6819) are fixed and munged serves the whole machine, so there is one cluster
per machine, shared by every pytest-xdist worker and by every test session on the
machine (two worktrees, a bench):

- `CONTROL` (flock, exclusive, held briefly): whoever holds it may start, attach to or
  stop the cluster. The first process starts it and writes `MARKER` (pids, config);
  later ones find it alive with their own config and attach.
- `USERS` (flock, shared, held for a process's whole use): the last process to let go
  (it gets the lock exclusively) stops the daemons; nobody stops a cluster another
  process still uses.
- `LEASE` (flock, exclusive, held for one test): a test owns the whole cluster, so
  capacity (4 GPUs) and the controller (a test may take it down) are its alone; the
  lease ends by cancelling every job, so the next test starts on an empty queue.
  Tests that take `slurm_cluster` share one xdist group (tests/conftest.py), so one
  worker runs them in turn instead of two workers waiting on each other's leases.

The daemons run with -D under Popen in their own session (they outlive the process
that started them while others use them). Stopping escalates to SIGKILL: slurmd may
ignore SIGTERM for minutes while it retries registration.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import pytest

ROOT = Path(os.environ.get("GPUBOT_TEST_SLURM_ROOT", "/var/lib/gpubot-test-slurm"))
_LOCK_DIR = Path("/var/lock") if os.access("/var/lock", os.W_OK) else Path("/tmp")
CONTROL = _LOCK_DIR / "gpubot-test-slurm.control.lock"
USERS = _LOCK_DIR / "gpubot-test-slurm.users.lock"
LEASE = _LOCK_DIR / "gpubot-test-slurm.lease.lock"
MARKER = ROOT / "conf" / "cluster.json"

GPUS = 4  # per node
GPU_TYPE = "a100"
GPU_MODEL = "A100"
CPUS = 8
# Memory is a consumable (CR_Core_Memory) and there is no DefMemPerGPU/DefMemPerNode: a
# job that asks for none is given all of it and holds the node alone (the lab trap).
MEMORY_MB = 2000
# short is the default (10 min by default, 30 at most), long (1 h by default, 2 days at
# most); both preemptible (requeued) by urgent (1 h at most, never preempted).
PARTITIONS = ("short", "long", "urgent")
DEFAULT_PARTITION = "short"
PREEMPTIBLE = ("short", "long")
URGENT = "urgent"
# The partition of both nodes: a job across nodes asks for it (the bot chooses it when
# no one-node partition has the GPUs); 1 h at most, preemptible like short and long.
WIDE = "wide"
ONE_NODE_PARTITIONS = PARTITIONS
# The second node: its own name, address on loopback and slurmd port (the first keeps
# Slurm's 6818 and 127.0.0.1). slurmctld declares a node whose slurmd stopped answering
# DOWN after SLURMD_TIMEOUT_S (default 300), ending its jobs NODE_FAIL.
SECOND_ADDR = "127.0.0.2"
SECOND_PORT = 6828
SLURMD_TIMEOUT_S = 20
# Preemption (partition GraceTime), as measured here with Slurm 22.05.8: an urgent job
# that needs a running short/long job's GPUs makes the backfill pass (within ~0.5 s)
# select it and start GRACE_S seconds of grace. At that moment only the job's steps get
# SIGCONT+SIGTERM: a batch job with no srun step (the bot's: its script is the program)
# gets nothing, unless it was submitted with --signal=B:SIG@T, which
# preempt_send_user_signal sends to the batch script at once (+0.3 s). At the end of the
# grace (checked by the full pass, so 10.6-14 s after the urgent job's submission) the
# job is requeued: SIGCONT+SIGTERM to the batch script, SIGKILL KillWait (2 s) later;
# the urgent job runs ~5 s after the requeue. The requeued job waits PENDING (BeginTime)
# about cred_expire (10 s) and a pass before it starts again (SLURM_RESTART_COUNT=1).
GRACE_S = 10
CLUSTER_NAME = "gpubot-test"

# The lab's unix accounts (scripts/slurm_cluster.sh creates them): people with their own
# account, the shared account of people the bot maps to no account, the bot's own (not
# root), and the group of the shared work directory (`lab_workdir`).
PEOPLE = {"alice": "gpubot-alice", "bob": "gpubot-bob"}
SHARED_ACCOUNT = "gpubot-lab"
BOT_ACCOUNT = "gpubot-slurmbot"
LAB_GROUP = "gpubot-labgroup"
# Slurm's accounting entities (AccountingStorageEnforce=associations,limits,qos: a job
# of a user with no association, or under an account or QOS not theirs, is refused).
DEFAULT_ACCOUNT = "lab"  # every user's default account
VISION_ACCOUNT = "vision"  # only alice's, besides lab
ACCOUNTS = {
    DEFAULT_ACCOUNT: (*PEOPLE.values(), SHARED_ACCOUNT, BOT_ACCOUNT, "root"),
    VISION_ACCOUNT: (PEOPLE["alice"],),
}
DEFAULT_QOS = "normal"  # every association's default
HIGH_QOS = "high"  # only bob's
QOS = {DEFAULT_QOS: ACCOUNTS[DEFAULT_ACCOUNT], HIGH_QOS: (PEOPLE["bob"],)}

# What lets the bot's account act as a person (scripts/slurm_cluster.sh installs it,
# checked with `visudo -cf`; docs/SLURM.md copies it). Seen working here (sudo 1.9.13,
# Debian 12), as root:
#   runuser -u gpubot-slurmbot -- env SLURM_CONF=/var/lib/gpubot-test-slurm/conf/slurm.conf \
#     sudo -n -u gpubot-alice sbatch --parsable --mem-per-gpu=100 --gres=gpu:a100:1 -A lab \
#     --chdir=DIR --wrap 'id -un'
# submits a job that runs as gpubot-alice (`sacct -a -X -P -o JobID,User,Account,State`:
# `N|gpubot-alice|lab|COMPLETED`), while `sudo -n -u gpubot-alice /bin/sh` is refused
# ("a password is required", exit 1): the bot's account may run these three tools as
# the people, nothing else, and as nobody else (not root). The lines, exactly:
#   Defaults:gpubot-slurmbot env_keep += "SLURM_CONF SLURM_TIME_FORMAT"
#   gpubot-slurmbot ALL=(gpubot-alice,gpubot-bob,gpubot-lab) NOPASSWD: /usr/bin/sbatch, \
#     /usr/bin/scancel, /usr/bin/scontrol
# (one line in the file). env_keep is the bot account's only: root running
# `sudo -n -u PERSON sbatch` loses SLURM_CONF to env_reset (sbatch then fails with
# "resolve_ctls_from_dns_srv"); `sudo -n --preserve-env=SLURM_CONF,SLURM_TIME_FORMAT -u
# PERSON -- TOOL` keeps it for both root and the bot's account, and any other variable
# is refused ("not allowed to set the following environment variables").
SUDOERS = Path("/etc/sudoers.d/gpubot-test")
SUDO_TOOLS = ("/usr/bin/sbatch", "/usr/bin/scancel", "/usr/bin/scontrol", "/usr/bin/srun")
SUDOERS_TEXT = (
    "# gpubot's Slurm test cluster (scripts/slurm_cluster.sh)\n"
    f'Defaults:{BOT_ACCOUNT} env_keep += "SLURM_CONF SLURM_TIME_FORMAT"\n'
    f"{BOT_ACCOUNT} ALL=({','.join([*PEOPLE.values(), SHARED_ACCOUNT])}) "
    f"NOPASSWD: {', '.join(SUDO_TOOLS)}\n"
)

# The accounting database: this module's own MariaDB (data under ROOT/mysql, made by
# scripts/slurm_cluster.sh), on loopback, on its own port and socket: a MariaDB the
# machine runs on 3306 is never touched. slurmdbd listens on Slurm's port 6819.
DB_PORT = int(os.environ.get("GPUBOT_TEST_SLURM_DB_PORT", "6830"))
DBD_PORT = 6819
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
DB_PASSWORD = "gpubot-test-slurmdbd"  # loopback only, a throwaway test database
# Seconds Slurm keeps a finished job in squeue (22.05 accepts 2; default 300): low, so
# a test sees a job forgotten without waiting minutes.
MIN_JOB_AGE = 3
# How long a session waits for another session on this machine to let go.
WAIT_S = float(os.environ.get("GPUBOT_TEST_LOCK_WAIT", "1800"))
GUARD_S = 60.0  # a daemon that takes longer than this to come up is broken, not slow
# In the order they start (each needs the one before) and the reverse of their stop.
DAEMONS = {
    "mariadbd": "/usr/sbin/mariadbd",
    "slurmdbd": "/usr/sbin/slurmdbd",
    "slurmctld": "/usr/sbin/slurmctld",
    "slurmd": "/usr/sbin/slurmd",
}
MUNGED = "/usr/sbin/munged"
MARIADB = "/usr/bin/mariadb"


class Marker(TypedDict):
    """What MARKER holds: the daemons' pids (munged only where this cluster started it)."""

    pids: dict[str, int]
    digest: str
    node: str


class SlurmClusterUnavailable(Exception):
    """The cluster cannot run here; the message says why (a skip reason)."""


def node_name() -> str:
    return socket.gethostname().split(".")[0]


def second_node(node: str) -> str:
    return f"{node}-b"


def slurmd_key(node: str, first: str) -> str:
    """The marker's name for a node's slurmd ("slurmd" for the first, as before)."""
    return "slurmd" if node == first else f"slurmd@{node}"


def _comm(key: str) -> str:
    """The process name of a marker's daemon key ("slurmd@n2" runs as slurmd)."""
    return key.split("@", 1)[0]


def slurm_conf(node: str, root: Path = ROOT) -> str:
    """The cluster's slurm.conf (NOTES.md in ../shared/slurm says why each line is there)."""
    preemptible = f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S} State=UP"
    second = second_node(node)
    return "\n".join(
        [
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={node}(127.0.0.1)",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "AuthInfo=cred_expire=10",  # a requeued job waits this long (default 120 s)
            "SlurmUser=slurm",
            f"StateSaveLocation={root}/state",
            # One spool, pid file and log per node (%n): two slurmd on one machine.
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/state/slurmctld.pid",
            f"SlurmdPidFile={root}/spool/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups here
            "TaskPlugin=task/none",
            f"TaskProlog={root}/conf/task_prolog.sh",  # the fake driver on PATH
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",  # and no DefMemPerGPU: see MEMORY_MB
            "SlurmdParameters=config_overrides",  # CPUs=8 on 2 real cores
            # rl_enable: per-user RPC rate limiting, as a lab's controller has it (Slurm
            # 23.02+; 22.05 accepts the word and does nothing: its slurmctld has no
            # rate limiter). preempt_send_user_signal: a job's --signal (B:SIG@T) is
            # sent to its batch script the moment it is preempted (see GRACE_S).
            "SlurmctldParameters=rl_enable,preempt_send_user_signal",
            "GresTypes=gpu",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={DBD_PORT}",
            "AccountingStorageTRES=gres/gpu",
            "AccountingStorageEnforce=associations,limits,qos",
            "JobAcctGatherType=jobacct_gather/linux",
            "JobCompType=jobcomp/filetxt",  # beside sacct: the file is the fallback
            f"JobCompLoc={root}/log/jobcomp.txt",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            # sched_interval: the full scheduling pass (default 60 s) is what ends a
            # preempted job's GraceTime and starts a requeued job: 5 s keeps the
            # preemption tests within their guards.
            "SchedulerParameters=bf_interval=1,sched_interval=5",
            f"MinJobAge={MIN_JOB_AGE}",
            "KillWait=2",  # a cancelled job's processes get SIGKILL 2 s after SIGTERM
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"NodeName={node} NodeAddr=127.0.0.1 Port=6818 CPUs={CPUS} "
            f"RealMemory={MEMORY_MB} Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN",
            f"NodeName={second} NodeHostname={node} NodeAddr={SECOND_ADDR} Port={SECOND_PORT} "
            f"CPUs={CPUS} RealMemory={MEMORY_MB} Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN",
            f"PartitionName=short Nodes={node} Default=YES DefaultTime=00:10:00 "
            f"MaxTime=00:30:00 {preemptible}",
            f"PartitionName=long Nodes={node} DefaultTime=01:00:00 MaxTime=2-00:00:00 "
            f"{preemptible}",
            f"PartitionName={URGENT} Nodes={node} DefaultTime=00:10:00 MaxTime=01:00:00 "
            "PriorityTier=10 PreemptMode=OFF State=UP",
            f"PartitionName={WIDE} Nodes={node},{second} DefaultTime=00:10:00 "
            f"MaxTime=01:00:00 {preemptible}",
            "",
        ]
    )


def slurmdbd_conf(root: Path = ROOT) -> str:
    """slurmdbd.conf, beside slurm.conf (slurmdbd finds it through SLURM_CONF's folder)."""
    return "\n".join(
        [
            "AuthType=auth/munge",
            "DbdAddr=127.0.0.1",
            "DbdHost=localhost",
            f"DbdPort={DBD_PORT}",
            "SlurmUser=slurm",
            f"LogFile={root}/log/slurmdbd.log",
            f"PidFile={root}/state/slurmdbd.pid",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",  # TCP: "localhost" would be the machine's socket
            f"StoragePort={DB_PORT}",
            f"StorageUser={DB_USER}",
            f"StoragePass={DB_PASSWORD}",
            f"StorageLoc={DB_NAME}",
            "",
        ]
    )


def db_socket(root: Path = ROOT) -> Path:
    return root / "mysql" / "mysqld.sock"


def mariadbd_argv(root: Path = ROOT) -> list[str]:
    """This module's MariaDB: its own data, socket and port, on loopback only, with no
    option file of the machine's (--no-defaults), small (a test database)."""
    db = root / "mysql"
    return [
        DAEMONS["mariadbd"],
        "--no-defaults",
        "--user=mysql",
        f"--datadir={db}/data",
        f"--socket={db_socket(root)}",
        f"--pid-file={db}/mariadbd.pid",
        f"--log-error={db}/error.log",
        f"--port={DB_PORT}",
        "--bind-address=127.0.0.1",
        "--skip-name-resolve",
        "--innodb-buffer-pool-size=64M",
        "--innodb-lock-wait-timeout=900",  # what slurmdbd asks for
        # No flush at each commit: each sacctmgr change took 0.4-0.8 s with it.
        "--innodb-flush-log-at-trx-commit=0",
        "--innodb-doublewrite=0",
        "--skip-log-bin",
    ]


def accounting_file() -> str:
    """The lab's accounts, users and their QOS as `sacctmgr load` reads them (the format
    of `sacctmgr dump`): one command, where one sacctmgr call per change took 0.4-0.8 s.
    The QOS it names must exist first (`sacctmgr add qos`)."""
    lab, vision = DEFAULT_ACCOUNT, VISION_ACCOUNT
    qos = f"DefaultQOS='{DEFAULT_QOS}':QOS='{DEFAULT_QOS}'"
    lines = [
        f"Cluster - '{CLUSTER_NAME}':QOS='{DEFAULT_QOS}'",
        "Parent - 'root'",
        f"User - 'root':DefaultAccount='{lab}':AdminLevel='Administrator'",
        f"Account - '{lab}':Description='the lab':Organization='lab':{qos}",
        f"Account - '{vision}':Description='vision':Organization='lab':{qos}",
        f"Parent - '{lab}'",
    ]
    for user in ACCOUNTS[lab]:
        extra = "".join(
            f":QOS='+{q}'" for q, users in QOS.items() if q != DEFAULT_QOS and user in users
        )
        lines.append(f"User - '{user}':DefaultAccount='{lab}'{extra}")
    lines.append(f"Parent - '{vision}'")
    lines += [f"User - '{user}':DefaultAccount='{lab}'" for user in ACCOUNTS[vision]]
    return "\n".join(lines) + "\n"


def gres_conf(node: str, root: Path = ROOT) -> str:
    """Each node's four fake GPUs (device files scripts/slurm_cluster.sh links to
    /dev/null): nvidia0-3 on the first node, nvidia4-7 on the second."""
    last = GPUS - 1
    return (
        f"AutoDetect=off\nNodeName={node} Name=gpu Type={GPU_TYPE} "
        f"File={root}/dev/nvidia[0-{last}]\n"
        f"NodeName={second_node(node)} Name=gpu Type={GPU_TYPE} "
        f"File={root}/dev/nvidia[{GPUS}-{2 * GPUS - 1}]\n"
    )


def utilization_file(root: Path = ROOT) -> Path:
    """What the fake GPUs report: {"NODE": {"INDEX": util %}}; a GPU not named is at 0%
    (a GPU that nothing uses). Tests write it (`SlurmCluster.set_utilization`)."""
    return root / "conf" / "gpu-util.json"


def fake_nvidia_smi(root: Path = ROOT) -> str:
    """The NVIDIA driver's tool for the fake GPUs, on every task's PATH (TaskProlog):
    the same `--query-gpu`/`--query-compute-apps` CSV a driver prints, so
    training.telemetry reads it as it reads a real one. Inside a job's step it shows that
    job's GPUs alone, renumbered from 0, as a cluster with ConstrainDevices (cgroup
    devices) shows them; the node's own index of each is SLURM_STEP_GPUS/SLURM_JOB_GPUS.
    Outside a job it fails as on a machine without a driver."""
    return f"""#!/usr/bin/python3
import json, os, sys
held = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS") or ""
node = os.environ.get("SLURMD_NODENAME", "")
if not node or not held:
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(9)
try:
    with open({str(utilization_file(root))!r}) as f:
        util = json.load(f).get(node, {{}})
except (OSError, ValueError):
    util = {{}}
if any(a.startswith("--query-compute-apps") for a in sys.argv[1:]):
    sys.exit(0)  # no process holds the fake GPUs
for seen, index in enumerate(sorted(int(i) for i in held.split(",") if i.strip())):
    busy = int(util.get(str(index), 0))
    used = 20000 if busy else 0
    print(f"{{seen}}, GPU-fake-{{node}}-{{index}}, NVIDIA A100-SXM4-40GB, {{busy}}, {{used}}, "
          f"40960, 35, {{60 + 3 * busy}}.00, 400.00")
"""


def task_prolog(root: Path = ROOT) -> str:
    """Slurm's TaskProlog: each task's environment gains the fake driver's folder."""
    return f'#!/bin/sh\necho "export PATH={root}/conf/driver:$PATH"\n'


def unavailable() -> str | None:
    """None when the cluster can run here; otherwise why not."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs jobs as their users)"
    missing = [p for p in [*DAEMONS.values(), MUNGED, MARIADB] if not os.access(p, os.X_OK)]
    if missing or shutil.which("sbatch") is None or shutil.which("sacctmgr") is None:
        return "Slurm is not installed (run `bash scripts/slurm_cluster.sh`)"
    for sub in ("conf", "state", "spool", "log", "dev", "work", "mysql/data/mysql"):
        if not (ROOT / sub).is_dir():
            return f"{ROOT}/{sub} is missing (run `bash scripts/slurm_cluster.sh`)"
    if not (ROOT / "dev" / f"nvidia{2 * GPUS - 1}").exists():
        return f"{ROOT}/dev lacks the second node's GPUs (run `bash scripts/slurm_cluster.sh`)"
    for name in [*PEOPLE.values(), SHARED_ACCOUNT, BOT_ACCOUNT]:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return f"there is no account {name} (run `bash scripts/slurm_cluster.sh`)"
    try:
        if SUDOERS.read_text() != SUDOERS_TEXT:
            return f"{SUDOERS} is not this module's (run `bash scripts/slurm_cluster.sh`)"
    except OSError:
        return f"{SUDOERS} is missing (run `bash scripts/slurm_cluster.sh`)"
    return None


def _alive(pid: int, name: str) -> bool:
    """Running and still `name` (zombies linger here: kill -0 is no liveness check)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    return comm == name[:15] and stat[stat.rindex(")") + 2] != "Z"


def _stop(pid: int, name: str, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns when the process is gone."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not _alive(pid, name):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(pid, name):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap it where it is our child
            time.sleep(0.05)


def _flock(path: Path, mode: int, wait_s: float, what: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise SlurmClusterUnavailable(
                    f"another test session on this machine has held {what} for over "
                    f"{wait_s:.0f} s ({path})"
                ) from None
            time.sleep(0.05)


@contextlib.contextmanager
def _held(path: Path, what: str, wait_s: float = WAIT_S) -> Iterator[None]:
    fd = _flock(path, fcntl.LOCK_EX, wait_s, what)
    try:
        yield
    finally:
        os.close(fd)


@dataclass
class SlurmCluster:
    """The machine's test cluster as one process uses it (see the module docstring)."""

    conf: Path
    node: str
    gpus: int = GPUS
    gpu_type: str = GPU_TYPE
    gpu_model: str = GPU_MODEL
    cpus: int = CPUS
    partitions: tuple[str, ...] = PARTITIONS
    root: Path = ROOT
    _users_fd: int | None = field(default=None, repr=False)
    _children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def jobcomp(self) -> Path:
        return self.root / "log" / "jobcomp.txt"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def env(self) -> dict[str, str]:
        """What a Slurm client on this machine needs to find the cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "LC_ALL": "C"}

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    # --- the controller, for tests of a controller that does not answer -----------

    def stop_controller(self) -> None:
        with _held(CONTROL, "the Slurm test cluster"):
            _stop(_read_marker()["pids"]["slurmctld"], "slurmctld", 3.0)
            self._children.pop("slurmctld", None)

    def start_controller(self) -> None:
        """Start slurmctld again on its saved state (jobs survive) and wait until the
        node has registered again (about 4 s here), so a job submitted next can start."""
        self.repair()

    def set_utilization(self, node: str, busy: Mapping[int, int]) -> None:
        """What the node's fake GPUs report from now on (index → util %; others 0%)."""
        path = utilization_file(self.root)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        doc[node] = {str(i): int(pct) for i, pct in busy.items()}
        path.write_text(json.dumps(doc))

    def kill_node(self, node: str) -> None:
        """SIGKILL a node's slurmd, as a node that dies: its jobs' processes live on
        (slurmstepd), and slurmctld declares it DOWN after SLURMD_TIMEOUT_S. `repair`
        (the next lease) starts it again; ReturnToService=2 puts it back in use."""
        with _held(CONTROL, "the Slurm test cluster"):
            key = slurmd_key(node, self.node)
            pid = _read_marker()["pids"].get(key)
            if pid is not None and _alive(pid, "slurmd"):
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and _alive(pid, "slurmd"):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                    time.sleep(0.05)
            self._children.pop(key, None)

    @contextlib.contextmanager
    def controller_down(self) -> Iterator[None]:
        self.stop_controller()
        try:
            yield
        finally:
            self.start_controller()

    # --- lifecycle -----------------------------------------------------------------

    @property
    def nodes(self) -> tuple[str, str]:
        return (self.node, second_node(self.node))

    @property
    def second(self) -> str:
        return second_node(self.node)

    def _spawn(self, name: str) -> int:
        """Starts the daemon `name` (a marker key: "slurmd@NODE" is that node's slurmd)."""
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's)
        if name == "mariadbd":
            argv = mariadbd_argv(self.root)
        elif _comm(name) == "slurmd":
            node = name.partition("@")[2] or self.node
            (self.root / "spool" / node).mkdir(exist_ok=True)
            argv = [DAEMONS["slurmd"], "-D", "-N", node]
        else:
            argv = [DAEMONS[name], "-D"]
        with log:
            # Not the test process's environment: nothing of it may reach a job.
            proc = subprocess.Popen(
                argv,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(self.conf)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self._children[name] = proc
        return proc.pid

    def _munge_ok(self) -> bool:
        try:
            made = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
            if made.returncode != 0:
                return False
            back = subprocess.run(["unmunge"], input=made.stdout, capture_output=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return back.returncode == 0

    def _start_munged(self) -> int | None:
        """munged for this machine unless one answers already; its pid when we started it."""
        if self._munge_ok():
            return None
        run = Path("/run/munge")
        run.mkdir(mode=0o755, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        proc = subprocess.Popen(
            [MUNGED, "--foreground"],
            user="munge",
            group="munge",
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + GUARD_S
        while not self._munge_ok():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SlurmClusterUnavailable("munged did not start (see /var/log/munge)")
            time.sleep(0.05)
        return proc.pid

    def _sql(self, statements: str) -> subprocess.CompletedProcess[str]:
        """SQL as MariaDB's root (unix-socket authentication: this process is root)."""
        return subprocess.run(
            [
                MARIADB,
                "--no-defaults",
                f"--socket={db_socket(self.root)}",
                "-u",
                "root",
                "--batch",
                "-e",
                statements,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def _wait_for(self, name: str, ready: Callable[[], bool], log: Path) -> None:
        """Until `ready()`; the daemon `name` exiting first, or a hang, is an error."""
        deadline = time.monotonic() + GUARD_S
        while not ready():
            proc = self._children.get(name)
            if proc is not None and proc.poll() is not None:
                raise SlurmClusterUnavailable(f"{name} exited with {proc.returncode}: {_tail(log)}")
            if time.monotonic() > deadline:
                raise SlurmClusterUnavailable(f"{name} did not come up: {_tail(log)}")
            time.sleep(0.05)

    def _db_up(self) -> bool:
        try:
            return self._sql("SELECT 1").returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _dbd_up(self) -> bool:
        try:
            return (
                self.command("sacctmgr", "-n", "-P", "list", "cluster", timeout=5).returncode == 0
            )
        except subprocess.TimeoutExpired:
            return False

    def _start_database(self, pids: dict[str, int], fresh: bool) -> None:
        """mariadbd and slurmdbd; `fresh`: an empty accounting database (slurmctld's
        state is new too, and job ids start again at 1), with the lab's entities."""
        pids["mariadbd"] = self._spawn("mariadbd")
        self._wait_for("mariadbd", self._db_up, self.root / "mysql" / "error.log")
        if fresh:
            user = f"'{DB_USER}'@'127.0.0.1'"
            made = self._sql(
                f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY '{DB_PASSWORD}'; "
                f"ALTER USER {user} IDENTIFIED BY '{DB_PASSWORD}'; "
                f"DROP DATABASE IF EXISTS {DB_NAME}; CREATE DATABASE {DB_NAME}; "
                f"GRANT ALL ON {DB_NAME}.* TO {user};"
            )
            if made.returncode != 0:
                raise SlurmClusterUnavailable(f"MariaDB refused the set-up: {made.stderr[-300:]}")
        pids["slurmdbd"] = self._spawn("slurmdbd")
        self._wait_for("slurmdbd", self._dbd_up, self.root / "log" / "slurmdbd.log")
        if fresh:
            self._add_accounting()

    def _add_accounting(self) -> None:
        """The lab's QOS, then its cluster, accounts and users (idempotent: a repeat adds
        nothing)."""
        flat = self.conf.parent / "accounting.cfg"
        flat.write_text(accounting_file())
        extra = [q for q in QOS if q != DEFAULT_QOS]  # normal comes with the database
        for args in (["add", "qos", *extra], ["load", f"file={flat}"]):
            done = self.command("sacctmgr", "-i", *args)
            said = (done.stdout + done.stderr).strip()
            if done.returncode != 0 and "Nothing new added" not in said:  # a repeat
                raise SlurmClusterUnavailable(f"sacctmgr {' '.join(args)}: {said[-300:]}")

    def _wait_ready(self) -> None:
        """Until the controller answers and the node takes jobs (idle, not `idle*`)."""
        deadline = time.monotonic() + GUARD_S
        last = ""
        current = set(_read_marker()["pids"].values())
        while time.monotonic() < deadline:
            for name, proc in self._children.items():
                if proc.poll() is not None and proc.pid in current:
                    raise SlurmClusterUnavailable(
                        f"{name} exited with {proc.returncode}: "
                        + _tail(self.root / "log" / f"{name}.out")
                    )
            try:
                shown = self.command("sinfo", "-h", "-N", "-o", "%T", timeout=5)
                last = (shown.stdout + shown.stderr).strip()
                states = set(shown.stdout.split())
                if shown.returncode == 0 and states and states <= {"idle", "mixed", "allocated"}:
                    return
            except subprocess.TimeoutExpired:
                last = "sinfo timed out"
            time.sleep(0.1)
        raise SlurmClusterUnavailable(f"the Slurm test cluster did not come up: {last[-300:]}")

    def _start(self, digest: str) -> None:
        for sub in ("state", "spool"):
            for entry in (self.root / sub).iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        for old in (self.root / "log").iterdir():
            old.unlink()
        _stop_stray(self.root / "mysql" / "mariadbd.pid", "mariadbd")
        (self.root / "mysql" / "error.log").unlink(missing_ok=True)
        self.conf.write_text(slurm_conf(self.node, self.root))
        (self.conf.parent / "gres.conf").write_text(gres_conf(self.node, self.root))
        driver = self.conf.parent / "driver"
        driver.mkdir(mode=0o755, exist_ok=True)
        for path, text in (
            (driver / "nvidia-smi", fake_nvidia_smi(self.root)),
            (self.conf.parent / "task_prolog.sh", task_prolog(self.root)),
        ):
            path.write_text(text)
            path.chmod(0o755)
        utilization_file(self.root).write_text("{}")
        utilization_file(self.root).chmod(0o644)
        dbd = self.conf.parent / "slurmdbd.conf"
        dbd.unlink(missing_ok=True)  # created 0600 before its password is in it
        fd = os.open(dbd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(slurmdbd_conf(self.root))
        shutil.chown(dbd, "slurm", "slurm")
        pids: dict[str, int] = {}
        munged = self._start_munged()
        if munged is not None:
            pids["munged"] = munged
        try:
            self._start_database(pids, fresh=True)
            pids["slurmctld"] = self._spawn("slurmctld")
            for node in self.nodes:
                key = slurmd_key(node, self.node)
                pids[key] = self._spawn(key)
            marker: Marker = {"pids": pids, "digest": digest, "node": self.node}
            MARKER.write_text(json.dumps(marker))
            self._wait_ready()
        except BaseException:
            _stop_all(pids)
            MARKER.unlink(missing_ok=True)
            raise

    def open(self, wait_s: float = WAIT_S) -> None:
        """Attach to the machine's cluster, starting it when nobody uses one."""
        reason = unavailable()
        if reason is not None:
            raise SlurmClusterUnavailable(reason)
        digest = hashlib.sha256(
            json.dumps(
                [
                    slurm_conf(self.node, self.root),
                    gres_conf(self.node, self.root),
                    fake_nvidia_smi(self.root),
                    task_prolog(self.root),
                    slurmdbd_conf(self.root),
                    mariadbd_argv(self.root),
                    accounting_file(),
                ]
            ).encode()
        ).hexdigest()
        deadline = time.monotonic() + wait_s
        while True:
            with _held(CONTROL, "the Slurm test cluster", wait_s):
                marker = _read_marker() if MARKER.exists() else None
                ours = marker is not None and marker["digest"] == digest
                try:
                    users = _flock(USERS, fcntl.LOCK_EX, 0.0, "the users lock")
                except SlurmClusterUnavailable:
                    users = None
                if users is None and ours:
                    # In use with this config: a daemon that is down now (a test took the
                    # controller down, one crashed) is brought back by the next lease.
                    self._users_fd = _flock(USERS, fcntl.LOCK_SH, 5.0, "the users lock")
                    return
                if users is not None:
                    try:
                        alive = marker is not None and all(
                            _alive(pid, _comm(name)) for name, pid in marker["pids"].items()
                        )
                        if not (ours and alive):  # dead, or left by another config
                            if marker is not None:
                                _stop_all(marker["pids"])
                                MARKER.unlink(missing_ok=True)
                            self._start(digest)
                        fcntl.flock(users, fcntl.LOCK_SH)  # from exclusive to shared
                    except BaseException:
                        os.close(users)
                        raise
                    self._users_fd = users
                    return
            if time.monotonic() > deadline:
                raise SlurmClusterUnavailable(
                    "another test session on this machine runs a Slurm cluster with another "
                    f"config and has not let go for {wait_s:.0f} s ({MARKER})"
                )
            time.sleep(0.5)

    def close(self) -> None:
        """Let go; the last process to do so stops the daemons."""
        fd, self._users_fd = self._users_fd, None
        if fd is None:
            return
        try:
            with _held(CONTROL, "the Slurm test cluster"):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # another process still uses the cluster
                if MARKER.exists():
                    _stop_all(_read_marker()["pids"])
                    MARKER.unlink(missing_ok=True)
        finally:
            os.close(fd)
            for proc in self._children.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0)

    @contextlib.contextmanager
    def lease(self) -> Iterator[SlurmCluster]:
        """The whole cluster for one test; every job is cancelled when it ends."""
        with _held(LEASE, "the Slurm test cluster's lease"):
            self.repair()
            self.cancel_all()  # left by a session that was killed mid-test
            utilization_file(self.root).write_text("{}")  # every fake GPU at 0%
            try:
                yield self
            finally:
                self.cancel_all()
                utilization_file(self.root).write_text("{}")

    def repair(self) -> None:
        """Start again whatever daemon is down (a test that failed with the controller
        down, a crash), on the saved state, and wait until the node takes jobs."""
        with _held(CONTROL, "the Slurm test cluster"):
            marker = _read_marker()
            pids = marker["pids"]
            munged = self._start_munged()  # None while one answers
            if munged is not None:
                pids["munged"] = munged
            try:
                if not _alive(pids["mariadbd"], "mariadbd"):
                    _stop(pids["slurmdbd"], "slurmdbd", 3.0)  # it would not reconnect
                    self._start_database(pids, fresh=False)
                elif not _alive(pids["slurmdbd"], "slurmdbd"):
                    pids["slurmdbd"] = self._spawn("slurmdbd")
                    self._wait_for("slurmdbd", self._dbd_up, self.root / "log" / "slurmdbd.log")
                names = ["slurmctld", *(slurmd_key(n, self.node) for n in self.nodes)]
                for name in names:
                    if name not in pids or not _alive(pids[name], _comm(name)):
                        pids[name] = self._spawn(name)
            finally:
                MARKER.write_text(json.dumps(marker))
            self._wait_ready()

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left running (guarded, not timed)."""
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            # %F: a job array's own id (one scancel ends every task of it; its pending
            # record's "%i", 12_[8-99%8], is no id scancel takes).
            shown = self.command("squeue", "-h", "-o", "%F %T")
            active = sorted({ln.split()[0] for ln in shown.stdout.splitlines() if ln.strip()})
            if shown.returncode == 0 and not active:
                return
            if active:
                self.command("scancel", *active)
            time.sleep(0.1)


def _read_marker() -> Marker:
    data: Marker = json.loads(MARKER.read_text())
    return data


def _stop_all(pids: dict[str, int]) -> None:
    # The node first (it would otherwise retry registering with a gone controller), the
    # database last (slurmctld and slurmdbd flush to it as they stop).
    graces = {"slurmd": 2.0, "slurmctld": 3.0, "slurmdbd": 3.0, "mariadbd": 10.0, "munged": 3.0}
    for name, grace in graces.items():
        for key, pid in pids.items():
            if _comm(key) == name:
                _stop(int(pid), name, grace)


def _stop_stray(pidfile: Path, name: str) -> None:
    """A daemon of this cluster's that no marker names (a session killed mid-start)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    _stop(pid, name, 10.0)


def _tail(path: Path, chars: int = 500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no {path})"


@contextlib.contextmanager
def running_cluster(wait_s: float = WAIT_S) -> Iterator[SlurmCluster]:
    """The machine's cluster for one process (a bench, a test session's worker)."""
    cluster = SlurmCluster(conf=ROOT / "conf" / "slurm.conf", node=node_name())
    cluster.open(wait_s)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def slurm_machine() -> Iterator[SlurmCluster]:
    """This process's hold on the machine's cluster (started by the first to ask)."""
    cluster = SlurmCluster(conf=ROOT / "conf" / "slurm.conf", node=node_name())
    try:
        cluster.open()
    except SlurmClusterUnavailable as exc:
        pytest.skip(f"no Slurm test cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm_cluster(slurm_machine: SlurmCluster) -> Iterator[SlurmCluster]:
    """The one-node cluster (4 fake A100s, 2000 MB, partitions short, long and urgent),
    this test's alone: its jobs are cancelled afterwards. In the "slurm" xdist group
    (tests/conftest.py)."""
    with slurm_machine.lease() as cluster:
        yield cluster


def make_lab_workdir(root: Path = ROOT) -> Path:
    """A fresh directory every job account can reach, as a lab's shared work directory:
    owned by the bot's account, group LAB_GROUP (all the lab's accounts), mode 2770
    (setgid: what a job writes there is the group's), its parents traversable."""
    parent = root / "work"
    path = Path(tempfile.mkdtemp(prefix="w-", dir=parent))
    shutil.chown(path, BOT_ACCOUNT, LAB_GROUP)
    path.chmod(0o2770)
    return path


@pytest.fixture
def lab_workdir() -> Iterator[Path]:
    """A fresh shared work directory (`make_lab_workdir`), removed afterwards."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no Slurm test cluster: {reason}")
    path = make_lab_workdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
