"""The Slack app manifest: what `gpubot manifest` prints for "Create app from manifest".

Scopes are derived from the Web API methods the bot calls (`METHOD_SCOPES`), so the
app asks for exactly what it uses; a test checks every `client.<method>` call in
`bot/faces/slack/` appears there.
"""

from __future__ import annotations

from typing import Any

import yaml

from bot.domain.commands import VERBS

# Each Web API method the bot calls, and the bot scopes it needs (none: no scope).
METHOD_SCOPES: dict[str, tuple[str, ...]] = {
    "auth.test": (),
    "chat.postMessage": ("chat:write",),
    # A run's live message, edited in place (bot.app.watching.runwatch).
    "chat.update": ("chat:write",),
    "conversations.open": ("im:write",),
    # The duplicate check before resending a maybe-sent notification: DMs and the team channel.
    "conversations.history": ("im:history", "channels:history"),
    "users.info": ("users:read",),
    # Members of the user groups in GPUBOT_RUN_GROUPS (bot.faces.slack.membership).
    "usergroups.users.list": ("usergroups:read",),
    "views.open": (),
    "views.publish": (),
    # files.getUploadURLExternal / completeUploadExternal (charts) add files:write when used.
}
BOT_EVENTS = ("app_home_opened",)


def bot_scopes() -> list[str]:
    return sorted({s for scopes in METHOD_SCOPES.values() for s in scopes} | {"commands"})


def manifest(name: str = "gpubot", request_url: str = "") -> dict[str, Any]:
    """Socket Mode when no `request_url` is given (no public URL needed); otherwise HTTP,
    with commands, interactivity and events all at that one URL (Bolt's /slack/events)."""
    command: dict[str, Any] = {
        "command": "/gpu",
        "description": "Share the team's GPUs: reserve, release, status, runs, cost",
        "usage_hint": "[" + "|".join(VERBS) + "] …",
        "should_escape": True,
    }
    interactivity: dict[str, Any] = {"is_enabled": True}
    events: dict[str, Any] = {"bot_events": list(BOT_EVENTS)}
    if request_url:
        command["url"] = request_url
        interactivity["request_url"] = request_url
        events["request_url"] = request_url
    return {
        "_metadata": {"major_version": 1, "minor_version": 1},
        "display_information": {
            "name": name,
            "description": "Reserve and share the team's GPUs from Slack.",
            "background_color": "#2c2d30",
        },
        "features": {
            "app_home": {
                "home_tab_enabled": True,
                "messages_tab_enabled": True,
                "messages_tab_read_only_enabled": True,
            },
            "bot_user": {"display_name": name, "always_online": True},
            "slash_commands": [command],
        },
        "oauth_config": {"scopes": {"bot": bot_scopes()}},
        "settings": {
            "event_subscriptions": events,
            "interactivity": interactivity,
            "org_deploy_enabled": False,
            "socket_mode_enabled": not request_url,
            "token_rotation_enabled": False,
        },
    }


def manifest_yaml(name: str = "gpubot", request_url: str = "") -> str:
    return yaml.safe_dump(manifest(name, request_url), sort_keys=False, allow_unicode=True)
