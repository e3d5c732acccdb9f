"""Where a run's code comes from (bot.app.hosts.sources): the --git/--path grammar, staging a
local directory, `gpubot submit` end to end on this machine, and a git source cloned
from a bare repository in tmp on a real sshd host (file:// only because the test
allows it; nothing dials the network).

The sshd host is a shortcut (the default lab, the bot's own user): the bare repository
lies in the test's tmp dir, which only the bot's user may read, and the run test starts
the bot's own interpreter there; these tests are about where code comes from, not what a
host has."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bot.app.hosts.sources import prepare_code, stage
from bot.domain.code_sources import (
    GitSource,
    PathSource,
    SourceError,
    StagedSource,
    parse_git,
    parse_path,
    parse_source,
)
from bot.domain.commands import Run, parse
from bot.domain.errors import UserError
from db.models import TrainingRun
from db.session import make_engine
from provisioning.ssh import LOOPBACK_ONLY_ENV, SshClient, SshTarget
from tests.core.helpers import actor, make_service, runs_here
from tests.core.test_runs import local_host, run_until, state
from tests.runtime_helpers import checked
from tests.ssh_hosts import SshLab, running_lab

ROOT = Path(__file__).resolve().parents[2]
GPUBOT = str(Path(sys.executable).with_name("gpubot"))


def run_cmd(text: str) -> Run:
    cmd = parse(text)
    assert isinstance(cmd, Run)
    return cmd


# --- grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "source"),
    [
        (
            "/gpu run --git https://github.com/org/repo@main -- python train.py",
            "git:https://github.com/org/repo@main",
        ),
        (
            "/gpu run --git https://github.com/org/repo.git -- python train.py",
            "git:https://github.com/org/repo.git@",
        ),
        (
            "/gpu run --git=git@github.com:org/repo.git@v1.2 --gpus 2 -- python t.py",
            "git:git@github.com:org/repo.git@v1.2",
        ),
        (
            "/gpu run --git https://gitlab.example.com:8443/a/b@" + "a" * 40 + " -- make",
            "git:https://gitlab.example.com:8443/a/b@" + "a" * 40,
        ),
        ("/gpu run --path /data/proj/ -- python train.py", "path:/data/proj"),
        ("/gpu run -- python train.py", ""),
    ],
)
def test_git_and_path_sources_parse_to_their_stored_form(line: str, source: str) -> None:
    cmd = run_cmd(line)
    assert cmd.source == source
    assert cmd.command[0] in {"python", "make"}
    if source:
        assert parse_source(source) is not None  # the stored form reads back


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("/gpu run --git file:///tmp/repo -- python t.py", "only https:// and git@"),
        ("/gpu run --git http://example.com/r -- python t.py", "only https:// and git@"),
        ("/gpu run --git ext::sh -c touch% /tmp/x -- python t.py", "only https:// and git@"),
        ("/gpu run --git https://user:tok@github.com/o/r -- python t.py", "no user name or token"),
        ("/gpu run --git https://github.com/o/r@ -- python t.py", "Nothing follows `@`"),
        ("/gpu run --git https://github.com/o/r@--upload-pack=x -- python t.py", "not a branch"),
        ("/gpu run --git https://github.com/o/../r -- python t.py", "not a repository path"),
        ("/gpu run --git -- python t.py", "only https:// and git@"),
        ("/gpu run --path data/proj -- python t.py", "absolute directory"),
        ("/gpu run --path /data/../etc -- python t.py", "plain absolute"),
        ("/gpu run --path / -- python t.py", "root directory"),
        ("/gpu run --git https://github.com/o/r --path /data -- python t.py", "not both"),
        ("/gpu run --recipe digits --path /data", "recipe brings its own code"),
        ("/gpu run --git https://github.com/o/r", "Say what to run"),
    ],
)
def test_bad_sources_get_a_clear_error_with_the_usage(line: str, words: str) -> None:
    with pytest.raises(UserError) as err:
        parse(line)
    assert words in err.value.text
    assert "Usage: /gpu run" in err.value.text and "--git URL[@REF]" in err.value.text


def test_file_urls_only_when_a_test_allows_them() -> None:
    with pytest.raises(SourceError):
        parse_git("file:///srv/repo@main")
    assert parse_git("file:///srv/repo@main", allow_file=True) == GitSource(
        "file:///srv/repo", "main"
    )
    assert parse_git("git@host:o/r.git").text() == "git:git@host:o/r.git@"
    assert parse_source("git:git@host:o/r.git@") == GitSource("git@host:o/r.git", "")
    assert parse_source("path:/x/y") == PathSource("/x/y")
    assert parse_source("staged:proj-0123abcd") == StagedSource("proj-0123abcd")
    with pytest.raises(SourceError):
        parse_source("staged:../../etc")
    with pytest.raises(SourceError):
        parse_path("relative")


# --- staging ---------------------------------------------------------------------------


def make_project(root: Path) -> Path:
    proj = root / "My Proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "train.py").write_text("print('hi')\n")
    (proj / "pkg" / "model.py").write_text("X = 1\n")
    (proj / "run.sh").write_text("#!/bin/sh\necho run\n")
    (proj / "run.sh").chmod(0o755)
    for junk in (".git/HEAD", "__pycache__/m.cpython-311.pyc", ".venv/lib/big.so", "data/d.bin"):
        (proj / junk).parent.mkdir(parents=True, exist_ok=True)
        (proj / junk).write_bytes(b"x" * 1000)
    (proj / ".gpubotignore").write_text("# data stays on the host\ndata/\n*.ckpt\n")
    (proj / "last.ckpt").write_bytes(b"c" * 10)
    return proj


def test_staging_copies_the_project_without_the_excludes(tmp_path: Path) -> None:
    proj = make_project(tmp_path)
    staged = stage(proj, tmp_path / "home")
    got = sorted(
        p.relative_to(staged.path).as_posix() for p in staged.path.rglob("*") if p.is_file()
    )
    assert got == [".gpubotignore", "pkg/model.py", "run.sh", "train.py"]
    assert staged.source.staged_id.startswith("my_proj-") and staged.fresh
    assert os.access(staged.path / "run.sh", os.X_OK), "the mode travels with the file"
    again = stage(proj, tmp_path / "home")
    assert again.source == staged.source and not again.fresh, "same tree, same id, one copy"
    (proj / "train.py").write_text("print('changed')\n")
    changed = stage(proj, tmp_path / "home")
    assert changed.source != staged.source
    assert changed.source.project == staged.source.project == "my_proj"


def test_staging_refuses_too_much_and_says_what_to_leave_out(tmp_path: Path) -> None:
    proj = make_project(tmp_path)
    (proj / "weights.pt").write_bytes(b"w" * 5000)
    with pytest.raises(SourceError) as err:
        stage(proj, tmp_path / "home", limit_bytes=4000)
    assert "weights.pt" in str(err.value) and ".gpubotignore" in str(err.value)
    assert not (tmp_path / "home" / "staged").exists() or not any(
        (tmp_path / "home" / "staged").iterdir()
    )
    with pytest.raises(SourceError, match="more than 2 files"):
        stage(proj, tmp_path / "home", limit_files=2)
    with pytest.raises(SourceError, match="not a directory"):
        stage(proj / "train.py", tmp_path / "home")


@pytest.mark.parametrize(
    "link",
    [
        "file outside",  # the reported case: a link to a secret staged for upload
        "file inside",  # even one that points inside the tree: the user decides
        "dir outside",
        "dir inside",
        "dangling",
    ],
)
def test_staging_refuses_every_symlink_and_names_it(tmp_path: Path, link: str) -> None:
    proj = make_project(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("root:$6$hash\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.py").write_text("X = 2\n")
    target = {
        "file outside": secret,
        "file inside": proj / "train.py",
        "dir outside": tmp_path / "elsewhere",
        "dir inside": proj / "pkg",
        "dangling": tmp_path / "gone",
    }[link]
    where = proj / "pkg" / "shadow"
    where.symlink_to(target)
    home = tmp_path / "home"
    with pytest.raises(SourceError) as err:
        stage(proj, home)
    assert f"{where} is a symbolic link" in str(err.value)
    staged = home / "staged"
    assert not staged.exists() or not any(staged.iterdir()), "nothing was staged"
    # An excluded link is never looked at (a `.venv` link is common).
    (proj / ".gpubotignore").write_text("shadow\n")
    got = stage(proj, home)
    assert not any(p.is_symlink() for p in got.path.rglob("*"))
    assert b"root:" not in b"".join(p.read_bytes() for p in got.path.rglob("*") if p.is_file())


def test_the_upload_refuses_a_symlink_too(tmp_path: Path) -> None:
    """local_tree (what upload_dir sends) checks on its own: a staged copy or a package
    directory that holds a link is refused, never sent by content."""
    from provisioning.local_runner import LOCAL_TARGET, LocalRunner
    from provisioning.manifest import SymlinkRefused, local_tree

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.py").write_text("A = 1\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    (tree / "sub" / "leak").symlink_to(secret)
    with pytest.raises(SymlinkRefused, match=f"{tree / 'sub' / 'leak'} is a symbolic link"):
        local_tree(tree, ())
    with pytest.raises(SymlinkRefused):
        LocalRunner().upload_dir(LOCAL_TARGET, tree, str(tmp_path / "dest"))
    assert not (tmp_path / "dest" / "sub" / "leak").exists()
    (tree / "sub" / "leak").unlink()
    (tree / "sub" / "loop").symlink_to(tree)
    with pytest.raises(SymlinkRefused, match="loop"):
        local_tree(tree, ())
    assert [f.rel for f in local_tree(tree, ("loop",))] == ["a.py"]


def test_gpubot_submit_refuses_a_link_to_a_file_outside_the_tree(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$hash\n")
    (proj / "creds").symlink_to(secret)
    home = tmp_path / "home"
    done = _submit(home, proj)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{proj / 'creds'} is a symbolic link" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (home / "staged").exists() or not any((home / "staged").iterdir())


# --- gpubot submit, end to end on this machine ------------------------------------------------


def _submit(home: Path, proj: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GPUBOT_HOME": str(home),
        "GPUBOT_TICK_SECONDS": "0.3",
        "GPUBOT_USER": "carol",
    }
    env.pop("DATABASE_URL", None)
    env.pop("GPUBOT_PROVIDER", None)
    return subprocess.run(
        [GPUBOT, "submit", str(proj), "--wait", "--", "python", "train.py", "--out", "ran.txt"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_gpubot_submit_uploads_runs_in_the_copy_and_sends_nothing_twice(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        "import os, sys, pathlib\n"
        "import helper\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "pathlib.Path(out).write_text(os.getcwd() + ' ' + helper.WORD)\n"
    )
    (proj / "helper.py").write_text("WORD = 'from-the-upload'\n")
    home = tmp_path / "home"
    first = _submit(home, proj)
    assert first.returncode == 0, first.stderr + first.stdout
    assert (
        "Run #1 queued" in first.stdout and "[dm @carol] Run #1 (`python train.py" in first.stdout
    )
    assert "finished" in first.stdout
    second = _submit(home, proj)
    assert second.returncode == 0, second.stderr + second.stdout
    assert "unchanged since it was last staged" in second.stdout
    engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
    with Session(engine) as s:
        runs = {r.id: r for r in s.exec(select(TrainingRun))}
    engine.dispose()
    assert [runs[1].state, runs[2].state] == ["succeeded", "succeeded"]
    assert runs[1].source == runs[2].source and runs[1].source.startswith("staged:proj-")
    assert sorted(runs[1].placement["code"]["uploaded"]) == ["helper.py", "train.py"]
    assert runs[2].placement["code"] == {"uploaded": [], "skipped": 2}, "nothing new was sent"
    for rid in (1, 2):
        code_dir = home / "runs" / str(rid) / "code"
        where, word = (code_dir / "ran.txt").read_text().split()
        assert Path(where) == code_dir.resolve() and word == "from-the-upload"
    assert not (proj / "ran.txt").exists(), "the run used the uploaded copy, not the original"
    log = (home / "runs" / "2" / "run.log").read_text()
    assert "sent 0 file(s), 2 unchanged" in log


def test_gpubot_submit_refuses_a_missing_command_or_directory(tmp_path: Path) -> None:
    env = {**os.environ, "GPUBOT_HOME": str(tmp_path / "home")}
    env.pop("DATABASE_URL", None)
    nothing = subprocess.run(
        [GPUBOT, "submit", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert nothing.returncode == 2 and "say what to run" in nothing.stderr
    missing = subprocess.run(
        [GPUBOT, "submit", str(tmp_path / "nope"), "--", "python", "t.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    assert "Traceback" not in missing.stderr + nothing.stderr


# --- git sources: a bare repository in tmp --------------------------------------------------


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_SYSTEM": "/dev/null"}
    out = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


@pytest.fixture
def bare_repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A bare repository with `main` (two commits) and a tag `v1` on the first."""
    work = tmp_path / "work"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    for k, v in (("user.email", "t@example.com"), ("user.name", "t")):
        git("config", k, v, cwd=work)
    (work / "train.py").write_text(
        "import pathlib\npathlib.Path('out.txt').write_text(open('VERSION').read())\n"
    )
    (work / "VERSION").write_text("one")
    git("add", ".", cwd=work)
    git("commit", "-q", "-m", "one", cwd=work)
    first = git("rev-parse", "HEAD", cwd=work)
    git("tag", "v1", cwd=work)
    (work / "VERSION").write_text("two")
    git("commit", "-q", "-am", "two", cwd=work)
    bare = tmp_path / "repo.git"
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    return bare, first, git("rev-parse", "HEAD", cwd=work)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshLab]:
    with running_lab(tmp_path_factory.mktemp("sshd")) as lab:
        yield lab


