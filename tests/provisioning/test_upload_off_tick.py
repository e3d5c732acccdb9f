"""A run's code is uploaded off the tick (bot.app.runs.starts), on a real loopback sshd host.

The SSH client is the real one with one seam: its `upload_dir` can be held at a gate,
then go on, fail as a dropped link would, or stop dead as a killed worker would (a
BaseException that nothing in the bot catches, so nothing after it runs). The tests
wait for that gate and for the start's future, never for time. No bootstrap (a
shortcut on the bot's own loopback hosts): these tests are about who waits for an upload.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, col, select

from bot.app.config import load_settings
from bot.app.hosts.remote import PreparedHost
from bot.app.hosts.sources import stage
from bot.app.runs import STARTING_GRACE, RunService
from bot.domain.clock import VirtualClock
from bot.domain.commands import Queue, Run
from bot.faces.runtime import Runtime, build_runtime
from bot.faces.terminal import render
from db.models import UsageInterval
from provisioning.ssh import LOOPBACK_ONLY_ENV, SshClient, SshError, SshTarget, UploadReport
from tests.runtime_helpers import checked, drive_until
from tests.runtime_helpers import dms as _dms
from tests.runtime_helpers import run_row as _run
from tests.ssh_hosts import SshLab

START = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)


class Killed(BaseException):
    """The worker died here: not an error the bot handles, nothing after it runs."""


class GatedClient(SshClient):
    """The real client; its uploads wait at `gate`, then do `then` ("go", "fail", "die")."""

    def __init__(self, then: str = "go") -> None:
        super().__init__(connect_timeout=5, command_timeout=60)
        self.then = then
        self.entered = threading.Event()
        self.gate = threading.Event()

    def upload_dir(self, target: SshTarget, local_dir: Any, remote_dir: str, **kw: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if self.then == "fail":
            raise SshError(f"connection to {target.name} reset during the upload")
        if self.then == "die":
            raise Killed()
        report: UploadReport = super().upload_dir(target, local_dir, remote_dir, **kw)
        return report


@pytest.fixture
def env(
    ssh_lab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[SshClient, VirtualClock], Runtime]]:
    host = ssh_lab.hosts["gpu-a"]
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    entry = f"gpu-a={ssh_lab.user}@{host.address}:{host.port}/2xcpu"
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", entry)
    remote = PreparedHost(root=str(tmp_path / "onhost"), python=sys.executable)
    made: list[tuple[Runtime, SshClient]] = []

    def runtime(client: SshClient, clock: VirtualClock) -> Runtime:
        rt = checked(
            build_runtime(
                load_settings(), clock=clock, ssh=client, prepare=lambda runner, target: remote
            )
        )
        made.append((rt, client))
        return rt

    yield runtime
    for rt, client in made:
        if isinstance(client, GatedClient):
            client.gate.set()
        runs = rt.service.runs
        if runs is not None:
            runs.ctx.starts.close()
        client.close()
        rt.engine.dispose()


def _project(tmp_path: Path, home: Path) -> str:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "train.py").write_text("import pathlib\npathlib.Path('ran.txt').write_text('yes')\n")
    return stage(proj, home).source.text()


def _until(runs: RunService, done: Callable[[], bool]) -> None:
    drive_until(runs, done, "the runs did not get there", guard_s=120)


def _open_intervals(rt: Runtime, rid: int) -> int:
    with Session(rt.engine) as s:
        return len(
            s.exec(
                select(UsageInterval).where(
                    UsageInterval.run_id == rid, col(UsageInterval.ended_at).is_(None)
                )
            ).all()
        )


def test_a_slow_upload_blocks_no_tick_and_shows_in_the_queue(
    env: Callable[[SshClient, VirtualClock], Runtime], tmp_path: Path
) -> None:
    client = GatedClient()
    clock = VirtualClock(START)
    rt = env(client, clock)
    runs = rt.service.runs
    alice, bob = rt.service.actor("alice"), rt.service.actor("bob")
    source = _project(tmp_path, rt.settings.home)
    slow = runs.submit(
        alice, Run(command=(sys.executable, "train.py"), model="cpu", source=source)
    ).extra["run_id"]
    quick = runs.submit(bob, Run(command=(sys.executable, "-c", "pass"), model="cpu")).extra[
        "run_id"
    ]

    # The tick returns while the upload is held; the other run starts and finishes.
    assert runs.dispatch() == 2
    assert client.entered.wait(60)
    assert runs.ctx.starts.in_flight(slow)
    queue = render(runs.queue(alice, Queue()).view)
    line = next(ln for ln in queue.splitlines() if f"#{slow}" in ln)
    assert "uploading code" in line and "starting on gpu-a" in line, queue
    _until(runs, lambda: _run(rt, quick).state == "succeeded")
    # Past the starting grace, poll still leaves it alone: its start is in flight here.
    clock.advance(STARTING_GRACE + timedelta(seconds=1))
    runs.poll()
    assert _run(rt, slow).state == "starting" and runs.ctx.starts.in_flight(slow)

    # The upload goes on; the run starts, with the same DM as ever, and finishes.
    client.gate.set()
    runs.ctx.starts.wait(60)
    run = _run(rt, slow)
    assert run.state in ("running", "succeeded") and "stage" not in run.placement
    assert run.placement["code"] == {"uploaded": ["train.py"], "skipped": 0}
    _until(runs, lambda: _run(rt, slow).state == "succeeded")
    started = [dm for dm in _dms(rt, "alice") if dm.startswith(f"Run #{slow} started on gpu-a")]
    assert len(started) == 1
    assert (Path(run.placement["dir"]) / "code" / "ran.txt").read_text() == "yes"


def test_an_upload_that_fails_ends_the_run_with_the_reason_and_frees_its_slot(
    env: Callable[[SshClient, VirtualClock], Runtime], tmp_path: Path
) -> None:
    client = GatedClient(then="fail")
    rt = env(client, VirtualClock(START))
    runs = rt.service.runs
    source = _project(tmp_path, rt.settings.home)
    rid = runs.submit(
        rt.service.actor("alice"),
        Run(command=(sys.executable, "train.py"), model="cpu", source=source),
    ).extra["run_id"]
    assert runs.dispatch() == 1
    client.gate.set()
    runs.ctx.starts.wait(60)
    run = _run(rt, rid)
    assert run.state == "failed"
    assert run.metrics["summary"]["error"] == (
        "could not start: connection to gpu-a reset during the upload"
    )
    assert _open_intervals(rt, rid) == 0
    assert any(f"#{rid}" in dm and "reset during the upload" in dm for dm in _dms(rt, "alice"))


def test_a_worker_killed_mid_upload_loses_nothing_the_next_one_uploads_it_again(
    env: Callable[[SshClient, VirtualClock], Runtime], tmp_path: Path
) -> None:
    dying = GatedClient(then="die")
    first = env(dying, VirtualClock(START))
    runs = first.service.runs
    source = _project(tmp_path, first.settings.home)
    rid = runs.submit(
        first.service.actor("alice"),
        Run(command=(sys.executable, "train.py"), model="cpu", source=source),
    ).extra["run_id"]
    assert runs.dispatch() == 1
    assert dying.entered.wait(60)
    dying.gate.set()  # the worker dies inside the upload: nothing after it runs
    runs.ctx.starts.wait(60)
    assert _run(first, rid).state == "starting" and "pgid" not in _run(first, rid).placement

    # Another worker, later, on the same database: the run is back in line, uploaded
    # again, and runs once; its owner hears of it once.
    again = env(
        SshClient(connect_timeout=5, command_timeout=60),
        VirtualClock(START + STARTING_GRACE + timedelta(seconds=1)),
    )
    runs2 = again.service.runs
    assert runs2 is not None
    runs2.poll()
    assert _run(again, rid).state == "queued" and _open_intervals(again, rid) == 0
    _until(runs2, lambda: _run(again, rid).state in ("succeeded", "failed"))
    run = _run(again, rid)
    assert run.state == "succeeded", run.metrics
    assert (Path(run.placement["dir"]) / "code" / "ran.txt").read_text() == "yes"
    started = [dm for dm in _dms(again, "alice") if dm.startswith(f"Run #{rid} started")]
    assert len(started) == 1


def test_a_start_that_outlives_its_workers_lead_stops_what_it_started(
    env: Callable[[SshClient, VirtualClock], Runtime], tmp_path: Path
) -> None:
    # A worker that lost the lead, alive, in a long upload: the new leader puts the run
    # back in line after the starting grace. When the old upload ends, what it started
    # is stopped and nothing is recorded, so the run cannot run twice.
    slow = GatedClient()
    first = env(slow, VirtualClock(START))
    runs = first.service.runs
    proj = tmp_path / "proj"
    proj.mkdir()
    marker = tmp_path / "started-by-the-old-leader"
    (proj / "train.py").write_text(
        "import pathlib, sys, time\npathlib.Path(sys.argv[1]).write_text('yes')\ntime.sleep(600)\n"
    )
    source = stage(proj, first.settings.home).source.text()
    rid = runs.submit(
        first.service.actor("alice"),
        Run(command=(sys.executable, "train.py", str(marker)), model="cpu", source=source),
    ).extra["run_id"]
    assert runs.dispatch() == 1
    assert slow.entered.wait(60)

    leader = env(
        SshClient(connect_timeout=5, command_timeout=60),
        VirtualClock(START + STARTING_GRACE + timedelta(seconds=1)),
    )
    runs2 = leader.service.runs
    assert runs2 is not None
    runs2.poll()
    assert _run(leader, rid).state == "queued"

    slow.gate.set()  # the old worker's upload ends; its start goes on
    runs.ctx.starts.wait(60)
    run = _run(leader, rid)
    assert run.state == "queued" and "pgid" not in run.placement
    assert not [dm for dm in _dms(leader, "alice") if dm.startswith(f"Run #{rid} started")]
    # What it started (its runner, then the command) is gone: the process group was
    # killed, so the command either never wrote the marker or stopped right after.
    deadline = time.monotonic() + 60  # a guard against a hang, not a speed goal
    while _command_alive(str(marker)):
        assert time.monotonic() < deadline, "the old leader's start was left running"
        time.sleep(0.1)


def _command_alive(token: str) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in cmdline.read_bytes():
                return True
        except OSError:
            continue
    return False
