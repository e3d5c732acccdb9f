"""`gpubot doctor` against the real things: the fake Slack Web API over a socket, moto,
real sshd hosts, SQLite files and this machine's own GPU probe."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from pydantic import SecretStr
from typer.testing import CliRunner

from bot import providers
from bot.app.config import ConfigError, Settings, load_settings
from bot.faces.doctor import (
    Check,
    Note,
    check_database,
    check_slack,
    doctor,
    render,
    run_checks,
)
from bot.providers.aws import AwsProvider, ec2_settings_from_env
from bot.providers.base import Probes
from bot.providers.local import check_gpus, run_account_interpreter
from bot.providers.ssh import check_ssh, ssh_targets_from_env
from db.migrate import head_revision, upgrade
from db.session import make_engine
from provisioning.ssh import SshTarget
from tests.fakes.slack_api import FakeSlack
from tests.provisioning.conftest import target_for
from tests.provisioning_aws.conftest import (  # noqa: F401  (fixtures)
    _AWS_VARS,
    AMI_PARAMETER,
    REGION,
    AwsLab,
    aws_env,
    inprocess_lab,
)
from tests.ssh_hosts import SshLab


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _one(checks: list[Check], name: str) -> Check:
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, checks
    return found[0]


def _slack(fake: FakeSlack, **values: str) -> Settings:
    return Settings(slack_api_url=fake.url, **values)  # type: ignore[arg-type]


# --- Slack -----------------------------------------------------------------------------


def test_a_working_bot_token_names_the_bot_and_workspace(fake_slack: FakeSlack) -> None:
    settings = load_settings(
        {
            "SLACK_API_URL": fake_slack.url,
            "SLACK_BOT_TOKEN": fake_slack.bot_token,
            "SLACK_SIGNING_SECRET": "s3cret-signing",
        }
    )
    checks = check_slack(settings)
    bot = _one(checks, "Slack")
    assert bot.ok, bot
    assert "@gpubot" in bot.detail and fake_slack.team_id in bot.detail
    assert len(fake_slack.calls_to("auth.test")) == 1
    http_mode = _one(checks, "Slack HTTP mode")
    assert http_mode.ok and "/slack/events" in http_mode.detail
    assert all(fake_slack.bot_token not in render(c) for c in checks)


def test_no_bot_token_says_where_to_get_one(fake_slack: FakeSlack) -> None:
    bot = _one(check_slack(_slack(fake_slack)), "Slack")
    assert not bot.ok
    assert "SLACK_BOT_TOKEN is not set" in bot.detail
    assert "OAuth & Permissions" in bot.fix and "xoxb-" in bot.fix
    assert fake_slack.calls_to("auth.test") == []


def test_a_user_token_in_place_of_the_bot_token_is_flagged(fake_slack: FakeSlack) -> None:
    bot = _one(check_slack(_slack(fake_slack, slack_bot_token=fake_slack.user_token)), "Slack")
    assert not bot.ok
    assert "user token" in bot.detail and "xoxp-" in bot.detail
    assert fake_slack.user_token not in render(bot)


def test_a_token_slack_rejects_is_said_plainly(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next("auth.test", kind="error", error="invalid_auth")
    bot = _one(check_slack(_slack(fake_slack, slack_bot_token=fake_slack.bot_token)), "Slack")
    assert not bot.ok
    assert "Slack does not accept SLACK_BOT_TOKEN" in bot.detail


def test_slack_unreachable_is_a_network_sentence() -> None:
    url = f"http://127.0.0.1:{_dead_port()}/api/"
    settings = Settings(
        slack_api_url=url,
        slack_bot_token=SecretStr("xoxb-1-2-abc"),
        slack_signing_secret=SecretStr("x" * 8),
    )
    bot = _one(check_slack(settings), "Slack")
    assert not bot.ok
    assert f"cannot reach the Slack API at {url}" in bot.detail
    assert "SLACK_API_URL" in bot.fix


def test_socket_mode_with_a_working_app_token(fake_slack: FakeSlack) -> None:
    settings = _slack(
        fake_slack, slack_bot_token=fake_slack.bot_token, slack_app_token=fake_slack.app_token
    )
    checks = check_slack(settings)
    socket_mode = _one(checks, "Slack Socket Mode")
    assert socket_mode.ok, socket_mode
    assert len(fake_slack.calls_to("apps.connections.open")) == 1
    assert all(fake_slack.app_token not in render(c) for c in checks)


def test_socket_mode_with_a_bot_token_as_app_token_is_flagged(fake_slack: FakeSlack) -> None:
    settings = _slack(
        fake_slack, slack_bot_token=fake_slack.bot_token, slack_app_token=fake_slack.bot_token
    )
    socket_mode = _one(check_slack(settings), "Slack Socket Mode")
    assert not socket_mode.ok
    assert "not an app-level token" in socket_mode.detail and "xapp-" in socket_mode.fix
    assert fake_slack.calls_to("apps.connections.open") == []


def test_socket_mode_with_an_app_token_slack_refuses(fake_slack: FakeSlack) -> None:
    fake_slack.fail_next("apps.connections.open", kind="error", error="invalid_auth")
    settings = _slack(
        fake_slack, slack_bot_token=fake_slack.bot_token, slack_app_token=fake_slack.app_token
    )
    socket_mode = _one(check_slack(settings), "Slack Socket Mode")
    assert not socket_mode.ok
    assert "Slack does not accept SLACK_APP_TOKEN" in socket_mode.detail


def test_neither_app_token_nor_signing_secret_says_http_mode_needs_one(
    fake_slack: FakeSlack,
) -> None:
    inbound = _one(
        check_slack(_slack(fake_slack, slack_bot_token=fake_slack.bot_token)), "Slack HTTP mode"
    )
    assert not inbound.ok
    assert "HTTP mode needs SLACK_SIGNING_SECRET" in inbound.detail
    assert "SLACK_APP_TOKEN" in inbound.fix


# --- database --------------------------------------------------------------------------


def test_a_database_never_migrated_says_to_run_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    engine = make_engine(url)
    with engine.connect():
        pass  # creates the empty file
    engine.dispose()
    db = _one(check_database(Settings(database_url=SecretStr(url))), "Database")
    assert not db.ok
    assert "no gpubot schema" in db.detail
    assert "run `gpubot db upgrade`" in db.fix.lower()


def test_a_missing_sqlite_file_is_not_created_by_the_doctor(tmp_path: Path) -> None:
    home = tmp_path / "home"
    db = _one(check_database(Settings(home=home)), "Database")
    # A fresh home is not a fault: a note, since the first command creates the database.
    assert isinstance(db, Note) and "first gpubot command creates it" in db.detail
    assert "gpubot db upgrade" in db.fix
    assert not home.exists()


def test_a_database_at_head_is_green(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gpubot.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    db = _one(check_database(Settings(database_url=SecretStr(url))), "Database")
    assert db.ok, db
    assert str(head_revision()) in db.detail


def test_a_database_password_is_never_printed() -> None:
    url = f"postgresql://gpubot:hunter2pw@127.0.0.1:{_dead_port()}/x"
    settings = Settings(database_url=SecretStr(url))
    checks = run_checks(settings, env={}, nvml_probe=lambda: "{}")
    db = _one(checks, "Database")
    assert not db.ok and "cannot open" in db.detail
    assert "***" in db.detail
    assert all("hunter2pw" not in render(c) for c in checks)


# --- AWS -------------------------------------------------------------------------------


def check_aws_section(settings: Settings, env: dict[str, str]) -> list[Check]:
    """The doctor's lines of every provider, for these settings and environment."""
    return providers.checks(settings, env, Probes(nvml=lambda: "{}"))


