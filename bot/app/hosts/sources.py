"""Where a run's code comes from: a git URL, a directory on the host, or a local
directory staged by `gpubot submit DIR`.

A run's `TrainingRun.source` is one line of text, so it survives the database and
shows in messages:

* ``git:<url>@<ref>`` — cloned on the host into the run's directory (``ref`` may be
  empty: the default branch). Only ``https://`` and ``git@host:path`` URLs: other
  schemes (``file://``, ``ext::``, ``ssh://`` with options...) can read the host's
  files or run commands, so they are refused unless a test asks for ``file://``.
* ``path:<absolute dir>`` — a directory that already exists on the host (a shared
  file system, a checkout someone keeps there); the run starts in it.
* ``staged:<id>`` — a copy under ``$GPUBOT_HOME/staged/<id>/`` that the worker uploads
  with `HostShell.upload_dir` when the run is placed. The id is content-addressed,
  so staging an unchanged directory again yields the same id, and the host keeps one
  cache per project name, so a second upload of unchanged files sends nothing.

The parsing is pure (the `/gpu` grammar uses it); `prepare_code` is what `bot.app.runs`
calls on the host right before the runner starts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bot.domain.code_sources import (
    GitSource,
    PathSource,
    Source,
    SourceError,
    StagedSource,
    clipped,
    parse_source,
)
from provisioning import shell

if TYPE_CHECKING:
    from provisioning.hostshell import HostShell
    from provisioning.ssh import SshTarget, UploadReport

# What is never staged: VCS metadata, caches, virtual environments. A `.gpubotignore`
# in the directory adds patterns (one a line, `#` comments), matched like these against
# the relative path and against each of its parts.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    "*.pyc",
    ".venv",
    "venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    ".DS_Store",
)
IGNORE_FILE = ".gpubotignore"
# Staging is for code and small data: big data belongs on the host (`--path`) or in a
# bucket. 200 MB goes up in well under a minute on an ordinary uplink.
STAGE_LIMIT_BYTES = 200 * 1024 * 1024
STAGE_LIMIT_FILES = 20_000
# How long a clone may take on the host before the run is failed instead.
FETCH_TIMEOUT_S = 600.0


# --- staging (the machine where `gpubot submit` runs) -----------------------------------------


@dataclass(frozen=True)
class Staged:
    source: StagedSource
    path: Path
    files: int
    bytes: int
    # False when an identical copy was already staged (the same id) and was reused.
    fresh: bool


def read_ignore_file(root: Path) -> tuple[str, ...]:
    ignore = root / IGNORE_FILE
    if not ignore.is_file():
        return ()
    lines = ignore.read_text(encoding="utf-8", errors="replace").splitlines()
    return tuple(ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith("#"))


def excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    parts = rel.split("/")
    return any(
        fnmatch.fnmatch(rel, p) or any(fnmatch.fnmatch(q, p) for q in parts) for p in patterns
    )


def collect(
    root: Path,
    *,
    limit_bytes: int = STAGE_LIMIT_BYTES,
    limit_files: int = STAGE_LIMIT_FILES,
) -> list[tuple[str, Path, int]]:
    """(relative path, path, size) of every file to stage, sorted; excluded directories
    are not even entered (a `.venv` can hold 100,000 files)."""
    patterns = DEFAULT_EXCLUDES + read_ignore_file(root)
    out: list[tuple[str, Path, int]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_base = base.relative_to(root).as_posix()
        dirnames[:] = sorted(d for d in dirnames if not excluded(_join(rel_base, d), patterns))
        for name in dirnames:  # os.walk lists a link to a directory here and never enters it
            if (base / name).is_symlink():
                raise _link_refused(base / name)
        for name in sorted(filenames):
            rel = _join(rel_base, name)
            if excluded(rel, patterns):
                continue
            path = base / name
            try:
                st = path.lstat()
            except OSError:
                continue  # gone since the listing: nothing to send
            if stat.S_ISLNK(st.st_mode):
                raise _link_refused(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            out.append((rel, path, st.st_size))
            if total > limit_bytes:
                biggest = sorted(out, key=lambda f: -f[2])[:3]
                listed = ", ".join(f"{r} ({_mb(n)})" for r, _, n in biggest)
                raise SourceError(
                    f"{root} holds more than {_mb(limit_bytes)} to upload (largest: {listed}). "
                    f"Leave data out with a `{IGNORE_FILE}` file (one pattern a line) and "
                    "keep it on the host (`/gpu run --path DIR`)."
                )
            if len(out) > limit_files:
                raise SourceError(
                    f"{root} holds more than {limit_files} files to upload; leave some out "
                    f"with a `{IGNORE_FILE}` file (one pattern a line)."
                )
    if not out:
        raise SourceError(f"{root} has no files to upload (after the excludes).")
    return sorted(out)


def _link_refused(path: Path) -> SourceError:
    """Staging never follows a symbolic link (to a file or a directory, inside the tree or
    out of it): a link to /etc/shadow would upload the file, and a link kept as a link
    would point at the host's files instead. The user decides what the link meant."""
    return SourceError(
        f"{path} is a symbolic link; links are not uploaded. Replace it with a copy of "
        f"what it points to, or leave it out with a `{IGNORE_FILE}` line."
    )


