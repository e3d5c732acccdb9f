"""The SSH layer: how the bot's hands reach a GPU host.

One narrow interface (`HostShell`) with two implementations that the same contract
tests run against: `SshClient` (fabric/paramiko, for EC2 and on-prem hosts) and
`provisioning.local_runner.LocalRunner` (subprocess, for this machine). Callers name
a host by an `SshTarget`; a `Resolver` turns an `Instance` into one, and tests swap
in a `StaticResolver` that maps the addresses moto invents onto loopback sshd hosts.

Rules every operation keeps, because the worker polls many hosts from one process:

- Nothing blocks forever: connects, commands and file transfers all carry a timeout.
- A failure to reach a host is an `SshError` with a plain message; a command that
  exits non-zero is not an error (the caller reads `exit_code`).
- Every shell word is built by `provisioning.shell` (the one quoting path); secrets
  (env values, keys) are never logged.
- `GPUBOT_SSH_LOOPBACK_ONLY=1` makes the client refuse any non-loopback address
  before dialing, so a test can never reach an address a fake cloud made up.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import posixpath
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut, ThreadException

from provisioning import shell
from provisioning.base import Instance, ProvisioningError
from provisioning.manifest import UploadReport as UploadReport
from provisioning.manifest import (
    local_tree,
    parse_remote_manifest,
    plan_upload,
    remote_manifest_command_line,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOPBACK_ONLY_ENV = "GPUBOT_SSH_LOOPBACK_ONLY"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_COMMAND_TIMEOUT_S = 60.0
# Signals a caller may send to a process group; anything else is a bug, not a wish.
SIGNALS = frozenset({"TERM", "KILL", "INT", "HUP", "QUIT", "USR1", "USR2", "CONT", "STOP"})
# Runs the user's login shell, as `ssh host cmd` does, so commands mean the same
# thing whether they are sent raw or wrapped below.
_LOGIN_SHELL = '"${SHELL:-/bin/sh}"'


class SshError(ProvisioningError):
    """A host could not be reached, or an operation on it did not finish in time."""


class SshNotAllowed(SshError):
    """The target is outside what this process may dial (see GPUBOT_SSH_LOOPBACK_ONLY)."""


class SshUnreachable(SshError):
    """The host did not take the connection (refused, silent, key or login refused) or the
    link died under an operation: the host is not answering, as opposed to a command that
    ran there and failed or took too long. Callers back off dialling it (bot.app.hosts.remote)."""


class SshLinkLost(SshUnreachable):
    """A link the host had taken died (or stalled) under an operation. Unlike a refused or
    silent dial it may be one dropped connection on a loaded host rather than a host
    gone: bot.app.hosts.remote dials once more before it calls the host down."""


@dataclass(frozen=True)
class SshTarget:
    # Address or host name to dial.
    host: str
    port: int = 22
    user: str = "root"
    # Private key file; None lets paramiko use the agent and ~/.ssh keys.
    key_path: str | None = None
    # What messages call the host (the instance name); the address when empty.
    name: str = ""
    # known_hosts file to check the host key against; None trusts the first key seen
    # (fresh cloud instances have unknown keys) and pins it for the client's lifetime.
    known_hosts: str | None = None

    @property
    def label(self) -> str:
        where = f"{self.user}@{self.host}:{self.port}"
        return f"{self.name} ({where})" if self.name else where


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Resolver(Protocol):
    """Where to dial for an instance; tests replace it so nothing off-loopback is dialed."""

    def resolve(self, instance: Instance | str) -> SshTarget: ...


def parse_address(text: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` → (user, host, port); a bare IPv6 address stays whole."""
    user: str | None = None
    if "@" in text:
        user, text = text.rsplit("@", 1)
    port: int | None = None
    if text.startswith("[") and "]" in text:
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
        return user, host, port
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if port_text.isdigit():
            return user, host, int(port_text)
    return user, text, port


@dataclass(frozen=True)
class InstanceResolver:
    """The production default: dial the address the provider recorded on the instance."""

    user: str = "ubuntu"
    key_path: str | None = None
    port: int = 22
    known_hosts: str | None = None

    def resolve(self, instance: Instance | str) -> SshTarget:
        if isinstance(instance, Instance):
            if not instance.address:
                raise SshError(f"{instance.name} has no SSH address yet")
            user, host, port = parse_address(instance.address)
            return SshTarget(
                host=host,
                port=port or instance.ssh_port or self.port,
                user=user or instance.ssh_user or self.user,
                key_path=self.key_path,
                name=instance.name,
                known_hosts=self.known_hosts,
            )
        if not instance:
            raise SshError("no SSH address given")
        user, host, port = parse_address(instance)
        return SshTarget(
            host=host,
            port=port or self.port,
            user=user or self.user,
            key_path=self.key_path,
            known_hosts=self.known_hosts,
        )


