"""`HostShell` for this machine, with subprocess instead of SSH.

The local host (`gpubot shell`, a laptop without sshd) takes the same code paths as
a remote one: the same shell snippets start, check and kill detached processes, and
the same sha256 plan decides what an upload copies. The contract tests run against
this and `SshClient` alike, so the double cannot drift from the real thing.
The target argument is accepted and ignored: there is only one "here".

A run must never see the bot's secrets (Slack token, signing secret, AWS keys, the
database password), and on this machine the bot's process sits right next to it, so:

- Every process starts with an environment built from `INHERITED_ENV` and the account
  it runs as, plus what the caller passes; nothing else of the bot's is inherited.
- With `run_as` (GPUBOT_RUN_AS) every command runs as that unprivileged account: as
  root through setuid/setgid with no supplementary groups, otherwise through
  ``sudo -n -u ACCOUNT`` (sudoers: ``BOTUSER ALL=(ACCOUNT) NOPASSWD: /usr/bin/env``).
  It then cannot read the bot's /proc/PID/environ, database file or config.
- Every file operation (read, write, upload, tail) goes through a shell of that same
  account, never through the bot's own open(): a run controls its directory, and a
  run.log or status.json that it turned into a link to the bot's database must be read
  with the run's rights, not the bot's. Without `run_as` the account is the bot's own
  (`gpubot shell`: one trusted person), through the same code path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import pwd
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from provisioning import shell
from provisioning.manifest import (
    local_tree,
    parse_remote_manifest,
    plan_upload,
    remote_manifest_command_line,
)
from provisioning.ssh import (
    GONE_POLL_S,
    RunResult,
    SshError,
    SshTarget,
    UploadReport,
    alive_command_line,
    check_pid,
    detached_command_line,
    kill_group_command_line,
    parse_pid,
    run_command_line,
    tail_command_line,
)

LOCAL_TARGET = SshTarget(host="localhost", port=0, user="", name="local")

# The only variables a process started here takes from the bot's own environment. None
# of them can carry a credential; everything else (SLACK_*, AWS_*, DATABASE_URL,
# GPUBOT_*) stays behind, in shell mode too. A caller that wants a variable in a run
# passes it explicitly (`env=`), where it can be seen.
INHERITED_ENV = (
    "PATH",  # how commands find programs (python, git, nvidia-smi)
    "LANG",  # the locale: text encoding of the run's output and file names
    "LANGUAGE",  # the order of message languages, with LANG
    "TZ",  # the machine's time zone, so a run's timestamps match the bot's
    "TMPDIR",  # where temporary files go, when this machine moved them
)
# Locale categories (LC_ALL, LC_CTYPE, …): the rest of the locale, as LANG.
INHERITED_PREFIXES = ("LC_",)
# Never from the bot: these describe the account the process runs as (its home, its
# name, its login shell), as `ssh ACCOUNT@host` sets them.
ACCOUNT_ENV = ("HOME", "USER", "LOGNAME", "SHELL")

# Login shells that only refuse a login; a command then runs under /bin/sh.
_NO_LOGIN = ("nologin", "false")
# read_file's "no such file" exit code (cat and head never exit with it).
_MISSING = 3


@dataclass(frozen=True)
class Account:
    """Who a command runs as: the bot's own account, or the run account."""

    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @classmethod
    def named(cls, name: str) -> Account:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise SshError(
                f"the run account {name!r} (GPUBOT_RUN_AS) does not exist on this machine; "
                f"create it (e.g. `useradd --create-home --shell /bin/sh {name}`)"
            ) from None
        return cls(name, entry.pw_uid, entry.pw_gid, entry.pw_dir, _usable_shell(entry.pw_shell))

    @functools.cached_property
    def groups(self) -> list[int]:
        """Its supplementary groups (initgroups' list), without its primary one: looked
        up once (an NSS lookup), not at every command."""
        return [g for g in os.getgrouplist(self.name, self.gid) if g != self.gid]

    @classmethod
    def this_process(cls) -> Account:
        """The bot's own account; its environment may say more than passwd does (a
        container's uid without a passwd entry), so HOME and SHELL come from there."""
        uid = os.geteuid()
        try:
            entry: pwd.struct_passwd | None = pwd.getpwuid(uid)
        except KeyError:
            entry = None
        name = entry.pw_name if entry else os.environ.get("USER", str(uid))
        home = os.environ.get("HOME") or (entry.pw_dir if entry else "/")
        login = os.environ.get("SHELL") or (entry.pw_shell if entry else "")
        return cls(name, uid, os.getegid(), home, _usable_shell(login))