def stage(
    directory: str | os.PathLike[str],
    home: Path,
    *,
    limit_bytes: int = STAGE_LIMIT_BYTES,
    limit_files: int = STAGE_LIMIT_FILES,
) -> Staged:
    """Copies `directory` (minus the excludes) to ``home/staged/<id>/``.

    A copy, not a reference, because the run may start hours later and must run the
    code as it was when submitted. The id is the project's name plus a hash of the
    contents, so the same tree staged twice is one copy.
    """
    root = Path(directory).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"{directory} is not a directory.")
    files = collect(root, limit_bytes=limit_bytes, limit_files=limit_files)
    digest = hashlib.sha256()
    for rel, path, _ in files:
        digest.update(rel.encode() + b"\0")
        digest.update(b"x" if os.access(path, os.X_OK) else b"-")
        digest.update(_sha256(path).encode() + b"\n")
    slug = re.sub(r"[^a-z0-9_]+", "_", root.name.lower()).strip("_")[:40] or "project"
    sid = f"{slug}-{digest.hexdigest()[:16]}"
    dest = home / "staged" / sid
    size = sum(n for _, _, n in files)
    if dest.is_dir():
        return Staged(StagedSource(sid), dest, len(files), size, fresh=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sid}.", dir=dest.parent))
    try:
        for rel, path, _ in files:
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            # Keeps the mode (an executable stays one). Never follows a link: a file
            # swapped for one since `collect` is copied as a link, which the upload
            # (provisioning.ssh.local_tree) then refuses.
            shutil.copy2(path, target, follow_symlinks=False)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():  # not a racing twin that staged the same tree
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return Staged(StagedSource(sid), dest, len(files), size, fresh=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Staged(StagedSource(sid), dest, len(files), size, fresh=True)


def staged_dir(home: Path, source: StagedSource) -> Path:
    return home / "staged" / source.staged_id


# --- on the host, right before the runner starts -------------------------------------------


# Git never prompts on the host: a private repository without a key there fails at
# once instead of hanging the run.
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new",
}


def _git_words(src: GitSource) -> None:
    """The last check before a URL and a ref become git's arguments: neither may look
    like an option (``--upload-pack=...``) nor hold what no argument can (NUL, a
    newline). `parse_git` is stricter; this guards a `GitSource` built any other way."""
    for what, word in (("git URL", src.url), ("git ref", src.ref)):
        if word.startswith("-") or "\0" in word or "\n" in word:
            raise SourceError(f"`{clipped(word)}` is not a {what} the bot will pass to git.")
    if not src.url:
        raise SourceError("a git source needs a repository URL.")


def git_fetch_line(src: GitSource, dest: str) -> str:
    """A shell line that leaves `dest` holding the repository at the ref, shallowly.

    A branch or tag: ``git clone --depth 1 --branch``. A full commit id: init + a
    shallow fetch of that commit (servers that allow fetching by id: GitHub, GitLab,
    and git itself over protocol v2). Every operand follows ``--``, so none is an option."""
    _git_words(src)
    env = shell.env_prefix(_GIT_ENV)
    if src.is_commit:
        inside = " && ".join(
            [
                shell.join(["git", "remote", "add", "--", "origin", src.url]),
                env + shell.join(["git", "fetch", "-q", "--depth", "1", "--", "origin", src.ref]),
                shell.join(
                    ["git", "-c", "advice.detachedHead=false", "checkout", "-q", "FETCH_HEAD"]
                ),
            ]
        )
        fetch = shell.join(["git", "init", "-q", "--", dest]) + " && " + shell.in_dir(dest, inside)
    else:
        argv = ["git", "clone", "-q", "--depth", "1"]
        argv += ["--branch", src.ref] if src.ref else []
        fetch = env + shell.join([*argv, "--", src.url, dest])
    return shell.join(["rm", "-rf", "--", dest]) + " && " + fetch


# What `path_check_line` exits with; any other failure is the shell's or the link's.
PATH_MISSING = 3
PATH_NOT_DIR = 4


