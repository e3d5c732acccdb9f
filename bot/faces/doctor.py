"""`gpubot doctor`: what is missing before the bot can work, in plain words, with the fix.

People run the doctor when something is already broken, so it must never crash: every
check is guarded, and an unexpected exception becomes that check's own failure line.
Each check is a real, read-only probe (Slack's `auth.test`, a login over SSH, the
Alembic revision, EC2 describe calls), so a green line means the thing works, not that
a variable is merely set. Secrets are never printed: details name the variable, and
every line is scrubbed of the token values before it leaves this module.

Each provider's lines come from the provider itself (bot.providers: its settings,
its read-only probes).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import typer
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from bot import providers
from bot.app.config import ConfigError, Settings, load_settings
from bot.faces.runtime import open_database
from bot.providers.base import SSH_TIMEOUT_S, AwsProbe, Note, NvmlProbe, Probes, guarded
from db.migrate import current_revision, head_revision
from provisioning.checks import Check
from provisioning.ssh import SshTarget

__all__ = ["Check", "Note", "doctor", "render", "run_checks"]

DEFAULT_SLACK_API_URL = "https://slack.com/api/"

# A WebClient for one token: tests hand in one aimed elsewhere (a dead port, a fake).
SlackClientFactory = Callable[[str], WebClient]

# --- the whole run ---------------------------------------------------------------------


def run_checks(
    settings: Settings,
    *,
    env: Mapping[str, str] | None = None,
    aws: AwsProbe | None = None,
    ssh_targets: Sequence[SshTarget] | None = None,
    slack_client_factory: SlackClientFactory | None = None,
    nvml_probe: NvmlProbe | None = None,
    ssh_timeout_s: float = SSH_TIMEOUT_S,
) -> list[Check]:
    """Runs every section even after a failure, so one run lists everything missing."""
    environ: Mapping[str, str] = os.environ if env is None else env
    checks: list[Check] = []
    checks += guarded("Config", lambda: [_config(settings, environ)])
    checks += guarded("Database", lambda: check_database(settings))
    # Only what the chosen face and provider need: no Slack secret at all is a shell-only
    # set-up, and only the local provider runs on this machine's GPUs.
    if slack_wanted(settings):
        checks += guarded("Slack", lambda: check_slack(settings, slack_client_factory))
    else:
        checks.append(_NO_SLACK)
    probes = Probes(aws=aws, ssh_targets=ssh_targets, nvml=nvml_probe, ssh_timeout_s=ssh_timeout_s)
    checks += guarded("Providers", lambda: providers.checks(settings, environ, probes))
    return [_scrub(c, _secrets(settings)) for c in checks]


_NO_SLACK = Note(
    "Slack",
    True,
    "no Slack secret is set: a shell-only set-up (`gpubot shell`, `gpubot submit`), "
    "which needs none",
    "For Slack, set SLACK_BOT_TOKEN and SLACK_APP_TOKEN (Socket Mode) or "
    "SLACK_SIGNING_SECRET (HTTP); docs/SLACK_SETUP.md says where to find them.",
)


def slack_wanted(settings: Settings) -> bool:
    """Whether this set-up means to use Slack: any of its secrets is set."""
    return any(
        secret.get_secret_value()
        for secret in (
            settings.slack_bot_token,
            settings.slack_app_token,
            settings.slack_signing_secret,
        )
    )


def _secrets(settings: Settings) -> list[str]:
    found = [
        secret.get_secret_value()
        for secret in (
            settings.slack_bot_token,
            settings.slack_app_token,
            settings.slack_signing_secret,
        )
    ]
    try:
        password = make_url(settings.sqlalchemy_url).password
    except ArgumentError:
        password = None
    if password:
        found.append(str(password))
    return [s for s in found if len(s) >= 4]


def _scrub(check: Check, secrets: Sequence[str]) -> Check:
    """A last guard: an error message that quotes a token must not print it."""
    detail, fix = check.detail, check.fix
    for secret in secrets:
        detail = detail.replace(secret, "<redacted>")
        fix = fix.replace(secret, "<redacted>")
    return replace(check, detail=detail, fix=fix)


def _config(settings: Settings, env: Mapping[str, str]) -> Check:
    source = env.get("GPUBOT_CONFIG") or "no config file"
    named = ",".join(settings.providers) or settings.provider
    return Check("Config", True, f"loaded ({source}); provider {named}, home {settings.home}")


# --- database --------------------------------------------------------------------------


def check_database(settings: Settings) -> list[Check]:
    """The schema must be at this code's Alembic head, or the first query fails oddly."""
    name = "Database"
    upgrade_fix = "Run `gpubot db upgrade` (every gpubot command also does this on start)."
    try:
        url = make_url(settings.sqlalchemy_url)
    except ArgumentError:
        return [
            Check(
                name,
                False,
                "DATABASE_URL is not a database URL",
                "Set DATABASE_URL like postgresql://user:password@host:5432/gpubot, or unset it for SQLite under GPUBOT_HOME.",
            )
        ]
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        path = Path(str(url.database)).expanduser()
        # Connecting would create the file (and its directory); the doctor only looks.
        if not path.exists():
            # A fresh home: the first command creates it; nothing is wrong yet.
            return [
                Note(
                    name,
                    True,
                    f"no database yet at {path}; the first gpubot command creates it",
                    upgrade_fix,
                )
            ]
    engine = open_database(settings, upgraded=False)  # it only looks
    try:
        current = current_revision(engine)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return [
            Check(
                name,
                False,
                f"cannot open {shown}: {reason[0] if reason else type(exc).__name__}",
                "Check DATABASE_URL (host, port, user, password, database name) and that the server is running.",
            )
        ]
    finally:
        engine.dispose()
    head = head_revision()
    if current is None:
        return [Check(name, False, f"{shown} has no gpubot schema yet", upgrade_fix)]
    if current != head:
        return [
            Check(
                name,
                False,
                f"{shown} is at schema revision {current}; this gpubot needs {head}",
                upgrade_fix
                + " If it says it cannot locate the revision, a newer gpubot upgraded this database: run that version.",
            )
        ]
    return [Check(name, True, f"{shown} at schema revision {head}")]


