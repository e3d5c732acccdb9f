"""Incremental uploads: which files a directory holds (here and on a host) and which
must travel. Both runners (provisioning.ssh's SshClient, provisioning.local_runner) plan an
upload with these: a sha256 manifest of each side, then only what differs is sent (or has
its executable bit changed)."""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from provisioning import shell
from provisioning.base import ProvisioningError


@dataclass(frozen=True)
class UploadReport:
    # Relative (posix) paths whose content was transferred.
    uploaded: tuple[str, ...] = ()
    # Relative paths already on the host with the same sha256 and mode.
    skipped: tuple[str, ...] = ()
    # Same content, but the executable bit differed: only the mode was changed.
    chmodded: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileState:
    sha256: str
    executable: bool


def _excluded(rel: str, exclude: Sequence[str]) -> bool:
    parts = rel.split("/")
    return any(fnmatch(rel, pat) or any(fnmatch(p, pat) for p in parts) for pat in exclude)


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class LocalFile:
    rel: str
    path: Path
    mode: int
    sha256: str

    @property
    def executable(self) -> bool:
        return bool(self.mode & stat.S_IXUSR)


class SymlinkRefused(ProvisioningError):
    """A tree to upload holds a symbolic link; the message names it."""


def local_tree(local_dir: str | os.PathLike[str], exclude: Sequence[str]) -> list[LocalFile]:
    """Every regular file under local_dir, sorted by path.

    A symbolic link anywhere in the tree (to a file or a directory, pointing inside the
    tree or out of it) is refused with its path named, never followed: following one
    would send whatever it points at (a link to /etc/shadow would upload the file), and
    sending it as a link would point at the host's files instead. Excluded paths are
    not looked at, so an excluded `.venv` link is fine. Other special files (sockets,
    fifos) are skipped."""
    root = Path(local_dir)
    if not root.is_dir():
        raise ProvisioningError(f"{root} is not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        dirnames.sort()
        for name in dirnames:  # os.walk lists a link to a directory here, and skips it
            rel = (base / name).relative_to(root).as_posix()
            if (base / name).is_symlink() and not _excluded(rel, exclude):
                raise SymlinkRefused(f"{base / name} is a symbolic link; links are not uploaded")
        for name in sorted(filenames):
            path = base / name
            rel = path.relative_to(root).as_posix()
            if _excluded(rel, exclude):
                continue
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                raise SymlinkRefused(f"{path} is a symbolic link; links are not uploaded")
            if not stat.S_ISREG(st.st_mode):
                continue
            files.append(LocalFile(rel, path, stat.S_IMODE(st.st_mode), sha256_file(path)))
    return files


_EXEC_MARK = "\n::gpubot-exec::\n"


def remote_manifest_command_line(remote_dir: str) -> str:
    """One round trip: every file's sha256, then the executable ones (NUL-separated)."""
    return (
        f"{shell.join(['mkdir', '-p', '--', remote_dir])} && {shell.cd(remote_dir)} && "
        "{ find . -type f -exec sha256sum -- {} + 2>/dev/null; "
        f"printf '{_EXEC_MARK.encode('unicode_escape').decode()}'; "
        "find . -type f -perm -u=x -print0 2>/dev/null; true; }"
    )


def _unescape_sha256sum(name: str) -> str:
    out = []
    chars = iter(name)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(nxt, nxt))
        else:
            out.append(ch)
    return "".join(out)


def parse_remote_manifest(output: str) -> dict[str, FileState]:
    hashes_part, _, exec_part = output.partition(_EXEC_MARK)
    executable = {name.removeprefix("./") for name in exec_part.split("\0") if name.strip("\n")}
    states: dict[str, FileState] = {}
    for line in hashes_part.splitlines():
        escaped = line.startswith("\\")
        if escaped:
            line = line[1:]
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            continue
        if escaped:
            name = _unescape_sha256sum(name)
        rel = name.removeprefix("./")
        states[rel] = FileState(digest, rel in executable)
    return states


@dataclass
class UploadPlan:
    send: list[LocalFile] = field(default_factory=list)
    chmod: list[LocalFile] = field(default_factory=list)
    skip: list[LocalFile] = field(default_factory=list)

    def report(self) -> UploadReport:
        return UploadReport(
            uploaded=tuple(f.rel for f in self.send),
            skipped=tuple(f.rel for f in self.skip),
            chmodded=tuple(f.rel for f in self.chmod),
        )

    def directories(self, remote_dir: str) -> list[str]:
        dirs = {posixpath.dirname(posixpath.join(remote_dir, f.rel)) for f in self.send}
        return sorted(d for d in dirs if d)


def plan_upload(local: list[LocalFile], remote: Mapping[str, FileState]) -> UploadPlan:
    plan = UploadPlan()
    for f in local:
        there = remote.get(f.rel)
        if there is None or there.sha256 != f.sha256:
            plan.send.append(f)
        elif there.executable != f.executable:
            plan.chmod.append(f)
        else:
            plan.skip.append(f)
    return plan


# --- the fabric client ---------------------------------------------------------------