def test_aws_not_used_with_the_local_provider() -> None:
    checks = check_aws_section(Settings(provider="local"), {"AWS_ACCESS_KEY_ID": "AKIA..."})
    assert _one(checks, "AWS") == Check("AWS", True, "not used (GPUBOT_PROVIDER=local)")
    assert not any("EC2" in c.name for c in checks)


def test_ec2_settings_from_env_maps_every_variable() -> None:
    settings = ec2_settings_from_env(
        {
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_REGION": "eu-central-1",
            "GPUBOT_AWS_SUBNETS": "subnet-a, subnet-b,",
            "GPUBOT_AWS_SECURITY_GROUPS": "sg-1",
            "GPUBOT_AWS_KEY_NAME": "bot-key",
            "GPUBOT_AWS_AMI": "ami-123",
        }
    )
    assert settings.region == "eu-central-1"
    assert settings.subnet_ids == ("subnet-a", "subnet-b")
    assert settings.security_group_ids == ("sg-1",)
    assert (settings.key_name, settings.ami_id) == ("bot-key", "ami-123")


def test_the_metadata_url_defaults_to_ec2s_and_can_be_pointed_elsewhere() -> None:
    """The host agent's spot watch asks it: IPv6-only subnets (and the journey test's
    loopback fake) need another address; a value that is no URL is refused by name."""
    base = {"GPUBOT_AWS_REGION": "us-east-1", "GPUBOT_AWS_SUBNETS": "subnet-a"}
    assert ec2_settings_from_env(base).metadata_url == "http://169.254.169.254"
    v6 = ec2_settings_from_env({**base, "GPUBOT_AWS_METADATA_URL": "http://[fd00:ec2::254]"})
    assert v6.metadata_url == "http://[fd00:ec2::254]"
    with pytest.raises(ConfigError, match="metadata_url must be an http:// URL"):
        ec2_settings_from_env({**base, "GPUBOT_AWS_METADATA_URL": "169.254.169.254"})