# --- Slack -----------------------------------------------------------------------------

_BOT_TOKEN_FIX = (
    "At api.slack.com/apps open your app → OAuth & Permissions → copy the Bot User OAuth Token "
    "(it starts with xoxb-) into SLACK_BOT_TOKEN. No app yet? Create one from `gpubot manifest` "
    "(docs/SLACK_SETUP.md)."
)
_APP_TOKEN_FIX = (
    "At api.slack.com/apps open your app → Basic Information → App-Level Tokens → generate one "
    "with the connections:write scope (it starts with xapp-) into SLACK_APP_TOKEN, and turn on "
    "Settings → Socket Mode; or unset SLACK_APP_TOKEN to use HTTP mode."
)
_NO_MODE_FIX = (
    "For Socket Mode (no public URL needed): Basic Information → App-Level Tokens → generate one "
    "with connections:write (starts with xapp-) into SLACK_APP_TOKEN. For HTTP mode: copy "
    "Basic Information → Signing Secret into SLACK_SIGNING_SECRET."
)
_TOKEN_KINDS = {
    "xoxb-": "a bot token",
    "xoxp-": "a user token",
    "xapp-": "an app-level token",
    "xoxe-": "a refresh token",
    "xoxe.": "a rotating token",
    "xoxa-": "a workspace token",
    "xoxs-": "a session token",
}


def _token_kind(token: str) -> str:
    for prefix, kind in _TOKEN_KINDS.items():
        if token.startswith(prefix):
            return f"{kind} (it starts with {prefix})"
    return "not a Slack token (it starts with none of xoxb-, xoxp-, xapp-)"


def _default_factory(settings: Settings) -> SlackClientFactory:
    base_url = settings.slack_api_url or DEFAULT_SLACK_API_URL

    def factory(token: str) -> WebClient:
        return WebClient(token=token, base_url=base_url, timeout=10)

    return factory


def check_slack(
    settings: Settings, client_factory: SlackClientFactory | None = None
) -> list[Check]:
    """The bot token (outbound) and one way for Slack to reach the bot (inbound)."""
    factory = client_factory or _default_factory(settings)
    base_url = settings.slack_api_url or DEFAULT_SLACK_API_URL
    return [
        guarded("Slack", lambda: [_bot_token(settings, factory, base_url)])[0],
        guarded("Slack inbound", lambda: [_inbound(settings, factory, base_url)])[0],
    ]


def _bot_token(settings: Settings, factory: SlackClientFactory, base_url: str) -> Check:
    name = "Slack"
    token = settings.slack_bot_token.get_secret_value()
    if not token:
        return Check(
            name,
            False,
            "SLACK_BOT_TOKEN is not set, so the bot cannot post or answer",
            _BOT_TOKEN_FIX,
        )
    if not token.startswith("xoxb-"):
        return Check(
            name,
            False,
            f"SLACK_BOT_TOKEN is {_token_kind(token)}, not the bot token",
            _BOT_TOKEN_FIX,
        )
    try:
        resp = factory(token).auth_test()
    except SlackApiError as exc:
        error = str(exc.response.get("error", "unknown_error"))
        return Check(name, False, _slack_refusal("SLACK_BOT_TOKEN", error), _BOT_TOKEN_FIX)
    except (SlackClientError, OSError, http.client.HTTPException, urllib.error.URLError) as exc:
        return _unreachable(name, base_url, exc)
    who = f"@{resp.get('user', '?')}"
    team = resp.get("team") or resp.get("team_id") or "?"
    team_id = resp.get("team_id", "")
    where = f"{team} ({team_id})" if team_id and team_id != team else str(team)
    return Check(name, True, f"bot {who} in workspace {where}")


