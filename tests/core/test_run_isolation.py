"""A run tries, as an attacker with a Slack account would, to get at the bot's secrets.

The bot's secrets (Slack token and signing secret, AWS keys, a database password) are
in its environment, its database holds a secret row, and a file only the bot may read
sits in a directory everyone can enter. A real run, submitted through the service and
started and polled by the worker's own calls on the real local runner, prints its
environment and tries the /proc entry of a process holding the secrets, the database
and that file; another turns its run.log into a link to the file for `/gpu logs` to
follow. With GPUBOT_RUN_AS none of it yields a secret; in `gpubot shell` (no run
account) the environment is still clean; `gpubot serve` without one refuses runs.
Admin rights come from configuration only, whatever a database row says.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.app.config import load_settings
from bot.app.hosts.runaccount import prepare_run_account
from bot.app.runs import RunService
from bot.domain.commands import Logs, Release, Reserve, Run
from bot.domain.errors import UserError
from bot.faces.dispatch import execute
from bot.faces.runtime import Runtime, build_runtime
from bot.faces.terminal import render
from db.models import Notification, Reservation, TrainingRun, User
from provisioning import shell
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from tests.core.helpers import make_service
from tests.provisioning.conftest import RUN_ACCOUNT
from tests.ssh_hosts import pip_env

SECRETS = {
    "SLACK_BOT_TOKEN": "xoxb-iso-bot-token-60913",
    "SLACK_SIGNING_SECRET": "iso-signing-secret-77120",
    "SLACK_APP_TOKEN": "xapp-iso-app-token-31337",
    "AWS_ACCESS_KEY_ID": "AKIAISOLATIONTEST0001",
    "AWS_SECRET_ACCESS_KEY": "iso-aws-secret-key-48213",
    "PGPASSWORD": "iso-pg-password-90210",
}
DB_SECRET = "iso-db-row-secret-55021"
FILE_SECRET = "iso-file-secret-17761"
ALL_SECRETS = (*SECRETS.values(), DB_SECRET, FILE_SECRET)


def leaked(text: str) -> list[str]:
    return [s for s in ALL_SECRETS if s in text]


@dataclass
class Bot:
    home: Path
    secret_file: Path
    holder_pid: int  # a process whose /proc/PID/environ holds the secrets, as the bot's does


@pytest.fixture
def bot(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bot]:
    # A directory every account may enter: only the modes the bot sets protect its home.
    parent = Path(tempfile.mkdtemp(prefix="gpubot-iso-"))
    parent.chmod(0o755)
    secret_file = parent / "bot-only.txt"
    secret_file.write_text(f"{FILE_SECRET}\n")
    secret_file.chmod(0o600)
    holder = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, **SECRETS}, start_new_session=True
    )
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUBOT_PROVIDER", "local")
    monkeypatch.setenv("GPUBOT_LOCAL_GPUS", "none")
    monkeypatch.setenv("GPUBOT_LOCAL_SLOTS", "2")
    monkeypatch.setenv("GPUBOT_HOME", str(parent / "home"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("GPUBOT_RUN_AS", raising=False)
    monkeypatch.delenv("GPUBOT_CONFIG", raising=False)
    try:
        yield Bot(parent / "home", secret_file, holder.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def as_account(bot: Bot, monkeypatch: pytest.MonkeyPatch, run_account: str) -> Iterator[Runtime]:
    """`gpubot serve`'s runtime with GPUBOT_RUN_AS; its runs in a directory of their own."""
    monkeypatch.setenv("GPUBOT_RUN_AS", run_account)
    rt = build_runtime(load_settings(), runs_as_self=False)
    runs = rt.service.runs
    assert runs is not None and type(runs) is RunService
    home = Path(pwd.getpwnam(RUN_ACCOUNT).pw_dir)
    access = runs.access
    assert access.runs_dir == home / ".gpubot" / "runs"  # type: ignore[attr-defined]
    # Run ids start at 1 in every test's database: each test gets its own directory.
    mine = home / ".gpubot" / f"runs-test-{uuid.uuid4().hex[:12]}"
    access.runs_dir = mine  # type: ignore[attr-defined]
    try:
        yield rt
    finally:
        rt.engine.dispose()
        shutil.rmtree(mine, ignore_errors=True)


