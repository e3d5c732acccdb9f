"""A spot reclaim end to end: notice → SIGTERM → checkpoint → requeue → resumed elsewhere.

Two real sshd hosts (gpu-a on 127.0.0.2, gpu-b on 127.0.0.3) declared as static hosts
(GPUBOT_PROVIDER=ssh) and driven by the worker's own code: `build_runtime`, then
`RunService.dispatch` / `poll` as the tick calls them. The metadata service is the fake
IMDSv2 of tests/training/test_agent.py on 127.0.0.1; the host agent runs on the host
over SSH with ``--once``, as its service loop would each interval.

The digits recipe trains in about half a second on a CPU, too short to land a notice
mid-run by timing on a shared two-core box; so the test sets the run's pace itself, as
a slow GPU would: the run's process group is held with SIGSTOP and let go in short
SIGCONT slices until its status file (rewritten every 2 s of wall time) shows steps. A signal sent while it is held (the agent's SIGTERM) is handled
when it goes on, exactly as it would be on the next training step.

Both hosts are this machine underneath: each keeps its files under its own root (see
tests/ssh_hosts.py), so "the old host's disk" and "the new host's disk" are apart.
A shortcut (the bot's own user, its interpreter and code, no bootstrap): the test is about
the notice and the resume, not about what a host has.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from bot.app.config import load_settings
from bot.app.hosts.remote import PreparedHost
from bot.app.money.billing import note_host_state
from bot.domain.commands import Run
from bot.faces.runtime import Runtime, build_runtime
from db.models import HOST_STOPPED, HOST_UNREACHABLE, Host
from db.session import transaction
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.runtime_helpers import checked
from tests.runtime_helpers import dms as _dms
from tests.runtime_helpers import run_row as _run
from tests.ssh_hosts import SshLab
from tests.training.test_agent import FakeImds
from training.agent import LEASE_NAME
from training.status import parse_status

REPO = Path(__file__).resolve().parents[2]


def _entry(lab: SshLab, name: str) -> str:
    host = lab.hosts[name]
    return f"{name}={lab.user}@{host.address}:{host.port}/1xcpu"


@pytest.fixture
def roots(ssh_lab: SshLab) -> Iterator[dict[str, Path]]:
    """Each host's gpubot root, on its own path."""
    out = {}
    for name in ("gpu-a", "gpu-b"):
        ssh_lab.hosts[name].root.mkdir(parents=True, exist_ok=True)
        out[name] = Path(tempfile.mkdtemp(dir=ssh_lab.hosts[name].root))
    try:
        yield out
    finally:
        for path in out.values():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runtime(
    ssh_lab: SshLab,
    roots: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Runtime, SshClient]]:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "bot"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", ",".join(_entry(ssh_lab, n) for n in ("gpu-a", "gpu-b")))
    client = SshClient(connect_timeout=5, command_timeout=60)

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        # A hand-prepared host: this interpreter, the checkout on PYTHONPATH.
        return PreparedHost(root=str(roots[target.name]), python=sys.executable, code_dir=str(REPO))

    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about spot notices and resuming;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    rt = checked(build_runtime(load_settings(), ssh=client, prepare=prepare))
    try:
        yield rt, client
    finally:
        client.close()
        rt.engine.dispose()


def _status(path: str) -> Any:
    try:
        return parse_status(Path(path).read_text())
    except OSError:
        return None


