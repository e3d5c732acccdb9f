"""The dead-man switch over real SSH: the bot renews the lease, the host agent decides.

The host is the real sshd on 127.0.0.2. The bot's side is `bot.app.hosts.hostagent` over the real
`SshClient`; the agent runs on the host as the worker would start it (``--once`` over
`run` for step-by-step checks, `start_detached` for the daemon). Time comes from a file
on the host, so hours pass in a test without sleeping; "stopping the host" appends a line
to a file, so a stop is observable and counted, and nothing real is ever shut down.

A shortcut: the host logs in as the bot's own user (the default lab) and runs the agent
with the bot's interpreter and code, which only a bootstrap would otherwise put there;
these tests are about the lease and the stop, not about what a host has. The agent a
real bootstrap installs on a stranger is checked in the journey and in
tests/provisioning/test_forget_host.py.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from bot.app.hosts.hostagent import (
    HostHolds,
    ReservationHold,
    RunHold,
    host_holds,
    read_agent_report,
    renew_lease,
)
from db.models import RES_ACTIVE, RES_RELEASED, Host, Reservation, TrainingRun, User
from db.session import transaction
from provisioning.bootstrap import (
    BOOTSTRAP_VERSION,
    UP_TO_DATE,
    AgentInstall,
    agent_unit,
    install_agent,
)
from provisioning.ssh import SshClient, SshTarget
from tests.provisioning.conftest import target_for
from tests.provisioning.test_bootstrap import _make_host
from tests.ssh_hosts import SshLab
from training.agent import HEARTBEAT_NAME, LEASE_NAME, STOP_NAME

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
IDLE_S, LEASE_S = 60, 120


@dataclass
class Remote:
    """One fake GPU host reached over SSH, with its agent's files under `root`."""

    client: SshClient
    target: SshTarget
    root: Path
    groups: list[int] = field(default_factory=list)

    @property
    def agent_dir(self) -> str:
        return str(self.root / "agent")

    @property
    def runs_dir(self) -> str:
        return str(self.root / "runs")

    def set_now(self, t: float) -> None:
        self.client.write_file(self.target, str(self.root / "now"), f"{t}\n".encode())

    def agent_argv(self, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "training.agent",
            "--state-dir", self.agent_dir, "--runs-dir", self.runs_dir,
            "--idle", str(IDLE_S), "--lease", str(LEASE_S),
            "--stop-command", f"echo stopped >> {shlex.quote(str(self.root / 'stopped'))}",
            "--imds-endpoint", "none", "--now-file", str(self.root / "now"),
            "--boot-id-file", str(self.root / "boot_id"), *extra,
        ]  # fmt: skip

    def once(self) -> dict[str, Any]:
        """One check by the agent on the host, run over SSH from the repository checkout."""
        result = self.client.run(
            self.target, shlex.join(self.agent_argv("--once")), 60, cwd=str(REPO)
        )
        assert result.ok, result.stderr
        out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return out

    def renew(self, t: float, holds: HostHolds | None = None) -> None:
        when = datetime.fromtimestamp(t, UTC)
        renew_lease(self.client, self.target, holds or HostHolds(), when, agent_dir=self.agent_dir)

    def stops(self) -> int:
        data = self.client.read_file(self.target, str(self.root / "stopped"))
        return len(data.decode().splitlines()) if data else 0


