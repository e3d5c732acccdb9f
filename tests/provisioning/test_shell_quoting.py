"""Every shell line the bot builds, fed hostile text and run by real shells.

Each builder's commands are pointed at a probe: a tiny `/bin/sh` script that appends
its argv, its working directory and chosen environment variables (NUL-separated) to
a log. The probe stands in for git, rm, tar, tail, find, the login shell and the
runner; env, setsid, nohup, mkdir, sleep, timeout and sh are the real programs, and
`cd`, `[` and `printf` are the shells' own builtins. A property holds when every
probe saw exactly the words the builder was given, each as one argument, in the
directory it was given, with the environment it was given, and nothing else ran
(no extra probe, no canary file from an injected `$(...)` or backticks).

`CDPATH` and `OLDPWD` point at a trap directory holding the same names, so a `cd`
that searched CDPATH or read `-` as "the previous directory" lands in the trap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bot.app.hosts import sources
from bot.app.hosts.remote import PreparedHost
from bot.app.runs import command_text, runner_command
from bot.domain import code_sources
from db.models import TrainingRun
from provisioning import bootstrap, shell, ssh
from provisioning import manifest as manifest_lines
from provisioning.local_runner import LOCAL_TARGET, LocalRunner


def _shells() -> list[str]:
    """/bin/sh and every other shell here (dash, bash), each once."""
    found: dict[str, str] = {}
    for path in ("/bin/sh", "/bin/dash", "/bin/bash", shutil.which("bash")):
        if path and os.path.exists(path):
            found.setdefault(os.path.realpath(path), path)
    return list(found.values())


SHELLS = _shells()
# The real programs the lines may call; everything else on PATH is the probe.
REAL = ("env", "setsid", "nohup", "mkdir", "mv", "sleep", "timeout", "sh")
PROBES = ("probe", "loginsh", "git", "rm", "tar", "tail", "find", "runnerprobe")
CANARY = Path(tempfile.gettempdir()) / f"gpubot-quoting-canary-{os.getpid()}"

# One record is written whole with one write (cat of a small file), so probes that run
# at once (the two ends of a pipe) cannot interleave their records.
PROBE_SCRIPT = """#!/bin/sh
t="$PROBE_LOG.$$"
{
  printf '%s\\0' @rec "$#" "$0" "$PWD" "$@"
  for v in $PROBE_VARS; do
    eval "s=\\${$v+1} x=\\${$v-}"
    printf '%s\\0' "$v" "${s:-0}" "$x"
  done
  printf '%s\\0' @end
} > "$t"
/bin/cat "$t" >> "$PROBE_LOG"
/bin/rm -f "$t"
if [ -n "$PROBE_KILL_PARENT" ]; then kill -TERM "$PPID"; fi
exit 0
"""

EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- hostile text -----------------------------------------------------------------------

_CHARS = st.characters(exclude_categories=["Cs"], exclude_characters="\0")
FRAGMENTS = (
    "'",
    '"',
    "\\",
    f"$(/usr/bin/touch {CANARY})",
    f"`/usr/bin/touch {CANARY}`",
    f"';/usr/bin/touch {CANARY};'",
    "$(probe injected)",
    "`probe injected`",
    "$HOME",
    "${PATH}",
    "\n",
    "\t",
    " ",
    "-",
    "--",
    "-rf",
    "--upload-pack=probe",
    "*",
    "?",
    "[a]",
    ";",
    "&&",
    "|",
    "#",
    "~",
    "!",
    "%",
    "=",
    ">",
    "<",
    "'\"'\"'",
    "{",
    "}",
    "é",
    "日本",
    "\u202e",
)
WORD = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(_CHARS, max_size=6)), max_size=6).map(
    "".join
)
ANY_WORD = st.one_of(WORD, st.text(_CHARS, max_size=30))
# A file name: no slash, not . or .., short enough for any file system.
NAME = (
    st.one_of(WORD, st.text(_CHARS, min_size=1, max_size=12))
    .map(lambda s: s.replace("/", "_"))
    .filter(lambda s: s not in ("", ".", "..") and len(s.encode()) <= 200)
)
REL = st.lists(NAME, min_size=1, max_size=2).map("/".join)
# Names of our own (Q...): an arbitrary one could be LD_PRELOAD, which would break the
# real programs rather than test the quoting.
ENV_NAME = st.from_regex(r"[A-Za-z0-9_]{0,8}", fullmatch=True).map(lambda n: "Q" + n)
# A --path as parse_path keeps it: no line break, nothing its strip() would take off.
HOST_DIR = REL.filter(lambda r: "\n" not in r and r == r.strip())
ENV = st.dictionaries(ENV_NAME, ANY_WORD, max_size=3)


# --- the probe ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rec:
    name: str
    pwd: str
    args: list[str]
    env: Mapping[str, str | None]


@dataclass
class Box:
    """One example's world: a working directory, a trap, and the probe's log."""

    probes: Path
    work: Path
    trap: Path
    log: Path

    def env(self, names: Sequence[str] = (), **extra: str) -> dict[str, str]:
        return {
            "PATH": str(self.probes),
            "SHELL": str(self.probes / "loginsh"),
            "HOME": str(self.work),
            "CDPATH": str(self.trap),
            "OLDPWD": str(self.trap),
            "PROBE_LOG": str(self.log),
            "PROBE_VARS": " ".join(names),
            "LC_ALL": "C",
            **extra,
        }

    def run(
        self, sh: str, line: str, names: Sequence[str] = (), **extra: str
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sh, "-c", line],
            cwd=self.work,
            env=self.env(names, **extra),
            capture_output=True,
            timeout=60,
        )

    def records(self, names: Sequence[str] = ()) -> list[Rec]:
        data = self.log.read_bytes() if self.log.exists() else b""
        return parse_records(data, len(names))

    def wait_records(self, count: int, names: Sequence[str] = ()) -> list[Rec]:
        """For a detached process: its record, once whole (bounded; not a timing check)."""
        deadline = time.monotonic() + 30
        while True:
            data = self.log.read_bytes() if self.log.exists() else b""
            if data.count(b"@end\0") >= count or time.monotonic() > deadline:
                return parse_records(data, len(names))
            time.sleep(0.02)

    def dir(self, rel: str, *, trap: bool = True) -> Path:
        """Makes rel under the work directory (and under the trap, as bait)."""
        path = self.work / rel
        path.mkdir(parents=True, exist_ok=True)
        if trap and not rel.startswith("/"):
            (self.trap / rel).mkdir(parents=True, exist_ok=True)
        return path


def parse_records(data: bytes, nvars: int) -> list[Rec]:
    fields = [os.fsdecode(f) for f in data.split(b"\0")]
    assert fields[-1] == "", "a record was cut short"
    out, i = [], 0
    while i < len(fields) - 1:
        assert fields[i] == "@rec", fields[i : i + 5]
        argc = int(fields[i + 1])
        name, pwd = os.path.basename(fields[i + 2]), fields[i + 3]
        args = fields[i + 4 : i + 4 + argc]
        i += 4 + argc
        env: dict[str, str | None] = {}
        for _ in range(nvars):
            var, isset, value = fields[i : i + 3]
            env[var] = value if isset == "1" else None
            i += 3
        assert fields[i] == "@end"
        i += 1
        out.append(Rec(name, pwd, args, env))
    return out


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("probes")
    script = where / "probe.sh"
    script.write_text(PROBE_SCRIPT)
    script.chmod(0o755)
    for name in PROBES:
        (where / name).symlink_to(script)
    for name in REAL:
        found = shutil.which(name) if name != "sh" else "/bin/sh"
        assert found, f"{name} is needed on PATH"
        (where / name).symlink_to(found)
    return where


@pytest.fixture
def boxes(probes: Path, tmp_path: Path) -> Iterator[Iterator[Box]]:
    """A fresh Box per hypothesis example (the fixture itself lives for the test)."""
    root = Path(os.path.realpath(tmp_path))

    def make() -> Iterator[Box]:
        n = 0
        while True:
            n += 1
            base = root / f"ex{n}"
            (base / "work").mkdir(parents=True)
            (base / "trap").mkdir()
            yield Box(probes, base / "work", base / "trap", base / "probe.log")

    yield make()
    assert not CANARY.exists(), "an injected command ran"


def no_injection(box: Box) -> None:
    assert not CANARY.exists(), "an injected command ran"


# --- provisioning.shell itself ---------------------------------------------------------------


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(words=st.lists(ANY_WORD, max_size=5))
def test_join_gives_each_word_as_one_argument(
    sh: str, boxes: Iterator[Box], words: list[str]
) -> None:
    box = next(boxes)
    proc = box.run(sh, shell.join(["probe", *words]))
    assert proc.returncode == 0, proc.stderr
    assert box.records() == [Rec("probe", str(box.work), words, {})]
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(word=ANY_WORD.filter(bool))
def test_a_path_word_is_never_an_option(sh: str, boxes: Iterator[Box], word: str) -> None:
    box = next(boxes)
    box.run(sh, "probe " + shell.path(word))
    [rec] = box.records()
    assert rec.args == [shell.anchored(word)] and not rec.args[0].startswith("-")
    assert os.path.normpath(os.path.join(box.work, rec.args[0])) == os.path.normpath(
        os.path.join(box.work, word)
    ), "the same file"


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(env=ENV, words=st.lists(ANY_WORD, max_size=3))
def test_env_prefix_sets_exactly_the_values(
    sh: str, boxes: Iterator[Box], env: dict[str, str], words: list[str]
) -> None:
    box = next(boxes)
    proc = box.run(sh, shell.env_prefix(env) + shell.join(["probe", *words]), list(env))
    assert proc.returncode == 0, proc.stderr
    assert box.records(list(env)) == [Rec("probe", str(box.work), words, dict(env))]
    no_injection(box)


@given(name=st.text(_CHARS, max_size=10).filter(lambda n: not n.isidentifier() or not n.isascii()))
def test_env_names_that_are_not_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="environment variable name"):
        shell.env_prefix({name: "x"})


def test_nul_is_refused_not_cut() -> None:
    for build in (shell.quote, shell.path, lambda w: shell.join([w])):
        with pytest.raises(ValueError, match="NUL"):
            build("a\0b")
    with pytest.raises(ValueError, match="NUL"):
        shell.env_prefix({"A": "x\0y"})


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(rel=REL, absolute=st.booleans(), words=st.lists(ANY_WORD, max_size=3))
def test_cd_goes_exactly_to_the_directory(
    sh: str, boxes: Iterator[Box], rel: str, absolute: bool, words: list[str]
) -> None:
    box = next(boxes)
    target = box.dir(rel)
    where = str(target) if absolute else rel
    for line in (
        shell.cd(where) + " && " + shell.join(["probe", *words]),
        shell.in_dir(where, shell.join(["probe", *words])),
    ):
        box.log.unlink(missing_ok=True)
        proc = box.run(sh, line)
        assert proc.returncode == 0 and proc.stdout == b"", proc.stderr
        assert box.records() == [Rec("probe", str(target), words, {})]
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
def test_cd_to_a_directory_named_dash_is_not_the_previous_one(
    sh: str, boxes: Iterator[Box]
) -> None:
    box = next(boxes)
    for rel in ("-", "-P", "--"):
        box.log.unlink(missing_ok=True)
        target = box.dir(rel)
        box.run(sh, shell.in_dir(rel, "probe"))
        assert [r.pwd for r in box.records()] == [str(target)]


# --- provisioning.ssh: what both runners send --------------------------------------------------


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(
    command=ANY_WORD,
    timeout=st.sampled_from([None, 7.5]),
    cwd=st.one_of(st.none(), REL),
    env=st.one_of(st.none(), ENV),
)
def test_run_command_line_hands_the_command_to_the_login_shell_whole(
    sh: str,
    boxes: Iterator[Box],
    command: str,
    timeout: float | None,
    cwd: str | None,
    env: dict[str, str] | None,
) -> None:
    box = next(boxes)
    where = box.dir(cwd) if cwd else box.work
    names = list(env or {})
    proc = box.run(sh, ssh.run_command_line(command, timeout, cwd, env), names)
    assert proc.returncode == 0, proc.stderr
    assert box.records(names) == [Rec("loginsh", str(where), ["-c", command], dict(env or {}))]
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@settings(EXAMPLES, max_examples=15)
@given(
    command=ANY_WORD,
    log=REL,
    cwd=st.one_of(st.none(), REL),
    env=st.one_of(st.none(), ENV),
    pid_file=st.one_of(st.none(), NAME),
)
def test_detached_command_line_starts_exactly_the_command(
    sh: str,
    boxes: Iterator[Box],
    command: str,
    log: str,
    cwd: str | None,
    env: dict[str, str] | None,
    pid_file: str | None,
) -> None:
    box = next(boxes)
    where = box.dir(cwd) if cwd else box.work
    names = list(env or {})
    if pid_file:
        pid_file = str(box.dir("pids") / pid_file)  # any name, in a directory that exists
    proc = box.run(sh, ssh.detached_command_line(command, log, cwd, env, pid_file), names)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().isdigit()
    if pid_file:
        assert Path(pid_file).read_bytes() == proc.stdout.strip() + b"\n"
    assert box.wait_records(1, names) == [
        Rec("loginsh", str(where), ["-c", command], dict(env or {}))
    ]
    assert (where / log).is_file(), "the log is where it was asked to be"
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(path=REL, lines=st.integers(1, 500), exists=st.booleans())
def test_tail_command_line_names_one_file(
    sh: str, boxes: Iterator[Box], path: str, lines: int, exists: bool
) -> None:
    box = next(boxes)
    if exists:
        box.dir(path).rmdir()
        (box.work / path).write_text("x")
    box.run(sh, ssh.tail_command_line(path, lines))
    want = [Rec("tail", str(box.work), ["-n", str(lines), "--", shell.anchored(path)], {})]
    assert box.records() == (want if exists else [])
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(dirs=st.lists(REL, min_size=1, max_size=3), manifest=REL)
def test_mkdir_and_manifest_lines_make_exactly_those_directories(
    sh: str, boxes: Iterator[Box], dirs: list[str], manifest: str
) -> None:
    box = next(boxes)
    proc = box.run(sh, ssh.mkdir_command_line(dirs))
    assert proc.returncode == 0, proc.stderr
    assert all((box.work / d).is_dir() for d in dirs)
    proc = box.run(sh, manifest_lines.remote_manifest_command_line(manifest))
    assert proc.returncode == 0, proc.stderr
    assert [(r.name, r.pwd) for r in box.records()] == [("find", str(box.work / manifest))] * 2
    no_injection(box)


def test_pid_and_signal_builders_take_numbers_and_known_names_only() -> None:
    for bad in ("1; rm -rf /", 1, 0, -5, True, "$(probe)"):
        with pytest.raises(ValueError):
            ssh.alive_command_line(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            ssh.kill_group_command_line(bad, "TERM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signal"):
        ssh.kill_group_command_line(1234, "TERM; probe")


# --- bot.app.hosts.sources: the code a run starts in -----------------------------------------------------

GIT_ENV = ["GIT_TERMINAL_PROMPT", "GIT_SSH_COMMAND"]


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(
    url=ANY_WORD,
    ref=st.one_of(ANY_WORD, st.just("0123456789abcdef0123456789abcdef01234567")),
    dest=REL,
)
def test_git_fetch_line_passes_url_ref_and_dest_as_operands(
    sh: str, boxes: Iterator[Box], url: str, ref: str, dest: str
) -> None:
    box = next(boxes)
    src = code_sources.GitSource(url, ref)
    if url.startswith("-") or ref.startswith("-") or not url or "\n" in url + ref:
        with pytest.raises(code_sources.SourceError):
            sources.git_fetch_line(src, dest)
        return
    target = box.dir(dest)  # `git init` is a probe: the directory it would make
    proc = box.run(sh, sources.git_fetch_line(src, dest), GIT_ENV)
    assert proc.returncode == 0, proc.stderr
    work, git_env = (
        str(box.work),
        {
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new",
        },
    )
    bare = {k: None for k in GIT_ENV}
    rm = Rec("rm", work, ["-rf", "--", dest], bare)
    if src.is_commit:
        want = [
            rm,
            Rec("git", work, ["init", "-q", "--", dest], bare),
            Rec("git", str(target), ["remote", "add", "--", "origin", url], bare),
            Rec("git", str(target), ["fetch", "-q", "--depth", "1", "--", "origin", ref], git_env),
            Rec(
                "git",
                str(target),
                ["-c", "advice.detachedHead=false", "checkout", "-q", "FETCH_HEAD"],
                bare,
            ),
        ]
    else:
        branch = ["--branch", ref] if ref else []
        clone = ["clone", "-q", "--depth", "1", *branch, "--", url, dest]
        want = [rm, Rec("git", work, clone, git_env)]
    assert box.records(GIT_ENV) == want
    no_injection(box)


@pytest.mark.parametrize("spec", ["--upload-pack=touch /tmp/x", "-oProxyCommand=x", "ext::sh -c x"])
def test_a_git_url_that_is_an_option_or_a_transport_is_refused(spec: str) -> None:
    with pytest.raises(code_sources.SourceError):
        code_sources.parse_git(spec)
    with pytest.raises(code_sources.SourceError):
        code_sources.parse_git(f"https://github.com/org/repo@{spec}")


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(rel=REL, kind=st.sampled_from(["dir", "file", "missing"]))
def test_path_check_line_answers_by_exit_code_and_runs_nothing(
    sh: str, boxes: Iterator[Box], rel: str, kind: str
) -> None:
    box = next(boxes)
    path = box.work / rel
    if kind != "missing":
        box.dir(rel, trap=False)
    if kind == "file":
        path.rmdir()
        path.write_text("x")
    proc = box.run(sh, sources.path_check_line(code_sources.PathSource(str(path))))
    want = {"dir": 0, "file": sources.PATH_NOT_DIR, "missing": sources.PATH_MISSING}[kind]
    assert (proc.returncode, proc.stdout, proc.stderr) == (want, b"", b"")
    assert box.records() == []
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(cache=REL, listing=REL, dest=REL)
def test_copy_listed_line_keeps_each_path_whole(
    sh: str, boxes: Iterator[Box], cache: str, listing: str, dest: str
) -> None:
    box = next(boxes)
    proc = box.run(sh, sources.copy_listed_line(cache, listing, dest))
    assert proc.returncode == 0, proc.stderr
    assert (box.work / dest).is_dir()
    work = str(box.work)
    got = sorted(box.records(), key=lambda r: (r.name, r.args))
    assert got == sorted(
        [
            Rec("rm", work, ["-rf", "--", dest], {}),
            Rec("tar", work, ["-C", cache, "-cf", "-", "--null", "-T", listing], {}),
            Rec("tar", work, ["-C", dest, "-xpf", "-"], {}),
        ],
        key=lambda r: (r.name, r.args),
    )
    no_injection(box)


# --- bot.app.runs: the runner's command line, as the runner then starts it ------------------------


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(
    argv=st.lists(ANY_WORD, max_size=4),
    where=st.sampled_from(["path", "staged", "none"]),
    code=HOST_DIR,
    run_dir=REL,
    batch=st.sampled_from([None, 0, 16]),
    precision=ANY_WORD,
)
def test_the_runner_line_and_the_users_command_arrive_word_for_word(
    sh: str,
    boxes: Iterator[Box],
    argv: list[str],
    where: str,
    code: str,
    run_dir: str,
    batch: int | None,
    precision: str,
) -> None:
    box = next(boxes)
    status, ckpt = str(box.work / "s.json"), str(box.work / "c k'pt")
    run = TrainingRun(
        id=7,
        user_id=1,
        command=command_text(["probe", *argv]),
        precision=precision,
        submitted_at=datetime.now(UTC),
    )
    if batch is not None:
        run.metrics = {"oom_retry": {"batch_size": batch} if batch else {}}
    if where == "path":
        code_dir = box.dir(code, trap=False)
        run.source = code_sources.parse_path(str(code_dir)).text()
        code_dir = Path(run.source.removeprefix("path:"))
    elif where == "staged":
        run.source = "staged:proj-0123"
        code_dir = box.dir(f"{run_dir}/code")
    else:
        code_dir = box.work
    placement = {"dir": run_dir, "status": status, "checkpoints": ckpt}
    line = runner_command(run, placement, "runnerprobe")
    names = ["GPUBOT_OOM_RETRY", "GPUBOT_BATCH_SCALE", "GPUBOT_BATCH_SIZE"]
    proc = box.run(sh, line, names)
    assert proc.returncode == 0, proc.stderr
    [runner] = box.records(names)
    own = ["-m", "training.runner", "--precision", precision, "--status-file", status]
    own += ["--checkpoint-dir", ckpt, "--run-id", "7"]
    cut = len(own)
    assert runner.args[:cut] == own and runner.args[cut] == "--"
    # What the runner starts: the words after `--`, as an argv (no shell of ours between).
    box.log.unlink()
    subprocess.run(runner.args[cut + 1 :], cwd=box.work, env=box.env(names), timeout=60, check=True)
    retry = batch is not None
    want_env: dict[str, str | None] = {
        "GPUBOT_OOM_RETRY": "1" if retry else None,
        "GPUBOT_BATCH_SCALE": "0.5" if retry else None,
        "GPUBOT_BATCH_SIZE": str(batch) if batch else None,
    }
    assert box.records(names) == [Rec("probe", str(code_dir), argv, want_env)]
    no_injection(box)


@EXAMPLES
@given(python=NAME, code_dir=ANY_WORD.filter(bool), argv=st.lists(ANY_WORD, max_size=3))
def test_a_prepared_hosts_interpreter_starts_the_module_word_for_word(
    boxes: Iterator[Box], python: str, code_dir: str, argv: list[str]
) -> None:
    """Through the real LocalRunner: the prepared host's interpreter (a probe at a hostile
    path) gets the module's words, with PYTHONPATH set to the host's code directory."""
    box = next(boxes)
    interpreter = box.dir("bin") / python
    interpreter.symlink_to(box.probes / "probe")
    host = PreparedHost(root="/r", python=str(interpreter), code_dir=code_dir).interpreter()
    line = host.module("training.runner", "--run-id", "3", "--", *argv)
    env = {"PROBE_LOG": str(box.log), "PROBE_VARS": "PYTHONPATH", **host.env()}
    LocalRunner().start_detached(
        LOCAL_TARGET, line, str(box.work / "run.log"), cwd=str(box.work), env=env
    )
    [rec] = box.wait_records(1, ["PYTHONPATH"])
    assert rec.name == python
    assert rec.args == ["-m", "training.runner", "--run-id", "3", "--", *argv]
    assert rec.env == {"PYTHONPATH": code_dir}
    no_injection(box)


@pytest.mark.parametrize("sh", SHELLS)
@EXAMPLES
@given(run_dir=REL, code=HOST_DIR, argv=st.lists(ANY_WORD, max_size=3))
def test_in_code_dir_starts_the_command_in_its_code(
    sh: str, boxes: Iterator[Box], run_dir: str, code: str, argv: list[str]
) -> None:
    box = next(boxes)
    on_host = box.dir(code, trap=False)
    staged = box.dir(f"{run_dir}/code")
    for text, where in (
        (code_sources.parse_path(str(on_host)).text(), on_host),
        ("staged:proj-0123", staged),
    ):
        box.log.unlink(missing_ok=True)
        line = sources.in_code_dir(text, run_dir) + " " + shell.join(["probe", *argv])
        proc = box.run(sh, line)
        assert proc.returncode == 0, proc.stderr
        assert box.records() == [Rec("probe", str(Path(os.path.normpath(where))), argv, {})]
    no_injection(box)


# --- provisioning.bootstrap: the host agent's supervisor and its crontab line ------------------


@pytest.mark.parametrize("sh", SHELLS)
@settings(EXAMPLES, max_examples=15)
@given(code=REL, pidfile=NAME, argv=st.lists(ANY_WORD, max_size=3), log=NAME, script=NAME)
def test_agent_supervisor_and_cron_lines_keep_paths_and_argv_whole(
    sh: str, boxes: Iterator[Box], code: str, pidfile: str, argv: list[str], log: str, script: str
) -> None:
    assume(len({"c", pidfile, log, script}) == 4)  # four different names in one directory
    box = next(boxes)
    code_dir = box.dir(f"c/{code}")
    text = bootstrap.agent_supervisor_script(str(code_dir), ["probe", *argv], pidfile)
    # The probe stops the loop (it signals its parent, the supervisor).
    box.run(sh, text, PROBE_KILL_PARENT="1")
    assert (box.work / shell.anchored(pidfile)).read_text().strip().isdigit()
    assert box.records() == [Rec("probe", str(code_dir), argv, {})]
    # cron turns `\%` back into `%` and runs the rest with sh; the script is the probe.
    script_path = box.work / shell.anchored(script)
    script_path.symlink_to(box.probes / "probe")
    cron = bootstrap.agent_cron_line(str(script_path), log)
    assert cron.startswith("@reboot ") and cron.endswith(bootstrap.AGENT_CRON_TAG)
    body = cron.removeprefix("@reboot ")
    assert "%" not in body.replace("\\%", "")
    box.log.unlink()
    box.run(sh, body.replace("\\%", "%"))
    [rec] = box.wait_records(1)
    assert (rec.name, rec.args) == (script_path.name, [])
    no_injection(box)


def test_a_unit_with_a_line_break_is_refused() -> None:
    with pytest.raises(Exception, match="line break"):
        bootstrap.agent_unit("ubuntu", "/srv/x\nExecStartPre=/bin/evil", ["python3"])
