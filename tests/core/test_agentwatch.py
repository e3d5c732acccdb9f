"""bot.app.hosts.agentwatch in the worker's poll: lease renewal and runs lost in a reboot.

Real sshd hosts on loopback (127.0.0.2, 127.0.0.3) declared as static hosts, the worker's
own `build_runtime` → `RunService.poll`/`dispatch`, and the real host agent run over SSH
with ``--once`` (a reboot is a new boot id in a file plus the run's processes killed).
The spot-notice path end to end is tests/provisioning/test_spot_resume.py.

A shortcut: the hosts log in as the bot's own user (the default lab) and run the agent and
runs with the bot's interpreter and code, without a bootstrap; these tests are about what
the worker does with the agent's reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, col, select

from bot.app.config import load_settings
from bot.app.hosts import agentwatch
from bot.app.hosts.hostagent import host_holds
from bot.app.hosts.hostcheck import HostChecker
from bot.app.hosts.remote import PreparedHost
from bot.app.runs.processes import ProcessExecutor
from bot.domain.commands import Cancel, Reserve, Run
from bot.faces.runtime import Runtime, build_runtime
from db.models import Host, TrainingRun, UsageInterval
from provisioning.hostshell import HostShell
from provisioning.ssh import LOOPBACK_ONLY_ENV, SshClient, SshTarget
from tests.runtime_helpers import checked, run_row
from tests.runtime_helpers import dms as _dms
from tests.ssh_hosts import SshLab, running_lab
from training.agent import LEASE_NAME, LOST_NAME

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    with running_lab(tmp_path_factory.mktemp("sshd-agentwatch")) as lab:
        yield lab


def _kill_run_processes(run_dir: Path) -> None:
    """What a reboot does to a run: every process working in its directory dies (the
    runner's child has its own process group, so a group kill alone would miss it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cwd = os.readlink(entry / "cwd")
            if cwd == str(run_dir) or cwd.startswith(f"{run_dir}/"):
                os.kill(int(entry.name), signal.SIGKILL)


class Bench:
    """A runtime over static sshd hosts, each with its own root on this machine."""

    def __init__(self, lab: SshLab, names: tuple[str, ...], home: Path) -> None:
        self.lab = lab
        self.roots: dict[str, Path] = {}
        for name in names:
            lab.hosts[name].root.mkdir(parents=True, exist_ok=True)
            self.roots[name] = Path(tempfile.mkdtemp(dir=lab.hosts[name].root))
        self.client = SshClient(connect_timeout=5, command_timeout=60)

        def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
            root = str(self.roots[target.name])
            return PreparedHost(root=root, python=sys.executable, code_dir=str(REPO))

        # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about the agent's reports;
        # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
        self.rt: Runtime = checked(build_runtime(load_settings(), ssh=self.client, prepare=prepare))
        runs = self.rt.service.runs
        self.runs = runs

    def target(self, name: str) -> SshTarget:
        host = self.lab.hosts[name]
        return SshTarget(
            host=host.address, port=host.port, user=self.lab.user,
            key_path=str(self.lab.client_key), name=name,
        )  # fmt: skip

    def agent_once(self, name: str, boot_id: str) -> dict[str, Any]:
        root = self.roots[name]
        (root / "boot_id").write_text(f"{boot_id}\n")
        argv = [
            sys.executable, "-m", "training.agent", "--once",
            "--state-dir", str(root / "agent"), "--runs-dir", str(root / "runs"),
            "--stop-command", "", "--imds-endpoint", "none",
            "--boot-id-file", str(root / "boot_id"),
        ]  # fmt: skip
        out = self.client.run(self.target(name), shlex.join(argv), 60, cwd=str(REPO))
        assert out.ok, out.stderr
        doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return doc

    def lease(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.roots[name] / "agent" / LEASE_NAME).read_text())
        return doc

    def run(self, rid: int) -> TrainingRun:
        return run_row(self.rt, rid)

    def dms(self, user: str) -> list[str]:
        return _dms(self.rt, user)

    def close(self) -> None:
        for root in self.roots.values():
            _kill_run_processes(root / "runs")
        self.client.close()
        self.rt.engine.dispose()
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def bench_for(
    lab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Bench]]:
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "bot"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(lab.client_key))
    made: list[Bench] = []

    def make(**gpus: str) -> Bench:
        entries = []
        for name, spec in gpus.items():
            host = lab.hosts[name.replace("_", "-")]
            entries.append(f"{host.name}={lab.user}@{host.address}:{host.port}/{spec}")
        monkeypatch.setenv("GPUBOT_SSH_HOSTS", ",".join(entries))
        bench = Bench(lab, tuple(n.replace("_", "-") for n in gpus), tmp_path)
        made.append(bench)
        return bench

    try:
        yield make
    finally:
        for bench in made:
            bench.close()


