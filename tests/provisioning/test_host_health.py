"""Static hosts' health (bot.app.hosts.hostcheck) against real sshd hosts, on the virtual clock.

A host's sshd is killed and started again, as a reboot or a network drop would; the
checks run on the checker's threads and the tests wait for them (`HostChecker.wait`)
rather than for time. The health tests prepare hosts without a bootstrap (they are about
marking down and back, not about what a host has). Where a check only dials (`true`) and
the host's GPUs are given, the hosts are strangers (`stranger_lab`: their own accounts,
nothing of the bot's); the slow-bootstrap test reads an inventory with the bot's own
interpreter, so it keeps the shortcut lab (`ssh_lab`, the bot's user). The last test is
the bootstrap one, on an isolated host with only the system python3.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import load_settings
from bot.app.hosts.hostcheck import BACKOFF_FIRST, CHECK_EVERY, HostChecker, backoff
from bot.app.hosts.remote import PreparedHost, bootstrap_prepare
from bot.app.watching.utilization import probe
from bot.domain.clock import VirtualClock
from bot.domain.commands import Queue, Release, Reserve, Run, Status
from bot.faces.runtime import Runtime, build_runtime
from db.models import Gpu, Host, Reservation
from provisioning.base import ProvisioningError
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshLinkLost, SshTarget
from tests.isolated_hosts import Bootstrapped
from tests.runtime_helpers import dms as _dms
from tests.ssh_hosts import SshHost, SshLab, _descendants_of, pip_env

START = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)


def _entry(lab: SshLab, name: str, gpus: str = "") -> str:
    host = lab.hosts[name]
    user = lab.user_of(name)
    return f"{name}={user}@{host.address}:{host.port}" + (f"/{gpus}" if gpus else "")


@pytest.fixture
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=2, command_timeout=20)
    try:
        yield c
    finally:
        c.close()


def _runtime(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    lab: SshLab,
    hosts: str,
    client: SshClient,
    prepare: object,
) -> tuple[Runtime, VirtualClock, HostChecker]:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(lab.client_key))
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", hosts)
    clock = VirtualClock(START)
    rt = build_runtime(load_settings(), clock=clock, ssh=client, prepare=prepare)  # type: ignore[arg-type]
    checker = rt.service.places.checker("ssh")
    assert isinstance(checker, HostChecker)
    return rt, clock, checker


def _no_bootstrap(root: Path) -> object:
    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        # A shortcut: these tests are about health, not about what a host has.
        return PreparedHost(root=str(root / target.name), python=sys.executable)

    return prepare


@pytest.fixture
def stranger_b(stranger_lab: SshLab) -> Iterator[SshHost]:
    """The strangers' gpu-b, which a test may stop; it is up again for the next test."""
    host = stranger_lab.hosts["gpu-b"]
    try:
        yield host
    finally:
        host.start()


def _host(rt: Runtime, name: str) -> Host:
    with Session(rt.engine) as s:
        return s.exec(select(Host).where(Host.name == name)).one()


def _check(checker: HostChecker) -> list[str]:
    started = checker.tick()
    checker.wait(timeout=60)
    return started


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff(n) for n in (1, 2, 3)] == [BACKOFF_FIRST, BACKOFF_FIRST * 2, BACKOFF_FIRST * 4]
    assert backoff(40) == timedelta(minutes=15)
    assert backoff(0) == CHECK_EVERY


