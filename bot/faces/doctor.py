"""`gpubot doctor`: what is missing before the bot can work, in plain words, with the fix.

People run the doctor when something is already broken, so it must never crash: every
check is guarded, and an unexpected exception becomes that check's own failure line.
Each check is a real, read-only probe (Slack's `auth.test`, a login over SSH, the
Alembic revision, EC2 describe calls), so a green line means the thing works, not that
a variable is merely set. Secrets are never printed: details name the variable, and
every line is scrubbed of the token values before it leaves this module.

The AWS and SSH settings the doctor reads (until `bot.app.config` carries them):

    GPUBOT_AWS_REGION          region; else AWS_REGION, else AWS_DEFAULT_REGION
    GPUBOT_AWS_SUBNETS         comma list of subnet ids, one per availability zone
    GPUBOT_AWS_SECURITY_GROUPS comma list of security group ids (optional)
    GPUBOT_AWS_KEY_NAME        the EC2 key pair the bot logs in with
    GPUBOT_AWS_AMI             a fixed AMI id (optional; else the DLAMI SSM parameter)
    GPUBOT_AWS_AMI_PARAMETER   another SSM parameter naming the AMI (optional)
    GPUBOT_AWS_METADATA_URL    the instance metadata service the host agent asks for spot
                               notices (default http://169.254.169.254)
    GPUBOT_SSH_HOSTS           comma list of [name=][user@]host[:port][/4xA100[+2xT4]] GPU hosts
    GPUBOT_SSH_USER            login user where a host names none (default root)
    GPUBOT_SSH_KEY             private key file (default: ssh-agent and ~/.ssh)
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import subprocess
import sys
import urllib.error
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import typer
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from bot.app.config import ConfigError, Settings, load_settings
from db.migrate import current_revision, head_revision
from db.session import make_engine
from provisioning.aws import DLAMI_SSM_PARAMETER, Ec2Settings
from provisioning.aws_doctor import Check, check_aws
from provisioning.bootstrap import DEFAULT_METADATA_URL
from provisioning.hosts import HostEntryError, StaticHost, parse_host_entries
from provisioning.ssh import SshClient, SshError, SshTarget
from training.telemetry import NO_DRIVER, parse_snapshot

__all__ = [
    "Check",
    "Note",
    "doctor",
    "ec2_settings_from_env",
    "render",
    "run_checks",
    "ssh_targets_from_env",
]

DEFAULT_SLACK_API_URL = "https://slack.com/api/"
AWS_ENV = (
    "GPUBOT_AWS_REGION",
    "GPUBOT_AWS_SUBNETS",
    "GPUBOT_AWS_SECURITY_GROUPS",
    "GPUBOT_AWS_KEY_NAME",
    "GPUBOT_AWS_AMI",
    "GPUBOT_AWS_AMI_PARAMETER",
    "GPUBOT_AWS_METADATA_URL",
)
SSH_TIMEOUT_S = 5.0
TELEMETRY_TIMEOUT_S = 60.0

# A WebClient for one token: tests hand in one aimed elsewhere (a dead port, a fake).
SlackClientFactory = Callable[[str], WebClient]
# The EC2 checks for one set of settings (default: provisioning's read-only `check_aws`).
AwsProbe = Callable[[Ec2Settings], list[Check]]
# This machine's `python -m training.telemetry --json` document, as text.
NvmlProbe = Callable[[], str]


@dataclass(frozen=True)
class Note(Check):
    """Worth saying but not wrong (no GPU here: the bot offers CPU slots), so it never
    turns the exit code red; `ok` is always True."""


# --- the whole run ---------------------------------------------------------------------


def run_checks(
    settings: Settings,
    *,
    env: Mapping[str, str] | None = None,
    aws: AwsProbe | None = None,
    ssh_targets: Sequence[SshTarget] = (),
    slack_client_factory: SlackClientFactory | None = None,
    nvml_probe: NvmlProbe | None = None,
    ssh_timeout_s: float = SSH_TIMEOUT_S,
) -> list[Check]:
    """Runs every section even after a failure, so one run lists everything missing."""
    environ: Mapping[str, str] = os.environ if env is None else env
    checks: list[Check] = []
    checks += _guarded("Config", lambda: [_config(settings, environ)])
    checks += _guarded("Database", lambda: check_database(settings))
    # Only what the chosen face and provider need: no Slack secret at all is a shell-only
    # set-up, and only the local provider runs on this machine's GPUs.
    if slack_wanted(settings):
        checks += _guarded("Slack", lambda: check_slack(settings, slack_client_factory))
    else:
        checks.append(_NO_SLACK)
    checks += _guarded("AWS", lambda: check_aws_section(settings, environ, aws))
    checks += _guarded(
        "SSH", lambda: check_ssh(ssh_targets, provider=settings.provider, timeout_s=ssh_timeout_s)
    )
    if settings.provider == "local":
        checks += _guarded("This machine's GPUs", lambda: check_gpus(settings, nvml_probe))
    checks += _guarded("Run account", lambda: check_run_account(settings))
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


def _guarded(name: str, section: Callable[[], list[Check]]) -> list[Check]:
    try:
        return section()
    except Exception as exc:
        return [
            Check(
                name,
                False,
                f"the check itself failed ({type(exc).__name__}: {exc})",
                "This is a bug in gpubot doctor; please report this line.",
            )
        ]


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
    return Check(
        "Config", True, f"loaded ({source}); provider {settings.provider}, home {settings.home}"
    )


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
    engine = make_engine(settings.sqlalchemy_url)
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
        _guarded("Slack", lambda: [_bot_token(settings, factory, base_url)])[0],
        _guarded("Slack inbound", lambda: [_inbound(settings, factory, base_url)])[0],
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


# --- AWS -------------------------------------------------------------------------------

_AWS_FIX = (
    "Set GPUBOT_AWS_REGION, GPUBOT_AWS_SUBNETS (subnet ids, comma-separated, one per zone), "
    "GPUBOT_AWS_KEY_NAME and optionally GPUBOT_AWS_SECURITY_GROUPS and GPUBOT_AWS_AMI; "
    "or set GPUBOT_PROVIDER to local or ssh."
)
# check_aws speaks of Ec2Settings fields; a person sets environment variables.
_FIELD_WORDS = {
    "subnet_ids": "GPUBOT_AWS_SUBNETS",
    "key_name": "GPUBOT_AWS_KEY_NAME",
    "ami_id": "GPUBOT_AWS_AMI",
}


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def ec2_settings_from_env(env: Mapping[str, str]) -> Ec2Settings:
    """The EC2 settings from the environment; a ConfigError names what is missing."""
    region = next(
        (
            env[v].strip()
            for v in ("GPUBOT_AWS_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
            if env.get(v, "").strip()
        ),
        "",
    )
    if not region:
        raise ConfigError("no AWS region: set GPUBOT_AWS_REGION (or AWS_REGION/AWS_DEFAULT_REGION)")
    subnets = _split(env.get("GPUBOT_AWS_SUBNETS", ""))
    if not subnets:
        raise ConfigError("GPUBOT_AWS_SUBNETS is not set: the bot needs a subnet to launch into")
    try:
        return Ec2Settings(
            region=region,
            subnet_ids=subnets,
            security_group_ids=_split(env.get("GPUBOT_AWS_SECURITY_GROUPS", "")),
            key_name=env.get("GPUBOT_AWS_KEY_NAME", "").strip() or None,
            ami_id=env.get("GPUBOT_AWS_AMI", "").strip() or None,
            ami_ssm_parameter=env.get("GPUBOT_AWS_AMI_PARAMETER", "").strip()
            or DLAMI_SSM_PARAMETER,
            metadata_url=env.get("GPUBOT_AWS_METADATA_URL", "").strip() or DEFAULT_METADATA_URL,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def aws_wanted(settings: Settings, env: Mapping[str, str]) -> bool:
    """Generic AWS credentials in a shell say nothing about gpubot; its own variables do."""
    return settings.provider == "aws" or any(env.get(v, "").strip() for v in AWS_ENV)


def check_aws_section(
    settings: Settings, env: Mapping[str, str], probe: AwsProbe | None = None
) -> list[Check]:
    if not aws_wanted(settings, env):
        return [Check("AWS", True, f"not used (GPUBOT_PROVIDER={settings.provider})")]
    try:
        ec2 = ec2_settings_from_env(env)
    except ConfigError as exc:
        return [Check("AWS settings", False, exc.text, _AWS_FIX)]
    checks = (probe or check_aws)(ec2)
    return [
        replace(c, detail=_env_words(c.detail), fix=_env_words(c.fix) if not c.ok else "")
        for c in checks
    ]


def _env_words(text: str) -> str:
    for field_name, var in _FIELD_WORDS.items():
        text = re.sub(rf"\b{field_name}\b", var, text)
    return text


# --- SSH -------------------------------------------------------------------------------


def ssh_targets_from_env(env: Mapping[str, str]) -> tuple[SshTarget, ...]:
    """GPUBOT_SSH_HOSTS as targets; a ConfigError names an entry that does not parse."""
    return tuple(h.target for h in static_hosts_from_env(env))


def static_hosts_from_env(env: Mapping[str, str]) -> tuple[StaticHost, ...]:
    """GPUBOT_SSH_HOSTS with the GPUs each entry declares (`box=user@host:22/4xA100`)."""
    user = env.get("GPUBOT_SSH_USER", "").strip() or "root"
    key = env.get("GPUBOT_SSH_KEY", "").strip() or None
    try:
        return parse_host_entries(
            env.get("GPUBOT_SSH_HOSTS", ""),
            default_user=user,
            key_path=str(Path(key).expanduser()) if key else None,
            normalize=_normalize_model,
        )
    except HostEntryError as exc:
        raise ConfigError(str(exc)) from None


def _normalize_model(text: str) -> str | None:
    from provisioning.catalog import Catalog

    return Catalog.load().normalize_model(text)


def check_ssh(
    targets: Sequence[SshTarget], *, provider: str = "local", timeout_s: float = SSH_TIMEOUT_S
) -> list[Check]:
    """A login plus `true` per host: a listening port is not a host the bot can use."""
    if not targets:
        if provider == "ssh":
            return [
                Check(
                    "SSH",
                    False,
                    "GPUBOT_PROVIDER=ssh but no hosts are configured",
                    "List the GPU hosts in GPUBOT_SSH_HOSTS as [name=][user@]host[:port], comma-separated.",
                )
            ]
        return [Check("SSH", True, "no SSH hosts configured (GPUBOT_SSH_HOSTS)")]
    checks = []
    with SshClient(connect_timeout=timeout_s, command_timeout=timeout_s) as client:
        for target in targets:
            name = f"SSH {target.name or target.host}"
            checks += _guarded(name, partial(_ssh_one, client, target, name, timeout_s))
    return checks


def _ssh_fix(target: SshTarget, message: str) -> str:
    key = target.key_path or "ssh-agent or ~/.ssh"
    try_it = (
        f"Try `ssh{f' -i {target.key_path}' if target.key_path else ''} -p {target.port} "
        f"{target.user}@{target.host} true` from this machine."
    )
    if "did not accept" in message:
        return (
            f"Add the bot's public key (for {key}) to ~{target.user}/.ssh/authorized_keys on the host, "
            f"or set GPUBOT_SSH_USER/GPUBOT_SSH_KEY to a user and key it accepts. {try_it}"
        )
    if "refused" in message:
        return f"Nothing listens on port {target.port}: start sshd there, or fix the port in GPUBOT_SSH_HOSTS. {try_it}"
    if "host key" in message:
        return f"The host was reinstalled or is not the one you meant; check its key before trusting it. {try_it}"
    return (
        f"Check that {target.host} is up and reachable from here (firewall, VPN), that sshd listens on "
        f"port {target.port}, and that user {target.user} accepts the key ({key}). {try_it}"
    )


def _ssh_one(client: SshClient, target: SshTarget, name: str, timeout_s: float) -> list[Check]:
    return [_ssh_login(client, target, name, timeout_s)]


def _ssh_login(client: SshClient, target: SshTarget, name: str, timeout_s: float) -> Check:
    if target.key_path and not Path(target.key_path).is_file():
        return Check(
            name,
            False,
            f"the SSH key {target.key_path} does not exist",
            "Set GPUBOT_SSH_KEY to the private key file the hosts accept.",
        )
    try:
        result = client.run(target, "true", timeout=timeout_s)
    except SshError as exc:
        return Check(name, False, str(exc), _ssh_fix(target, str(exc)))
    if not result.ok:
        return Check(
            name,
            False,
            f"logged in to {target.label}, but `true` exited {result.exit_code}",
            f"The login shell of {target.user} on {target.host} is broken; check its shell and profile.",
        )
    return Check(name, True, f"{target.label}: logged in and ran a command")


# --- this machine's GPUs ---------------------------------------------------------------


def _telemetry_json() -> str:
    """A child process, as on a remote host, so the bot's process never loads NVML."""
    proc = subprocess.run(
        [sys.executable, "-m", "training.telemetry", "--json"],
        capture_output=True,
        text=True,
        timeout=TELEMETRY_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(tail)
    return proc.stdout


def check_gpus(settings: Settings, probe: NvmlProbe | None = None) -> list[Check]:
    name = "This machine's GPUs"
    fix = "Run `python -m training.telemetry` to see what the probe says."
    try:
        text = (probe or _telemetry_json)()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return [Check(name, False, f"the GPU probe failed: {exc}", fix)]
    snap = parse_snapshot(text)
    if snap is None:
        return [Check(name, False, "the GPU probe's answer could not be read", fix)]
    if snap.source == "none" or not snap.gpus:
        why = snap.error or NO_DRIVER
        return [
            Note(
                name,
                True,
                f"{why}: this machine will offer CPU slots",
                "If it has an NVIDIA GPU, install the driver (nvidia-smi should list it); otherwise nothing to do.",
            )
        ]
    counts = Counter(g.name for g in snap.gpus)
    summary = ", ".join(f"{n} × {model}" for model, n in counts.items()) + f" (via {snap.source})"
    if settings.local_gpus == "none":
        summary += "; GPUBOT_LOCAL_GPUS=none, so the bot offers CPU slots instead"
    if snap.error:
        return [
            Note(
                name,
                True,
                f"{summary}; but {snap.error}",
                "Some metrics are missing; the GPUs are still usable.",
            )
        ]
    return [Check(name, True, summary)]


# --- the run account --------------------------------------------------------------------

_RUN_AS_FIX = (
    "Create an unprivileged account (`sudo useradd --create-home --shell /bin/sh gpubot-run`) "
    "and set GPUBOT_RUN_AS=gpubot-run; a bot that is not root also needs the sudoers line "
    "`BOTUSER ALL=(gpubot-run) NOPASSWD: /usr/bin/env` (README, Configuration)."
)


def check_run_account(settings: Settings) -> list[Check]:
    """Runs on this machine must not run as the bot, next to its secrets (bot.faces.runtime)."""
    name = "Run account"
    if settings.provider != "local":
        return [Check(name, True, "runs go to the GPU hosts, which get none of the bot's secrets")]
    if not settings.run_as:
        return [
            Note(
                name,
                True,
                "GPUBOT_RUN_AS is not set: `gpubot serve` refuses runs (they would run as the "
                "bot's own user, able to read its tokens and database); `gpubot shell` runs "
                "them as you. Reservations work either way",
                _RUN_AS_FIX,
            )
        ]
    import pwd

    try:
        account = pwd.getpwnam(settings.run_as)
    except KeyError:
        return [
            Check(name, False, f"GPUBOT_RUN_AS={settings.run_as}: no such account", _RUN_AS_FIX)
        ]
    if account.pw_uid == os.geteuid():
        return [
            Check(
                name,
                False,
                f"GPUBOT_RUN_AS={settings.run_as} is the bot's own account: runs could read its secrets",
                _RUN_AS_FIX,
            )
        ]
    home = settings.home
    if home.exists() and home.stat().st_mode & 0o077:
        return [
            Check(
                name,
                False,
                f"{home} (GPUBOT_HOME) is open to other accounts, the run account among them",
                f"chmod 700 {home} (every gpubot command also does this on start)",
            )
        ]
    checks: list[Check] = [
        Check(
            name,
            True,
            f"runs run as {settings.run_as} (uid {account.pw_uid}), in {account.pw_dir}/.gpubot/runs",
        )
    ]
    own = run_account_interpreter(settings.run_as)
    if own is not None:
        checks.append(own)
    return checks


def run_account_interpreter(account: str) -> Check | None:
    """Whether the run account can run `training` and torch with the bot's interpreter;
    where it cannot (a checkout in a private home), what its first run will do instead
    and the exact fix, so nobody learns it from a run that waits minutes for an install."""
    from bot.app.runaccount import bot_pip_env, run_account_fix
    from provisioning import shell
    from provisioning.local_runner import LOCAL_TARGET, LocalRunner
    from provisioning.ssh import SshError

    try:
        runner = LocalRunner(run_as=account)
        probe = runner.run(
            LOCAL_TARGET,
            shell.join([sys.executable, "-c", "import training.runner, torch"]),
            timeout=180,
            cwd=runner.account.home,
        )
    except SshError as exc:
        return Check("Run environment", False, f"cannot run a command as {account}: {exc}")
    if probe.ok:
        return None
    why = (probe.stderr.strip().splitlines() or [f"exit {probe.exit_code}"])[-1][:200]
    source = ", ".join(sorted(bot_pip_env())) or "pip's defaults (PyPI)"
    return Note(
        "Run environment",
        True,
        f"{account} cannot use the bot's interpreter {sys.executable} ({why}): its first run "
        f"installs an environment of its own under {runner.account.home}/.gpubot (the train "
        f"extra, torch included, from {source}), which takes minutes once",
        run_account_fix(account),
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
        try:
            targets = ssh_targets_from_env(os.environ)
        except ConfigError as exc:
            targets = ()
            bad_hosts = [Check("SSH hosts", False, exc.text, "Fix GPUBOT_SSH_HOSTS.")]
        else:
            bad_hosts = []
        checks = run_checks(settings, ssh_targets=targets) + bad_hosts
    if json_out:
        typer.echo(as_json(checks))
    else:
        for check in checks:
            typer.echo(render(check))
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)