def drive(rt: Runtime, run_id: int, timeout: float = 180.0) -> TrainingRun:
    """The worker's part: dispatch and poll until the run has finished."""
    runs = rt.service.runs
    deadline = time.monotonic() + timeout
    while True:
        runs.dispatch()
        runs.poll()
        with Session(rt.engine) as s:
            run = s.get(TrainingRun, run_id)
            assert run is not None
            if run.finished_at is not None:
                return run
        assert time.monotonic() < deadline, f"run {run_id} is still {run.state}"
        time.sleep(0.2)


def submit(rt: Runtime, who: str, script: str) -> int:
    reply = execute(rt.service, rt.service.actor(who), Run(command=("sh", "-c", script)))
    run_id = reply.extra["run_id"]
    assert isinstance(run_id, int)
    return run_id


def logs(rt: Runtime, who: str, run_id: int) -> str:
    return render(execute(rt.service, rt.service.actor(who), Logs(run_id, lines=200)).view)


def dms(rt: Runtime, who: str) -> str:
    with Session(rt.engine) as s:
        rows = s.exec(
            select(Notification).where(Notification.target == who).order_by(col(Notification.id))
        )
        return "\n".join(n.text + repr(n.view) for n in rows)


def probe_script(bot: Bot) -> str:
    """Every way a process has to the secrets; -o and grep keep the log short, so a hit is
    never clipped off the end of `/gpu logs`."""
    wanted = "SLACK_|AWS_|PGPASSWORD|DATABASE_URL|iso-"
    environs = " ".join(
        f"/proc/{pid}/environ" for pid in ("$PPID", str(bot.holder_pid), str(os.getpid()))
    )
    return (
        "echo \"whoami=$(id -un)\"; env | grep -E 'USER=|HOME='; "
        f"env | grep -E '{wanted}'; "
        f"for f in {environs}; do tr '\\0' '\\n' < \"$f\" | grep -E '{wanted}'; done; "
        f"grep -aoE 'iso-[a-z-]+-[0-9]+' {bot.home}/gpubot.db; ls {bot.home}; "
        f"cat {bot.secret_file}; grep -raoE 'iso-[a-z-]+-[0-9]+' {bot.home}; "
        "echo finished-probing"
    )


def test_a_run_as_the_run_account_reaches_no_secret(as_account: Runtime, bot: Bot) -> None:
    rt = as_account
    assert stat.S_IMODE(bot.home.stat().st_mode) == 0o700
    assert stat.S_IMODE((bot.home / "gpubot.db").stat().st_mode) == 0o600
    rt.service.actor("alice", DB_SECRET)  # the secret row is now in the database file
    run_id = submit(rt, "alice", probe_script(bot))
    run = drive(rt, run_id)
    text = logs(rt, "alice", run_id)
    assert "finished-probing" in text, text
    assert f"whoami={RUN_ACCOUNT}" in text
    assert f"USER={RUN_ACCOUNT}" in text
    assert "Permission denied" in text
    assert leaked(text) == []
    assert leaked(dms(rt, "alice")) == []
    # Its directory is in the run account's home, not under $GPUBOT_HOME.
    assert run.placement["dir"].startswith(pwd.getpwnam(RUN_ACCOUNT).pw_dir + "/")


def test_a_run_log_linked_to_the_bots_file_is_not_followed_for_it(
    as_account: Runtime, bot: Bot
) -> None:
    rt = as_account
    run_id = submit(rt, "alice", f"ln -sf {bot.secret_file} run.log; echo replaced")
    drive(rt, run_id)
    with Session(rt.engine) as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        log_path = Path(run.placement["log"])
    assert log_path.is_symlink()  # the link is there, and the bot could read its target
    assert FILE_SECRET in bot.secret_file.read_text()
    text = logs(rt, "alice", run_id)
    assert leaked(text) == []
    assert leaked(dms(rt, "alice")) == []


def test_in_shell_mode_a_run_runs_as_the_bot_with_a_clean_environment(bot: Bot) -> None:
    rt = build_runtime(load_settings())  # `gpubot shell`: no run account
    try:
        runs = rt.service.runs
        assert runs is not None and type(runs) is RunService
        run_id = submit(rt, "me", "env; echo finished-probing")
        drive(rt, run_id)
        text = logs(rt, "me", run_id)
        assert "finished-probing" in text
        assert "PATH=" in text
        assert leaked(text) == []
        assert leaked(dms(rt, "me")) == []
    finally:
        rt.engine.dispose()