def _signal(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def test_a_spot_notice_requeues_the_run_and_it_resumes_on_another_host(
    runtime: tuple[Runtime, SshClient],
    roots: dict[str, Path],
    ssh_lab: SshLab,
    imds: FakeImds,
    tmp_path: Path,
) -> None:
    rt, client = runtime
    runs = rt.service.runs
    alice = rt.service.actor("alice")
    rid = runs.submit(alice, Run(recipe="digits", model="cpu", precision="fp32")).extra["run_id"]
    groups: list[int] = []
    try:
        assert runs.dispatch() == 1
        first = _run(rt, rid)
        old, new = first.placement["host"], ({"gpu-a", "gpu-b"} - {first.placement["host"]}).pop()
        pgid = int(first.placement["pgid"])
        groups.append(pgid)
        _signal(pgid, signal.SIGSTOP)  # from here on the test sets the pace
        status_path = str(first.placement["status"])
        assert status_path.startswith(str(roots[old]))

        # Slices of run time until the status file shows training steps done.
        deadline = time.monotonic() + 180
        while (st := _status(status_path)) is None or st.state != "running" or st.step < 1:
            if time.monotonic() > deadline:
                log = Path(first.placement["log"])
                pytest.fail(f"the run never got going: {st}\n{log.read_text()[-2000:]}")
            # Start-up (imports, data) in 20 ms slices; training steps (~1.5 ms each
            # here) in 2 ms ones, so the status file's 2-second write lands mid-run.
            training = st is not None and st.state == "running"
            _signal(pgid, signal.SIGCONT)
            time.sleep(0.002 if training else 0.02)
            _signal(pgid, signal.SIGSTOP)
            time.sleep(0.05)
        held_at = st.step

        # The worker's poll renews the lease: the host agent sees what the bot holds.
        assert runs.poll() == 0
        lease = json.loads((roots[old] / "agent" / LEASE_NAME).read_text())
        assert lease["runs"] == [{"id": str(rid), "pgid": pgid}]
        assert json.loads((roots[new] / "agent" / LEASE_NAME).read_text())["runs"] == []

        # The two-minute notice; the agent on the old host signals the run.
        imds.notice = {"action": "terminate", "time": "2027-01-15T12:02:00Z"}
        agent = [
            sys.executable, "-m", "training.agent", "--once",
            "--state-dir", str(roots[old] / "agent"), "--runs-dir", str(roots[old] / "runs"),
            "--stop-command", "", "--imds-endpoint", imds.url,
            "--boot-id-file", str(roots[old] / "boot_id"),
        ]  # fmt: skip
        (roots[old] / "boot_id").write_text("boot-1\n")
        target = SshTarget(
            host=ssh_lab.hosts[old].address, port=ssh_lab.hosts[old].port,
            user=ssh_lab.user, key_path=str(ssh_lab.client_key), name=old,
        )  # fmt: skip
        out = client.run(target, shlex.join(agent), 60, cwd=str(REPO))
        assert out.ok, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1])["signalled"] == [str(rid)]
        _signal(pgid, signal.SIGCONT)  # it handles the SIGTERM: checkpoint, exit 75
        deadline = time.monotonic() + 120
        while client.is_alive(target, pgid):
            assert time.monotonic() < deadline, "the run did not stop on SIGTERM"
            time.sleep(0.1)
        stopped = _status(status_path)
        assert stopped is not None and stopped.state == "preempted"
        assert stopped.exit_code == 75
        step = stopped.checkpoint_step
        assert step is not None and step >= held_at >= 1

        # The worker reads the report, copies the checkpoint, requeues the run.
        assert runs.poll() == 0
        requeued = _run(rt, rid)
        assert requeued.state == "queued" and requeued.host_id is None
        resume = requeued.placement["resume_from"]
        assert resume["step"] == step and resume["host"] == old
        assert resume["reason"] == "spot reclaim" and resume["count"] == 1
        saved = tmp_path / "bot" / "checkpoints" / str(rid) / "latest.pt"
        assert resume["dir"] == str(saved.parent)
        assert (
            saved.read_bytes()
            == (roots[old] / "runs" / str(rid) / "checkpoints" / "latest.pt").read_bytes()
        )
        assert _dms(rt, "alice")[-1] == (
            f"Run #{rid} was interrupted on {old} (spot reclaim); it is back in line "
            f"and resumes from step {step}."
        )
        with Session(rt.engine) as s:
            host = s.exec(select(Host).where(Host.name == old)).one()
            assert host.state == HOST_UNREACHABLE  # nothing new is placed there
        # The GPUs went back: no open usage on the old host.
        assert runs.poll() == 0 and _run(rt, rid).state == "queued"

        # The cloud takes the old host away (what the fleet's reconcile writes down).
        with transaction(rt.engine) as s:
            host = s.exec(select(Host).where(Host.name == old)).one()
            host.state = HOST_STOPPED
            s.add(host)
            s.flush()
            note_host_state(s, host, rt.service.clock.now(), rt.service.settings)
        shutil.rmtree(roots[old] / "runs")  # and its disk with it

        # Placed on the other host with the checkpoint uploaded first; it resumes.
        assert runs.dispatch() == 1
        # The checkpoint goes up off the tick (bot.app.runs.starts), then the runner starts.
        runs.ctx.starts.wait(timeout=240)
        moved = _run(rt, rid)
        assert moved.placement["host"] == new and moved.placement["resume_from"] == resume
        groups.append(int(moved.placement["pgid"]))
        assert str(moved.placement["checkpoints"]).startswith(str(roots[new]))
        deadline = time.monotonic() + 240
        while (done := _run(rt, rid)).state not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, "the resumed run did not finish"
            runs.poll()
            time.sleep(0.2)
        assert done.state == "succeeded", done.metrics
        final = _status(str(moved.placement["status"]))
        assert final is not None and final.state == "done"
        assert final.resumed_from_step == step > 0
        assert final.summary is not None
        assert final.summary.final_metrics["test_accuracy"] >= 0.9
        dms = _dms(rt, "alice")
        assert sum(d.startswith(f"Run #{rid} started on {new}") for d in dms) == 1
        assert sum("back in line" in d for d in dms) == 1
    finally:
        for g in groups:
            _signal(g, signal.SIGCONT)
            _signal(g, signal.SIGKILL)