def _wait_running(bench: Bench, rid: int) -> TrainingRun:
    deadline = time.monotonic() + 60
    while (run := bench.run(rid)).state != "running" or "pgid" not in run.placement:
        assert time.monotonic() < deadline, run
        time.sleep(0.1)
    return run


def test_after_a_poll_each_host_lease_lists_what_the_database_holds(
    bench_for: Callable[..., Bench],
) -> None:
    bench = bench_for(gpu_a="2xcpu", gpu_b="1xcpu")
    alice = bench.rt.service.actor("alice")
    bench.rt.service.reserve(alice, Reserve(1, "cpu"))
    rid = bench.runs.submit(alice, Run(command=("sleep", "600"), model="cpu")).extra["run_id"]
    assert bench.runs.dispatch() == 1
    run = _wait_running(bench, rid)
    before = time.time()
    assert bench.runs.poll() == 0
    with Session(bench.rt.engine) as s:
        hosts = {h.name: h.id for h in s.exec(select(Host))}
        holds = {name: host_holds(s, hid) for name, hid in hosts.items() if hid is not None}
    held = {"reservations": 0, "runs": 0}
    for name, hold in holds.items():
        lease = bench.lease(name)
        assert before - 1 <= lease["renewed_at"] <= time.time()
        assert lease["reservations"] == [{"id": r.id, "until": r.until} for r in hold.reservations]
        assert lease["runs"] == [{"id": r.id, "pgid": r.pgid} for r in hold.runs]
        held["reservations"] += len(hold.reservations)
        held["runs"] += len(hold.runs)
    assert held == {"reservations": 1, "runs": 1}  # one of each, somewhere
    assert bench.lease(run.placement["host"])["runs"] == [
        {"id": str(rid), "pgid": run.placement["pgid"]}
    ]

    # The agent on the run's host reads it as the bot meant it.
    seen = bench.agent_once(run.placement["host"], "boot-1")
    assert [(r["id"], r["pgid"]) for r in seen["runs"]] == [(str(rid), run.placement["pgid"])]

    # A lease that holds nothing new is not written on every poll (50 hosts' writes every
    # 15 s were most of a tick: issue 39) ...
    first = bench.lease(run.placement["host"])["renewed_at"]
    time.sleep(0.05)
    bench.runs.poll()
    assert bench.lease(run.placement["host"])["renewed_at"] == first
    # ... but again once it is RENEW_EVERY_S old (here made 0), the value moving with the clock,
    executor = bench.runs.ctx.executor
    assert isinstance(executor, ProcessExecutor)
    executor.leases.every_s = 0.0
    bench.runs.poll()
    second = bench.lease(run.placement["host"])["renewed_at"]
    assert second > first
    # ... and at once when what it holds changed: the run ended, the next poll says so.
    executor.leases.every_s = 3600.0
    bench.runs.cancel(alice, Cancel(rid))
    deadline = time.monotonic() + 60
    while bench.run(rid).state != "cancelled":
        assert time.monotonic() < deadline, bench.run(rid)
        bench.runs.poll()
        time.sleep(0.1)
    bench.runs.poll()
    assert bench.lease(run.placement["host"])["runs"] == []


