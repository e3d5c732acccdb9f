"""The one port every place's commands go through: run a command line on a host, move
files there and back, start and watch a process that outlives the call.

Named for what it does, not for how: `SshClient` (provisioning.ssh) does it over SSH,
`LocalRunner` (provisioning.local_runner) on this machine as the bot or the run account,
a cluster's login node through either; a Kubernetes pod's exec would be one more. Every
command line handed to it is built with `provisioning.shell`'s quoting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from provisioning.manifest import UploadReport
from provisioning.ssh import RunResult, SshTarget


class HostShell(Protocol):
    """What the bot may do on a host; `SshClient` and `LocalRunner` both satisfy it."""

    def run(
        self,
        target: SshTarget,
        command: str,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run a shell command; a non-zero exit is a result, not an exception."""
        ...

    def upload_dir(
        self,
        target: SshTarget,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        exclude: Sequence[str] = (),
    ) -> UploadReport:
        """Make remote_dir hold local_dir's files, sending only those whose sha256 differs."""
        ...

    def put_file(
        self,
        target: SshTarget,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        mode: int | None = None,
    ) -> None: ...

    def write_file(
        self, target: SshTarget, remote_path: str, data: bytes, *, mode: int = 0o644
    ) -> None: ...

    def read_file(
        self, target: SshTarget, path: str, *, max_bytes: int | None = None
    ) -> bytes | None:
        """The file's bytes, or None when it does not exist (yet)."""
        ...

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
        """Start a process that outlives this connection; returns its process-group id,
        also written to `pid_file` (when given) before this returns."""
        ...

    def tail(self, target: SshTarget, path: str, lines: int = 50) -> str:
        """The last lines of a log; empty when the file does not exist yet."""
        ...

    def kill_group(self, target: SshTarget, pgid: int, signal: str = "TERM") -> bool:
        """Signal a whole process group; False when no process of it was left."""
        ...

    def is_alive(self, target: SshTarget, pid: int) -> bool: ...

    def wait_gone(self, target: SshTarget, pid: int, timeout: float) -> bool:
        """Blocks until the process has ended (True) or `timeout` seconds passed with it
        still running (False). Other operations on the host go on meanwhile: a run's end
        is learnt within a fraction of a second, not at the next poll."""
        ...

    def close(self, target: SshTarget | None = None) -> None:
        """Drop cached connections (one target's, or all)."""
        ...
