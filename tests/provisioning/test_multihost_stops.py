"""A run over two hosts stopped as one: a spot notice on node 1's host, and the scheduler's
preemption. Both requeue the whole run once, free both hosts' GPUs, and send one DM.

On the default lab (gpu-a, gpu-b: the bot's own machine over sshd, each host its own
root), without a bootstrap (a shortcut: these tests are about dispatch, poll and the
agents' reports, not about what a host has). The run is torchrun over gloo on CPU; the
host agent is the real one, run with ``--once`` against the fake metadata service of
tests/training/test_agent.py. Loops wait for states, never for time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import load_settings
from bot.app.hosts.remote import PreparedHost
from bot.app.runs import RunService
from bot.app.watching import runwatch
from bot.domain.clock import VirtualClock
from bot.domain.commands import Cancel, Run
from bot.faces.runtime import Runtime, build_runtime
from db.models import HOST_UNREACHABLE, Host, TrainingRun, UsageInterval
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.runtime_helpers import checked, drive_until
from tests.runtime_helpers import dms as _dms
from tests.runtime_helpers import run_row as _run
from tests.ssh_hosts import SshLab
from tests.training.test_agent import FakeImds
from training.agent import LEASE_NAME
from training.status import parse_status

REPO = Path(__file__).resolve().parents[2]
START = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)
HOURLY_USD = 3.6  # each host's price (an owned host has none): $0.001 a second

# Both ranks meet (gloo), rank 0 reports a step; on SIGTERM rank 0 saves a checkpoint
# and every rank exits 75 ("resume me"), as the runner's contract asks.
STOPPABLE = (
    "import os, pathlib, signal, sys, time\n"
    "import torch.distributed as dist\n"
    "import training\n"
    "def stop(*a):\n"
    "    d = os.environ.get('GPUBOT_CHECKPOINT_DIR')\n"
    "    if d and os.environ.get('RANK') == '0':\n"
    "        pathlib.Path(d, 'latest.pt').write_text('saved')\n"
    "    sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "dist.init_process_group('gloo')\n"
    "dist.barrier()\n"
    "training.report(step=1, loss=1.0)\n"
    "while True:\n"
    "    time.sleep(0.1)\n"
)


@pytest.fixture
def bot(
    ssh_lab: SshLab,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loopback_rendezvous: None,  # its xdist group: one run across the lab at a time
) -> Iterator[tuple[Runtime, VirtualClock, dict[str, Path]]]:
    roots = {
        name: Path(tempfile.mkdtemp(dir=ssh_lab.hosts[name].root)) for name in ("gpu-a", "gpu-b")
    }
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "bot"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    entries = [
        f"{name}={ssh_lab.user}@{host.address}:{host.port}/1xcpu"
        for name, host in sorted(ssh_lab.hosts.items())
    ]
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", ",".join(entries))
    client = SshClient(connect_timeout=5, command_timeout=60)

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        # A hand-prepared host: this interpreter, the checkout on PYTHONPATH.
        return PreparedHost(root=str(roots[target.name]), python=sys.executable, code_dir=str(REPO))

    clock = VirtualClock(START)
    rt = checked(build_runtime(load_settings(), clock=clock, ssh=client, prepare=prepare))
    with Session(rt.engine) as s:
        for host in s.exec(select(Host)):
            host.hourly_usd = HOURLY_USD
            s.add(host)
        s.commit()
    try:
        yield rt, clock, roots
    finally:
        # A start still in flight off the tick (a resumed run's checkpoint upload, bot.app.
        # runs.starts) records its process groups first, or it would start them unseen.
        _runs(rt).ctx.starts.close()
        # What a failed test left running: SIGTERM first, so each node's runner stops its
        # torchrun (its own process group), then SIGKILL what is left.
        with Session(rt.engine) as s:
            groups = [
                int(node["pgid"])
                for run in s.exec(select(TrainingRun))
                for node in run.placement.get("nodes", [])
                if isinstance(node.get("pgid"), int)
            ]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            deadline = time.monotonic() + 30
            while any(_alive(g) for g in groups) and time.monotonic() < deadline:
                time.sleep(0.1)
        client.close()
        rt.engine.dispose()


def _runs(rt: Runtime) -> RunService:
    assert rt.service.runs is not None
    return rt.service.runs


def _until(rt: Runtime, done: Callable[[], bool], what: str) -> None:
    drive_until(_runs(rt), done, what)


def _status_step(path: str) -> int:
    try:
        st = parse_status(Path(path).read_text())
    except (OSError, ValueError):
        return 0
    return st.step if st is not None and st.step is not None else 0


def _started_on_both(rt: Runtime, rid: int) -> TrainingRun:
    """Submits nothing; waits until both nodes met and node 0 reported a step."""

    def going() -> bool:
        run = _run(rt, rid)
        return run.state == "running" and _status_step(str(run.placement["status"])) >= 1

    _until(rt, going, "the two nodes never got going")
    run = _run(rt, rid)
    assert [n["host"] for n in run.placement["nodes"]] == ["gpu-a", "gpu-b"]
    return run


def _intervals(rt: Runtime, rid: int) -> list[tuple[str, UsageInterval]]:
    with Session(rt.engine) as s:
        names = {h.id: h.name for h in s.exec(select(Host))}
        return sorted(
            (names[iv.host_id], iv)
            for iv in s.exec(select(UsageInterval).where(UsageInterval.run_id == rid))
        )


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _ends(pgid: int) -> bool:
    """Whether the process group is gone within a guard's time (its last process may still
    be reaped a moment after the bot saw the run end)."""
    deadline = time.monotonic() + 30  # a guard against a hang, not a speed goal
    while _alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _node_status(node: dict[str, object]) -> str | None:
    st = parse_status(Path(str(node["status"])).read_text())
    return st.state if st is not None else None


def _stoppable(rt: Runtime, tmp_path: Path) -> int:
    script = tmp_path / "stoppable.py"
    script.write_text(STOPPABLE)
    cmd = Run(command=(sys.executable, str(script)), gpus=2, model="cpu", checkpoints=True)
    rid: int = _runs(rt).submit(rt.service.actor("alice"), cmd).extra["run_id"]
    return rid


def test_a_spot_notice_on_node_1s_host_requeues_the_whole_run_once(
    bot: tuple[Runtime, VirtualClock, dict[str, Path]],
    ssh_lab: SshLab,
    imds: FakeImds,
    tmp_path: Path,
) -> None:
    rt, _, roots = bot
    runs = _runs(rt)
    rid = _stoppable(rt, tmp_path)
    run = _started_on_both(rt, rid)
    node0, node1 = run.placement["nodes"]

    # The lease on node 1's host names the run (its own process group), so its agent
    # knows the bot holds it there.
    runs.poll()
    lease = json.loads((roots["gpu-b"] / "agent" / LEASE_NAME).read_text())
    assert lease["runs"] == [{"id": str(rid), "pgid": node1["pgid"]}]

    # The notice lands on node 1's instance; its agent signals the node there.
    imds.notice = {"action": "terminate", "time": "2027-01-15T12:02:00Z"}
    (roots["gpu-b"] / "boot_id").write_text("boot-1\n")
    agent = [
        sys.executable, "-m", "training.agent", "--once",
        "--state-dir", str(roots["gpu-b"] / "agent"), "--runs-dir", str(roots["gpu-b"] / "runs"),
        "--stop-command", "", "--imds-endpoint", imds.url,
        "--boot-id-file", str(roots["gpu-b"] / "boot_id"),
    ]  # fmt: skip
    host = ssh_lab.hosts["gpu-b"]
    target = SshTarget(
        host=host.address, port=host.port, user=ssh_lab.user,
        key_path=str(ssh_lab.client_key), name="gpu-b",
    )  # fmt: skip
    seat = runs.access.runner_for("gpu-b")
    assert seat is not None
    out = seat.runner.run(target, shlex.join(agent), 60, cwd=str(REPO))
    assert out.ok, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["signalled"] == [str(rid)]

    # The worker stops every node and puts the run back in line once, from node 0's
    # checkpoint; it is not failed for node 1 ending.
    _until(rt, lambda: _run(rt, rid).state != "running", "the run was never stopped")
    requeued = _run(rt, rid)
    assert requeued.state == "queued", requeued.metrics
    resume = requeued.placement["resume_from"]
    assert (resume["reason"], resume["count"], resume["host"]) == ("spot reclaim", 1, "gpu-a")
    assert Path(resume["dir"], "latest.pt").read_text() == "saved"
    assert _ends(node0["pgid"]) and _ends(node1["pgid"])
    assert _node_status(node0) == "preempted" and _node_status(node1) == "preempted"
    # Both hosts' GPUs back; node 1's host takes nothing new.
    ivs = _intervals(rt, rid)
    assert [name for name, _ in ivs] == ["gpu-a", "gpu-b"]
    assert all(iv.ended_at is not None for _, iv in ivs)
    with Session(rt.engine) as s:
        assert s.exec(select(Host).where(Host.name == "gpu-b")).one().state == HOST_UNREACHABLE
    dms = [dm for dm in _dms(rt, "alice") if "back in line" in dm]
    assert dms == [
        f"Run #{rid} was interrupted on gpu-b (spot reclaim); it is back in line and "
        "resumes from its last checkpoint."
    ]
    runs.poll()
    assert len([dm for dm in _dms(rt, "alice") if "back in line" in dm]) == 1


def test_the_schedulers_preemption_stops_every_node_and_requeues_once(
    bot: tuple[Runtime, VirtualClock, dict[str, Path]], tmp_path: Path
) -> None:
    rt, clock, _ = bot
    runs = _runs(rt)
    rid = _stoppable(rt, tmp_path)
    run = _started_on_both(rt, rid)
    node0, node1 = run.placement["nodes"]
    started = run.started_at
    assert started is not None

    # Alice has had both slots for an hour; bob waits for one. The scheduler's Preempt for
    # her run is carried out by dispatch's own step (`Dispatcher._preempt`), handed the
    # action here: its fair-share band rarely picks a run holding every host as a victim
    # (moving 2 GPUs for 1 brings two users no nearer their shares by half of what moves).
    late = runs.submit(
        rt.service.actor("bob"), Run(command=(sys.executable, "-c", "pass"), model="cpu")
    ).extra["run_id"]
    clock.advance(timedelta(hours=1))
    runs.dispatcher._preempt(rid, str(late))
    marked = _run(rt, rid)
    assert marked.placement["interrupted"]["action"] == "preempt"
    assert marked.placement["interrupted"]["reason"].startswith(f"preempted for run #{late}")
    assert marked.placement.get("term_sent") is True
    # Both nodes got SIGTERM from the preemption itself: they stop before any poll.
    deadline = time.monotonic() + 60  # a guard against a hang, not a speed goal
    while _alive(node0["pgid"]) or _alive(node1["pgid"]):
        assert time.monotonic() < deadline, "a node did not get SIGTERM"
        time.sleep(0.1)

    # Each node says "preempted", not failed; the run is requeued once with the hour it
    # ran, and both hosts' GPUs go back.
    _until(rt, lambda: _run(rt, rid).state != "running", "the run was never stopped")
    requeued = _run(rt, rid)
    assert requeued.state == "queued", requeued.metrics
    assert _ends(node0["pgid"]) and _ends(node1["pgid"])
    assert _node_status(node0) == "preempted" and _node_status(node1) == "preempted"
    assert requeued.metrics["attained_s"] == pytest.approx(3600.0, abs=1.0)
    assert requeued.placement["resume_from"]["count"] == 1
    ivs = _intervals(rt, rid)
    assert [name for name, _ in ivs] == ["gpu-a", "gpu-b"]
    assert all(iv.ended_at is not None for _, iv in ivs)
    # Its cost is both hosts' usage summed: an hour of a one-slot host each.
    each = [
        iv.usd_per_hour * (iv.ended_at - iv.started_at).total_seconds() / 3600  # type: ignore[operator]
        for _, iv in ivs
    ]
    assert each == [pytest.approx(HOURLY_USD, abs=0.01)] * 2
    with Session(rt.engine) as s:
        usd, _ = runwatch.cost_so_far(s, rid, clock.now())
    assert usd == pytest.approx(sum(each), abs=1e-6)
    back = [dm for dm in _dms(rt, "alice") if "back in line" in dm]
    assert len(back) == 1 and f"preempted for run #{late}" in back[0]

    # The freed slot serves bob; alice's run is not requeued a second time meanwhile.
    _until(rt, lambda: _run(rt, late).state == "succeeded", "bob's run never ran")
    assert len([dm for dm in _dms(rt, "alice") if "back in line" in dm]) == 1
    runs.cancel(rt.service.actor("alice"), Cancel(rid))
