"""One `Settings` object, read once: defaults, then the TOML file named by
`GPUBOT_CONFIG`, then the environment (the environment wins, as a PaaS expects).

Secrets (Slack tokens) come only from the environment and are masked in `repr`
so that logging a Settings object can never leak them.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from bot.durations import format_duration, parse_duration
from bot.errors import UserError

PROVIDERS = ("local", "ssh", "aws")


@dataclass(frozen=True)
class Settings:
    # Where SQLite and other local state live (`$GPUBOT_HOME`, default ./.gpubot).
    home: Path = Path(".gpubot")
    # SQLAlchemy URL; empty means SQLite at <home>/gpubot.db.
    database_url: str = ""
    # Which compute the bot manages: this machine, static SSH hosts, or EC2.
    provider: str = "local"
    # CPU slots the local host offers when it has no NVIDIA GPU.
    local_slots: int = 1
    # "auto": offer this machine's NVIDIA GPUs if it has any; "none": CPU slots only.
    local_gpus: str = "auto"
    # The unprivileged unix account that runs training runs on this machine (its home
    # holds their directories); None: runs are refused by `gpubot serve` on the local
    # provider, and `gpubot shell` (one trusted person) runs them as itself.
    run_as: str | None = None
    # GPU model a bare `/gpu reserve` asks for; None means any free GPU.
    default_gpu: str | None = None
    # Length of a reservation when the user gives none, and the most one may last.
    default_duration: timedelta = timedelta(hours=2)
    max_duration: timedelta = timedelta(days=3)
    # How long before its end a holder is warned by DM.
    expiry_warning: timedelta = timedelta(minutes=10)
    # User ids (Slack ids, or names in the shell) allowed to release anyone's GPUs.
    admins: tuple[str, ...] = ()
    # Who may start runs (`/gpu run`, the run form, `gpubot submit`): these user ids (Slack
    # ids, or names in the shell) and the members of these Slack user group ids. Both
    # empty: everyone who can use /gpu. Admins always may.
    run_users: tuple[str, ...] = ()
    run_groups: tuple[str, ...] = ()
    # Slack channel ids where `/gpu run` is accepted; empty: any channel, and DMs.
    run_channels: tuple[str, ...] = ()
    # Whether anyone may read any run's log; off: the run's owner and admins only.
    shared_logs: bool = False
    # Channel for team posts (utilization snapshots, digest, pool notes).
    channel: str = "gpu"
    # Seconds between worker ticks (expiry, grants, notification delivery).
    tick_seconds: float = 15.0
    # How old the shared part of /gpu status may be when another process changed it
    # (this process's own writes drop it at once); 0 turns the cache off.
    status_cache_s: float = 1.0
    # The team's time zone, for the digest and for "today"/"this week".
    timezone: str = "UTC"
    # --- the fleet (EC2) -----------------------------------------------------------
    # A rented instance with no reservation and no run for this long is stopped, and one
    # stopped for terminate_after is terminated (each with a channel note).
    idle_stop_after: timedelta = timedelta(minutes=15)
    terminate_after: timedelta = timedelta(days=3)
    # Caps per instance type unless `/gpu pool` set one: how many may exist (running or
    # booting), and what all of that type may cost per running hour (0: no cap).
    pool_max_instances: int = 4
    pool_max_usd_per_hour: float = 0.0
    # The root volume of each instance and its price: what a stopped instance costs.
    ebs_gb: float = 500.0
    ebs_usd_gb_month: float = 0.08
    # --- utilization --------------------------------------------------------------
    # How often the worker samples every busy host's GPUs, and posts a snapshot to the
    # channel (only while something runs; 0 turns the post off).
    util_sample_s: float = 60.0
    util_post_interval: timedelta = timedelta(hours=1)
    # A held GPU under idle_util_pct for idle_window is idle; its holder is asked
    # Keep/Release and, with no answer in idle_grace, it is released.
    idle_util_pct: float = 5.0
    idle_window: timedelta = timedelta(minutes=30)
    idle_grace: timedelta = timedelta(minutes=15)
    # --- the weekly digest --------------------------------------------------------
    # When the digest is posted, in the team's time zone: "<weekday> HH:MM".
    digest_at: str = "mon 09:00"
    # --- prices -------------------------------------------------------------------
    # The catalog CSV `gpubot prices refresh` writes and the bot prefers over the shipped
    # snapshot when it exists; None means <home>/prices.csv.
    prices_file: Path | None = None
    # Slack credentials: environment only, never printed.
    slack_bot_token: str = field(default="", repr=False)
    slack_signing_secret: str = field(default="", repr=False)
    slack_app_token: str = field(default="", repr=False)
    slack_api_url: str = ""

    @property
    def prices_path(self) -> Path:
        return self.prices_file or self.home / "prices.csv"

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'gpubot.db'}"

    def is_admin(self, user_key: str) -> bool:
        return user_key in self.admins

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("slack_") and f.name.endswith(("token", "secret")):
                value = "<set>" if value else "<unset>"
            elif isinstance(value, timedelta):
                value = format_duration(value)
            shown.append(f"{f.name}={value!r}")
        return "Settings(" + ", ".join(shown) + ")"


_ENV = {
    "GPUBOT_HOME": "home",
    "DATABASE_URL": "database_url",
    "GPUBOT_PROVIDER": "provider",
    "GPUBOT_LOCAL_SLOTS": "local_slots",
    "GPUBOT_LOCAL_GPUS": "local_gpus",
    "GPUBOT_RUN_AS": "run_as",
    "GPUBOT_DEFAULT_GPU": "default_gpu",
    "GPUBOT_DEFAULT_DURATION": "default_duration",
    "GPUBOT_MAX_DURATION": "max_duration",
    "GPUBOT_EXPIRY_WARNING": "expiry_warning",
    "GPUBOT_ADMINS": "admins",
    "GPUBOT_RUN_USERS": "run_users",
    "GPUBOT_RUN_GROUPS": "run_groups",
    "GPUBOT_RUN_CHANNELS": "run_channels",
    "GPUBOT_SHARED_LOGS": "shared_logs",
    "GPUBOT_CHANNEL": "channel",
    "GPUBOT_TICK_SECONDS": "tick_seconds",
    "GPUBOT_STATUS_CACHE_SECONDS": "status_cache_s",
    "GPUBOT_TIMEZONE": "timezone",
    "GPUBOT_IDLE_STOP_AFTER": "idle_stop_after",
    "GPUBOT_TERMINATE_AFTER": "terminate_after",
    "GPUBOT_POOL_MAX_INSTANCES": "pool_max_instances",
    "GPUBOT_POOL_MAX_USD_PER_HOUR": "pool_max_usd_per_hour",
    "GPUBOT_EBS_GB": "ebs_gb",
    "GPUBOT_EBS_USD_GB_MONTH": "ebs_usd_gb_month",
    "GPUBOT_UTIL_SAMPLE_SECONDS": "util_sample_s",
    "GPUBOT_UTIL_POST_INTERVAL": "util_post_interval",
    "GPUBOT_IDLE_UTIL_PCT": "idle_util_pct",
    "GPUBOT_IDLE_WINDOW": "idle_window",
    "GPUBOT_IDLE_GRACE": "idle_grace",
    "GPUBOT_DIGEST_AT": "digest_at",
    "GPUBOT_PRICES_FILE": "prices_file",
    "SLACK_BOT_TOKEN": "slack_bot_token",
    "SLACK_SIGNING_SECRET": "slack_signing_secret",
    "SLACK_APP_TOKEN": "slack_app_token",
    "SLACK_API_URL": "slack_api_url",
}
_FILE_ONLY_FORBIDDEN = {"slack_bot_token", "slack_signing_secret", "slack_app_token"}


class ConfigError(UserError):
    """A bad setting: the message names the setting and where it came from."""


# Settings in seconds and the range each may take.
_SECONDS = {
    "tick_seconds": (0.05, 3600.0),
    "status_cache_s": (0.0, 60.0),
    "util_sample_s": (0.05, 3600.0),
}
# Plain numbers and the range each may take.
_NUMBERS = {
    "pool_max_usd_per_hour": (0.0, 1e6),
    "ebs_gb": (0.0, 1e5),
    "ebs_usd_gb_month": (0.0, 100.0),
    "idle_util_pct": (0.0, 100.0),
}
_DURATIONS = {
    "default_duration",
    "max_duration",
    "expiry_warning",
    "idle_stop_after",
    "terminate_after",
    "util_post_interval",
    "idle_window",
    "idle_grace",
}
_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
# Settings that hold Slack ids, the shape of each, and an example for the error.
_SLACK_IDS = {
    "run_groups": (r"S[A-Z0-9]{2,}", "S0614TZR7 (a user group's id, not its @handle)"),
    "run_channels": (r"[CGD][A-Z0-9]{2,}", "C0123ABCD (a channel's id, not its #name)"),
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_weekly_time(raw: str) -> tuple[int, int, int]:
    """`"mon 09:00"` → (weekday 0-6, hour, minute); ValueError with the accepted form."""
    parts = raw.strip().lower().split()
    if len(parts) == 2 and parts[0][:3] in _WEEKDAYS:
        hh, sep, mm = parts[1].partition(":")
        if (
            sep
            and parts[1].isascii()
            and hh.isdigit()
            and mm.isdigit()
            and int(hh) < 24
            and int(mm) < 60
        ):
            return _WEEKDAYS.index(parts[0][:3]), int(hh), int(mm)
    raise ValueError(f"expected a weekday and a time like 'mon 09:00', not {raw!r}")


def _coerce(name: str, raw: Any, source: str) -> Any:
    where = f"{name} (from {source})"
    if name == "home":
        return Path(str(raw)).expanduser()
    if name == "prices_file":
        return Path(str(raw)).expanduser() if str(raw).strip() else None
    if name in {"local_slots", "pool_max_instances"}:
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a whole number, not {raw!r}") from None
        if not 0 <= value <= 64:
            raise ConfigError(f"{where} must be between 0 and 64")
        return value
    if name in _NUMBERS:
        low, high = _NUMBERS[name]
        try:
            number = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, not {raw!r}") from None
        if not low <= number <= high:
            raise ConfigError(f"{where} must be between {low:g} and {high:g}")
        return number
    if name == "digest_at":
        try:
            parse_weekly_time(str(raw))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return str(raw).strip().lower()
    if name in _SECONDS:
        low, high = _SECONDS[name]
        try:
            secs = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number of seconds, not {raw!r}") from None
        if not low <= secs <= high:
            raise ConfigError(f"{where} must be between {low:g} and {high:g} seconds")
        return secs
    if name in _DURATIONS:
        if name == "util_post_interval" and str(raw).strip().lower() in {"0", "off"}:
            return timedelta(0)
        delta = parse_duration(str(raw))
        if delta is None:
            raise ConfigError(f"{where} must be a duration like 2h or 30m, not {raw!r}")
        return delta
    if name in {"admins", "run_users"}:
        items = raw if isinstance(raw, list) else str(raw).split(",")
        return tuple(str(i).strip().lstrip("@") for i in items if str(i).strip())
    if name in _SLACK_IDS:
        pattern, example = _SLACK_IDS[name]
        items = raw if isinstance(raw, list) else str(raw).split(",")
        ids = tuple(str(i).strip() for i in items if str(i).strip())
        for item in ids:
            if not re.fullmatch(pattern, item):
                # A name instead of an id would match nothing and lock everyone out.
                raise ConfigError(f"{where} takes Slack ids like {example}, not {item!r}")
        return ids
    if name == "shared_logs":
        flag = str(raw).strip().lower()
        if flag not in _TRUE | _FALSE:
            raise ConfigError(f"{where} must be true or false, not {raw!r}")
        return flag in _TRUE
    if name == "provider":
        provider = str(raw).strip().lower()
        if provider not in PROVIDERS:
            raise ConfigError(f"{where} must be one of {', '.join(PROVIDERS)}, not {raw!r}")
        return provider
    if name == "run_as":
        account = str(raw).strip()
        if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", account):
            raise ConfigError(f"{where} must be a unix account name like gpubot-run, not {raw!r}")
        return account
    if name == "local_gpus":
        mode = str(raw).strip().lower()
        if mode not in {"auto", "none"}:
            raise ConfigError(f"{where} must be auto or none, not {raw!r}")
        return mode
    if name == "timezone":
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        zone = str(raw).strip()
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigError(
                f"{where} must be an IANA time zone like Europe/Berlin, not {raw!r}"
            ) from None
        return zone
    if name == "default_gpu":
        text = str(raw).strip()
        return text or None
    if name == "channel":
        return str(raw).strip().lstrip("#") or "gpu"
    return str(raw)


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Reads the config once; callers pass the result down instead of reading env again."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    config_path = env.get("GPUBOT_CONFIG", "")
    if config_path:
        path = Path(config_path).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"GPUBOT_CONFIG points at {path}, which does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
        known = {f.name for f in fields(Settings)}
        for key, raw in data.items():
            if key not in known:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            if key in _FILE_ONLY_FORBIDDEN:
                raise ConfigError(f"{path}: {key} is a secret; set it in the environment instead")
            values[key] = _coerce(key, raw, str(path))
    for var, name in _ENV.items():
        if var in env and env[var] != "":
            values[name] = _coerce(name, env[var], var)
    for name, raw in overrides.items():
        values[name] = raw
    settings = Settings(**values)
    if settings.default_duration > settings.max_duration:
        settings = replace(settings, default_duration=settings.max_duration)
    return settings
