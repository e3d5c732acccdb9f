"""`SshRunner` for this machine, with subprocess instead of SSH.

The local host (`gpubot shell`, a laptop without sshd) takes the same code paths as
a remote one: the same shell snippets start, check and kill detached processes, and
the same sha256 plan decides what an upload copies. The contract tests run against
this and `SshClient` alike, so the double cannot drift from the real thing.
The target argument is accepted and ignored: there is only one "here".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from provisioning.ssh import (
    FileState,
    RunResult,
    SshError,
    SshTarget,
    UploadReport,
    alive_command_line,
    detached_command_line,
    kill_group_command_line,
    local_tree,
    parse_pid,
    plan_upload,
    run_command_line,
    sha256_file,
    tail_command_line,
)


@contextlib.contextmanager
def _as_ssh_error(what: str) -> Iterator[None]:
    """File errors surface as SshError, as they do from a remote host's SFTP server."""
    try:
        yield
    except OSError as exc:
        raise SshError(f"{what} on local failed: {exc}") from exc


LOCAL_TARGET = SshTarget(host="localhost", port=0, user="", name="local")


def _login_shell() -> str:
    shell = os.environ.get("SHELL") or ""
    return shell if os.path.isabs(shell) and os.access(shell, os.X_OK) else "/bin/sh"


class LocalRunner:
    """Runs everything as this process's user on this machine."""

    def __init__(self, *, command_timeout: float = 60.0) -> None:
        self.command_timeout = command_timeout

    def _exec(self, line: str, timeout: float | None) -> RunResult:
        limit = self.command_timeout if timeout is None else timeout
        # Its own session, so a timeout kills the command's children too, as the
        # host-side `timeout` wrapper does over SSH.
        proc = subprocess.Popen(
            [_login_shell(), "-c", line],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise SshError(f"a command on local did not finish within {limit:g}s") from None
        code = proc.returncode
        # The shell convention for "killed by signal N", as a remote shell reports it.
        code = 128 - code if code < 0 else code
        return RunResult(code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

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
        dest_root = Path(remote_dir)
        with _as_ssh_error("an upload"):
            dest_root.mkdir(parents=True, exist_ok=True)
            there: dict[str, FileState] = {}
            for f in files:
                dest = dest_root / f.rel
                if dest.is_file():
                    st = dest.stat()
                    there[f.rel] = FileState(sha256_file(dest), bool(st.st_mode & stat.S_IXUSR))
            plan = plan_upload(files, there)
            for f in plan.send:
                self._copy(f.path, dest_root / f.rel, f.mode)
            for f in plan.chmod:
                os.chmod(dest_root / f.rel, f.mode)
        return plan.report()

    @staticmethod
    def _copy(source: Path, dest: Path, mode: int) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.gpubot-part")
        shutil.copyfile(source, part)
        os.chmod(part, mode)
        os.replace(part, dest)

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
        with _as_ssh_error("a file upload"):
            self._copy(source, Path(remote_path), file_mode)

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        dest = Path(remote_path)
        with _as_ssh_error("writing a file"):
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(f".{dest.name}.gpubot-part")
            part.write_bytes(data)
            os.chmod(part, mode)
            os.replace(part, dest)

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                return fh.read(max_bytes) if max_bytes is not None else fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SshError(f"reading a file on local failed: {exc}") from exc

    def start_detached(
        self,
        target: SshTarget,
        command: str,
        log_path: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        # Through a shell that exits at once, so the process is orphaned and its
        # reaper is init, as on a remote host, not this (possibly short-lived) bot.
        result = self._exec(detached_command_line(command, log_path, cwd, env), None)
        return parse_pid(result, "local")

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        return self._exec(tail_command_line(path, lines), None).stdout

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        return self._exec(kill_group_command_line(pgid, signal), None).ok

    def is_alive(self, target: SshTarget, pid: int) -> bool:
        return self._exec(alive_command_line(pid), None).ok

    def close(self, target: SshTarget | None = None) -> None:
        """Nothing is cached locally."""