def test_aws_without_subnets_names_the_variable() -> None:
    checks = AwsProvider.checks(
        Settings(provider="aws"), {"GPUBOT_AWS_REGION": "us-east-1"}, Probes()
    )
    assert len(checks) == 1 and not checks[0].ok
    assert "GPUBOT_AWS_SUBNETS" in checks[0].detail


def _lab_env(lab: AwsLab, **extra: str) -> dict[str, str]:
    env = {
        "GPUBOT_AWS_REGION": REGION,
        "GPUBOT_AWS_SUBNETS": ",".join(lab.subnet_ids),
        "GPUBOT_AWS_SECURITY_GROUPS": lab.security_group_id,
        "GPUBOT_AWS_KEY_NAME": lab.key_name,
        "GPUBOT_AWS_AMI_PARAMETER": AMI_PARAMETER,
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v}


def test_aws_on_moto_is_green(inprocess_lab: AwsLab) -> None:  # noqa: F811
    checks = check_aws_section(Settings(provider="aws"), _lab_env(inprocess_lab))
    assert checks and all(c.ok for c in checks), checks
    assert inprocess_lab.ami_id in _one(checks, "AMI").detail


def test_aws_gpubot_variables_turn_the_checks_on(inprocess_lab: AwsLab) -> None:  # noqa: F811
    checks = check_aws_section(
        Settings(provider="local"), _lab_env(inprocess_lab, GPUBOT_AWS_KEY_NAME="")
    )
    key = _one(checks, "EC2 key pair")
    assert not key.ok
    assert "GPUBOT_AWS_KEY_NAME" in key.fix


