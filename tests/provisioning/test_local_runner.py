"""What keeps a run away from the bot's secrets on this machine, held as a contract.

The environment tests take `bench`, so the real SSH client, the LocalRunner as the bot's
own user and the LocalRunner as the run account (GPUBOT_RUN_AS) all give a command the
same thing: none of the bot's variables. The others are about what only the run account
adds: the bot's /proc entry and files are out of reach, and a link a run plants in its
own directory is read (or replaced) with the run's rights, never the bot's.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from provisioning.local_runner import LOCAL_TARGET, Account, LocalRunner, run_environment
from provisioning.ssh import SshError
from tests.provisioning.conftest import RUN_ACCOUNT, Bench

SECRETS = {
    "SLACK_BOT_TOKEN": "xoxb-secret-bot-token-4417",
    "SLACK_SIGNING_SECRET": "signing-secret-9932",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-key-5521",
    "DATABASE_URL": "postgresql://gpubot:db-password-7781@127.0.0.1/gpubot",
    "GPUBOT_SOMETHING": "gpubot-setting-3310",
}


@pytest.fixture
def secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return SECRETS


def _leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text or name in text]


def test_a_command_sees_none_of_the_bots_variables(
    bench: Bench, secrets_in_env: dict[str, str]
) -> None:
    result = bench.runner.run(bench.target, "env", timeout=20, env={"GIVEN": "explicitly"})
    assert result.ok, result.stderr
    assert _leaks(result.stdout) == []
    assert "GIVEN=explicitly" in result.stdout.splitlines()
    assert any(line.startswith("PATH=") for line in result.stdout.splitlines())


def test_a_detached_process_sees_none_of_the_bots_variables(
    bench: Bench, secrets_in_env: dict[str, str]
) -> None:
    bench.start("env; echo done", env={"CUDA_VISIBLE_DEVICES": "0"})
    log = bench.path("out.log")
    text = ""
    for _ in range(200):
        text = (bench.runner.read_file(bench.target, log) or b"").decode()
        if "done" in text:
            break
        import time

        time.sleep(0.05)
    assert "done" in text
    assert _leaks(text) == []
    assert "CUDA_VISIBLE_DEVICES=0" in text.splitlines()


def test_the_environment_is_the_allowlist_and_the_account() -> None:
    account = Account("alice", 1234, 1234, "/home/alice", "/bin/sh")
    env = run_environment(
        account,
        {
            **SECRETS,
            "PATH": "/usr/bin",
            "LC_ALL": "C.UTF-8",
            "TZ": "Europe/Berlin",
            "HOME": "/root",
            "USER": "root",
            "PYTHONPATH": "/srv/bot",
            "LD_PRELOAD": "/tmp/x.so",
        },
    )
    assert env == {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "TZ": "Europe/Berlin",
        "HOME": "/home/alice",
        "USER": "alice",
        "LOGNAME": "alice",
        "SHELL": "/bin/sh",
    }


# --- as the run account ----------------------------------------------------------------


@pytest.fixture
def as_account(run_account: str) -> LocalRunner:
    return LocalRunner(command_timeout=20, run_as=run_account)


@pytest.fixture
def run_dir(as_account: LocalRunner) -> str:
    made = as_account.run(LOCAL_TARGET, 'mktemp -d "$HOME/gpubot-iso.XXXXXX"', timeout=20)
    assert made.ok, made.stderr
    return made.stdout.strip()


@pytest.fixture
def bot_secret_file(tmp_path: Path) -> Path:
    """A file only the bot may read, as its database is."""
    path = tmp_path / "gpubot.db"
    path.write_text("the database holds " + SECRETS["DATABASE_URL"])
    path.chmod(0o600)
    return path


def test_commands_run_as_the_account_with_its_home(as_account: LocalRunner) -> None:
    out = as_account.run(LOCAL_TARGET, 'id -un; printf "%s\\n" "$HOME"; pwd', timeout=20)
    home = pwd.getpwnam(RUN_ACCOUNT).pw_dir
    assert out.stdout.split() == [RUN_ACCOUNT, home, home]
    groups = as_account.run(LOCAL_TARGET, "id -G", timeout=20).stdout.split()
    # No supplementary group of the bot's (root's) came along.
    assert groups == [str(pwd.getpwnam(RUN_ACCOUNT).pw_gid)]


def test_the_bots_process_environment_and_files_are_out_of_reach(
    as_account: LocalRunner, secrets_in_env: dict[str, str], bot_secret_file: Path
) -> None:
    # This test process stands for the bot: the secrets are in its environment now, and
    # the kernel's copy of it is what /proc/PID/environ shows (set them at exec time).
    tries = (
        f"cat /proc/{os.getpid()}/environ; "
        f"tr '\\0' '\\n' < /proc/{os.getpid()}/environ; "
        f"cat {bot_secret_file}; cat /proc/$PPID/environ; "
        f"grep -r db-password {bot_secret_file.parent} 2>&1"
    )
    result = as_account.run(LOCAL_TARGET, tries, timeout=20)
    assert _leaks(result.stdout + result.stderr) == []
    assert "Permission denied" in result.stderr


def test_a_link_to_the_bots_file_is_read_with_the_runs_rights(
    as_account: LocalRunner, run_dir: str, bot_secret_file: Path
) -> None:
    for name in ("run.log", "status.json"):
        link = f"{run_dir}/{name}"
        assert as_account.run(LOCAL_TARGET, f"ln -s {bot_secret_file} {link}", timeout=20).ok
        # The account cannot even see the file behind the link: it reads as missing (or
        # is refused), never as the bot's bytes.
        for limit in (None, 64):
            try:
                got = as_account.read_file(LOCAL_TARGET, link, max_bytes=limit)
            except SshError as exc:
                assert _leaks(str(exc)) == []
                got = None
            assert got is None
        assert _leaks(as_account.tail(LOCAL_TARGET, link, 50)) == []


def test_a_write_onto_a_planted_link_replaces_the_link(
    as_account: LocalRunner, run_dir: str, bot_secret_file: Path, tmp_path: Path
) -> None:
    before = bot_secret_file.read_text()
    link = f"{run_dir}/lease.json"
    assert as_account.run(LOCAL_TARGET, f"ln -s {bot_secret_file} {link}", timeout=20).ok
    as_account.write_file(LOCAL_TARGET, link, b"new")
    assert bot_secret_file.read_text() == before
    assert not os.path.islink(link) and Path(link).read_bytes() == b"new"
    # A part file planted as a link is removed, not written through.
    part = f"{run_dir}/.put.bin.gpubot-part"
    assert as_account.run(LOCAL_TARGET, f"ln -s {bot_secret_file} {part}", timeout=20).ok
    source = tmp_path / "put.bin"
    source.write_bytes(b"checkpoint")
    as_account.put_file(LOCAL_TARGET, source, f"{run_dir}/put.bin")
    assert bot_secret_file.read_text() == before
    assert Path(f"{run_dir}/put.bin").read_bytes() == b"checkpoint"
    assert Path(f"{run_dir}/put.bin").stat().st_uid == pwd.getpwnam(RUN_ACCOUNT).pw_uid


def test_an_upload_over_planted_links_does_not_write_through_them(
    as_account: LocalRunner, run_dir: str, bot_secret_file: Path, tmp_path: Path
) -> None:
    before = bot_secret_file.read_text()
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "train.py").write_text("print('hi')\n")
    (code / "pkg" / "m.py").write_text("x = 1\n")
    dest = f"{run_dir}/code"
    assert as_account.run(
        LOCAL_TARGET, f"mkdir -p {dest} && ln -s {bot_secret_file} {dest}/train.py", timeout=20
    ).ok
    report = as_account.upload_dir(LOCAL_TARGET, code, dest)
    assert sorted(report.uploaded) == ["pkg/m.py", "train.py"]
    assert bot_secret_file.read_text() == before
    assert Path(f"{dest}/train.py").read_text() == "print('hi')\n"
    assert not os.path.islink(f"{dest}/train.py")