@dataclass(frozen=True)
class StaticResolver:
    """A fixed map from instance name, address or cloud id to a target (tests, on-prem hosts)."""

    mapping: Mapping[str, SshTarget]

    def resolve(self, instance: Instance | str) -> SshTarget:
        if isinstance(instance, Instance):
            keys = [instance.name, instance.address, instance.instance_id or ""]
            label = instance.name
        else:
            keys = [instance]
            label = instance
        for key in keys:
            target = self.mapping.get(key) if key else None
            if target is not None:
                return target if target.name else replace(target, name=label)
        raise SshError(f"no SSH address is known for {label}")


# --- shell snippets shared by both runners ------------------------------------------


def env_prefix(env: Mapping[str, str] | None) -> str:
    return shell.env_prefix(env)


# What coreutils `timeout` exits with when it killed the command (TERM, then KILL after -k).
_HOST_TIMEOUT_CODES = (124, 137)


def run_command_line(
    command: str,
    timeout: float | None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The command wrapped so that it also dies on the host when the caller gives up.

    Closing an SSH channel does not kill a command without a pty, so a hung
    `nvidia-smi` would pile up; coreutils `timeout` (where the host has it) kills
    the command's whole group a little after the caller's own deadline.
    """
    inner = f"{shell.env_prefix(env)}{_LOGIN_SHELL} -c {shell.quote(command)}"
    if timeout is not None:
        limit = f"{timeout + 1:.3f}"
        inner = (
            f"if command -v timeout >/dev/null 2>&1; then exec timeout -k 2 {limit} {inner}; "
            f"else exec {inner}; fi"
        )
    if cwd:
        inner = shell.in_dir(cwd, inner)
    return inner


def detached_command_line(
    command: str,
    log_path: str,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    pid_file: str | None = None,
) -> str:
    """A launcher that returns at once and prints the new process-group id.

    setsid gives the process its own session and group (so kill_group reaches its
    children and no hang-up from the closing connection reaches it); every stream is
    redirected, or sshd would keep the channel open until the process ended. In a
    non-interactive shell a background job is no group leader, so setsid does not
    fork and `$!` is the new group's id. The launcher waits (briefly) until the
    child has called setsid, so a kill_group right after the return finds the group.

    With `pid_file`, the launcher also writes the group id there (atomically, by rename)
    before it returns: a worker that dies before recording the answer finds the process
    through the file, however slowly the process itself starts on a loaded host.
    """
    steps = []
    # cd first: a relative log path then means the same to mkdir and to the redirect.
    if cwd:
        steps.append(shell.cd(cwd))
    log_dir = posixpath.dirname(log_path)
    if log_dir:
        steps.append(mkdir_command_line([log_dir]))
    note = ""
    if pid_file:
        tmp = shell.path(f"{pid_file}.tmp")
        note = f'echo "$p" >{tmp} && mv -f -- {tmp} {shell.path(pid_file)}; '
    launch = (
        f"{shell.env_prefix(env)}setsid nohup {_LOGIN_SHELL} -c {shell.quote(command)} "
        f"</dev/null >>{shell.path(log_path)} 2>&1 & p=$!; {note}i=0; "
        'while [ "$i" -lt 300 ] && [ -r "/proc/$p/stat" ]; do '
        '{ read -r line <"/proc/$p/stat"; } 2>/dev/null || break; '
        'set -- ${line##*) }; [ "$3" = "$p" ] && break; i=$((i+1)); sleep 0.01; done; '
        'echo "$p"'
    )
    steps.append(f"{{ {launch}; }}")
    return " && ".join(steps)


def alive_command_line(pid: int) -> str:
    """Exit 0 when pid runs; a zombie counts as dead (an orphan may wait for its reaper).
    Builtins only (`read`, parameter expansion, POSIX sh): a wait runs it every
    `GONE_POLL_S` for every watched run, and the `sed | cut` it used forked three
    processes a round, 200 watched runs about 4,000 forks a second (issue 39)."""
    pid = check_pid(pid)
    return (
        f"if [ -d /proc/self ]; then "
        f"s=; {{ read -r s </proc/{pid}/stat; }} 2>/dev/null; s=${{s##*) }}; s=${{s%%[ ]*}}; "
        f'[ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]; '
        f"else kill -0 {pid} 2>/dev/null; fi"
    )


# How often a process's end is looked for while waiting for it (wait_gone): one `sleep`
# fork a round, so a host with its 8 runs watched forks 8 a second.
GONE_POLL_S = 1.0


def wait_gone_command_line(pid: int, timeout: float) -> str:
    """Exit 0 once pid has ended (a zombie counts as ended, as in alive_command_line), 1
    when it still runs after `timeout` seconds. A loop on the host rather than one check
    per round trip: the wait costs one channel, not a command every fraction of a second."""
    rounds = max(1, int(timeout / GONE_POLL_S))
    return (
        f"i=0; while [ $i -lt {rounds} ]; do {{ {alive_command_line(pid)}; }} || exit 0; "
        f"sleep {GONE_POLL_S:g}; i=$((i+1)); done; exit 1"
    )


def kill_group_command_line(pgid: int, signal: str) -> str:
    pgid = check_pid(pgid)
    name = signal.upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise ValueError(f"not a signal kill_group sends: {signal!r}")
    # Exit 0 only when a member was running: a group of zombies waiting for their
    # reaper still accepts signals, and "killed" must mean something was stopped.
    live = (
        "live=1; if [ -d /proc/self ]; then live=0; "
        "for f in /proc/[0-9]*/stat; do "
        '{ read -r line <"$f"; } 2>/dev/null || continue; set -- ${line##*) }; '
        f'if [ "$3" = {pgid} ] && [ "$1" != Z ] && [ "$1" != X ]; then live=1; break; fi; '
        "done; fi"
    )
    return f'{live}; kill -s {name} -- -{pgid} 2>/dev/null && [ "$live" = 1 ]'


def mkdir_command_line(directories: Sequence[str]) -> str:
    """``mkdir -p`` of each directory; none of them is read as an option."""
    return shell.join(["mkdir", "-p", "--", *directories])


def tail_command_line(path: str, lines: int) -> str:
    if lines < 1:
        raise ValueError("lines must be at least 1")
    quoted = shell.path(path)
    return f"if [ -e {quoted} ]; then tail -n {int(lines)} -- {quoted}; fi"


def check_pid(pid: int) -> int:
    # 0, 1 and negative numbers mean "my group", "every process" or init to kill(1).
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise ValueError(f"not a process id this layer may touch: {pid!r}")
    return pid


def parse_pid(result: RunResult, label: str) -> int:
    lines = result.stdout.strip().splitlines()
    if result.ok and lines and lines[-1].strip().isdigit():
        return int(lines[-1].strip())
    detail = result.stderr.strip()[-300:] or f"exit code {result.exit_code}"
    raise SshError(f"could not start a process on {label}: {detail}")


def loopback_only() -> bool:
    return os.environ.get(LOOPBACK_ONLY_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# Errors that mean "the link to the host failed", as opposed to a bug in the caller.
_LINK_ERRORS: tuple[type[BaseException], ...] = (
    paramiko.SSHException,
    OSError,
    EOFError,
    ThreadException,
)


@dataclass
class _Slot:
    """One cached connection; its lock keeps one operation at a time on it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    conn: Connection | None = None


class SshClient:
    """Reusable connections to many hosts, safe to share between worker threads."""

    def __init__(
        self,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        keepalive_s: int = 15,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.keepalive_s = keepalive_s
        self._slots: dict[SshTarget, _Slot] = {}
        self._slots_lock = threading.Lock()

    def __enter__(self) -> SshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # connection management

    def _slot(self, target: SshTarget) -> _Slot:
        with self._slots_lock:
            slot = self._slots.get(target)
            if slot is None:
                slot = self._slots[target] = _Slot()
            return slot

    def _check_allowed(self, target: SshTarget) -> None:
        if loopback_only() and not _is_loopback(target.host):
            raise SshNotAllowed(
                f"refusing to dial {target.label}: {LOOPBACK_ONLY_ENV}=1 allows loopback addresses only"
            )

    def _connect(self, slot: _Slot, target: SshTarget) -> Connection:
        """The slot's live connection, dialing (again) when there is none or it died.

        The same fabric Connection is reopened, so the host key it first saw stays
        pinned: a host that comes back with another key is refused, not trusted anew.
        """
        self._check_allowed(target)
        conn = slot.conn
        if conn is not None and conn.is_connected:
            return conn
        if conn is None:
            kwargs: dict[str, object] = {
                "timeout": self.connect_timeout,
                "banner_timeout": self.connect_timeout,
                "auth_timeout": self.connect_timeout,
                "channel_timeout": self.connect_timeout,
                "look_for_keys": target.key_path is None,
                "allow_agent": target.key_path is None,
            }
            if target.key_path is not None:
                kwargs["key_filename"] = target.key_path
            config = Config(
                ssh_config=paramiko.SSHConfig(),
                overrides={"run": {"encoding": "utf-8"}, "load_ssh_configs": False},
            )
            conn = Connection(
                host=target.host,
                user=target.user,
                port=target.port,
                config=config,
                connect_kwargs=kwargs,
            )
            if target.known_hosts is not None:
                conn.client.load_host_keys(target.known_hosts)
                conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            slot.conn = conn
        else:
            self._quiet_close(conn)
        started = time.monotonic()
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            raise SshUnreachable(
                f"{target.label} presented a different host key than expected; not connecting"
            ) from exc
        except paramiko.AuthenticationException as exc:
            raise SshUnreachable(f"{target.label} did not accept the SSH key") from exc
        except TimeoutError as exc:
            raise SshUnreachable(
                f"cannot reach {target.label}: no answer within {self.connect_timeout:g}s"
            ) from exc
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            reasons = {
                "connection refused"
                if isinstance(err, ConnectionRefusedError)
                else (getattr(err, "strerror", None) or str(err)).lower()
                for err in exc.errors.values()
            }
            raise SshUnreachable(
                f"cannot reach {target.label}: {', '.join(sorted(reasons))}"
            ) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SshUnreachable(
                f"cannot reach {target.label}: {exc or type(exc).__name__}"
            ) from exc
        transport = conn.client.get_transport()
        if transport is not None and self.keepalive_s:
            transport.set_keepalive(self.keepalive_s)
        log.debug("ssh: connected to %s in %.2fs", target.label, time.monotonic() - started)
        return conn

    @staticmethod
    def _quiet_close(conn: Connection) -> None:
        try:
            conn.close()
        except Exception:  # a dead transport may fail to close; it is gone either way
            log.debug("ssh: error while closing a dead connection", exc_info=True)

    def close(self, target: SshTarget | None = None) -> None:
        with self._slots_lock:
            if target is None:
                slots = list(self._slots.values())
                self._slots.clear()
            else:
                slot = self._slots.pop(target, None)
                slots = [slot] if slot else []
        for slot in slots:
            with slot.lock:
                if slot.conn is not None:
                    self._quiet_close(slot.conn)
                    slot.conn = None

    def _call(
        self,
        target: SshTarget,
        what: str,
        op: Callable[[Connection], T],
        *,
        retry: bool,
    ) -> T:
        """Run op on the target's connection, mapping link failures to SshError.

        A connection that is found dead is redialed before op runs. If the link dies
        while op runs, op is repeated once on a fresh connection only when it is safe
        to repeat (reads, hash-checked uploads): a command that may have started is
        never sent twice.
        """
        slot = self._slot(target)
        with slot.lock:
            for attempt in (1, 2):
                conn = self._connect(slot, target)
                try:
                    return op(conn)
                except SshError:
                    raise
                except CommandTimedOut as exc:
                    raise SshError(
                        f"{what} on {target.label} did not finish within {exc.timeout:g}s"
                    ) from exc
                except TimeoutError as exc:
                    self._quiet_close(conn)
                    raise SshLinkLost(f"{what} on {target.label} stalled; gave up") from exc
                except _LINK_ERRORS as exc:
                    died = not conn.is_connected
                    if not died and isinstance(exc, OSError):
                        # An SFTP status (permission denied, not a file): the host
                        # answered and the link is fine; the request was not.
                        raise SshError(f"{what} on {target.label} failed: {exc}") from exc
                    self._quiet_close(conn)
                    if attempt == 1 and died and retry:
                        log.info("ssh: link to %s dropped; redialing once", target.label)
                        continue
                    if died:
                        raise SshLinkLost(
                            f"lost the connection to {target.label} during {what}"
                        ) from exc
                    raise SshError(
                        f"{what} on {target.label} failed: {exc or type(exc).__name__}"
                    ) from exc
        raise AssertionError("unreachable")

    def _sftp(self, conn: Connection, timeout: float | None) -> paramiko.SFTPClient:
        sftp: paramiko.SFTPClient = conn.sftp()
        channel = sftp.get_channel()
        if channel is not None:
            # A per-read timeout: it bounds a stall, not the length of a big transfer.
            channel.settimeout(timeout or self.command_timeout)
        return sftp

    # operations

    def _exec(
        self, target: SshTarget, line: str, timeout: float | None, what: str, retry: bool
    ) -> RunResult:
        limit = self.command_timeout if timeout is None else timeout

        def op(conn: Connection) -> RunResult:
            started = time.monotonic()
            result = conn.run(line, hide=True, warn=True, timeout=limit, in_stream=False, pty=False)
            if result.exited == -1:
                # The channel closed without an exit status.
                if not conn.is_connected:
                    raise EOFError("connection closed during the command")
                if limit is not None and time.monotonic() - started >= limit:
                    # invoke's timer closed the channel, but invoke asks whether its timer
                    # thread is still alive to decide "timed out", and on a loaded machine
                    # that thread may not have finished when the run returns: the same
                    # timeout, seen one scheduling slice early.
                    raise SshError(f"{what} on {target.label} did not finish within {limit:g}s")
            return RunResult(int(result.exited), str(result.stdout), str(result.stderr))

        return self._call(target, what, op, retry=retry)

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        limit = self.command_timeout if timeout is None else timeout
        line = run_command_line(command, limit, cwd, env)
        started = time.monotonic()
        result = self._exec(target, line, limit, "a command", retry=False)
        if (
            limit is not None
            and result.exit_code in _HOST_TIMEOUT_CODES
            and time.monotonic() - started >= limit
        ):
            # The host's own `timeout` (run_command_line) killed it before the client's
            # timer fired, as happens on a loaded machine: the same timeout, one way.
            raise SshError(f"a command on {target.label} did not finish within {limit:g}s")
        return result

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        files = local_tree(local_dir, exclude)
        listing = self._exec(
            target,
            remote_manifest_command_line(remote_dir),
            None,
            "listing the upload target",
            retry=True,
        )
        if not listing.ok:
            raise SshError(
                f"cannot write to {remote_dir} on {target.label}: {listing.stderr.strip()[-300:]}"
            )
        plan = plan_upload(files, parse_remote_manifest(listing.stdout))
        dirs = plan.directories(remote_dir)
        for chunk in _chunks(dirs, 200):
            made = self._exec(
                target,
                mkdir_command_line(chunk),
                None,
                "creating directories",
                retry=True,
            )
            if not made.ok:
                raise SshError(
                    f"cannot create directories on {target.label}: {made.stderr.strip()[-300:]}"
                )

        def op(conn: Connection) -> None:
            sftp = self._sftp(conn, None)
            for f in plan.send:
                dest = posixpath.join(remote_dir, f.rel)
                _sftp_put(sftp, str(f.path), dest, f.mode)
            for f in plan.chmod:
                sftp.chmod(posixpath.join(remote_dir, f.rel), f.mode)

        if plan.send or plan.chmod:
            self._call(target, "an upload", op, retry=True)
        log.info(
            "ssh: upload to %s:%s sent %d, skipped %d, chmod %d",
            target.label,
            remote_dir,
            len(plan.send),
            len(plan.skip),
            len(plan.chmod),
        )
        return plan.report()

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None:
        source = Path(local_path)
        file_mode = stat.S_IMODE(source.stat().st_mode) if mode is None else mode
        self._mkdir_parent(target, remote_path)

        def op(conn: Connection) -> None:
            _sftp_put(self._sftp(conn, None), str(source), remote_path, file_mode)

        self._call(target, "a file upload", op, retry=True)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self._mkdir_parent(target, remote_path)

        def op(conn: Connection) -> None:
            sftp = self._sftp(conn, None)
            part = _part_name(remote_path)
            with sftp.open(part, "wb") as fh:
                fh.write(data)
            sftp.chmod(part, mode)
            sftp.posix_rename(part, remote_path)

        self._call(target, "writing a file", op, retry=True)

    def _mkdir_parent(self, target: SshTarget, remote_path: str) -> None:
        """The file's directory, made when it is missing. Looked at over SFTP first: a
        command costs a session on the host (a shell; hundreds of milliseconds on a
        loaded one), a stat a round trip, and the directory is almost always there."""
        parent = posixpath.dirname(remote_path)

        def is_dir(conn: Connection) -> bool:
            try:
                return stat.S_ISDIR(self._sftp(conn, None).stat(parent).st_mode or 0)
            except FileNotFoundError:
                return False

        if parent and not self._call(target, "a stat", is_dir, retry=True):
            made = self._exec(
                target, mkdir_command_line([parent]), None, "creating a directory", True
            )
            if not made.ok:
                raise SshError(f"cannot create {parent} on {target.label}: {made.stderr.strip()}")

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        def op(conn: Connection) -> bytes | None:
            sftp = self._sftp(conn, None)
            try:
                with sftp.open(path, "rb") as fh:
                    data: bytes = fh.read(max_bytes) if max_bytes is not None else fh.read()
                    return data
            except FileNotFoundError:
                return None

        return self._call(target, "reading a file", op, retry=True)

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
        line = detached_command_line(command, log_path, cwd, env, pid_file)
        result = self._exec(target, line, None, "starting a process", retry=False)
        return parse_pid(result, target.label)

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return self._exec(target, tail_command_line(path, lines), None, "a tail", True).stdout

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        line = kill_group_command_line(pgid, signal)
        return self._exec(target, line, None, "a kill", retry=True).ok

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        """The process's state read from /proc over SFTP, as alive_command_line reads it:
        a read is a round trip where a command is a session and a shell on the host. A
        host without /proc, or a read that failed as the process went, gets the command."""
        pid = check_pid(pid)

        def op(conn: Connection) -> bool | None:
            sftp = self._sftp(conn, None)
            try:
                with sftp.open(f"/proc/{pid}/stat", "rb") as fh:
                    raw: bytes = fh.read(4096)
            except FileNotFoundError:
                try:
                    sftp.stat("/proc/self/stat")
                except FileNotFoundError:
                    return None  # no /proc here
                return False
            except OSError:
                if not conn.is_connected:
                    raise  # the link, not the file: _call says so
                # Opened while the process was there, read after it was reaped: the kernel
                # answers ESRCH, which SFTP reports only as "Failure". The command decides.
                return None
            fields = raw.decode("ascii", "replace").rpartition(")")[2].split()
            return bool(fields) and fields[0] not in ("Z", "X")

        found = self._call(target, "a process check", op, retry=True)
        if found is not None:
            return found
        return self._exec(target, alive_command_line(pid), None, "a process check", True).ok

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        """The wait runs on a channel of its own, opened on the host's cached connection
        under its lock and then waited on outside it, so uploads, polls and other waits
        on the same host go on meanwhile (paramiko multiplexes channels on one link)."""
        line = wait_gone_command_line(pid, timeout)
        slot = self._slot(target)
        with slot.lock:
            conn = self._connect(slot, target)
            transport = conn.client.get_transport()
            if transport is None or not transport.is_active():
                self._quiet_close(conn)
                raise SshLinkLost(f"lost the connection to {target.label}")
            try:
                channel = transport.open_session(timeout=self.connect_timeout)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                # sshd's MaxSessions per connection, or a link that just died.
                raise SshError(f"cannot open a channel on {target.label}: {exc}") from exc
        try:
            channel.exec_command(line)
            deadline = time.monotonic() + timeout + self.command_timeout
            while not channel.status_event.wait(0.5):
                if not transport.is_active() or channel.closed:
                    raise SshLinkLost(f"lost the connection to {target.label} during a wait")
                if time.monotonic() > deadline:
                    raise SshError(f"a wait on {target.label} did not end within {timeout:g}s")
            status: int = channel.recv_exit_status()
            if status == -1:  # closed with no exit status: the connection under it went
                raise SshLinkLost(f"lost the connection to {target.label} during a wait")
            return status == 0
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SshLinkLost(f"lost the connection to {target.label} during a wait") from exc
        finally:
            with contextlib.suppress(Exception):
                channel.close()


def _part_name(remote_path: str) -> str:
    head, tail = posixpath.split(remote_path)
    return posixpath.join(head, f".{tail}.gpubot-part")


def _sftp_put(sftp: paramiko.SFTPClient, local: str, remote: str, mode: int) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    part = _part_name(remote)
    sftp.put(local, part, confirm=True)
    sftp.chmod(part, mode)
    sftp.posix_rename(part, remote)


def _chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