@pytest.fixture
def remote(ssh_lab: SshLab) -> Iterator[Remote]:
    host = ssh_lab.hosts["gpu-a"]
    host.root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(dir=host.root))
    (root / "boot_id").write_text("boot-1\n")
    client = SshClient(connect_timeout=5, command_timeout=60)
    r = Remote(client, target_for(ssh_lab, "gpu-a"), root)
    r.set_now(T0)
    try:
        yield r
    finally:
        client.close()
        # The sshd host is this machine: what a test started there, it ends by its group id.
        for pgid in r.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_a_renewed_lease_keeps_an_idle_host_running(remote: Remote) -> None:
    for minute in range(0, 30, 5):  # half an hour idle, but the bot renews every 5 minutes
        t = T0 + minute * 60
        remote.renew(t)
        remote.set_now(t + 30)
        out = remote.once()
        assert out["stop_issued"] is False
        assert out["lease_renewed_at"] == t and out["lease_age_s"] <= 30
    assert out["idle_s"] >= 25 * 60
    assert remote.stops() == 0
    report = read_agent_report(
        remote.client, remote.target, datetime.fromtimestamp(T0 + 1560, UTC),
        agent_dir=remote.agent_dir,
    )  # fmt: skip
    assert report.heartbeat_age_s == 30 and report.stop is None
    assert report.lost_runs == () and report.interruption is None


def test_an_expired_lease_on_an_idle_host_issues_the_stop_exactly_once(remote: Remote) -> None:
    remote.renew(T0)
    assert remote.once()["stop_issued"] is False
    lease = remote.client.read_file(remote.target, f"{remote.agent_dir}/{LEASE_NAME}")
    assert lease is not None and json.loads(lease)["renewed_at"] == T0
    # No temp file left behind by the atomic renewal.
    assert sorted(os.listdir(remote.agent_dir)) == sorted(
        [LEASE_NAME, HEARTBEAT_NAME, "agent-state.json", "agent.lock"]
    )

    remote.set_now(T0 + LEASE_S)  # lease exactly at its limit: not yet
    assert remote.once()["stop_issued"] is False
    remote.set_now(T0 + LEASE_S + 1)  # the bot died: no renewal for longer than the lease
    out = remote.once()
    assert out["stop_issued"] is True
    assert remote.stops() == 1
    for later in (1, 60, 3600):
        remote.set_now(T0 + LEASE_S + 1 + later)
        assert remote.once()["stop_issued"] is False
    assert remote.stops() == 1

    report = read_agent_report(remote.client, remote.target, agent_dir=remote.agent_dir)
    assert report.stop is not None and report.stop["at"] == T0 + LEASE_S + 1
    assert report.stop["exit_code"] == 0
    stop = remote.client.read_file(remote.target, f"{remote.agent_dir}/{STOP_NAME}")
    assert stop is not None and json.loads(stop)["command"].startswith("echo stopped")