def test_a_host_that_stops_answering_is_marked_down_and_comes_back_by_itself(
    stranger_lab: SshLab,
    stranger_b: SshHost,
    client: SshClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lab = stranger_lab
    hosts = ",".join([_entry(lab, "gpu-a", "1xA100"), _entry(lab, "gpu-b", "1xT4")])
    rt, clock, checker = _runtime(
        monkeypatch, tmp_path, lab, hosts, client, _no_bootstrap(tmp_path)
    )
    svc = rt.service
    assert sorted(_check(checker)) == ["gpu-a", "gpu-b"]
    assert _host(rt, "gpu-b").state == "ready"
    alice, bob = svc.actor("alice"), svc.actor("bob")
    assert "gpu-b" in svc.reserve(alice, Reserve(1, "T4")).view.text
    svc.reserve(bob, Reserve(1, "T4"))  # waits behind alice

    stranger_b.stop()
    first_failure = clock.now()
    seen = []
    for failures in (1, 2, 3):
        clock.advance(timedelta(minutes=2) if failures == 1 else backoff(failures - 1))
        started = _check(checker)
        assert "gpu-b" in started
        host = _host(rt, "gpu-b")
        seen.append(host.state)
        assert host.check_failures == failures
        assert host.next_check_at == clock.now() + backoff(failures)
        # Backing off: a tick before the next check is due does not dial it.
        assert "gpu-b" not in checker.tick()
        checker.wait(timeout=60)
        if failures == 1:
            first_failure = clock.now()
    assert seen == ["ready", "ready", "unreachable"]
    host = _host(rt, "gpu-b")
    assert host.down_since == first_failure
    assert host.down_reason is not None and host.down_reason.startswith("unreachable: ")
    assert _host(rt, "gpu-a").state == "ready" and _host(rt, "gpu-a").check_failures == 0

    # Told once each: the holder and the one waiting for its T4.
    for user in ("alice", "bob"):
        [note] = [t for t in _dms(rt, user) if "is down since" in t]
        assert note.startswith("Host gpu-b is down since 09:")
    clock.advance(backoff(3))
    _check(checker)
    assert sum("is down since" in t for t in _dms(rt, "bob")) == 1

    status = svc.status(alice, Status()).view
    line = next(b for b in status.blocks if "*gpu-b*" in str(b))
    assert "down since" in str(line) and "unreachable: " in str(line)
    assert any("gpu-b is down since" in str(b) for b in status.blocks)

    # /gpu queue: a run for its T4 says what it waits on.
    assert svc.runs is not None
    svc.runs.submit(bob, Run(recipe="digits", model="T4"))
    queue = svc.runs.queue(bob, Queue()).view
    table = next(b for b in queue.blocks if "est. start" in str(b))
    assert "waits: gpu-b down since" in str(table)
    assert any(
        str(b).startswith("Context") and "gpu-b is down since" in str(b) for b in queue.blocks
    )

    # Nothing is granted there while it is down.
    svc.release(alice, Release(all=True))
    svc.tick()
    with Session(rt.engine) as s:
        assert s.exec(select(Reservation).where(Reservation.state == "waiting")).all()

    stranger_b.start()
    clock.advance(backoff(4))
    _check(checker)
    host = _host(rt, "gpu-b")
    assert (host.state, host.down_since, host.down_reason, host.check_failures) == (
        "ready",
        None,
        None,
        0,
    )
    svc.tick()
    with Session(rt.engine) as s:
        assert not s.exec(select(Reservation).where(Reservation.state == "waiting")).all()
    rt.engine.dispose()


def test_the_tick_never_waits_for_a_slow_bootstrap(
    ssh_lab: SshLab, client: SshClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered = threading.Event()

    def slow(runner: HostShell, target: SshTarget) -> PreparedHost:
        entered.set()
        assert release.wait(timeout=60)
        return PreparedHost(root=str(tmp_path / target.name), python=sys.executable)

    rt, _clock, checker = _runtime(
        monkeypatch, tmp_path, ssh_lab, _entry(ssh_lab, "gpu-a"), client, slow
    )
    # It has not answered yet (and without a GPU list it has none until its bootstrap and
    # inventory): checking, not grantable.
    assert _host(rt, "gpu-a").state == "checking"
    assert checker.tick() == ["gpu-a"]
    assert entered.wait(timeout=60)
    # The bootstrap is in flight: the tick hands out nothing more and returns.
    assert checker.tick() == []
    assert checker.in_flight() == ["gpu-a"]
    rt.service.tick()
    # What the tick's dispatch and sampling ask for is "not ready yet", not a wait.
    assert rt.service.runs is not None
    assert rt.service.runs.access.runner_for("gpu-a") is None
    release.set()
    [result] = checker.wait(timeout=60)
    assert result.ok
    assert _host(rt, "gpu-a").state == "ready"
    rt.engine.dispose()


def test_a_failed_setup_marks_the_host_down_at_once_and_tells_the_channel(
    stranger_lab: SshLab, client: SshClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(runner: HostShell, target: SshTarget) -> PreparedHost:
        raise ProvisioningError(f"bootstrap of {target.name}: pip install failed: No space left")

    lab = stranger_lab
    rt, _clock, checker = _runtime(
        monkeypatch, tmp_path, lab, _entry(lab, "gpu-a", "1xA100"), client, broken
    )
    rt.service.reserve(rt.service.actor("carol"), Reserve(1, "A100"))
    _check(checker)
    host = _host(rt, "gpu-a")
    assert host.state == "unreachable" and host.check_failures == 1
    assert host.down_reason == "setup failed: bootstrap of gpu-a: pip install failed: No space left"
    [dm] = [t for t in _dms(rt, "carol") if "is down since" in t]
    assert "setup failed: bootstrap of gpu-a: pip install failed" in dm
    rt.engine.dispose()


def test_a_host_without_a_gpu_list_is_probed_after_its_bootstrap_with_its_own_python(
    bootstrapped: Bootstrapped,
    client: SshClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lab = bootstrapped.lab
    prepare = functools.partial(bootstrap_prepare, cloud=False, env=pip_env())
    rt, _clock, checker = _runtime(
        monkeypatch, tmp_path, lab, _entry(lab, "lab-a"), client, prepare
    )
    assert checker.tick() == ["lab-a"]
    [result] = checker.wait(timeout=600)
    assert result.ok, result.reason
    host = _host(rt, "lab-a")
    assert host.state == "ready"
    with Session(rt.engine) as s:
        assert [g.model for g in s.exec(select(Gpu).where(Gpu.host_id == host.id))] == ["cpu"]
    status = rt.service.status(rt.service.actor("dave"), Status()).view
    assert any("CPU only: no NVIDIA GPU found" in str(b) for b in status.blocks)

    # Telemetry as bot.app.watching.utilization asks for it runs with the interpreter the host's
    # seat hands out: its venv and code, not the bare system python3.
    assert rt.service.runs is not None
    seat = rt.service.runs.access.runner_for("lab-a")
    assert seat is not None
    snap = probe(seat)
    assert snap.gpus == () and snap.error
    rt.engine.dispose()


class _DeadPort:
    """A loopback port that takes each connection and closes it at once, counting them: a
    host whose sshd is gone but whose machine answers TCP. Every dial of the bot to it,
    from any job, is one accepted connection here."""

    def __init__(self) -> None:
        import socket

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self.dials = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.dials += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def dead_port() -> Iterator[_DeadPort]:
    port = _DeadPort()
    try:
        yield port
    finally:
        port.close()


def _worker_minutes(rt: Runtime, clock: VirtualClock, checker: HostChecker, minutes: int) -> None:
    """The worker's jobs on the virtual clock, as `gpubot worker` schedules them with a 2 s
    tick: the tick (grants, poll, dispatch) every 2 s, samples and idle checks every
    `util_sample_s`, host checks every 15 s; each check finished before time moves on."""
    from bot.app.watching import idle, utilization
    from bot.faces.worker import tick_job

    sample_every = int(rt.settings.util_sample_s)
    for second in range(0, minutes * 60, 2):
        tick_job(rt.service, None)
        if second % sample_every == 0:
            utilization.sample_job(rt.service)
            idle.idle_job(rt.service)
        if second % 15 == 0:
            checker.tick()
            checker.wait(timeout=60)
        clock.advance(timedelta(seconds=2))


def test_a_declared_host_that_never_answers_is_checking_then_unreachable_and_never_granted(
    dead_port: _DeadPort, client: SshClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBOT_TICK_SECONDS", "2")
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", f"dead=nobody@127.0.0.1:{dead_port.port}/1xT4")
    clock = VirtualClock(START)
    rt = build_runtime(load_settings(), clock=clock, ssh=client, prepare=_no_bootstrap(tmp_path))  # type: ignore[arg-type]
    checker = rt.service.places.checker("ssh")
    assert isinstance(checker, HostChecker)
    svc, alice = rt.service, rt.service.actor("alice")

    # Declared with its GPUs, but it has not answered: checking, nothing granted on it,
    # and the waiting reservation is told why.
    assert _host(rt, "dead").state == "checking"
    reply = svc.reserve(alice, Reserve(1, "T4")).view.text
    assert "waiting" in reply and "dead is not answered yet" in reply, reply
    status = svc.status(alice, Status()).view
    assert status.text.startswith("0 of 0 free on 0 hosts; 1 starting up")
    assert any("*dead*" in str(b) and "not answered yet" in str(b) for b in status.blocks)

    # Its first check fails: unreachable at once (it never answered: not a flap).
    _check(checker)
    host = _host(rt, "dead")
    assert host.state == "unreachable" and host.check_failures == 1
    status = svc.status(alice, Status()).view
    assert any("*dead*" in str(b) and "down since 09:00" in str(b) for b in status.blocks)
    [note] = [t for t in _dms(rt, "alice") if "is down since" in t]
    assert note.startswith("Host dead is down since 09:00")

    # Three minutes of the worker with a 2 s tick: every job, and the host checks on their
    # backoff. Only the checks dial it, and few times.
    before = dead_port.dials
    _worker_minutes(rt, clock, checker, 3)
    assert 1 <= dead_port.dials - before <= 10, dead_port.dials - before
    with Session(rt.engine) as s:
        assert [r.state for r in s.exec(select(Reservation))] == ["waiting"]
    rt.engine.dispose()


def test_a_ready_host_that_stops_answering_is_dialled_only_by_its_checks(
    stranger_lab: SshLab,
    stranger_b: SshHost,
    client: SshClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It answered before: today's rule against flapping keeps it ready until its checks
    fail three times, but from its first unanswered dial (here the tick's telemetry) only
    the checks dial it, on their backoff, and status says it is not answering."""
    monkeypatch.setenv("GPUBOT_TICK_SECONDS", "2")
    lab = stranger_lab
    rt, clock, checker = _runtime(
        monkeypatch, tmp_path, lab, _entry(lab, "gpu-b", "1xT4"), client, _no_bootstrap(tmp_path)
    )
    _check(checker)
    assert _host(rt, "gpu-b").state == "ready"
    rt.service.reserve(rt.service.actor("alice"), Reserve(1, "T4"))  # busy: it is sampled
    stranger_b.stop()
    client.close()  # the cached connection would hide the stop until it noticed
    from bot.app.watching import utilization

    utilization.sample_job(rt.service)  # a tick's dial, not a check's
    host = _host(rt, "gpu-b")
    assert host.state == "ready" and host.down_since == clock.now()
    assert host.next_check_at == clock.now()  # checked at once
    assert rt.service.runs is not None and rt.service.runs.access.runner_for("gpu-b") is None
    line = next(
        b
        for b in rt.service.status(rt.service.actor("a"), Status()).view.blocks
        if "*gpu-b*" in str(b)
    )
    assert "not answering since 09:00" in str(line)

    _worker_minutes(rt, clock, checker, 4)
    host = _host(rt, "gpu-b")
    assert host.state == "unreachable" and host.check_failures >= 3

    stranger_b.start()
    clock.advance(backoff(host.check_failures))
    _check(checker)
    host = _host(rt, "gpu-b")
    assert (host.state, host.down_since) == ("ready", None)
    assert rt.service.runs.access.runner_for("gpu-b") is not None
    rt.engine.dispose()


def test_a_dropped_link_is_an_outage_only_when_a_fresh_dial_fails_too(
    stranger_lab: SshLab,
    stranger_b: SshHost,
    client: SshClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's watcher waits on a channel of the host's one connection; a stalled read
    elsewhere closes that connection under it. The host still answers, so it stays in use;
    a host that went with its link (sshd killed, every connection with it) is marked."""
    lab = stranger_lab
    rt, clock, checker = _runtime(
        monkeypatch, tmp_path, lab, _entry(lab, "gpu-b", "1xT4"), client, _no_bootstrap(tmp_path)
    )
    _check(checker)
    assert rt.service.runs is not None
    access = rt.service.runs.access
    seat = access.runner_for("gpu-b")
    assert seat is not None
    log_path = str(stranger_b.root / "sleeper.log")  # the account's own home

    def waits_while(cut: Callable[[], None]) -> None:
        pid = seat.runner.start_detached(seat.target, "exec sleep 120", log_path)
        timer = threading.Timer(0.5, cut)
        timer.start()
        try:
            with pytest.raises(SshLinkLost):
                seat.runner.wait_gone(seat.target, pid, 60)
        finally:
            timer.join()

    waits_while(lambda: client.close(seat.target))  # the connection dropped, not the host
    host = _host(rt, "gpu-b")
    assert (host.state, host.down_since) == ("ready", None)
    again = access.runner_for("gpu-b")
    assert again is not None and again.runner.run(again.target, "true").ok

    def host_gone() -> None:
        """The listener first, then every live connection, as when a host's network goes:
        stop() kills them the other way round, and a fresh dial between the two found
        the listener still there (a race a loaded machine lost)."""
        daemon = stranger_b.process
        assert daemon is not None
        sessions = _descendants_of(daemon.pid)
        daemon.kill()
        daemon.wait(timeout=10)
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stranger_b.stop()

    waits_while(host_gone)  # the host gone with its link
    host = _host(rt, "gpu-b")
    assert host.down_since == clock.now() and "lost the connection" in (host.down_reason or "")
    assert access.runner_for("gpu-b") is None
    rt.engine.dispose()