def test_serve_without_a_run_account_refuses_runs_and_keeps_reservations(bot: Bot) -> None:
    rt = build_runtime(load_settings(), runs_as_self=False)
    try:
        alice = rt.service.actor("alice")
        with pytest.raises(UserError) as refused:
            execute(rt.service, alice, Run(command=("env",)))
        assert "GPUBOT_RUN_AS" in refused.value.text
        assert "Usage: /gpu run" in refused.value.text
        with Session(rt.engine) as s:
            assert s.exec(select(TrainingRun)).first() is None
        reply = execute(rt.service, alice, Reserve(1, "cpu"))
        assert "local" in reply.view.text
    finally:
        rt.engine.dispose()


def test_a_role_admin_row_makes_nobody_an_admin(engine: Engine) -> None:
    from tests.core.test_runs import local_host

    svc, _ = make_service(engine, [local_host(2)], admins=("root",))
    svc.reserve(svc.actor("alice"), Reserve(1, "cpu"))
    svc.actor("mallory")
    with Session(engine) as s:
        res_id = s.exec(select(Reservation.id)).one()
        row = s.exec(select(User).where(User.key == "mallory")).one()
        row.role = "admin"  # what a run holding the database password once wrote
        s.add(row)
        s.commit()
    mallory = svc.actor("mallory")
    assert not mallory.admin
    with pytest.raises(UserError, match=r"not yours|only"):
        svc.release(mallory, Release(res_id))
    # Configuration still makes admins, and an admin may release it.
    root = svc.actor("root")
    assert root.admin
    svc.release(root, Release(res_id))


def test_a_stale_lent_path_is_lent_again_when_the_run_account_is_prepared(
    run_account: str,
) -> None:
    """The run account's staged venv borrows the bot's site-packages through a .pth; a
    bot venv that moved since (another checkout, a rebuild) must not leave it without
    torch for good because the bootstrap marker remembers torch from the first time."""
    runner = LocalRunner(run_as=run_account)
    first = prepare_run_account(runner)
    if first.python == sys.executable:
        pytest.skip("the run account runs the bot's own interpreter: nothing is lent")
    ask = shell.join([first.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    purelib = runner.run(LOCAL_TARGET, ask, timeout=60).stdout.strip()
    pth = f"{purelib}/_gpubot_bot_packages.pth"
    runner.write_file(LOCAL_TARGET, pth, b"/nonexistent/gpubot/site-packages\n")
    again = prepare_run_account(runner)
    probe = shell.join([again.python, "-c", "import torch; print(torch.__version__)"])
    result = runner.run(LOCAL_TARGET, probe, timeout=120)
    assert result.ok, result.stderr
    assert "/nonexistent/" not in (runner.read_file(LOCAL_TARGET, pth) or b"").decode()


def test_a_run_account_that_cannot_read_the_bot_venv_gets_torch_of_its_own(
    run_account: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout under a private directory (`mktemp -d`, many homes): the run account can
    read neither the bot's interpreter nor its site-packages. Its environment then gets the
    whole train extra, torch included, from where the bot's pip installs (here the suite's
    wheel cache), instead of runs failing later with `No module named 'torch'`."""
    closed = tmp_path / "closed" / "site-packages"
    closed.mkdir(parents=True)
    (tmp_path / "closed").chmod(0o700)  # what the run account cannot enter
    monkeypatch.setattr("bot.app.hosts.runaccount.site.getsitepackages", lambda: [str(closed)])
    for name, value in pip_env().items():
        monkeypatch.setenv(name, value)
    runner = LocalRunner(run_as=run_account)
    prepared = prepare_run_account(runner)
    if prepared.python == sys.executable:
        pytest.skip("the run account runs the bot's own interpreter here")
    where = shell.join([prepared.python, "-c", "import torch; print(torch.__file__)"])
    result = runner.run(LOCAL_TARGET, where, timeout=300)
    assert result.ok, result.stderr
    assert result.stdout.strip().startswith(runner.account.home), result.stdout