def test_an_expired_lease_with_an_active_run_keeps_the_host_running(remote: Remote) -> None:
    run_dir = f"{remote.runs_dir}/7"
    status = json.dumps({"schema_version": 1, "state": "running", "run_id": "7"})
    remote.client.write_file(remote.target, f"{run_dir}/status.json", status.encode())
    pgid = remote.client.start_detached(
        remote.target, "sleep 600", f"{run_dir}/run.log", cwd=run_dir
    )
    remote.groups.append(pgid)
    remote.renew(T0)
    assert remote.once()["runs"] == [{"id": "7", "pgid": pgid, "source": "run-dir", "dir": run_dir}]
    remote.set_now(T0 + 10 * LEASE_S)  # the bot is long gone; the run goes on
    out = remote.once()
    assert out["stop_issued"] is False and out["idle_s"] == 0
    assert remote.stops() == 0

    # The run ends; the host is idle from then on, and stops once idle long enough.
    assert remote.client.kill_group(remote.target, pgid, "KILL")
    deadline = time.monotonic() + 10
    while remote.client.is_alive(remote.target, pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    remote.set_now(T0 + 10 * LEASE_S + IDLE_S)
    assert remote.once()["stop_issued"] is False
    remote.set_now(T0 + 10 * LEASE_S + IDLE_S + 1)
    assert remote.once()["stop_issued"] is True
    assert remote.stops() == 1


def test_a_run_in_the_lease_is_seen_by_its_process_group(remote: Remote) -> None:
    pgid = remote.client.start_detached(remote.target, "sleep 600", f"{remote.root}/x.log")
    remote.groups.append(pgid)
    remote.renew(T0, HostHolds(runs=(RunHold("12", pgid),)))
    assert [(r["id"], r["source"]) for r in remote.once()["runs"]] == [("12", "lease")]
    remote.set_now(T0 + 10 * LEASE_S)
    assert remote.once()["stop_issued"] is False


def test_the_agent_daemon_started_as_the_bot_would_stops_a_forgotten_host(
    remote: Remote,
) -> None:
    line = shlex.join(remote.agent_argv("--interval", "0.1"))
    pgid = remote.client.start_detached(
        remote.target, line, f"{remote.root}/agent.log", cwd=str(REPO)
    )
    remote.groups.append(pgid)

    def heartbeat() -> dict[str, Any] | None:
        raw = remote.client.read_file(remote.target, f"{remote.agent_dir}/{HEARTBEAT_NAME}")
        return json.loads(raw) if raw else None

    def wait_for(check: Any) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.1)
        log = remote.client.tail(remote.target, f"{remote.root}/agent.log", 20)
        pytest.fail(f"timed out; agent log:\n{log}")

    remote.renew(T0)
    wait_for(lambda: (hb := heartbeat()) is not None and hb["seen"]["lease_renewed_at"] == T0)
    remote.set_now(T0 + 60)
    remote.renew(T0 + 60)
    # Until the agent has seen this renewal at T0 + 60: a loop that read the clock after
    # set_now and the lease before renew also beats at T0 + 60, and if the renewal is
    # first seen after the clock moves on below, the lease counts as fresh from then and
    # nothing is ever stopped (CI's loaded fresh clone timed out so, once).
    wait_for(
        lambda: (
            (hb := heartbeat()) is not None
            and hb["time"] == T0 + 60
            and hb["seen"]["lease_renewed_at"] == T0 + 60
        )
    )
    assert remote.stops() == 0
    remote.set_now(T0 + 60 + LEASE_S + 1)  # no more renewals
    wait_for(lambda: remote.stops() >= 1)
    time.sleep(0.5)  # several more iterations
    assert remote.stops() == 1
    hb = heartbeat()
    assert hb is not None and hb["stop"]["at"] == T0 + 60 + LEASE_S + 1
    assert remote.client.kill_group(remote.target, pgid, "TERM")


