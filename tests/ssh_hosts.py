"""Real OpenSSH servers standing in for GPU hosts in tests.

Each fake host is one `sshd -D` with its own config, host key and log, listening on
its own loopback address (127.0.0.2, 127.0.0.3, … port 2222), so the SSH layer is
tested against the daemon it meets in production rather than a double. One client
key pair is shared by all hosts, as one bot key is in production.

The default lab (`start_lab`) logs in as the bot's own user: both hosts are this
machine underneath, with the bot's venv readable, so tests keep each host's files apart
by path (see `SshHost.root`). That is a shortcut for tests about the SSH layer, runs and
agents, not about what a host has. `start_isolated_lab` is the honest one: each host is
its own unix account (scripts/ssh_accounts.sh makes them) with its own home, a login
shell and only the system python3, so a bootstrap there starts from nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# GPUBOT_SSHD points at another sshd binary (or a missing one, to see the tests skip).
SSHD = os.environ.get("GPUBOT_SSHD", "/usr/sbin/sshd")
SSH_KEYGEN = "ssh-keygen"


def worker_index() -> int:
    """N in pytest-xdist's worker gwN; 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


def _default_port() -> int:
    """2222, or 2222 + 20·N in pytest-xdist's worker gwN: two workers starting their labs
    at once would both find 2222 free, and the loser's sshd would fail to bind (or its
    client would meet the winner's daemon, which knows another key)."""
    return 2222 + 20 * worker_index()


DEFAULT_PORT = _default_port()


class SshdUnavailable(Exception):
    """sshd cannot run here; the message says why, for a pytest skip reason."""


def _port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As sshd binds: connections of a stopped daemon in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def _pick_port(address: str, preferred: int) -> int:
    """2222 unless taken (another test session on this machine, a stale sshd)."""
    if _port_free(address, preferred):
        return preferred
    for port in range(preferred + 1, preferred + 200):
        if _port_free(address, port):
            return port
    raise SshdUnavailable(f"no free port near {preferred} on {address}")


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _descendants_of(pid: int) -> list[int]:
    """Every process below the listener: the per-connection sshd (it calls setsid, so a
    group kill misses it) and, where the login is another account, its unprivileged child
    and the command it runs, which outlive the root-owned per-connection process alone."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1].isdigit():
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def _ssh_banner(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5) as sock:
            sock.settimeout(0.5)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def sshd_available() -> str | None:
    """None when sshd can run; otherwise the reason it cannot."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing (run `bash scripts/sshd_hosts.sh` to install openssh-server)"
    if shutil.which(SSH_KEYGEN) is None:
        return "ssh-keygen is missing (openssh-client)"
    if os.geteuid() == 0:
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        except OSError as exc:
            return f"cannot create /run/sshd: {exc}"
    return None