def _inbound(settings: Settings, factory: SlackClientFactory, base_url: str) -> Check:
    app_token = settings.slack_app_token.get_secret_value()
    if app_token:
        name = "Slack Socket Mode"
        if not app_token.startswith("xapp-"):
            return Check(
                name,
                False,
                f"SLACK_APP_TOKEN is {_token_kind(app_token)}, not an app-level token",
                _APP_TOKEN_FIX,
            )
        try:
            factory(app_token).apps_connections_open(app_token=app_token)
        except SlackApiError as exc:
            error = str(exc.response.get("error", "unknown_error"))
            return Check(name, False, _slack_refusal("SLACK_APP_TOKEN", error), _APP_TOKEN_FIX)
        except (SlackClientError, OSError, http.client.HTTPException, urllib.error.URLError) as exc:
            return _unreachable(name, base_url, exc)
        return Check(name, True, "SLACK_APP_TOKEN works: `gpubot serve` connects over Socket Mode")
    name = "Slack HTTP mode"
    if settings.slack_signing_secret:
        return Check(
            name,
            True,
            "SLACK_SIGNING_SECRET is set (no SLACK_APP_TOKEN): Slack must reach /slack/events on this app's public HTTPS URL",
        )
    return Check(
        name,
        False,
        "neither SLACK_APP_TOKEN (Socket Mode) nor SLACK_SIGNING_SECRET (HTTP mode) is set, "
        "so `gpubot serve` cannot receive commands; HTTP mode needs SLACK_SIGNING_SECRET",
        _NO_MODE_FIX,
    )


def _slack_refusal(variable: str, error: str) -> str:
    if error in {"invalid_auth", "not_authed"}:
        return f"Slack does not accept {variable} ({error}): it is mistyped or from another app"
    if error in {"token_revoked", "token_expired", "account_inactive"}:
        return f"Slack says {variable} no longer works ({error}): the app was uninstalled or reinstalled"
    if error == "missing_scope":
        return f"{variable} lacks a scope Slack requires for this ({error})"
    return f"Slack refused {variable}: {error}"


def _unreachable(name: str, base_url: str, exc: BaseException) -> Check:
    reason: object = getattr(exc, "reason", None) or exc
    text = str(reason).strip() or type(exc).__name__
    return Check(
        name,
        False,
        f"cannot reach the Slack API at {base_url}: {text}",
        "Check this machine's network and proxy (HTTPS_PROXY), or SLACK_API_URL if it is set.",
    )


# --- the command -----------------------------------------------------------------------


def render(check: Check) -> str:
    if isinstance(check, Note):
        line = f"! {check.name}: {check.detail}"
        return f"{line} — {check.fix}" if check.fix else line
    mark = "✓" if check.ok else "✗"
    line = f"{mark} {check.name}: {check.detail}"
    return f"{line} — fix: {check.fix}" if not check.ok and check.fix else line


def as_json(checks: Sequence[Check]) -> str:
    rows: list[dict[str, Any]] = []
    for c in checks:
        row = asdict(c)
        row["level"] = "note" if isinstance(c, Note) else "required"
        rows.append(row)
    return json.dumps(rows, indent=2, ensure_ascii=False)


def doctor(
    json_out: bool = typer.Option(False, "--json", help="Print the checks as a JSON list."),
) -> None:
    """Checks the config, database, Slack, AWS, SSH hosts and this machine's GPUs.

    Prints one line per check (✓ works, ✗ missing, with the fix; ! worth knowing) and
    exits 1 when anything required is missing. AWS and SSH settings come from
    GPUBOT_AWS_* and GPUBOT_SSH_HOSTS/GPUBOT_SSH_USER/GPUBOT_SSH_KEY.
    """
    # Libraries (paramiko) log link failures; the doctor says them in its own lines.
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.NullHandler())
    checks: list[Check]
    try:
        settings = load_settings()
        providers.names(settings)
    except ConfigError as exc:
        checks = [
            Check(
                "Config",
                False,
                exc.text,
                "Fix that setting in the environment or in the GPUBOT_CONFIG file.",
            )
        ]
    else:
        checks = run_checks(settings)
    if json_out:
        typer.echo(as_json(checks))
    else:
        for check in checks:
            typer.echo(render(check))
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)