def test_a_git_source_is_cloned_on_a_real_sshd_host(
    lab: SshLab, bare_repo: tuple[Path, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    bare, first, second = bare_repo
    host = lab.hosts["gpu-a"]
    target = SshTarget(
        host=host.address, port=host.port, user=lab.user, key_path=str(lab.client_key), name="gpu-a"
    )
    url = f"file://{bare}"
    with SshClient(connect_timeout=5, command_timeout=60) as ssh:
        for ref, want in (("main", "two"), ("v1", "one"), (first, "one"), ("", "two")):
            run_dir = str(host.root / "runs" / (ref[:8] or "default"))
            ssh.run(target, f"mkdir -p {run_dir}", timeout=10)
            done = prepare_code(
                ssh,
                target,
                parse_git(f"{url}@{ref}" if ref else url, allow_file=True),
                run_dir,
                home=tmp_path,
            )
            assert done.cwd == f"{run_dir}/code"
            assert ssh.read_file(target, f"{run_dir}/code/VERSION") == want.encode(), ref
            assert (first[:7] if want == "one" else second[:7]) in done.note
        with pytest.raises(SourceError) as err:
            prepare_code(
                ssh,
                target,
                GitSource(url, "no-such-branch"),
                str(host.root / "runs" / "bad"),
                home=tmp_path,
            )
        assert "no-such-branch" in str(err.value)
        with pytest.raises(SourceError, match="no directory /nowhere/at/all"):
            prepare_code(ssh, target, PathSource("/nowhere/at/all"), str(host.root), home=tmp_path)


def test_a_run_from_git_and_one_from_a_host_path_run_in_their_code(
    sqlite_engine: Engine, bare_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    bare, _, _ = bare_repo
    svc, _ = make_service(
        sqlite_engine, [local_host(1)], home=tmp_path / "home", places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    alice = actor(svc, "alice")
    cmd = Run(command=("python", "train.py"), source=f"git:file://{bare}@v1")
    with pytest.raises(UserError, match="only https:// and git@"):
        runs.submit(alice, cmd)
    runs.allow_file_git = True
    rid = runs.submit(alice, cmd).extra["run_id"]
    on_host = tmp_path / "onhost"
    on_host.mkdir()
    (on_host / "train.py").write_text(
        "import pathlib\npathlib.Path('out.txt').write_text('path')\n"
    )
    rid2 = runs.submit(alice, Run(command=("python", "train.py"), source=f"path:{on_host}")).extra[
        "run_id"
    ]
    rid3 = runs.submit(alice, Run(command=("python", "t.py"), source="path:/nowhere/x")).extra[
        "run_id"
    ]
    run_until(
        runs,
        lambda: all(
            state(sqlite_engine, r).state in {"succeeded", "failed"} for r in (rid, rid2, rid3)
        ),
    )
    assert state(sqlite_engine, rid).state == "succeeded"
    assert (tmp_path / "runs" / str(rid) / "code" / "out.txt").read_text() == "one"
    assert state(sqlite_engine, rid2).state == "succeeded"
    assert (on_host / "out.txt").read_text() == "path"
    bad = state(sqlite_engine, rid3)
    assert bad.state == "failed" and "no directory /nowhere/x" in bad.metrics["summary"]["error"]
    with pytest.raises(UserError, match="no staged upload"):
        runs.submit(alice, Run(command=("python", "t.py"), source="staged:gone-0123"))


def test_a_path_that_is_shell_code_runs_nothing_through_the_service_and_worker(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """The reported attack, as typed in Slack, through the real grammar, service, worker
    and local runner: the path is one word wherever it goes. A missing one fails the run
    with a sentence naming it (no shell's stderr); an existing one is where the command
    runs."""
    from bot.faces.dispatch import handle_text

    svc, _ = make_service(
        sqlite_engine, [local_host(1)], home=tmp_path / "home", places=runs_here(tmp_path / "runs")
    )
    runs = svc.runs
    alice = actor(svc, "alice")
    pwned = tmp_path / "pwned"
    missing = f"{tmp_path}/x';touch {pwned};'"
    reply = handle_text(svc, alice, f'/gpu run --path "{missing}" -- echo hi')
    assert not reply.error and "queued" in reply.view.text, reply.view.text
    rid = reply.extra["run_id"]
    weird = tmp_path / f"ok';touch {pwned}2;'$(touch {pwned}3)`touch {pwned}4`"
    weird.mkdir(parents=True)
    script = "import os; open('where.txt', 'w').write(os.getcwd())"
    reply2 = handle_text(svc, alice, f'/gpu run --path "{weird}" -- python -c "{script}"')
    assert not reply2.error, reply2.view.text
    rid2 = reply2.extra["run_id"]
    run_until(
        runs,
        lambda: all(state(sqlite_engine, r).state in {"succeeded", "failed"} for r in (rid, rid2)),
    )
    bad = state(sqlite_engine, rid)
    assert bad.state == "failed"
    assert bad.metrics["summary"]["error"] == (
        f"could not start: could not get the code: there is no directory {missing} on local"
    )
    good = state(sqlite_engine, rid2)
    assert good.state == "succeeded", good.metrics
    assert (weird / "where.txt").read_text() == str(weird)
    assert not list(tmp_path.glob("pwned*")), "no injected command ran"


def test_the_runner_stays_in_the_run_dir_and_the_command_moves_to_its_code() -> None:
    from datetime import UTC, datetime

    from bot.app.runs import runner_command

    placement = {"dir": "/h/runs/7", "status": "/h/runs/7/s.json", "checkpoints": "/h/runs/7/c"}
    run = TrainingRun(
        user_id=1,
        command="python train.py --lr 3e-4",
        source="path:/data/my proj",
        submitted_at=datetime.now(UTC),
    )
    line = runner_command(run, placement, sys.executable)
    assert line.endswith(
        "-- sh -c 'cd \"$0\" && exec \"$@\"' '/data/my proj' python train.py --lr 3e-4"
    )
    run.source = "staged:proj-0123"
    assert 'exec "$@"\' /h/runs/7/code python train.py' in runner_command(
        run, placement, sys.executable
    )
    run.source = ""
    assert runner_command(run, placement, sys.executable).endswith(" -- python train.py --lr 3e-4")


def test_staged_and_git_runs_on_a_static_ssh_host(
    lab: SshLab,
    bare_repo: tuple[Path, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole path over real SSH: upload_dir of the staged copy, a clone on the host,
    the runner started there, and a second upload of the same tree that sends nothing."""
    import time

    from bot.app.config import load_settings
    from bot.app.hosts.remote import PreparedHost
    from bot.faces.runtime import build_runtime

    host = lab.hosts["gpu-b"]
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(lab.client_key))
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", f"gpu-b={lab.user}@{host.address}:{host.port}/1xcpu")
    remote = PreparedHost(root=str(host.root / "gpubot"), python=sys.executable)
    client = SshClient(connect_timeout=5, command_timeout=60)
    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about where a run's code comes from;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    rt = checked(build_runtime(load_settings(), ssh=client, prepare=lambda runner, target: remote))
    runs = rt.service.runs
    runs.allow_file_git = True
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        "import os, pathlib\npathlib.Path('where.txt').write_text(os.getcwd())\n"
    )
    staged = stage(proj, rt.settings.home)
    alice = rt.service.actor("alice")
    bare, _, _ = bare_repo
    ids = [
        runs.submit(
            alice, Run(command=(sys.executable, "train.py"), model="cpu", source=src)
        ).extra["run_id"]
        for src in (staged.source.text(), f"git:file://{bare}@main", staged.source.text())
    ]

    def done() -> bool:
        with Session(rt.engine) as s:
            return all(
                (r := s.get(TrainingRun, i)) is not None and r.state in {"succeeded", "failed"}
                for i in ids
            )

    deadline = time.monotonic() + 150
    while not done():
        assert time.monotonic() < deadline, "the runs did not finish"
        runs.poll()
        runs.dispatch()
        time.sleep(0.3)
    with Session(rt.engine) as s:
        got = [s.get(TrainingRun, i) for i in ids]
    assert [r.state if r else None for r in got] == ["succeeded"] * 3, [
        r.metrics if r else None for r in got
    ]
    runs_dir = host.root / "gpubot" / "runs"
    for rid in (ids[0], ids[2]):
        assert (runs_dir / str(rid) / "code" / "where.txt").read_text() == str(
            runs_dir / str(rid) / "code"
        )
    assert (runs_dir / str(ids[1]) / "code" / "out.txt").read_text() == "two"
    first, again = got[0], got[2]
    assert first is not None and again is not None
    assert first.placement["code"] == {"uploaded": ["train.py"], "skipped": 0}
    assert again.placement["code"] == {"uploaded": [], "skipped": 1}, "sent once over SSH"
    client.close()
    rt.engine.dispose()