def test_install_agent_runs_it_under_a_supervisor_that_restarts_it(remote: Remote) -> None:
    agent = AgentInstall(
        stop_command="",
        imds_endpoint=None,
        interval_s=0.2,
        runs_dirs=(remote.runs_dir,),
        use_systemd=False,
    )
    # A pid file left from before a reboot, its number now another process's: left alone.
    stranger = remote.client.start_detached(remote.target, "sleep 600", f"{remote.root}/s.log")
    remote.groups.append(stranger)
    remote.client.write_file(
        remote.target, f"{remote.root}/agent/supervisor.pid", f"{stranger}\n".encode()
    )
    service, steps = install_agent(
        remote.client,
        remote.target,
        str(remote.root),
        agent,
        python=sys.executable,
        code_dir=str(REPO),
    )
    agent_dir = f"{remote.root}/agent"
    pidfile = f"{agent_dir}/supervisor.pid"
    raw_pid = remote.client.read_file(remote.target, pidfile)
    assert raw_pid is not None
    remote.groups.append(int(raw_pid))
    assert service == "supervisor"
    assert remote.client.is_alive(remote.target, stranger)
    assert steps[0] == f"host agent: supervised process started (group {int(raw_pid)})"

    def beat() -> dict[str, Any] | None:
        raw = remote.client.read_file(remote.target, f"{agent_dir}/{HEARTBEAT_NAME}")
        return json.loads(raw) if raw else None

    deadline = time.monotonic() + 30
    while (hb := beat()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hb is not None
    first_pid = hb["pid"]
    os.kill(first_pid, signal.SIGKILL)  # the agent dies; the supervisor brings it back
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        hb = beat()
        if hb is not None and hb["pid"] != first_pid:
            break
        time.sleep(0.2)
    assert hb is not None and hb["pid"] != first_pid

    # Installing again replaces the supervisor: still exactly one agent afterwards.
    install_agent(
        remote.client,
        remote.target,
        str(remote.root),
        agent,
        python=sys.executable,
        code_dir=str(REPO),
    )
    new_pid = remote.client.read_file(remote.target, pidfile)
    assert new_pid is not None and new_pid != raw_pid
    remote.groups.append(int(new_pid))
    assert not remote.client.is_alive(remote.target, int(raw_pid))


def test_bootstrap_installs_the_agent_once_and_brings_it_back_when_it_is_gone(
    ssh_lab: SshLab, tmp_path: Path
) -> None:
    client = SshClient(connect_timeout=5, command_timeout=60)
    host = _make_host(client, target_for(ssh_lab, "gpu-a"), tmp_path / "gpu-a")
    agent = AgentInstall(stop_command=None, imds_endpoint=None, interval_s=0.2)
    agent_dir = host.root / "agent"
    groups: list[int] = []

    def supervisor() -> int:
        pgid = int((agent_dir / "supervisor.pid").read_text())
        groups.append(pgid)
        return pgid

    def wait_for_heartbeat(not_pid: int | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            path = agent_dir / HEARTBEAT_NAME
            if path.exists():
                hb: dict[str, Any] = json.loads(path.read_text())
                if hb["pid"] != not_pid:
                    return hb
            time.sleep(0.1)
        pytest.fail("no heartbeat from the installed agent")

    try:
        first = host.boot(agent=agent)
        pgid = supervisor()
        assert first.steps[-3:] == (
            f"host agent: supervised process started (group {pgid})",
            "host agent: no crontab here, so after a reboot it runs again at the next bootstrap",
            f"marker written (bootstrap v{BOOTSTRAP_VERSION})",
        )
        marker = host.marker()
        assert marker["agent"] == agent.marker() and marker["agent_service"] == "supervisor"
        beat = wait_for_heartbeat()
        assert beat["limits"]["stops_host"] is False  # stop_command=None: watch only
        assert beat["seen"]["imds"] == "off"

        # Up to date and the agent alive: only the marker and the supervisor are looked at.
        host.runner.calls.clear()
        again = host.boot(agent=agent)
        assert again.noop and again.steps == (UP_TO_DATE,)
        assert [c for c in host.runner.calls if c[0] != "read_file"] == [("is_alive", str(pgid))]
        assert [c[1] for c in host.runner.calls if c[0] == "read_file"] == [
            str(host.root / "bootstrap.json"),
            str(agent_dir / "supervisor.pid"),
            f"/proc/{pgid}/cmdline",
        ]
        assert supervisor() == pgid

        # The host rebooted without cron (here: the supervisor's group is killed).
        os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while client.is_alive(host.target, pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        third = host.boot(agent=agent)
        assert third.noop and third.steps[-1] == UP_TO_DATE
        new_pgid = supervisor()
        assert new_pgid != pgid
        assert third.steps[0] == f"host agent: supervised process started (group {new_pgid})"
        wait_for_heartbeat(not_pid=beat["pid"])

        # Other agent settings make the marker stale: bootstrap runs again and reinstalls.
        changed = AgentInstall(stop_command=None, imds_endpoint=None, interval_s=0.3)
        fourth = host.boot(agent=changed)
        assert not fourth.noop
        assert supervisor() != new_pgid
        assert not client.is_alive(host.target, new_pgid)
        assert host.marker()["agent"] == changed.marker()
    finally:
        client.close()
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)


def test_the_lease_lists_what_the_database_holds_on_the_host(
    remote: Remote, engine: Engine
) -> None:
    """From the worker's rows to the agent's view: active reservations and live runs hold."""
    now = datetime.fromtimestamp(T0, UTC)
    pgid = remote.client.start_detached(remote.target, "sleep 600", f"{remote.root}/r.log")
    remote.groups.append(pgid)
    with transaction(engine) as s:
        user = User(key="alice", display_name="Alice", created_at=now)
        here = Host(name="gpu-a", provider="ssh", created_at=now, updated_at=now)
        there = Host(name="gpu-b", provider="ssh", created_at=now, updated_at=now)
        s.add_all([user, here, there])
        s.flush()
        assert user.id is not None and here.id is not None and there.id is not None
        user_id = user.id

        def reservation(host_id: int, state: str) -> Reservation:
            return Reservation(
                user_id=user_id, duration_s=3600, state=state, host_id=host_id,
                requested_at=now, ends_at=now + timedelta(hours=1),
            )  # fmt: skip

        def run(host_id: int, state: str, placement: dict[str, Any]) -> TrainingRun:
            return TrainingRun(
                user_id=user_id, command="x", state=state, host_id=host_id,
                placement=placement, submitted_at=now,
            )  # fmt: skip

        held = reservation(here.id, RES_ACTIVE)
        live = run(here.id, "running", {"pgid": pgid})
        claimed = run(here.id, "starting", {})
        s.add_all(
            [
                held,
                reservation(here.id, RES_RELEASED),
                reservation(there.id, RES_ACTIVE),
                live,
                claimed,
                run(here.id, "succeeded", {"pgid": 1}),
                run(there.id, "running", {"pgid": 2}),
            ]
        )
        s.flush()
        host_id, ids = here.id, (str(held.id), str(live.id), str(claimed.id))
    with transaction(engine, write=False) as s:
        holds = host_holds(s, host_id)
    assert holds == HostHolds(
        reservations=(ReservationHold(ids[0], T0 + 3600),),
        runs=(RunHold(ids[1], pgid), RunHold(ids[2], None)),
    )
    remote.renew(T0, holds)
    remote.set_now(T0 + 10 * LEASE_S)  # lease long expired: the holds still keep the host
    out = remote.once()
    assert out["reservations"] == [ids[0]]
    assert [(r["id"], r["pgid"]) for r in out["runs"]] == [(ids[1], pgid)]
    assert out["stop_issued"] is False


def test_the_systemd_unit_restarts_the_agent_and_starts_at_boot() -> None:
    """No systemd runs here, so the unit is checked as text; its command line must
    survive systemd's quoting (the same rules as the shell's for these arguments)."""
    agent = AgentInstall(stop_command="sudo -n shutdown -h now", runs_dirs=("/data/runs",))
    argv = agent.argv("/home/ubuntu/.gpubot/venv/bin/python", "/home/ubuntu/.gpubot")
    unit = agent_unit("ubuntu", "/home/ubuntu/.gpubot/code", argv)
    lines = unit.splitlines()
    assert "User=ubuntu" in lines and "Restart=always" in lines
    assert "WantedBy=multi-user.target" in lines
    assert "WorkingDirectory=/home/ubuntu/.gpubot/code" in lines
    [exec_start] = [line for line in lines if line.startswith("ExecStart=")]
    assert shlex.split(exec_start.removeprefix("ExecStart=")) == argv
    assert argv[argv.index("--stop-command") + 1] == "sudo -n shutdown -h now"
    assert argv[argv.index("--runs-dir") + 1] == "/data/runs"
    assert argv[argv.index("--imds-endpoint") + 1] == "http://169.254.169.254"
    assert argv[argv.index("--state-dir") + 1] == "/home/ubuntu/.gpubot/agent"
    # systemd's own expansions are escaped: a literal % or $ reaches the agent unchanged.
    odd = AgentInstall(stop_command="echo 100% $HOME >> /tmp/x").argv("/py", "/r")
    [odd_exec] = [x for x in agent_unit("u", "/c", odd).splitlines() if x.startswith("ExecStart=")]
    assert "'echo 100%% $$HOME >> /tmp/x'" in odd_exec