def test_a_run_lost_in_a_reboot_is_requeued_once(bench_for: Callable[..., Bench]) -> None:
    bench = bench_for(gpu_a="1xcpu")
    alice = bench.rt.service.actor("alice")
    rid = bench.runs.submit(alice, Run(command=("sleep", "600"), model="cpu")).extra["run_id"]
    assert bench.runs.dispatch() == 1
    run = _wait_running(bench, rid)
    bench.runs.poll()  # the lease names the run
    assert [r["id"] for r in bench.agent_once("gpu-a", "boot-1")["runs"]] == [str(rid)]

    # The host reboots: the run's processes are gone, the boot id is new.
    _kill_run_processes(Path(run.placement["dir"]))
    deadline = time.monotonic() + 10
    while bench.client.is_alive(bench.target("gpu-a"), int(run.placement["pgid"])):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = bench.agent_once("gpu-a", "boot-2")
    assert after["lost"] == [str(rid)], after
    lost = json.loads((bench.roots["gpu-a"] / "agent" / LOST_NAME).read_text())
    assert [e["id"] for e in lost["runs"]] == [str(rid)]

    # The worker requeues it (not "failed: ended without a final status").
    assert bench.runs.poll() == 0
    requeued = bench.run(rid)
    assert requeued.state == "queued" and requeued.host_id is None
    resume = requeued.placement["resume_from"]
    assert resume["reason"] == "the host rebooted" and resume["dir"] is None
    assert resume["lost_seen"] == [f"gpu-a@{lost['runs'][0]['lost_at']:.3f}"]
    back = [d for d in bench.dms("alice") if "back in line" in d]
    assert back == [
        f"Run #{rid} was interrupted on gpu-a (the host rebooted); it is back in line and "
        "starts again from step 0: it had no checkpoint yet."
    ]

    # Placed again on the same host; the report still lists the old loss, acted on once.
    assert bench.runs.dispatch() == 1
    again = _wait_running(bench, rid)
    assert again.placement["pgid"] != run.placement["pgid"]
    for _ in range(3):
        assert bench.runs.poll() == 0
        assert bench.run(rid).state == "running"
    assert json.loads((bench.roots["gpu-a"] / "agent" / LOST_NAME).read_text()) == lost
    assert len([d for d in bench.dms("alice") if "back in line" in d]) == 1
    assert bench.agent_once("gpu-a", "boot-2")["lost"] == []


# --- a stop for a resume without any agent: the runner's exit 75 alone ----------------------

RESUMING_SCRIPT = """\
import os, pathlib, sys
state = pathlib.Path(os.environ["GPUBOT_CHECKPOINT_DIR"]) / "state.txt"
if state.exists():
    print("resumed with", state.read_text())
    sys.exit(0)
state.write_text("step 7")
sys.exit(75)
"""


@pytest.fixture
def local_rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    monkeypatch.setenv("GPUBOT_PROVIDER", "local")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "bot"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    rt = build_runtime(load_settings())
    try:
        yield rt
    finally:
        rt.engine.dispose()