def test_aws_without_credentials_says_so_plainly(
    aws_env: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # Should anything get past the missing credentials, it dials a dead loopback port.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_dead_port()}")
    env = {"GPUBOT_AWS_REGION": REGION, "GPUBOT_AWS_SUBNETS": "subnet-0abc"}
    checks = check_aws_section(Settings(provider="aws"), env)
    creds = _one(checks, "AWS credentials")
    assert not creds.ok
    assert "no AWS credentials found" in creds.detail
    assert "AWS_ACCESS_KEY_ID" in creds.fix
    assert not _one(checks, "EC2 key pair").ok


# --- SSH -------------------------------------------------------------------------------


def test_ssh_to_a_real_host_is_green(stranger_lab: SshLab) -> None:
    """A host that is its own account (only the system's tools, nothing of the bot's):
    what the doctor checks is the login, which needs nothing on the host."""
    target = target_for(stranger_lab, "gpu-a")
    assert target.user != stranger_lab.user
    checks = check_ssh([target])
    assert len(checks) == 1 and checks[0].ok, checks
    assert checks[0].name == "SSH gpu-a"


def test_ssh_to_a_port_nobody_listens_on_is_plain_words() -> None:
    target = SshTarget(host="127.0.0.1", port=_dead_port(), user="gpubot", name="box")
    (check,) = check_ssh([target], timeout_s=2)
    assert not check.ok
    assert "cannot reach" in check.detail and "connection refused" in check.detail
    assert f"port {target.port}" in check.fix and "gpubot@127.0.0.1" in check.fix


def test_ssh_with_a_key_file_that_is_missing(tmp_path: Path) -> None:
    target = SshTarget(host="127.0.0.1", port=_dead_port(), key_path=str(tmp_path / "nope"))
    (check,) = check_ssh([target])
    assert not check.ok and "does not exist" in check.detail and "GPUBOT_SSH_KEY" in check.fix


def test_ssh_provider_without_hosts_fails() -> None:
    (check,) = check_ssh([], required=True)
    assert not check.ok and "GPUBOT_SSH_HOSTS" in check.fix


def test_ssh_targets_from_env() -> None:
    targets = ssh_targets_from_env(
        {
            "GPUBOT_SSH_HOSTS": "gpu1=ubuntu@gpu1.lab.example:2200, box2",
            "GPUBOT_SSH_USER": "ops",
            "GPUBOT_SSH_KEY": "/keys/bot",
        }
    )
    assert targets == (
        SshTarget(
            host="gpu1.lab.example", port=2200, user="ubuntu", key_path="/keys/bot", name="gpu1"
        ),
        SshTarget(host="box2", port=22, user="ops", key_path="/keys/bot", name=""),
    )


# --- this machine's GPUs ---------------------------------------------------------------

_A100 = {
    "schema_version": 1,
    "taken_at": "2026-01-01T00:00:00+00:00",
    "source": "nvml",
    "error": None,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-1",
            "name": "NVIDIA A100-SXM4-40GB",
            "util_pct": 3,
            "mem_used_mb": 1,
            "mem_total_mb": 40960,
            "temp_c": 30,
            "power_w": 50.0,
            "power_limit_w": 400.0,
            "processes": [],
        }
    ],
}


def test_this_machines_gpus_through_the_real_probe() -> None:
    (check,) = check_gpus(Settings())
    assert check.ok, check
    if isinstance(check, Note):
        # A machine without a driver: worth saying, never a failure.
        assert "no NVIDIA driver" in check.detail and "CPU slots" in check.detail
    else:
        assert "×" in check.detail


def test_a_recorded_gpu_snapshot_is_summarized() -> None:
    (check,) = check_gpus(Settings(), lambda: json.dumps(_A100))
    assert check.ok and not isinstance(check, Note)
    assert check.detail == "1 × NVIDIA A100-SXM4-40GB (via nvml)"


def test_an_unreadable_probe_answer_is_a_failure() -> None:
    (check,) = check_gpus(Settings(), lambda: "Traceback (most recent call last): ...")
    assert not check.ok and "could not be read" in check.detail


