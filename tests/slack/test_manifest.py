"""`gpubot manifest`: valid against Slack's published schema, with exactly the scopes
the code's Web API calls need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from bot.faces.slack import manifest as m
from tests.fakes.slack_api import shared_slack_dir

ROOT = Path(__file__).resolve().parents[2]
# No type stubs for jsonschema are installed; importorskip hands it over as a plain module.
jsonschema = pytest.importorskip("jsonschema")


def _schema() -> dict[str, object]:
    path = shared_slack_dir() / "manifest" / "manifest.schema.1.0.0.json"
    if not path.exists():
        pytest.skip(f"{path} missing")
    data: dict[str, object] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize("url", ["", "https://gpubot.example.com/slack/events"])
def test_manifest_validates_against_slacks_schema(url: str) -> None:
    doc = yaml.safe_load(m.manifest_yaml(request_url=url))
    jsonschema.validate(doc, _schema())
    assert doc["features"]["slash_commands"][0]["command"] == "/gpu"
    assert doc["features"]["app_home"]["home_tab_enabled"] is True
    assert doc["settings"]["interactivity"]["is_enabled"] is True
    assert doc["settings"]["event_subscriptions"]["bot_events"] == ["app_home_opened"]
    assert doc["settings"]["socket_mode_enabled"] is (url == "")
    if url:
        assert doc["features"]["slash_commands"][0]["url"] == url
        assert doc["settings"]["interactivity"]["request_url"] == url


def test_scopes_are_exactly_those_of_the_methods_called() -> None:
    called: set[str] = set()
    for path in (ROOT / "bot" / "faces" / "slack").glob("*.py"):
        for name in re.findall(
            r"client\.((?:chat|conversations|users|usergroups|views|files|apps)_[A-Za-z_0-9]+)",
            path.read_text(),
        ):
            called.add(name)
    # files_upload_v2 is the upload helper (scope added when charts use it); Bolt calls auth.test.
    as_methods = {n.replace("_", ".") for n in called} - {"files.upload.v2"} | {"auth.test"}
    assert as_methods == set(m.METHOD_SCOPES), (
        "a Web API call without a scope entry, or a stale one"
    )
    assert m.bot_scopes() == sorted(
        {
            "commands",
            "chat:write",
            "im:write",
            "im:history",
            "channels:history",
            "users:read",
            "usergroups:read",
        }
    )


def test_cli_prints_yaml() -> None:
    import typer

    from bot.faces.slack.cli import manifest

    app = typer.Typer()
    app.command()(manifest)
    out = CliRunner().invoke(app, [])
    assert out.exit_code == 0
    assert yaml.safe_load(out.stdout)["display_information"]["name"] == "gpubot"
