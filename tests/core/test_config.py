"""Settings: defaults, TOML, environment on top, plain errors, secrets masked."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from bot.config import ConfigError, load_settings


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
        ({"GPUBOT_PROVIDER": "azure"}, "GPUBOT_PROVIDER"),
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
