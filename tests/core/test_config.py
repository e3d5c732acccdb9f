"""Settings: defaults, TOML, environment on top, plain errors, secrets masked."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr

from bot.app.config import ConfigError, Settings, load_settings


def test_defaults_are_the_embedded_bot() -> None:
    s = load_settings({})
    assert s.provider == "local" and s.local_slots == 1
    assert s.sqlalchemy_url == "sqlite:///.gpubot/gpubot.db"
    assert s.default_duration == timedelta(hours=2) and s.expiry_warning == timedelta(minutes=10)


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text('admins = ["U1", "@root"]\ndefault_duration = "4h"\nchannel = "#ml-gpus"\n')
    s = load_settings({"GPUBOT_CONFIG": str(cfg), "GPUBOT_DEFAULT_DURATION": "1h"})
    assert s.admins == ("U1", "root") and s.channel == "ml-gpus"
    assert s.default_duration == timedelta(hours=1)
    assert s.is_admin("root") and not s.is_admin("alice")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUBOT_PROVIDER": "two words"}, "GPUBOT_PROVIDER"),
        ({"GPUBOT_LOCAL_SLOTS": "many"}, "whole number"),
        ({"GPUBOT_DEFAULT_DURATION": "soon"}, "duration like 2h"),
        ({"GPUBOT_CONFIG": "/nonexistent/gpubot.toml"}, "does not exist"),
    ],
)
def test_bad_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env)


def test_secrets_never_show_in_repr_and_never_come_from_the_file(tmp_path: Path) -> None:
    s = load_settings({"SLACK_BOT_TOKEN": "xoxb-secret-value", "SLACK_SIGNING_SECRET": "shh"})
    assert "xoxb-secret-value" not in repr(s) and "shh" not in repr(s)
    assert "slack_bot_token='<set>'" in repr(s)
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text('slack_bot_token = "xoxb-in-a-file"\n')
    with pytest.raises(ConfigError, match="secret"):
        load_settings({"GPUBOT_CONFIG": str(cfg)})


# Every variable the bot reads, a value a person would type, and what it becomes.
ENVIRONMENT = [
    ("GPUBOT_HOME", "/srv/gpubot", "home", Path("/srv/gpubot")),
    ("DATABASE_URL", "postgresql://db/gpubot", "sqlalchemy_url", "postgresql://db/gpubot"),
    ("GPUBOT_PROVIDER", "SSH", "provider", "ssh"),
    ("GPUBOT_LOCAL_SLOTS", "3", "local_slots", 3),
    ("GPUBOT_LOCAL_GPUS", "none", "local_gpus", "none"),
    ("GPUBOT_RUN_AS", "gpubot-run", "run_as", "gpubot-run"),
    ("GPUBOT_DEFAULT_GPU", "A100", "default_gpu", "A100"),
    ("GPUBOT_DEFAULT_DURATION", "90m", "default_duration", timedelta(minutes=90)),
    ("GPUBOT_MAX_DURATION", "1d", "max_duration", timedelta(days=1)),
    ("GPUBOT_EXPIRY_WARNING", "5m", "expiry_warning", timedelta(minutes=5)),
    ("GPUBOT_ADMINS", "U1, @root", "admins", ("U1", "root")),
    ("GPUBOT_RUN_USERS", "@bob", "run_users", ("bob",)),
    ("GPUBOT_RUN_GROUPS", "S0GPUTEAM", "run_groups", ("S0GPUTEAM",)),
    ("GPUBOT_RUN_CHANNELS", "C0GPU0001", "run_channels", ("C0GPU0001",)),
    ("GPUBOT_SHARED_LOGS", "on", "shared_logs", True),
    ("GPUBOT_CHANNEL", "#ml", "channel", "ml"),
    ("GPUBOT_TICK_SECONDS", "2", "tick_seconds", 2.0),
    ("GPUBOT_STATUS_CACHE_SECONDS", "0", "status_cache_s", 0.0),
    ("GPUBOT_TIMEZONE", "Europe/Berlin", "timezone", "Europe/Berlin"),
    ("GPUBOT_IDLE_STOP_AFTER", "1h", "idle_stop_after", timedelta(hours=1)),
    ("GPUBOT_TERMINATE_AFTER", "2d", "terminate_after", timedelta(days=2)),
    ("GPUBOT_POOL_MAX_INSTANCES", "8", "pool_max_instances", 8),
    ("GPUBOT_POOL_MAX_USD_PER_HOUR", "12.5", "pool_max_usd_per_hour", 12.5),
    ("GPUBOT_EBS_GB", "100", "ebs_gb", 100.0),
    ("GPUBOT_EBS_USD_GB_MONTH", "0.1", "ebs_usd_gb_month", 0.1),
    ("GPUBOT_UTIL_SAMPLE_SECONDS", "30", "util_sample_s", 30.0),
    ("GPUBOT_UTIL_POST_INTERVAL", "off", "util_post_interval", timedelta(0)),
    ("GPUBOT_IDLE_UTIL_PCT", "7.5", "idle_util_pct", 7.5),
    ("GPUBOT_IDLE_WINDOW", "20m", "idle_window", timedelta(minutes=20)),
    ("GPUBOT_IDLE_GRACE", "10m", "idle_grace", timedelta(minutes=10)),
    ("GPUBOT_DIGEST_AT", "Fri 17:30", "digest_at", "fri 17:30"),
    ("GPUBOT_PRICES_FILE", "/srv/prices.csv", "prices_file", Path("/srv/prices.csv")),
    ("SLACK_API_URL", "http://127.0.0.1:9/api/", "slack_api_url", "http://127.0.0.1:9/api/"),
]
SECRETS = [
    ("SLACK_BOT_TOKEN", "slack_bot_token"),
    ("SLACK_SIGNING_SECRET", "slack_signing_secret"),
    ("SLACK_APP_TOKEN", "slack_app_token"),
]


@pytest.mark.parametrize(("var", "text", "name", "expected"), ENVIRONMENT)
def test_each_variable_keeps_its_name_and_its_parsing(
    var: str, text: str, name: str, expected: object
) -> None:
    assert getattr(load_settings({}), name) != expected
    assert getattr(load_settings({var: text}), name) == expected
    assert getattr(load_settings({var: ""}), name) != expected  # empty: unset, as on a PaaS


@pytest.mark.parametrize(("var", "name"), SECRETS)
def test_secrets_are_read_from_the_environment_and_held_masked(var: str, name: str) -> None:
    s = load_settings({var: "xoxb-1-2-topsecretvalue"})
    secret = getattr(s, name)
    assert isinstance(secret, SecretStr) and secret.get_secret_value() == "xoxb-1-2-topsecretvalue"
    for shown in (repr(s), str(s), f"{secret}", repr(secret)):
        assert "topsecretvalue" not in shown
    assert f"{name}='<set>'" in repr(s)


def test_the_database_password_never_shows(tmp_path: Path) -> None:
    url = "postgresql://gpubot:hunter2pw@db.internal/gpubot"
    s = load_settings({"DATABASE_URL": url})
    assert s.sqlalchemy_url == url  # what make_engine gets
    assert "hunter2pw" not in repr(s) and "hunter2pw" not in str(s)
    assert "db.internal/gpubot" in repr(s)  # where the database is still shows
    # Unlike the Slack secrets, the file may name the database (as it always could).
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text(f'database_url = "{url}"\n')
    assert load_settings({"GPUBOT_CONFIG": str(cfg)}).sqlalchemy_url == url


@pytest.mark.parametrize(("var", "name"), SECRETS)
def test_no_slack_secret_in_the_file(tmp_path: Path, var: str, name: str) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text(f'{name} = "xoxb-in-a-file"\n')
    with pytest.raises(ConfigError, match=f"{name} is a secret; set it in the environment instead"):
        load_settings({"GPUBOT_CONFIG": str(cfg), var: "xoxb-from-env"})


def test_settings_built_in_code_do_not_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fixture's Settings(...) must mean the same on every machine, whatever is exported.
    monkeypatch.delenv("GPUBOT_CONFIG", raising=False)
    monkeypatch.setenv("GPUBOT_PROVIDER", "aws")
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-from-the-shell")
    monkeypatch.setenv("provider", "aws")
    s = Settings(admins=("root",))
    assert s.provider == "local" and not s.slack_bot_token
    assert load_settings().provider == "aws"  # the one reader of the environment


def test_overrides_are_parsed_like_the_environment() -> None:
    s = load_settings(
        {},
        local_slots="3",
        default_duration="90m",
        admins="U1, @root",
        shared_logs="yes",
        slack_bot_token="xoxb-override",
    )
    assert s.local_slots == 3 and s.default_duration == timedelta(minutes=90)
    assert s.admins == ("U1", "root") and s.shared_logs is True
    assert s.slack_bot_token.get_secret_value() == "xoxb-override"
    with pytest.raises(
        ConfigError, match=r"tick_seconds \(from override\) must be a number of seconds, not 'fast'"
    ):
        load_settings({}, tick_seconds="fast")
    with pytest.raises(ConfigError, match=r"max_duration \(from override\) must be a duration"):
        load_settings({}, max_duration=3)
    with pytest.raises(ConfigError, match="unknown setting 'tick'"):
        load_settings({}, tick=2)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("local_slots = true", "local_slots (from {path}) must be a whole number, not True"),
        ("local_slots = 2.5", "local_slots (from {path}) must be a whole number, not 2.5"),
        (
            "tick_seconds = false",
            "tick_seconds (from {path}) must be a number of seconds, not False",
        ),
        ('channel = ["ml"]', "channel (from {path}) must be text, not ['ml']"),
        ("admins = 5", "admins (from {path}) must be a list or comma-separated text, not 5"),
        ("shared_logs = 2", "shared_logs (from {path}) must be true or false, not 2"),
        ("default_duration = 7200", "default_duration (from {path}) must be a duration like 2h"),
        ("digest_at = 5", "digest_at (from {path}): expected a weekday and a time"),
        ('run_channels = ["#gpu"]', "run_channels (from {path}) takes Slack ids like C0123ABCD"),
        ("home = 1979-05-27", "home (from {path}) must be text, not datetime.date(1979, 5, 27)"),
    ],
)
def test_a_file_value_of_the_wrong_type_is_refused(tmp_path: Path, line: str, message: str) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings({"GPUBOT_CONFIG": str(cfg)})
    assert refused.value.text.startswith(message.format(path=cfg))


def test_file_values_of_a_near_type_are_coerced(tmp_path: Path) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text(
        "local_slots = 3.0\ntick_seconds = 2\ndefault_gpu = 4090\nshared_logs = true\n"
        'admins = "U1,U2"\nutil_post_interval = 0\nrun_groups = ["S0GPUTEAM"]\n'
    )
    s = load_settings({"GPUBOT_CONFIG": str(cfg)})
    assert s.local_slots == 3 and isinstance(s.local_slots, int)
    assert s.tick_seconds == 2.0 and isinstance(s.tick_seconds, float)
    assert s.default_gpu == "4090" and s.shared_logs is True and s.admins == ("U1", "U2")
    assert s.util_post_interval == timedelta(0) and s.run_groups == ("S0GPUTEAM",)


def test_a_bad_file_value_is_refused_even_when_the_environment_sets_it(tmp_path: Path) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text('default_duration = "soon"\n')
    with pytest.raises(ConfigError, match=r"default_duration \(from .*gpubot.toml\)"):
        load_settings({"GPUBOT_CONFIG": str(cfg), "GPUBOT_DEFAULT_DURATION": "1h"})


def test_file_errors_keep_their_words(tmp_path: Path) -> None:
    cfg = tmp_path / "gpubot.toml"
    cfg.write_text("tick = 2\n")
    with pytest.raises(ConfigError, match=f"^{cfg}: unknown setting 'tick'$"):
        load_settings({"GPUBOT_CONFIG": str(cfg)})
    cfg.write_text("not toml [")
    with pytest.raises(ConfigError, match=f"^{cfg} is not valid TOML: "):
        load_settings({"GPUBOT_CONFIG": str(cfg)})


def test_the_default_length_never_passes_the_longest() -> None:
    s = load_settings({"GPUBOT_MAX_DURATION": "1h"})
    assert s.default_duration == timedelta(hours=1) == s.max_duration
    with pytest.raises(
        ConfigError, match=r"local_slots \(from GPUBOT_LOCAL_SLOTS\) must be between 0 and 64"
    ):
        load_settings({"GPUBOT_LOCAL_SLOTS": "65"})


def test_a_provider_that_does_not_exist_is_named_with_the_ones_that_do() -> None:
    """Which providers exist is theirs to say (bot.providers), not the settings'."""
    from bot.providers import names

    with pytest.raises(
        ConfigError, match=r"GPUBOT_PROVIDER=azure: azure is not one of local, ssh, aws"
    ):
        names(load_settings({"GPUBOT_PROVIDER": "azure"}))
    with pytest.raises(ConfigError, match="GPUBOT_PROVIDERS=ssh,gcp: gcp is not one of"):
        names(load_settings({"GPUBOT_PROVIDERS": "ssh, gcp"}))
    assert names(load_settings({"GPUBOT_PROVIDERS": "ssh,aws"})) == ("ssh", "aws")
    assert names(load_settings({"GPUBOT_PROVIDER": "SSH"})) == ("ssh",)