def path_check_line(src: PathSource) -> str:
    """Exits 0 when the path is a directory there, PATH_MISSING when nothing is there,
    PATH_NOT_DIR when something else is. It prints nothing: the user's sentence is
    written here from the path as typed, never from the host's words."""
    where = shell.path(src.path)
    return (
        f"if [ -d {where} ]; then exit 0; "
        f"elif [ -e {where} ] || [ -L {where} ]; then exit {PATH_NOT_DIR}; "
        f"else exit {PATH_MISSING}; fi"
    )


def path_problem(src: PathSource, host: str, exit_code: int) -> str:
    """The sentence a user reads when `--path` did not name a directory on the host."""
    path = clipped(src.path, 200)
    if exit_code == PATH_MISSING:
        return f"there is no directory {path} on {host}"
    if exit_code == PATH_NOT_DIR:
        return f"{path} on {host} is not a directory"
    return f"could not check {path} on {host} (exit code {exit_code})"


def copy_listed_line(cache_dir: str, list_file: str, dest: str) -> str:
    """Copies exactly the staged files from the host's cache into the run's directory:
    the cache may still hold files an older version had."""
    return " && ".join(
        [
            shell.join(["rm", "-rf", "--", dest]),
            shell.join(["mkdir", "-p", "--", dest]),
            shell.join(["tar", "-C", cache_dir, "-cf", "-", "--null", "-T", list_file])
            + " | "
            + shell.join(["tar", "-C", dest, "-xpf", "-"]),
        ]
    )


def code_dir(source: Source, run_dir: str) -> str:
    """Where the command runs: the host directory itself, else `<run dir>/code`."""
    if isinstance(source, PathSource):
        return source.path
    return posixpath.join(run_dir, "code")


def in_code_dir(text: str, run_dir: str) -> str:
    """A prefix for the user's command that starts it in its code directory.

    The runner (the supervisor) stays in the run's directory, where the host agent
    finds a run by its processes' working directory; only the command moves.
    The stored source was checked when it was accepted, file:// tests included."""
    src = parse_source(text, allow_file=True)
    assert src is not None
    return shell.join(["sh", "-c", 'cd "$0" && exec "$@"', shell.cd_target(code_dir(src, run_dir))])


@dataclass(frozen=True)
class Prepared:
    # The directory the run's command starts in.
    cwd: str
    # One line for the run's log: where the code came from (and what the upload sent).
    note: str
    # For staged sources: what upload_dir sent and skipped.
    upload: UploadReport | None = None


def prepare_code(
    runner: HostShell,
    target: SshTarget,
    source: Source,
    run_dir: str,
    *,
    home: Path,
) -> Prepared:
    """Puts the run's code in place on the host; raises SourceError with the host's own
    words when it cannot (a missing directory, a clone that failed)."""
    from provisioning.manifest import local_tree

    if isinstance(source, PathSource):
        result = runner.run(target, path_check_line(source), timeout=30)
        if not result.ok:
            raise SourceError(path_problem(source, target.name or target.host, result.exit_code))
        return Prepared(cwd=source.path, note=f"code: {source.path} on the host")
    dest = code_dir(source, run_dir)
    if isinstance(source, GitSource):
        result = runner.run(target, git_fetch_line(source, dest), timeout=FETCH_TIMEOUT_S)
        if not result.ok:
            raise SourceError(
                _why(result.stderr, "git failed") + f" (fetching {source.url} {source.ref})"
            )
        head = runner.run(target, "git rev-parse --short HEAD", timeout=30, cwd=dest)
        at = head.stdout.strip() if head.ok else "?"
        return Prepared(
            cwd=dest, note=f"code: {source.url} {source.ref or '(default branch)'} at {at}"
        )
    local = staged_dir(home, source)
    if not local.is_dir():
        raise SourceError(
            f"the staged copy {source.staged_id} is gone from {local.parent}; submit it again"
        )
    # One cache per project on the host: an unchanged file is never sent twice.
    cache = posixpath.join(posixpath.dirname(run_dir.rstrip("/")), "_staged", source.project)
    report = runner.upload_dir(target, local, cache)
    names = b"\0".join(f.rel.encode() for f in local_tree(local, ())) + b"\0"
    list_file = posixpath.join(run_dir, "code.files")
    runner.write_file(target, list_file, names)
    result = runner.run(target, copy_listed_line(cache, list_file, dest), timeout=FETCH_TIMEOUT_S)
    if not result.ok:
        raise SourceError(_why(result.stderr, "copying the code failed"))
    note = (
        f"code: staged {source.staged_id}: sent {len(report.uploaded)} file(s), "
        f"{len(report.skipped)} unchanged"
    )
    return Prepared(cwd=dest, note=note, upload=report)


def _why(stderr: str, fallback: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else fallback


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _join(base: str, name: str) -> str:
    return name if base in ("", ".") else f"{base}/{name}"


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:.0f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.0f} KiB"