def test_an_unexpected_exception_becomes_that_checks_failure(tmp_path: Path) -> None:
    def broken() -> str:
        raise ValueError("boom")

    checks = run_checks(Settings(home=tmp_path), env={}, nvml_probe=broken)
    gpus = _one(checks, "This machine's GPUs")
    assert not gpus.ok and "ValueError" in gpus.detail
    assert _one(checks, "AWS").ok  # the other sections still ran


# --- the command -----------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[typer.Typer, Path]]:
    for var in (
        "GPUBOT_CONFIG",
        "DATABASE_URL",
        "SLACK_BOT_TOKEN",
        "SLACK_APP_TOKEN",
        "SLACK_SIGNING_SECRET",
        "SLACK_API_URL",
        "GPUBOT_PROVIDER",
        "GPUBOT_SSH_HOSTS",
        *(
            f"GPUBOT_AWS_{v}"
            for v in ("REGION", "SUBNETS", "SECURITY_GROUPS", "KEY_NAME", "AMI", "AMI_PARAMETER")
        ),
        *_AWS_VARS,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path / "home"))
    app = typer.Typer()
    app.command()(doctor)
    yield app, tmp_path / "home"


def test_the_command_exits_1_with_a_cross_and_never_prints_the_token(
    cli: tuple[typer.Typer, Path],
) -> None:
    app, _home = cli
    token = "xoxp-1234-5678-verysecretusertoken"
    result = CliRunner().invoke(app, [], env={"SLACK_BOT_TOKEN": token})
    assert result.exit_code == 1, result.output
    assert "✗ Slack: SLACK_BOT_TOKEN is a user token" in result.output
    assert "✓ AWS: not used (GPUBOT_PROVIDER=local)" in result.output
    assert token not in result.output
    assert "Traceback" not in result.output


def test_the_command_is_green_when_everything_required_works(
    cli: tuple[typer.Typer, Path], fake_slack: FakeSlack
) -> None:
    app, home = cli
    engine = make_engine(f"sqlite:///{home / 'gpubot.db'}")
    upgrade(engine)
    engine.dispose()
    env = {
        "SLACK_API_URL": fake_slack.url,
        "SLACK_BOT_TOKEN": fake_slack.bot_token,
        "SLACK_SIGNING_SECRET": "signing-secret-value",
    }
    result = CliRunner().invoke(app, ["--json"], env=env)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {r["name"] for r in rows} >= {"Config", "Database", "Slack", "AWS", "SSH"}
    assert all(r["ok"] for r in rows)
    assert {r["level"] for r in rows} <= {"required", "note"}
    assert "signing-secret-value" not in result.output
    assert fake_slack.bot_token not in result.output


def test_a_bad_setting_is_a_config_failure_line(cli: tuple[typer.Typer, Path]) -> None:
    app, _home = cli
    result = CliRunner().invoke(app, [], env={"GPUBOT_PROVIDER": "azure"})
    assert result.exit_code == 1
    assert result.output.startswith(
        "✗ Config: GPUBOT_PROVIDER=azure: azure is not one of local, ssh, aws"
    )


def test_the_run_environment_note_names_the_directories_to_open(tmp_path: Path) -> None:
    """What keeps the run account from the bot's virtualenv is named, with the exact fix."""
    from bot.app.hosts.runaccount import closed_dirs

    private = tmp_path / "private"
    venv = private / "checkout" / ".venv"
    venv.mkdir(parents=True)
    private.chmod(0o700)
    assert private in closed_dirs(venv)
    assert venv not in closed_dirs(venv) and (private / "checkout") not in closed_dirs(venv)
    private.chmod(0o755)
    assert private not in closed_dirs(venv)


def test_doctor_says_what_the_run_account_will_run_with(run_account: str) -> None:

    said = run_account_interpreter(run_account)
    if said is None:
        return  # it can use the bot's own interpreter here: nothing to say
    assert isinstance(said, Note) and said.ok
    assert "cannot use the bot's interpreter" in said.detail
    assert "installs an environment of its own" in said.detail
    assert said.fix is not None and "chmod o+x" in said.fix
