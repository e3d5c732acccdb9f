"""Reaching hosts over SSH: preparing one on first use, and handing out its seat.

`RemoteAccess` is the `HostAccess` (bot.app.ports) of static hosts and cloud instances.
It prepares a host once per process (`bootstrap_prepare`: the idempotent bootstrap and
the host agent; `home_prepare` where the bot's interpreter is already there), remembers
the result (`PreparedHost`: where runs live, which python runs `training` and from which
code directory), and hands out a `HostSeat` built from it, so every command line that
starts `python -m training.…` there is built with the host's own interpreter. The fleet
(bot.app.fleet) and the host checks (bot.app.hosts.hostcheck) use it; neither is needed here.
"""

from __future__ import annotations

import logging
import os
import posixpath
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlmodel import select

from bot.app.ports import HostAccess, HostSeat, Interpreter
from bot.domain.clock import Clock, SystemClock
from db.models import HOST_READY, HOST_STOPPED, HOST_TERMINATED, HOST_UNREACHABLE, Host
from db.session import transaction
from provisioning.base import Instance, ProvisioningError
from provisioning.bootstrap import DEFAULT_METADATA_URL, AgentInstall, bootstrap
from provisioning.hostshell import HostShell
from provisioning.ssh import (
    Resolver,
    RunResult,
    SshError,
    SshLinkLost,
    SshTarget,
    SshUnreachable,
    UploadReport,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# The dial that tells a dropped link from a host gone (the host checks' own dial timeout).
CONFIRM_DIAL_S = 15.0


@dataclass(frozen=True)
class PreparedHost:
    """Where gpubot lives on a host once it is ready: runs go under `root`/runs, and
    `python -m training.…` runs with `python` from `code_dir` (on PYTHONPATH)."""

    root: str
    python: str
    code_dir: str | None = None

    def interpreter(self) -> Interpreter:
        """What starts `python -m training.…` there (bot.app.ports.HostSeat hands it out)."""
        return Interpreter(self.python, self.code_dir)

    @property
    def runs_dir(self) -> str:
        """Where runs live there (the seat's `runs_dir`; the checks read its free disk)."""
        return posixpath.join(self.root, "runs")


# (runner, target) -> the prepared host; raises ProvisioningError when it cannot be.
Prepare = Callable[[HostShell, SshTarget], PreparedHost]


def bootstrap_prepare(
    runner: HostShell,
    target: SshTarget,
    *,
    cloud: bool | None = None,
    env: Mapping[str, str] | None = None,
    metadata_url: str = DEFAULT_METADATA_URL,
) -> PreparedHost:
    """The production preparation: the idempotent bootstrap (a marker read when current),
    with the host agent (training.agent; bot.app.hosts.agentwatch reads it). On an EC2 instance it
    guards the budget: it stops the instance when the bot is gone and nothing runs, and
    watches for spot notices. On a static host (someone else's machine) it only watches:
    no stop, no metadata service. `cloud` None: an EC2 host is one named by its instance
    id (the EC2 fleet's host names); static hosts carry the names the team gave them.
    The agent's runs dir is the bootstrap root's ``runs``, where `RemoteAccess` puts runs.
    `env` goes to the bootstrap's commands: a pip index, proxy or wheel directory.
    `metadata_url` is where an EC2 agent asks for spot notices (Ec2Settings.metadata_url)."""
    if cloud is None:
        ident = target.name.removeprefix("i-")
        cloud = target.name.startswith("i-") and len(ident) in (8, 17)
        cloud = cloud and all(c in "0123456789abcdef" for c in ident)
    if cloud:  # EC2: `shutdown -h` stops (not terminates); a non-root login needs sudo
        stop = "shutdown -h now" if target.user == "root" else "sudo -n shutdown -h now"
        agent = AgentInstall(stop_command=stop, imds_endpoint=metadata_url)
    else:
        agent = AgentInstall(stop_command=None, imds_endpoint=None)
    report = bootstrap(runner, target, remote_root="~/.gpubot", agent=agent, env=env)
    return PreparedHost(root=report.root, python=report.venv_python, code_dir=report.code_dir)


def home_prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
    """No bootstrap: `~/.gpubot` on a host where the bot's own interpreter and training
    package already are (a shared file system, a hand-made image; tests' loopback hosts)."""
    result = runner.run(target, 'printf %s "$HOME"', timeout=15)
    home = result.stdout.strip()
    if not result.ok or not home.startswith("/"):
        raise SshError(f"cannot read the home directory on {target.label}")
    return PreparedHost(root=f"{home}/.gpubot", python=sys.executable)


def _instance(host: Host) -> Instance:
    """What the resolver needs of a host row."""
    return Instance(
        name=host.name,
        provider=host.provider,
        state=host.state,
        gpus=(),
        instance_id=host.instance_id,
        instance_type=host.instance_type,
        market=host.market,
        address=host.address,
        ssh_user=host.ssh_user,
        ssh_port=host.ssh_port,
    )


# Host states of a host known to answer (unless `down_since` says its last dial failed):
# ready, or unreachable without a failed dial (draining after a spot notice).
_ANSWERING = (HOST_READY, HOST_UNREACHABLE)


class _Reporting:
    """A host's runner that reports a dial the host did not answer (SshUnreachable) to
    `failed` before raising it: every use of a seat (poll, start, upload, telemetry,
    a run's watcher) then falls under the one backoff of the host checks. A link lost
    under an operation (SshLinkLost) is reported only when a fresh dial fails too."""

    def __init__(self, inner: HostShell, failed: Callable[[SshUnreachable], None]) -> None:
        self.inner = inner
        self.failed = failed

    def _call(self, op: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        try:
            return op(*args, **kwargs)
        except SshUnreachable as exc:
            if isinstance(exc, SshLinkLost) and self._answers(args[0]):
                # One dropped link (a stalled read on a loaded host closes the shared
                # connection under every channel on it) is not an outage: the caller
                # sees this operation fail, and the next one dials afresh.
                log.info("%s; it answers a fresh dial, so it is not marked down", exc)
                raise
            try:
                self.failed(exc)
            except Exception:  # reporting must never hide the failure it reports
                log.exception("could not record that a host did not answer")
            raise

    def _answers(self, target: SshTarget) -> bool:
        try:
            return self.inner.run(target, "true", timeout=CONFIRM_DIAL_S).ok
        except SshError:
            return False

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        return self._call(self.inner.run, target, command, timeout, cwd=cwd, env=env)

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        return self._call(self.inner.upload_dir, target, local_dir, remote_dir, exclude=exclude)

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None:
        self._call(self.inner.put_file, target, local_path, remote_path, mode=mode)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self._call(self.inner.write_file, target, remote_path, data, mode=mode)

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        return self._call(self.inner.read_file, target, path, max_bytes=max_bytes)

    def start_detached(
        self,
        target: SshTarget,
        command: str,
        log_path: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pid_file: str | None = None,
    ) -> int:
        return self._call(
            self.inner.start_detached,
            target,
            command,
            log_path,
            cwd=cwd,
            env=env,
            pid_file=pid_file,
        )

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return self._call(self.inner.tail, target, path, lines)

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        return self._call(self.inner.kill_group, target, pgid, signal)

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        return self._call(self.inner.is_alive, target, pid)

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        return self._call(self.inner.wait_gone, target, pid, timeout)

    def close(self, target: SshTarget | None = None) -> None:
        self.inner.close(target)


class PrepareInProgress(ProvisioningError):
    """Another thread is bootstrapping this host now; asked not to wait for it."""


class RemoteAccess:
    """`HostAccess` for hosts reached over SSH (static hosts and cloud instances).

    Every host shares one `HostShell` (one `SshClient`, its connections cached); the
    resolver says where to dial, so tests map cloud instances onto loopback sshd hosts
    and the addresses a fake cloud invents are never dialed. A host is prepared
    (bootstrapped) on its first use by this process; the result is remembered.
    """

    def __init__(
        self,
        engine: Any,
        runner: HostShell,
        resolver: Resolver,
        *,
        prepare: Prepare | None = bootstrap_prepare,
        local: HostAccess | None = None,
        wait_for_prepare: bool = True,
        clock: Clock | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.runner = runner
        self.resolver = resolver
        self.prepare = prepare or home_prepare
        self.local = local
        # False where another thread prepares hosts (bot.app.hosts.hostcheck): a caller that finds a
        # bootstrap in progress gets None ("not ready yet") instead of waiting minutes.
        self.wait_for_prepare = wait_for_prepare
        self._prepared: dict[str, PreparedHost] = {}
        self._lock = threading.Lock()
        self._host_locks: dict[str, threading.Lock] = {}

    def instance_of(self, host_name: str) -> Instance | None:
        with transaction(self.engine, write=False) as s:
            host = s.exec(select(Host).where(Host.name == host_name)).first()
        if host is None or host.state in (HOST_TERMINATED, HOST_STOPPED):
            return None
        return _instance(host)

    def target_for(self, instance: Instance) -> SshTarget:
        return self.resolver.resolve(instance)

    def reachable(self, instance: Instance) -> bool:
        """True when a login and `true` work and the host is prepared (bootstrapped): the
        cloud's "running" is not a usable host, and a reservation's holder expects the
        runner's environment there."""
        try:
            target = self.resolver.resolve(instance)
            if not self.runner.run(target, "true", timeout=15).ok:
                return False
        except SshError as exc:
            log.info("%s is not reachable yet: %s", instance.name, exc)
            return False
        return self._prepare(instance.name, target) is not None

    def runner_for(self, host_name: str) -> HostSeat | None:
        """The seat of a host that answered and has not failed a dial since; None
        otherwise. Only the host checks (bot.app.hosts.hostcheck) dial a host that has not
        answered yet (checking, or a cloud instance being set up) or stopped answering
        (`down_since`), so a dead host costs a dial per check on the checks' backoff,
        not one per tick per job. A host draining after a spot notice still answers:
        its runs are signalled, read and requeued through it."""
        if self.local is not None:
            found = self.local.runner_for(host_name)
            if found is not None:
                return found
        with transaction(self.engine, write=False) as s:
            host = s.exec(select(Host).where(Host.name == host_name)).first()
        if host is None or host.state not in _ANSWERING or host.down_since is not None:
            return None
        inst = _instance(host)
        try:
            target = self.resolver.resolve(inst)
        except SshError as exc:
            log.warning("no SSH target for %s: %s", host_name, exc)
            return None
        prepared = self._prepare(host_name, target)
        if prepared is None:
            return None
        runner = _Reporting(self.runner, lambda exc: self.not_answering(host_name, str(exc)))
        return HostSeat(runner, target, Path(prepared.runs_dir), prepared.interpreter)

    def not_answering(self, host_name: str, reason: str) -> None:
        """A dial to a ready host failed: no more dials to it but the checks' until one
        answers. The next check is due at once (bot.app.hosts.hostcheck counts failed checks
        and marks it down on its usual rule; the first that answers clears this)."""
        now = self.clock.now()
        with transaction(self.engine) as s:
            host = s.exec(select(Host).where(Host.name == host_name)).first()
            if host is None or host.state != HOST_READY or host.down_since is not None:
                return
            host.down_since = now
            host.down_reason = f"unreachable: {reason}"[:300]
            host.next_check_at = now
            s.add(host)
        log.warning(
            "%s did not answer (%s); only its checks dial it until one answers", host_name, reason
        )

    def prepared(self, host_name: str) -> PreparedHost | None:
        """The host as this process prepared it, without dialling; None if not yet."""
        with self._lock:
            return self._prepared.get(host_name)

    def prepare_now(self, host_name: str, target: SshTarget, *, wait: bool = True) -> PreparedHost:
        """Prepares (bootstraps) the host unless this process did; raises
        ProvisioningError saying why it cannot be (bot.app.hosts.hostcheck runs it off the tick).
        `wait=False`: PrepareInProgress when another thread is preparing it right now."""
        with self._lock:
            if host_name in self._prepared:
                return self._prepared[host_name]
            host_lock = self._host_locks.setdefault(host_name, threading.Lock())
        if not host_lock.acquire(blocking=wait):
            raise PrepareInProgress(f"{host_name} is being prepared")
        try:
            with self._lock:
                if host_name in self._prepared:
                    return self._prepared[host_name]
            prepared = self.prepare(self.runner, target)
            with self._lock:
                self._prepared[host_name] = prepared
            log.info("host %s prepared (root %s)", host_name, prepared.root)
            return prepared
        finally:
            host_lock.release()

    def forget(self, host_name: str) -> None:
        """Drops what this process knew of the host (`gpubot hosts forget`)."""
        with self._lock:
            self._prepared.pop(host_name, None)

    def _prepare(self, host_name: str, target: SshTarget) -> PreparedHost | None:
        try:
            return self.prepare_now(host_name, target, wait=self.wait_for_prepare)
        except PrepareInProgress:
            log.info("%s is being prepared on another thread; not ready yet", host_name)
            return None
        except ProvisioningError as exc:
            log.warning("preparing %s failed: %s", host_name, exc)
            return None