@dataclass
class SshHost:
    """One fake GPU host: an sshd that can be stopped and started again (an SSH drop)."""

    name: str
    address: str
    directory: Path
    authorized_keys: Path
    port: int = DEFAULT_PORT
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # The unix account this host logs in as; None: the bot's own (the default lab).
    account: str | None = None

    @property
    def root(self) -> Path:
        """Where tests put this host's remote files, so two hosts never share a path."""
        if self.account is not None:
            return Path(pwd.getpwnam(self.account).pw_dir)
        return Path(f"/tmp/gpubot-sshtest-{self.address}-{os.getpid()}")

    @property
    def log_path(self) -> Path:
        return self.directory / "sshd.log"

    def _write_config(self) -> Path:
        host_key = self.directory / "host_ed25519_key"
        if not host_key.exists():
            _keygen(host_key, f"host-{self.name}")
        config = self.directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.address}:{self.port}",
                    f"HostKey {host_key}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PrintMotd no",
                    "UseDNS no",
                    "MaxStartups 64",
                    "MaxSessions 64",
                    "ClientAliveInterval 0",
                    "Subsystem sftp internal-sftp",
                    "LogLevel INFO",
                    *self._home(),
                    "",
                ]
            )
        )
        return config

    def _home(self) -> list[str]:
        """A host of the default lab logs in as the bot's own account, whose shell would
        read that account's ~/.bashrc on every command (bash does under sshd): this
        machine's startup files, not a fresh host's. Here root's runs `pyenv rehash`,
        which waits forever on a lock that a command killed mid-login leaves behind, and
        twenty tests then failed at once with every host "not reachable". The session's
        HOME is the host's own directory instead, empty like a fresh image's home; an
        isolated lab's account has its own home already."""
        return [] if self.account is not None else [f"SetEnv HOME={self.root}"]

    def start(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.port = _pick_port(self.address, self.port)
        config = self._write_config()
        check = subprocess.run(
            [SSHD, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30
        )
        if check.returncode != 0:
            raise SshdUnavailable(f"sshd rejects its test config: {check.stderr.strip()}")
        self.process = subprocess.Popen(
            [SSHD, "-D", "-f", str(config), "-E", str(self.log_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                self.process = None
                raise SshdUnavailable(f"sshd for {self.address} exited: {log.strip()[-500:]}")
            if _ssh_banner(self.address, self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise SshdUnavailable(f"sshd for {self.address}:{self.port} did not come up")

    def stop(self) -> None:
        """Kill the daemon and every live connection, as a host crash or reboot would."""
        proc = self.process
        if proc is None:
            return
        self.process = None
        for child in _descendants_of(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _ssh_banner(self.address, self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class SshLab:
    """The fake hosts and the one client key that all of them accept."""

    directory: Path
    client_key: Path
    hosts: dict[str, SshHost]
    user: str
    # Where the isolated lab keeps the authorized keys the accounts may read; None otherwise.
    keys_dir: Path | None = None
    # The isolated lab's hold on its accounts (AccountLock); released by `stop`.
    lock: AccountLock | None = None

    def stop(self) -> None:
        for host in self.hosts.values():
            host.stop()
        for host in self.hosts.values():
            if host.account is None:
                shutil.rmtree(host.root, ignore_errors=True)
            else:
                # The home stays as the session left it (a look after a failure helps);
                # the next isolated lab empties it before its bootstrap from nothing.
                end_account_processes(host.account)
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def user_of(self, name: str) -> str:
        """The login name for host `name`."""
        return self.hosts[name].account or self.user


def start_lab(directory: Path, addresses: dict[str, str] | None = None) -> SshLab:
    """Start one sshd per fake host; raises SshdUnavailable with the reason if it cannot."""
    reason = sshd_available()
    if reason is not None:
        raise SshdUnavailable(reason)
    addresses = addresses or {"gpu-a": "127.0.0.2", "gpu-b": "127.0.0.3"}
    directory.mkdir(parents=True, exist_ok=True)
    client_key = directory / "client_ed25519"
    _keygen(client_key, "gpubot-test-client")
    authorized = directory / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())

    user = pwd.getpwuid(os.geteuid()).pw_name
    hosts: dict[str, SshHost] = {}
    lab = SshLab(directory=directory, client_key=client_key, hosts=hosts, user=user)
    try:
        for name, address in addresses.items():
            host_dir = directory / name
            host_dir.mkdir(exist_ok=True)
            host = SshHost(
                name=name, address=address, directory=host_dir, authorized_keys=authorized
            )
            hosts[name] = host
            host.start()
            host.root.mkdir(parents=True, exist_ok=True)
    except BaseException:
        lab.stop()
        raise
    return lab


@contextlib.contextmanager
def running_lab(directory: Path) -> Iterator[SshLab]:
    """`start_lab` for a fixture: the test skips (with why) where sshd cannot run here,
    and the lab stops when the fixture ends."""
    try:
        lab = start_lab(directory)
    except SshdUnavailable as exc:
        pytest.skip(f"no sshd test hosts: {exc}")
    try:
        yield lab
    finally:
        lab.stop()


# --- hosts that are not the bot's ---------------------------------------------------------

# The accounts scripts/ssh_accounts.sh creates, and the wheel cache it fills.
HOST_ACCOUNTS = tuple(
    os.environ.get("GPUBOT_TEST_HOST_ACCOUNTS", "gpubot-host-a gpubot-host-b").split()
)
WHEELS = Path(os.environ.get("GPUBOT_TEST_WHEELS", "/var/cache/gpubot-test-wheels"))
# The SSH layer's own accounts, two per xdist worker (gpubot-ssh0-a, gpubot-ssh0-b, …):
# tests about running commands, files and connections need no bootstrap, so each worker
# has its own strangers and those tests are not queued behind the bootstrapped hosts'.
SSH_ACCOUNT_PREFIX = os.environ.get("GPUBOT_TEST_SSH_ACCOUNT_PREFIX", "gpubot-ssh")


def worker_accounts(index: int | None = None) -> tuple[str, str]:
    """This xdist worker's two SSH-layer accounts (scripts/ssh_accounts.sh makes them)."""
    n = worker_index() if index is None else index
    return (f"{SSH_ACCOUNT_PREFIX}{n}-a", f"{SSH_ACCOUNT_PREFIX}{n}-b")


def isolated_unavailable(
    accounts: tuple[str, ...] = HOST_ACCOUNTS, *, wheels: bool = True
) -> str | None:
    """None when the isolated hosts can run here; otherwise why not (a skip reason)."""
    reason = sshd_available()
    if reason is not None:
        return reason
    if os.geteuid() != 0:
        return "the isolated SSH hosts need root (to log in as other accounts and reset them)"
    for account in accounts:
        try:
            pwd.getpwnam(account)
        except KeyError:
            return (
                f"no account {account} (run `bash scripts/ssh_accounts.sh`; with more "
                "than two xdist workers, `PYTEST_WORKERS=N bash scripts/ssh_accounts.sh`)"
            )
    if wheels and not (WHEELS / ".requirements").exists():
        return f"no wheel cache at {WHEELS} (run `bash scripts/ssh_accounts.sh`)"
    return None


# --- one test session at a time on an account ------------------------------------------------

# How long a lab waits for another test session on this machine to let go of its accounts.
LOCK_WAIT_S = float(os.environ.get("GPUBOT_TEST_LOCK_WAIT", "1800"))
_LOCK_DIR = Path("/var/lock") if os.access("/var/lock", os.W_OK) else Path("/tmp")
# How long a process that holds a later account waits for an earlier one (AccountLock).
OUT_OF_ORDER_WAIT_S = 60.0
# The accounts this process holds: a second lab on one of them here would wait for itself.
_held: set[str] = set()


@dataclass
class AccountLock:
    """An exclusive flock per account, held while a lab uses it.

    Two test sessions on one machine (two developers, a CI job beside a `make test`)
    would otherwise empty each other's homes and kill each other's processes mid-test:
    the second waits here instead. The kernel drops a flock when its process dies, so a
    killed session never leaves a stale lock.

    Locks are taken in name order, within a lab and across the labs of one process (an
    xdist worker holds its `stranger_lab` and may later start `isolated_lab`). Waiting in
    that order cannot deadlock; a process that already holds a later name and now wants
    an earlier one might wait for a session that waits for it, so that wait is short
    (`out_of_order_s`) and then the lab is unavailable (its tests skip, saying why)."""

    accounts: tuple[str, ...]
    fds: list[int] = field(default_factory=list)

    def acquire(
        self, wait_s: float = LOCK_WAIT_S, out_of_order_s: float = OUT_OF_ORDER_WAIT_S
    ) -> None:
        again = sorted(set(self.accounts) & _held)
        if again:
            raise SshdUnavailable(f"this process already has a lab on {', '.join(again)}")
        later = sorted(a for a in _held if a > min(self.accounts))
        if later:
            wait_s = min(wait_s, out_of_order_s)
        deadline = time.monotonic() + wait_s
        try:
            for account in sorted(self.accounts):
                fd = os.open(
                    _LOCK_DIR / f"gpubot-test-{account}.lock", os.O_RDWR | os.O_CREAT, 0o600
                )
                self.fds.append(fd)
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            order = (
                                f"; this process holds {', '.join(later)}, so it waits only "
                                "briefly (a longer wait could be a deadlock)"
                                if later
                                else ""
                            )
                            raise SshdUnavailable(
                                f"another test session on this machine has held {account} "
                                f"for over {wait_s:.0f} s ({_LOCK_DIR}/gpubot-test-{account}.lock)"
                                + order
                            ) from None
                        time.sleep(0.5)
        except BaseException:
            self.release()
            raise
        _held.update(self.accounts)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)  # closing the only descriptor drops the flock
        self.fds.clear()
        _held.difference_update(self.accounts)


def pip_env() -> dict[str, str]:
    """What a bootstrap on an isolated host gets: the shared wheel cache, no index (the
    suite installs offline; a real team passes its own index or proxy the same way)."""
    return {"PIP_FIND_LINKS": str(WHEELS), "PIP_NO_INDEX": "1"}


def _account_pids(account: str) -> list[int]:
    uid = pwd.getpwnam(account).pw_uid
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def end_account_processes(account: str) -> None:
    """Kill, by id, what the tests started as `account` (agents, runs, probes): the
    account exists only for these tests, so every process it owns is theirs."""
    for pid in _account_pids(account):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wipe_home(account: str) -> None:
    """The account's home as `useradd` left it (empty): the next bootstrap starts from nothing."""
    home = Path(pwd.getpwnam(account).pw_dir)
    children = [str(child) for child in home.iterdir()] if home.is_dir() else []
    if children:  # rm(1): a venv with torch is ~20k files, twice as fast as shutil.rmtree
        subprocess.run(["rm", "-rf", "--", *children], capture_output=True, check=False)
    if shutil.which("crontab") is not None:  # the agent's @reboot line, where cron exists
        subprocess.run(["crontab", "-r", "-u", account], capture_output=True, check=False)


def start_isolated_lab(
    directory: Path,
    addresses: dict[str, str] | None = None,
    *,
    fresh: bool = True,
    accounts: tuple[str, ...] = HOST_ACCOUNTS,
    wheels: bool = True,
) -> SshLab:
    """One sshd per host, each logging in as its own account (`accounts` in order).

    The accounts are locked for the lab's life (AccountLock: another test session on
    this machine waits). `fresh` then empties their homes, so what a test sees there was
    made by this session. `wheels`: the hosts will bootstrap, so the wheel cache must be
    there. The authorized keys live in a world-readable directory of their own: sshd
    reads them as the logging-in account, which may not read the bot's temp dirs."""
    reason = isolated_unavailable(accounts, wheels=wheels)
    if reason is not None:
        raise SshdUnavailable(reason)
    addresses = addresses or {"lab-a": "127.0.0.4", "lab-b": "127.0.0.5"}
    if len(addresses) > len(accounts):
        raise SshdUnavailable(f"only {len(accounts)} host accounts for {len(addresses)} hosts")
    accounts = accounts[: len(addresses)]
    lock = AccountLock(accounts)
    lock.acquire()
    try:
        return _start_isolated(directory, addresses, accounts, lock, fresh=fresh)
    except BaseException:
        lock.release()
        raise


def _start_isolated(
    directory: Path,
    addresses: dict[str, str],
    accounts: tuple[str, ...],
    lock: AccountLock,
    *,
    fresh: bool,
) -> SshLab:
    directory.mkdir(parents=True, exist_ok=True)
    client_key = directory / "client_ed25519"
    _keygen(client_key, "gpubot-test-client")
    keys_dir = Path(f"/tmp/gpubot-sshkeys-{os.getpid()}-{directory.name}")
    keys_dir.mkdir(mode=0o755, exist_ok=True)
    keys_dir.chmod(0o755)
    authorized = keys_dir / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    authorized.chmod(0o644)
    user = pwd.getpwuid(os.geteuid()).pw_name
    hosts: dict[str, SshHost] = {}
    lab = SshLab(
        directory=directory,
        client_key=client_key,
        hosts=hosts,
        user=user,
        keys_dir=keys_dir,
        lock=lock,
    )
    try:
        for (name, address), account in zip(addresses.items(), accounts, strict=True):
            if fresh:
                end_account_processes(account)
                wipe_home(account)
            host_dir = directory / name
            host_dir.mkdir(exist_ok=True)
            host = SshHost(
                name=name,
                address=address,
                directory=host_dir,
                authorized_keys=authorized,
                account=account,
            )
            hosts[name] = host
            host.start()
    except BaseException:
        lab.stop()
        raise
    return lab
