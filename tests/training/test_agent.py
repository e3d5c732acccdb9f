"""The host agent on this machine: spot notices from a fake IMDSv2, reboots, GPU activity.

Every check runs the real `python -m training.agent --once` as a process, with time and
the boot id steered through files; the metadata service is an http.server on 127.0.0.1.
The dead-man switch over real SSH is in tests/provisioning/test_agent_ssh.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from bot.app.hosts.hostagent import AgentReport, LostRun, read_agent_report
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from tests.training.conftest import REPO, runner_cmd, runner_env
from training.agent import (
    HEARTBEAT_NAME,
    INTERRUPTION_NAME,
    LEASE_NAME,
    LOST_NAME,
    STOP_NAME,
    Lease,
    ReservationHold,
    parse_lease,
)
from training.exitcodes import EXIT_PREEMPTED
from training.status import read_status
from training.telemetry import GpuSnapshot, HostSnapshot

T0 = 1_800_000_000.0


# --- a fake instance metadata service (IMDSv2) --------------------------------------------


@dataclass
class FakeImds:
    token: str = "tok-3f9a"
    notice: dict[str, Any] | None = None
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""


def _imds_handler(state: FakeImds) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            state.requests.append(("PUT", self.path, ttl))
            if self.path != "/latest/api/token" or not ttl or not ttl.isdigit():
                self._send(400)
                return
            self._send(200, state.token)

        def do_GET(self) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            state.requests.append(("GET", self.path, token))
            if token != state.token:
                self._send(401)
            elif self.path != "/latest/meta-data/spot/instance-action" or state.notice is None:
                self._send(404)
            else:
                self._send(200, json.dumps(state.notice))

    return Handler


# --- running the agent ---------------------------------------------------------------------


@dataclass
class Host:
    """One fake host's files: the agent's state dir, run dirs, clock and boot id."""

    root: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def state(self) -> Path:
        return self.root / "agent"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def set_now(self, t: float) -> None:
        (self.root / "now").write_text(f"{t}\n")

    def set_boot(self, boot_id: str) -> None:
        (self.root / "boot_id").write_text(boot_id + "\n")

    def doc(self, name: str) -> dict[str, Any] | None:
        path = self.state / name
        return json.loads(path.read_text()) if path.exists() else None

    def agent(self, *extra: str, imds: str = "none", stop: str | None = None) -> dict[str, Any]:
        stop_command = stop if stop is not None else f"echo stop >> {self.root / 'stopped'}"
        argv = [
            sys.executable, "-m", "training.agent", "--once",
            "--state-dir", str(self.state), "--runs-dir", str(self.runs),
            "--idle", "60", "--lease", "120", "--stop-command", stop_command,
            "--imds-endpoint", imds, "--now-file", str(self.root / "now"),
            "--boot-id-file", str(self.root / "boot_id"), *extra,
        ]  # fmt: skip
        done = subprocess.run(
            argv, cwd=REPO, env=runner_env(), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def report(self) -> AgentReport:
        return read_agent_report(
            LocalRunner(), LOCAL_TARGET, datetime.fromtimestamp(T0, UTC), agent_dir=str(self.state)
        )

    def stops(self) -> int:
        path = self.root / "stopped"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def start_in_run_dir(self, run_id: str, argv: list[str], state: str = "running") -> Path:
        """A live process whose working directory is a run directory with a status file."""
        run_dir = self.runs / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "status.json").write_text(json.dumps({"schema_version": 1, "state": state}))
        proc = subprocess.Popen(argv, cwd=run_dir, start_new_session=True)
        self.started.append(proc)
        return run_dir


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "host")
    h.root.mkdir()
    h.set_now(T0)
    h.set_boot("boot-a")
    try:
        yield h
    finally:
        for proc in h.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _write_lease(host: Host, lease: Lease) -> None:
    host.state.mkdir(parents=True, exist_ok=True)
    (host.state / LEASE_NAME).write_text(lease.to_json())


# --- spot interruption -----------------------------------------------------------------------


def test_the_fake_service_wants_the_token_flow(imds: FakeImds) -> None:
    """The double is strict like IMDSv2: a GET without a token is refused."""
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{imds.url}/latest/meta-data/spot/instance-action", timeout=5)
    assert refused.value.code == 401


def test_a_spot_notice_sigterms_the_run_which_checkpoints_and_exits_75(
    host: Host, imds: FakeImds
) -> None:
    run_dir = host.runs / "41"
    run_dir.mkdir(parents=True)
    status_path = run_dir / "status.json"
    args = (
        "--recipe", "digits", "--epochs", "5000", "--precision", "fp32", "--quiet",
        "--status-file", status_path, "--checkpoint-dir", run_dir / "checkpoints",
        "--status-every", "0.05", "--run-id", "41",
    )  # fmt: skip
    proc = subprocess.Popen(
        runner_cmd(*args),
        cwd=run_dir,
        env=runner_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    host.started.append(proc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = read_status(status_path)
        if status is not None and status.state == "running" and status.step >= 20:
            break
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        time.sleep(0.05)
    else:
        pytest.fail("the run never got going")

    quiet = host.agent(imds=imds.url)
    assert quiet["imds"] == "no notice" and quiet["signalled"] == []
    assert [r["id"] for r in quiet["runs"]] == ["41"]
    assert proc.poll() is None
    assert not (host.state / INTERRUPTION_NAME).exists()

    imds.notice = {"action": "stop", "time": "2027-01-15T12:02:00Z"}
    noticed = host.agent(imds=imds.url)
    assert noticed["signalled"] == ["41"]
    assert proc.wait(timeout=90) == EXIT_PREEMPTED
    final = read_status(status_path)
    assert final is not None and final.state == "preempted"
    assert final.checkpoint_step is not None and final.checkpoint_step >= 20
    assert (run_dir / "checkpoints" / "latest.pt").exists()

    record = host.doc(INTERRUPTION_NAME)
    assert record is not None and record["interrupted"] is True
    assert record["notice"] == imds.notice
    assert [(r["id"], r["ok"]) for r in record["runs"]] == [("41", True)]
    # The token flow: a token first, and every metadata read carries it.
    assert imds.requests[0] == ("PUT", "/latest/api/token", "21600")
    gets = [r for r in imds.requests if r[0] == "GET"]
    assert gets and all(token == imds.token for _, _, token in gets)

    # A later check with the notice still up signals nobody twice (the run is gone anyway).
    again = host.agent(imds=imds.url)
    assert again["signalled"] == []
    assert host.doc(INTERRUPTION_NAME) == record

    # The worker's read (bot.app.hosts.hostagent, here through the local runner).
    report = host.report()
    assert report.interrupted_runs == ("41",) and report.interruption == record
    # After the host's next boot that notice is history, not news.
    imds.notice = None
    host.set_boot("boot-b")
    host.agent(imds=imds.url)
    assert host.report().interruption is None and host.report().interrupted_runs == ()


def test_an_unreachable_metadata_service_is_reported_not_fatal(host: Host) -> None:
    # A closed port on loopback: refused at once.
    out = host.agent(imds="http://127.0.0.1:9")
    assert out["imds"].startswith("error:")
    assert host.doc(HEARTBEAT_NAME) is not None


# --- after a reboot ------------------------------------------------------------------------


def test_runs_active_before_a_reboot_and_gone_after_are_reported_lost(host: Host) -> None:
    host.start_in_run_dir("7", ["sleep", "300"])
    host.start_in_run_dir("8", ["sleep", "300"])
    before = host.agent()
    assert sorted(r["id"] for r in before["runs"]) == ["7", "8"]
    assert before["lost"] == []

    # The "reboot": every process dies, run 8 had written its final status first.
    for proc in host.started:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    (host.runs / "8" / "status.json").write_text(json.dumps({"schema_version": 1, "state": "done"}))
    host.set_boot("boot-b")
    host.set_now(T0 + 300)
    after = host.agent()
    assert after["lost"] == ["7"]
    report = host.doc(LOST_NAME)
    assert report is not None
    [entry] = report["runs"]
    assert entry["id"] == "7" and entry["status"] == "running"
    assert (entry["previous_boot_id"], entry["boot_id"]) == ("boot-a", "boot-b")
    assert host.report().lost_runs == (LostRun("7", "running", T0 + 300),)

    # Same boot again: nothing new is reported, the old entry stays for the worker.
    assert host.agent()["lost"] == []
    assert host.doc(LOST_NAME) == report


def test_a_process_that_ended_normally_is_not_lost(host: Host) -> None:
    host.start_in_run_dir("9", ["sleep", "300"])
    assert [r["id"] for r in host.agent()["runs"]] == ["9"]
    proc = host.started[0]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert host.agent()["runs"] == []  # same boot: ended, the worker's poll handles it
    host.set_boot("boot-b")
    assert host.agent()["lost"] == []
    assert host.doc(LOST_NAME) is None


# --- what keeps a host up ----------------------------------------------------------------


def _snapshot(util: int | None) -> str:
    gpu = GpuSnapshot(0, "GPU-1", "NVIDIA A10G", util, 100, 23000, 40, 60.0, 300.0)
    return HostSnapshot(datetime.fromtimestamp(T0, UTC), "nvml", (gpu,)).to_json()


def test_gpu_activity_keeps_the_host_up_and_idleness_stops_it_once(host: Host) -> None:
    snap = host.root / "telemetry.json"
    snap.write_text(_snapshot(95))
    first = host.agent("--telemetry-file", str(snap))
    assert first["gpu_busy"] is True and first["stop_issued"] is False
    host.set_now(T0 + 1000)  # lease never written: 1000 s > 120 s, but the GPU is busy
    assert host.agent("--telemetry-file", str(snap))["stop_issued"] is False
    assert host.stops() == 0

    snap.write_text(_snapshot(0))
    host.set_now(T0 + 1030)
    calm = host.agent("--telemetry-file", str(snap))  # busy at T0+1000, idle since
    assert (calm["gpu_busy"], calm["idle_s"], calm["stop_issued"]) == (False, 30, False)
    host.set_now(T0 + 1061)
    out = host.agent("--telemetry-file", str(snap))
    assert out["stop_issued"] is True and host.stops() == 1
    host.set_now(T0 + 2000)
    assert host.agent("--telemetry-file", str(snap))["stop_issued"] is False
    assert host.stops() == 1
    stop = host.doc(STOP_NAME)
    assert stop is not None and stop["exit_code"] == 0 and stop["boot_id"] == "boot-a"
    heartbeat = host.doc(HEARTBEAT_NAME)
    assert heartbeat is not None and heartbeat["stop"]["at"] == T0 + 1061


def test_a_reservation_holds_the_host_until_it_ends(host: Host) -> None:
    _write_lease(host, Lease(renewed_at=T0, reservations=(ReservationHold("r5", T0 + 500),)))
    assert host.agent()["reservations"] == ["r5"]
    host.set_now(T0 + 499)  # lease 499 s old, but r5 is still on
    assert host.agent()["stop_issued"] is False
    host.set_now(T0 + 560)  # r5 ended at T0+500; idle since T0+499 = 61 s > 60 s
    out = host.agent()
    assert out["reservations"] == [] and out["stop_issued"] is True
    assert host.stops() == 1


def test_a_renewal_after_a_stop_rearms_the_switch(host: Host) -> None:
    host.agent()
    host.set_now(T0 + 200)
    assert host.agent()["stop_issued"] is True
    # The host did not go down (a failed stop) and the bot came back, then died again.
    _write_lease(host, Lease(renewed_at=T0 + 250))
    host.set_now(T0 + 250)
    assert host.agent()["stop_issued"] is False
    host.set_now(T0 + 371)
    assert host.agent()["stop_issued"] is True
    assert host.stops() == 2


def test_without_a_stop_command_the_agent_only_watches(host: Host) -> None:
    host.agent(stop="")
    host.set_now(T0 + 10_000)
    out = host.agent(stop="")
    assert out["stop_issued"] is False and out["idle_s"] == 10_000
    heartbeat = host.doc(HEARTBEAT_NAME)
    assert heartbeat is not None and heartbeat["limits"]["stops_host"] is False


def test_a_lease_is_parsed_strictly() -> None:
    lease = Lease(renewed_at=T0, reservations=(ReservationHold("1", None),))
    assert parse_lease(lease.to_json()) == lease
    assert parse_lease("{}") is None
    assert parse_lease('{"schema_version": 1, "renewed_at": "soon"}') is None
    assert parse_lease(b"not json") is None


def test_a_second_agent_on_the_same_state_dir_refuses(host: Host) -> None:
    argv = [
        sys.executable, "-m", "training.agent", "--state-dir", str(host.state),
        "--runs-dir", str(host.runs), "--stop-command", "", "--imds-endpoint", "none",
        "--interval", "0.2", "--now-file", str(host.root / "now"),
        "--boot-id-file", str(host.root / "boot_id"),
    ]  # fmt: skip
    daemon = subprocess.Popen(
        argv,
        cwd=REPO,
        env=runner_env(),
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    host.started.append(daemon)
    deadline = time.monotonic() + 30
    while host.doc(HEARTBEAT_NAME) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    heartbeat = host.doc(HEARTBEAT_NAME)
    assert heartbeat is not None and heartbeat["pid"] == daemon.pid
    second = subprocess.run(
        [sys.executable, "-m", "training.agent", "--once", "--state-dir", str(host.state)],
        cwd=REPO,
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 3 and "another agent" in second.stderr
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=10) == 0