def _usable_shell(path: str) -> str:
    if (
        os.path.isabs(path)
        and os.access(path, os.X_OK)
        and not posixpath.basename(path).startswith(_NO_LOGIN)
    ):
        return path
    return "/bin/sh"


def run_environment(account: Account, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a process started as `account`: the allowlist, read
    from `source` (the bot's environment), and the account's own names."""
    source = os.environ if source is None else source
    env = {
        k: v
        for k, v in source.items()
        if k in INHERITED_ENV or any(k.startswith(p) for p in INHERITED_PREFIXES)
    }
    env.setdefault("PATH", os.defpath)
    env.update(HOME=account.home, USER=account.name, LOGNAME=account.name, SHELL=account.shell)
    return env


class LocalRunner:
    """Runs everything on this machine, as `run_as` when given, else as this process's user."""

    def __init__(self, *, command_timeout: float = 60.0, run_as: str | None = None) -> None:
        self.command_timeout = command_timeout
        self.run_as = run_as or None
        # Looked up now, so a missing account is said at start-up, not at the first run.
        self.account = Account.named(run_as) if run_as else Account.this_process()

    # --- one process ------------------------------------------------------------------

    def _argv(self, line: str) -> list[str]:
        if self.run_as is None or os.geteuid() == 0:
            return [self.account.shell, "-c", line]
        # Not root: sudo switches the account; `env -i` then sets exactly our
        # environment (sudo's own SUDO_* and whatever its env_keep lets through go).
        assignments = [f"{k}={v}" for k, v in sorted(run_environment(self.account).items())]
        return [
            "sudo",
            "-n",
            "-u",
            self.run_as,
            "--",
            "/usr/bin/env",
            "-i",
            *assignments,
            self.account.shell,
            "-c",
            line,
        ]

    def _spawn(self, line: str, stdin: IO[bytes] | int) -> subprocess.Popen[bytes]:
        switch = self.run_as is not None and os.geteuid() == 0
        if self.run_as is not None:
            # Its home, as an SSH login starts there: relative paths mean the same on
            # every host, and the bot's own working directory is none of its business.
            line = 'cd "$HOME" || exit 1\n' + line
        try:
            # Its own session, so a timeout kills the command's children too, as the
            # host-side `timeout` wrapper does over SSH.
            return subprocess.Popen(
                self._argv(line),
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=run_environment(self.account),
                cwd="/" if self.run_as is not None else None,
                user=self.account.uid if switch else None,
                group=self.account.gid if switch else None,
                # Its groups too, as a login gets them (a lab's work directory is
                # shared with the bot account through one).
                extra_groups=self.account.groups if switch else None,
                umask=0o022,
            )
        except OSError as exc:
            raise SshError(f"cannot start a command on local: {exc}") from exc

    def _exec_bytes(
        self,
        line: str,
        timeout: float | None,
        *,
        data: bytes | None = None,
        stdin: IO[bytes] | None = None,
    ) -> tuple[int, bytes, str]:
        limit = self.command_timeout if timeout is None else timeout
        source: IO[bytes] | int = (
            stdin
            if stdin is not None
            else subprocess.PIPE
            if data is not None
            else subprocess.DEVNULL
        )
        proc = self._spawn(line, source)
        try:
            out, err = proc.communicate(input=data, timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise SshError(f"a command on local did not finish within {limit:g}s") from None
        code = proc.returncode
        # The shell convention for "killed by signal N", as a remote shell reports it.
        code = 128 - code if code < 0 else code
        return code, out, err.decode("utf-8", "replace")

    def _exec(self, line: str, timeout: float | None) -> RunResult:
        code, out, err = self._exec_bytes(line, timeout)
        return RunResult(code, out.decode("utf-8", "replace"), err)

    def _must(
        self, what: str, line: str, *, data: bytes | None = None, stdin: IO[bytes] | None = None
    ) -> bytes:
        code, out, err = self._exec_bytes(line, None, data=data, stdin=stdin)
        if code != 0:
            raise SshError(f"{what} on local failed: {err.strip()[-300:] or f'exit {code}'}")
        return out

    # --- the HostShell interface --------------------------------------------------------

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        # The same wrapper as over SSH (less the host-side timeout, which _exec does):
        # cwd, env and the login shell mean the same thing on both.
        return self._exec(run_command_line(command, None, cwd, env), timeout)

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        files = local_tree(local_dir, exclude)
        listing = self._exec(remote_manifest_command_line(remote_dir), None)
        if not listing.ok:
            raise SshError(
                f"cannot write to {remote_dir} on local: {listing.stderr.strip()[-300:]}"
            )
        plan = plan_upload(files, parse_remote_manifest(listing.stdout))
        if plan.send:
            # One tar stream, read by the bot and unpacked by the account: the bot never
            # opens a path under the run's control. tar replaces a file (or a link a run
            # left there) by unlinking it first, and -p keeps each file's mode.
            with tempfile.TemporaryFile() as archive:
                with tarfile.open(fileobj=archive, mode="w") as tar:
                    for f in plan.send:
                        info = tar.gettarinfo(str(f.path), arcname=f.rel)
                        info.mode = f.mode
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        with open(f.path, "rb") as fh:
                            tar.addfile(info, fh)
                archive.seek(0)
                unpack = shell.join(["tar", "-x", "-p", "--no-same-owner", "-f", "-", "-C"])
                self._must(
                    "an upload",
                    f"{unpack} {shell.path(remote_dir)}",
                    stdin=archive,
                )
        if plan.chmod:
            self._must(
                "an upload",
                " && ".join(
                    shell.join(["chmod", f"{f.mode:o}", "--", posixpath.join(remote_dir, f.rel)])
                    for f in plan.chmod
                ),
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
        # Opened by the bot (it is the bot's file), written by the account from that
        # descriptor: the content streams, a checkpoint is never held in memory.
        try:
            source = open(local_path, "rb")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise SshError(f"a file upload on local failed: {exc}") from exc
        with source:
            file_mode = os.fstat(source.fileno()).st_mode & 0o7777 if mode is None else mode
            self._must("a file upload", _write_line(remote_path, file_mode), stdin=source)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        self._must("writing a file", _write_line(remote_path, mode), data=data)

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        quoted = shell.path(path)
        reader = (
            f"head -c {int(max_bytes)} -- {quoted}"
            if max_bytes is not None
            else (f"cat -- {quoted}")
        )
        # Missing (also when it vanished between the test and the read) is None, as
        # from SFTP; anything else (a directory, no permission) is an error.
        line = (
            f"if [ -e {quoted} ]; then {reader} && exit 0; [ -e {quoted} ] || exit {_MISSING}; "
            f"exit 1; else exit {_MISSING}; fi"
        )
        code, out, err = self._exec_bytes(line, None)
        if code == _MISSING:
            return None
        if code != 0:
            raise SshError(f"reading a file on local failed: {err.strip()[-300:] or code}")
        return out

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
        # Through a shell that exits at once, so the process is orphaned and its
        # reaper is init, as on a remote host, not this (possibly short-lived) bot.
        result = self._exec(detached_command_line(command, log_path, cwd, env, pid_file), None)
        return parse_pid(result, "local")

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return self._exec(tail_command_line(path, lines), None).stdout

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        return self._exec(kill_group_command_line(pgid, signal), None).ok

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        return self._exec(alive_command_line(pid), None).ok

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        """Reads the process's state in /proc (what alive_command_line reads, without a
        shell per look): /proc/PID/stat is the kernel's, whoever the process runs as, so
        no file a run controls is opened with the bot's rights."""
        pid = check_pid(pid)
        deadline = time.monotonic() + timeout
        while True:
            state = _proc_state(pid)
            if state is None and not os.path.isdir("/proc/self"):
                if not self.is_alive(target, pid):  # no /proc here: ask a shell
                    return True
            elif state is None or state in "ZX":
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(GONE_POLL_S)

    def close(self, target: SshTarget | None = None) -> None:
        """Nothing is cached locally."""


def _proc_state(pid: int) -> str | None:
    """The one-letter state of /proc/PID/stat (R, S, Z, …); None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = raw.rpartition(")")[2].split()
    return rest[0] if rest else None


def _write_line(remote_path: str, mode: int) -> str:
    """Stdin into a file beside the target, then renamed over it: a reader never sees
    half a file, and a link at the target is replaced, not followed."""
    head, tail = posixpath.split(remote_path)
    part = posixpath.join(head, f".{tail}.gpubot-part")
    steps = [shell.join(["mkdir", "-p", "--", head])] if head else []
    steps += [
        shell.join(["rm", "-f", "--", part]),
        f"cat > {shell.path(part)}",
        shell.join(["chmod", f"{mode:o}", "--", part]),
        shell.join(["mv", "-f", "--", part, remote_path]),
    ]
    return " && ".join(steps)
