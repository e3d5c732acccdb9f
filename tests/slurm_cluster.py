"""A real one-node Slurm cluster for tests: slurmctld, slurmd and munge from Debian.

`scripts/slurm_cluster.sh` installs the packages and prepares what needs root (munge
key, state directories, four fake GPU device files); this module writes the config and
runs the daemons. Slurm's ports (6817/6818) are fixed and munged serves the whole
machine, so there is one cluster per machine, shared by every pytest-xdist worker and
by every test session on the machine (two worktrees, a bench):

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
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
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

GPUS = 4
GPU_TYPE = "a100"
GPU_MODEL = "A100"
CPUS = 8
PARTITIONS = ("gpu", "short")  # gpu is the default; short has a 30-minute MaxTime
# Seconds Slurm keeps a finished job in squeue (22.05 accepts 2; default 300): low, so
# a test sees a job forgotten without waiting minutes.
MIN_JOB_AGE = 3
# How long a session waits for another session on this machine to let go.
WAIT_S = float(os.environ.get("GPUBOT_TEST_LOCK_WAIT", "1800"))
GUARD_S = 60.0  # a daemon that takes longer than this to come up is broken, not slow
DAEMONS = {"slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
MUNGED = "/usr/sbin/munged"


class Marker(TypedDict):
    """What MARKER holds: the daemons' pids (munged only where this cluster started it)."""

    pids: dict[str, int]
    digest: str
    node: str


class SlurmClusterUnavailable(Exception):
    """The cluster cannot run here; the message says why (a skip reason)."""


def node_name() -> str:
    return socket.gethostname().split(".")[0]


def slurm_conf(node: str, root: Path = ROOT) -> str:
    """The cluster's slurm.conf (NOTES.md in ../shared/slurm says why each line is there)."""
    return "\n".join(
        [
            "ClusterName=gpubot-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "AuthInfo=cred_expire=10",  # a requeued job waits this long (default 120 s)
            "SlurmUser=slurm",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/state/slurmctld.pid",
            f"SlurmdPidFile={root}/spool/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",  # no cgroups here
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",  # CPUs=8 on 2 real cores
            "GresTypes=gpu",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",  # the history of finished jobs: no slurmdbd
            f"JobCompLoc={root}/log/jobcomp.txt",
            "SchedulerParameters=bf_interval=1",
            f"MinJobAge={MIN_JOB_AGE}",
            "KillWait=2",  # a cancelled job's processes get SIGKILL 2 s after SIGTERM
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=2000 "
            f"Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN",
            f"PartitionName={PARTITIONS[0]} Nodes={node} Default=YES DefaultTime=01:00:00 "
            "MaxTime=INFINITE State=UP",
            f"PartitionName={PARTITIONS[1]} Nodes={node} DefaultTime=00:10:00 "
            "MaxTime=00:30:00 State=UP",
            "",
        ]
    )


def gres_conf(node: str, root: Path = ROOT) -> str:
    last = GPUS - 1
    return (
        f"AutoDetect=off\nNodeName={node} Name=gpu Type={GPU_TYPE} "
        f"File={root}/dev/nvidia[0-{last}]\n"
    )


def unavailable() -> str | None:
    """None when the cluster can run here; otherwise why not."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs jobs as their users)"
    missing = [p for p in [*DAEMONS.values(), MUNGED] if not os.access(p, os.X_OK)]
    if missing or shutil.which("sbatch") is None:
        return "Slurm is not installed (run `bash scripts/slurm_cluster.sh`)"
    for sub in ("conf", "state", "spool", "log", "dev"):
        if not (ROOT / sub).is_dir():
            return f"{ROOT}/{sub} is missing (run `bash scripts/slurm_cluster.sh`)"
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

    @contextlib.contextmanager
    def controller_down(self) -> Iterator[None]:
        self.stop_controller()
        try:
            yield
        finally:
            self.start_controller()

    # --- lifecycle -----------------------------------------------------------------

    def _spawn(self, name: str) -> int:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's)
        with log:
            # Not the test process's environment: nothing of it may reach a job.
            proc = subprocess.Popen(
                [DAEMONS[name], "-D"],
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
                        + _tail(self.root / "log" / f"{name}.log")
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
        self.conf.write_text(slurm_conf(self.node, self.root))
        (self.conf.parent / "gres.conf").write_text(gres_conf(self.node, self.root))
        pids: dict[str, int] = {}
        munged = self._start_munged()
        if munged is not None:
            pids["munged"] = munged
        try:
            pids["slurmctld"] = self._spawn("slurmctld")
            pids["slurmd"] = self._spawn("slurmd")
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
            (slurm_conf(self.node, self.root) + gres_conf(self.node, self.root)).encode()
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
                            _alive(pid, name) for name, pid in marker["pids"].items()
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
            try:
                yield self
            finally:
                self.cancel_all()

    def repair(self) -> None:
        """Start again whatever daemon is down (a test that failed with the controller
        down, a crash), on the saved state, and wait until the node takes jobs."""
        with _held(CONTROL, "the Slurm test cluster"):
            marker = _read_marker()
            pids = marker["pids"]
            munged = self._start_munged()  # None while one answers
            if munged is not None:
                pids["munged"] = munged
            for name in DAEMONS:
                if not _alive(pids[name], name):
                    pids[name] = self._spawn(name)
            MARKER.write_text(json.dumps(marker))
            self._wait_ready()

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left running (guarded, not timed)."""
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            shown = self.command("squeue", "-h", "-o", "%i %T")
            active = [line.split()[0] for line in shown.stdout.splitlines() if line.strip()]
            if shown.returncode == 0 and not active:
                return
            if active:
                self.command("scancel", *active)
            time.sleep(0.1)


def _read_marker() -> Marker:
    data: Marker = json.loads(MARKER.read_text())
    return data


def _stop_all(pids: dict[str, int]) -> None:
    # The node first (it would otherwise retry registering with a gone controller).
    for name, grace in (("slurmd", 2.0), ("slurmctld", 3.0), ("munged", 3.0)):
        if name in pids:
            _stop(int(pids[name]), name, grace)


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
    """The one-node cluster (4 fake A100s, partitions gpu and short), this test's alone:
    its jobs are cancelled afterwards. In the "slurm" xdist group (tests/conftest.py)."""
    with slurm_machine.lease() as cluster:
        yield cluster