def _drive(rt: Runtime, rid: int, until: Callable[[TrainingRun], bool]) -> TrainingRun:
    runs = rt.service.runs
    deadline = time.monotonic() + 120
    while True:
        with Session(rt.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
        if until(run):
            return run
        assert time.monotonic() < deadline, run
        runs.poll()
        time.sleep(0.1)


def test_exit_75_requeues_with_the_checkpoint_which_the_next_start_uploads(
    local_rt: Runtime, tmp_path: Path
) -> None:
    runs = local_rt.service.runs
    script = tmp_path / "train.py"
    script.write_text(RESUMING_SCRIPT)
    alice = local_rt.service.actor("alice")
    rid = runs.submit(alice, Run(command=(sys.executable, str(script)))).extra["run_id"]
    assert runs.dispatch() == 1
    run = _drive(local_rt, rid, lambda r: r.state == "queued")
    resume = run.placement["resume_from"]
    saved = tmp_path / "bot" / "checkpoints" / str(rid) / "state.txt"
    assert resume["dir"] == str(saved.parent) and saved.read_text() == "step 7"
    assert resume["count"] == 1 and resume["reason"] == "stopped by SIGTERM"
    with Session(local_rt.engine) as s:
        open_usage = s.exec(
            select(UsageInterval).where(col(UsageInterval.ended_at).is_(None))
        ).all()
    assert open_usage == []  # its GPUs went back while it waits
    assert [d for d in _dms(local_rt, "alice") if "back in line" in d] == [
        f"Run #{rid} was interrupted on local (stopped by SIGTERM); it is back in line and "
        "resumes from its last checkpoint."
    ]
    # The old run dir's checkpoint is gone (as with a lost disk): the saved copy serves.
    first_dir = Path(str(tmp_path / "bot" / "runs" / str(rid) / "checkpoints"))
    shutil.rmtree(first_dir)
    assert runs.dispatch() == 1
    done = _drive(local_rt, rid, lambda r: r.state not in ("queued", "starting", "running"))
    assert done.state == "succeeded", done.metrics
    log = Path(done.placement["log"]).read_text()
    assert "resumed with step 7" in log
    assert sum(d.startswith(f"Run #{rid} started on local") for d in _dms(local_rt, "alice")) == 2


def test_a_run_that_always_asks_to_resume_fails_after_the_cap(
    local_rt: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agentwatch, "MAX_RESUMES", 2)
    runs = local_rt.service.runs
    script = tmp_path / "always75.py"
    script.write_text("import sys\nsys.exit(75)\n")
    alice = local_rt.service.actor("alice")
    rid = runs.submit(alice, Run(command=(sys.executable, str(script)))).extra["run_id"]
    for _ in range(3):
        assert runs.dispatch() == 1
        run = _drive(local_rt, rid, lambda r: r.state not in ("starting", "running"))
    assert run.state == "failed" and run.exit_code == 75
    assert len([d for d in _dms(local_rt, "alice") if "back in line" in d]) == 2
    assert "starts again from step 0: it had no checkpoint yet" in _dms(local_rt, "alice")[1]


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[None]:
    """A filesystem of `size` of its own at `path` (a tmpfs: needs root, as CI has)."""
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        yield
    finally:
        _kill_run_processes(path)
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_fails_the_run_by_name_and_the_host_takes_nothing_until_it_has_room(
    bench_for: Callable[..., Bench], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: a run that fills its host's disk fails with "disk full on HOST" (not a
    run that vanished without a status), its owner is told so, and the host is taken out
    of placements while its SSH still serves the runs on it, until a check finds room."""
    monkeypatch.setenv("GPUBOT_MIN_FREE_MB", "1")
    bench = bench_for(gpu_a="2xcpu")
    runs_dir = bench.roots["gpu-a"] / "runs"
    with _small_disk(runs_dir, "4m"):
        alice = bench.rt.service.actor("alice")
        fill = "open('fill', 'wb').write(b'x' * (8 << 20))"  # twice the disk, in its run dir
        rid = bench.runs.submit(alice, Run(command=(sys.executable, "-c", fill), model="cpu"))
        run_id = rid.extra["run_id"]
        assert bench.runs.dispatch() == 1
        deadline = time.monotonic() + 90
        while bench.run(run_id).state not in ("failed", "succeeded"):
            assert time.monotonic() < deadline, bench.run(run_id)
            bench.runs.poll()
            time.sleep(0.2)
        run = bench.run(run_id)
        assert run.state == "failed"
        error = str(run.metrics.get("summary", {}).get("error") or "")
        assert error.startswith("disk full on gpu-a: "), run.metrics
        assert any("disk full on gpu-a" in text for text in bench.dms("alice"))
        with Session(bench.rt.engine) as s:
            host = s.exec(select(Host).where(Host.name == "gpu-a")).one()
        assert host.state == "unreachable" and host.down_since is None
        assert (host.down_reason or "").startswith("disk full on gpu-a")

        # Nothing new goes there while it is full; a check that still finds it full keeps it so.
        queued = bench.runs.submit(alice, Run(command=("true",), model="cpu")).extra["run_id"]
        assert bench.runs.dispatch() == 0
        (checker,) = bench.rt.service.places.checkers
        assert isinstance(checker, HostChecker)
        assert not checker.check("gpu-a").ok
        assert bench.run(queued).state == "queued"

        # Room again (the owner cleaned up): the next check brings it back, the run starts.
        for filler in runs_dir.rglob("fill"):
            filler.unlink()
        assert checker.check("gpu-a").ok
        with Session(bench.rt.engine) as s:
            host = s.exec(select(Host).where(Host.name == "gpu-a")).one()
        assert host.state == "ready" and host.down_reason is None
        assert bench.runs.dispatch() == 1
        deadline = time.monotonic() + 90
        while bench.run(queued).state != "succeeded":
            assert time.monotonic() < deadline, bench.run(queued)
            bench.runs.poll()
            time.sleep(0.2)
