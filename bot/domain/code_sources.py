"""A run's code source as the grammar and the database see it: ``git:<url>@<ref>``,
``path:<dir>``, ``staged:<id>``, parsed and checked. Pure, so the `/gpu` grammar can
refuse a bad URL before anything is queued; fetching, staging and copying the code are
`bot.app.hosts.sources`."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass


def clipped(text: str, limit: int = 60) -> str:
    """User text shown back in an error, cut so a pasted essay stays one line."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


_GIT_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/\-]{0,199}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]{0,252}(:[0-9]{1,5})?")
_REPO_PATH = re.compile(r"[A-Za-z0-9._~/\-]{1,500}")
_STAGED_ID = re.compile(r"[a-z0-9][a-z0-9_\-]{0,79}")


class SourceError(ValueError):
    """A source the bot will not use; the message is shown to the user as it is."""


@dataclass(frozen=True)
class GitSource:
    url: str
    # Branch, tag or full commit id; "" is the remote's default branch.
    ref: str = ""

    @property
    def is_commit(self) -> bool:
        return bool(_COMMIT.fullmatch(self.ref))

    def text(self) -> str:
        return f"git:{self.url}@{self.ref}"


@dataclass(frozen=True)
class PathSource:
    path: str

    def text(self) -> str:
        return f"path:{self.path}"


@dataclass(frozen=True)
class StagedSource:
    staged_id: str

    @property
    def project(self) -> str:
        """The project's name part of the id: the host keeps one upload cache per name."""
        return self.staged_id.rsplit("-", 1)[0]

    def text(self) -> str:
        return f"staged:{self.staged_id}"


Source = GitSource | PathSource | StagedSource


# --- parsing ------------------------------------------------------------------------------


def parse_git(spec: str, *, allow_file: bool = False) -> GitSource:
    """``URL[@REF]`` as typed after ``--git``. `allow_file` is for tests only: a
    ``file://`` repository on the test machine, so no test ever dials the network."""
    spec = spec.strip()
    if not spec:
        raise SourceError(
            "`--git` needs a repository URL, e.g. `--git https://github.com/org/repo@main`."
        )
    if any(ch.isspace() for ch in spec) or "\0" in spec:
        raise SourceError("A git URL has no spaces in it.")
    if spec.startswith("https://"):
        rest = spec[len("https://") :]
        host, slash, path = rest.partition("/")
        if "@" in host:
            raise SourceError(
                "Put no user name or token in the git URL: it would show in logs and in "
                "`/gpu queue`. Give the host a deploy key or use a public URL."
            )
        if not _HOST.fullmatch(host) or not slash:
            raise SourceError(f"`{clipped(spec)}` is not a repository URL (https://HOST/PATH).")
        path, ref = _split_ref(path)
        url = f"https://{host}/{path}"
    elif spec.startswith("git@"):
        rest = spec[len("git@") :]
        host, colon, path = rest.partition(":")
        if not colon or not _HOST.fullmatch(host) or "@" in host:
            raise SourceError(f"`{clipped(spec)}` is not a repository URL (git@HOST:PATH).")
        path, ref = _split_ref(path)
        url = f"git@{host}:{path}"
    elif spec.startswith("file://") and allow_file:
        path, ref = _split_ref(spec[len("file://") :])
        if not path.startswith("/"):
            raise SourceError("A file:// repository needs an absolute path.")
        url = f"file://{path}"
    else:
        raise SourceError(
            f"`{clipped(spec)}`: only https:// and git@ repository URLs are allowed "
            "(e.g. `https://github.com/org/repo@main` or `git@github.com:org/repo.git@v1.2`)."
        )
    if not path or (path.startswith(("-", "/")) and not url.startswith("file://")):
        raise SourceError(f"`{clipped(spec)}` names no repository.")
    if not _REPO_PATH.fullmatch(path) or ".." in path.split("/"):
        raise SourceError(f"`{clipped(path)}` is not a repository path.")
    if ref and (not _GIT_REF.fullmatch(ref) or ".." in ref or ref.endswith((".lock", "/"))):
        raise SourceError(f"`{clipped(ref)}` is not a branch, tag or commit name.")
    return GitSource(url=url, ref=ref)


def _split_ref(path: str) -> tuple[str, str]:
    """The ref follows the last `@` of the path part (the host part may hold one too)."""
    if "@" in path:
        path, ref = path.rsplit("@", 1)
        if not ref:
            raise SourceError("Nothing follows `@` in the git URL: give a branch, tag or commit.")
        return path, ref
    return path, ""


def parse_path(spec: str) -> PathSource:
    """A directory on the host, as typed after ``--path``: absolute, no `..`."""
    spec = spec.strip()
    if not spec.startswith("/"):
        raise SourceError(
            f"`{clipped(spec)}`: `--path` takes an absolute directory on the host, e.g. `/data/proj`."
        )
    if "\0" in spec or "\n" in spec or ".." in spec.split("/"):
        raise SourceError(f"`{clipped(spec)}` is not a plain absolute directory.")
    norm = posixpath.normpath(spec)
    if norm == "/":
        raise SourceError(
            "`--path /` would run in the host's root directory; name a project directory."
        )
    return PathSource(norm)


def parse_source(text: str, *, allow_file: bool = False) -> Source | None:
    """The stored form (``TrainingRun.source``) back into a source; None for "no source"."""
    if not text:
        return None
    kind, _, rest = text.partition(":")
    if kind == "git":
        url, at, ref = rest.rpartition("@")
        if not at:
            raise SourceError(f"`{clipped(text)}` is not a stored git source.")
        return parse_git(f"{url}@{ref}" if ref else url, allow_file=allow_file)
    if kind == "path":
        return parse_path(rest)
    if kind == "staged":
        if not _STAGED_ID.fullmatch(rest):
            raise SourceError(f"`{clipped(rest)}` is not a staged upload id.")
        return StagedSource(rest)
    raise SourceError(f"`{clipped(text)}` is not a code source (git:, path: or staged:).")
