"""One `Settings` object, read once: defaults, then the TOML file named by
`GPUBOT_CONFIG`, then the environment (the environment wins, as a PaaS expects).

Each setting is declared once, on its field: its type, its default, the environment
variable it is read from (`Env`) and the rule that turns what a person typed into the
value. Pydantic runs that rule whatever the value came from (the environment, the file,
`load_settings(**overrides)` or `Settings(...)` in code), so no path stores a value of
the wrong type, and adding a setting is one field, not a branch in a chain of names.

Secrets (the Slack tokens and signing secret, and the database URL, which may carry a
password) are `SecretStr`: `repr`, `str` and a traceback's locals show a mask, and the
value leaves only through `.get_secret_value()` where it is handed to a client. The Slack
secrets come only from the environment: a config file that holds one is refused.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BeforeValidator, SecretStr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from bot.domain.durations import ascii_digits, format_duration, parse_duration, parse_threshold
from bot.domain.errors import UserError
from bot.domain.scheduling import BURST_AFTER_S, IDLE_STOP_S
from provisioning.costs import DEFAULT_COSTS


class ConfigError(UserError):
    """A bad setting: the message names the setting and where it came from."""


@dataclass(frozen=True)
class Env:
    """Field metadata: the environment variable a setting is read from, and whether the
    config file may hold it too (not for secrets, which a file in a repository leaks)."""

    var: str
    in_file: bool = True


class _Refusal(ValueError):
    """What a rule says about a value it cannot take. `load_settings` puts the setting's
    name and the place the value came from in front: `{name} (from {source}){sep}{text}`."""

    def __init__(self, text: str, sep: str = " ") -> None:
        super().__init__(text)
        self.text = text
        self.sep = sep


def _rule(parse: Callable[[Any], Any]) -> BeforeValidator:
    return BeforeValidator(parse)


# --- the rules: each takes text (environment), a TOML value, or a typed value (code) ---


def _is_number(raw: object) -> bool:
    # bool is an int to Python; `local_slots = true` is a mistake, not 1.
    return isinstance(raw, int | float) and not isinstance(raw, bool)


def _text(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    if _is_number(raw):  # `default_gpu = 4090` in TOML means the text
        return str(raw)
    raise _Refusal(f"must be text, not {raw!r}")


def _secret(raw: object) -> object:
    return raw if isinstance(raw, SecretStr) else _text(raw)


def _path(raw: object) -> Path:
    if isinstance(raw, Path):
        return raw.expanduser()
    return Path(_text(raw)).expanduser()


def _optional_path(raw: object) -> Path | None:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    return _path(raw)


def _whole(low: int, high: int) -> BeforeValidator:
    def parse(raw: object) -> int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise _Refusal(f"must be a whole number, not {raw!r}")
        try:
            value = int(raw)
        except ValueError:
            raise _Refusal(f"must be a whole number, not {raw!r}") from None
        if not low <= value <= high:
            raise _Refusal(f"must be between {low} and {high}")
        return value

    return _rule(parse)


def _number(low: float, high: float, unit: str = "") -> BeforeValidator:
    what = f"a number of {unit}" if unit else "a number"
    suffix = f" {unit}" if unit else ""

    def parse(raw: object) -> float:
        if not (_is_number(raw) or isinstance(raw, str)):
            raise _Refusal(f"must be {what}, not {raw!r}")
        try:
            number = float(raw)  # type: ignore[arg-type]
        except ValueError:
            raise _Refusal(f"must be {what}, not {raw!r}") from None
        if not low <= number <= high:
            raise _Refusal(f"must be between {low:g} and {high:g}{suffix}")
        return number

    return _rule(parse)


def _duration(off_allowed: bool = False) -> BeforeValidator:
    """Durations as `bot.domain.durations` reads them (`2h`, `1h30m`); `off_allowed`: also
    `0`/`off`, which turns the thing off."""

    def parse(raw: object) -> timedelta:
        if isinstance(raw, timedelta):
            positive = raw > timedelta(0) or (off_allowed and raw == timedelta(0))
            if positive and raw <= timedelta(days=366):
                return raw
        elif isinstance(raw, str) or _is_number(raw):
            # A TOML number is read as the text it is (`0` turns off; `7200` has no unit).
            text = str(raw)
            if off_allowed and text.strip().lower() in {"0", "off"}:
                return timedelta(0)
            delta = parse_duration(text)
            if delta is not None:
                return delta
        raise _Refusal(f"must be a duration like 2h or 30m, not {raw!r}")

    return _rule(parse)


def _items(raw: object) -> list[str]:
    if isinstance(raw, str):
        items: list[object] = list(raw.split(","))
    elif isinstance(raw, list | tuple):
        items = list(raw)
    else:
        raise _Refusal(f"must be a list or comma-separated text, not {raw!r}")
    texts = (_text(item).strip() for item in items)
    return [text for text in texts if text]


def _names(raw: object) -> tuple[str, ...]:
    """User ids or shell names, `@` optional."""
    return tuple(item.lstrip("@") for item in _items(raw))


def _slack_ids(pattern: str, example: str) -> BeforeValidator:
    def parse(raw: object) -> tuple[str, ...]:
        ids = tuple(_items(raw))
        for item in ids:
            if not re.fullmatch(pattern, item):
                # A name instead of an id would match nothing and lock everyone out.
                raise _Refusal(f"takes Slack ids like {example}, not {item!r}")
        return ids

    return _rule(parse)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    flag = str(raw).strip().lower() if isinstance(raw, str | int) else ""
    if flag not in _TRUE | _FALSE:
        raise _Refusal(f"must be true or false, not {raw!r}")
    return flag in _TRUE


def _provider(raw: object) -> str:
    """A provider's name: a word (which names exist is bot.providers' to say)."""
    provider = str(raw).strip().lower()
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", provider):
        raise _Refusal(f"must name a provider (local, ssh, aws, slurm), not {raw!r}")
    return provider


def _providers(raw: object) -> tuple[str, ...]:
    """Several providers, owned first: `slurm,aws`."""
    return tuple(_provider(item) for item in _items(raw))


def _burst_after(raw: object) -> float | None:
    """GPUBOT_BURST_AFTER: `90s`, `15m`, `0` (offer at once) or `never` (None)."""
    if raw is None:
        return None
    if _is_number(raw) and not isinstance(raw, bool):
        return float(raw)  # type: ignore[arg-type]
    try:
        return parse_threshold(str(raw))
    except ValueError as exc:
        raise _Refusal(str(exc)) from None


def _local_gpus(raw: object) -> str:
    mode = str(raw).strip().lower()
    if mode not in {"auto", "none"}:
        raise _Refusal(f"must be auto or none, not {raw!r}")
    return mode


def _account(raw: object) -> str | None:
    if raw is None:
        return None
    account = str(raw).strip()
    if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", account):
        raise _Refusal(f"must be a unix account name like gpubot-run, not {raw!r}")
    return account


def _timezone(raw: object) -> str:
    zone = str(raw).strip()
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise _Refusal(f"must be an IANA time zone like Europe/Berlin, not {raw!r}") from None
    return zone


_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def parse_weekly_time(raw: str) -> tuple[int, int, int]:
    """`"mon 09:00"` → (weekday 0-6, hour, minute); ValueError with the accepted form."""
    parts = raw.strip().lower().split()
    if len(parts) == 2 and parts[0][:3] in _WEEKDAYS:
        hh, sep, mm = parts[1].partition(":")
        if sep and ascii_digits(hh) and ascii_digits(mm) and int(hh) < 24 and int(mm) < 60:
            return _WEEKDAYS.index(parts[0][:3]), int(hh), int(mm)
    raise ValueError(f"expected a weekday and a time like 'mon 09:00', not {raw!r}")


def _weekly_time(raw: object) -> str:
    try:
        parse_weekly_time(str(raw))
    except ValueError as exc:
        raise _Refusal(str(exc), sep=": ") from None
    return str(raw).strip().lower()


def _gpu_model(raw: object) -> str | None:
    return None if raw is None else _text(raw).strip() or None


def _channel(raw: object) -> str:
    return _text(raw).strip().lstrip("#") or "gpu"


class Settings(BaseSettings):
    """The bot's settings. `Settings(...)` in code takes only its arguments (tests build
    one by hand); `load_settings()` is the one reader of the file and the environment."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", validate_default=True)

    # Where SQLite and other local state live (`$GPUBOT_HOME`, default ./.gpubot).
    home: Annotated[Path, Env("GPUBOT_HOME"), _rule(_path)] = Path(".gpubot")
    # SQLAlchemy URL; empty means SQLite at <home>/gpubot.db. Secret: it may hold a password.
    database_url: Annotated[SecretStr, Env("DATABASE_URL"), _rule(_secret)] = SecretStr("")
    # Where GPUs come from (bot.providers): this machine, static SSH hosts, EC2, a Slurm
    # cluster. GPUBOT_PROVIDERS names several, owned ones first (`slurm,aws`); it wins
    # over GPUBOT_PROVIDER when set.
    provider: Annotated[str, Env("GPUBOT_PROVIDER"), _rule(_provider)] = "local"
    providers: Annotated[tuple[str, ...], Env("GPUBOT_PROVIDERS"), _rule(_providers)] = ()
    # CPU slots the local host offers when it has no NVIDIA GPU.
    local_slots: Annotated[int, Env("GPUBOT_LOCAL_SLOTS"), _whole(0, 64)] = 1
    # "auto": offer this machine's NVIDIA GPUs if it has any; "none": CPU slots only.
    local_gpus: Annotated[str, Env("GPUBOT_LOCAL_GPUS"), _rule(_local_gpus)] = "auto"
    # The unprivileged unix account that runs training runs on this machine (its home
    # holds their directories); None: runs are refused by `gpubot serve` on the local
    # provider, and `gpubot shell` (one trusted person) runs them as itself.
    run_as: Annotated[str | None, Env("GPUBOT_RUN_AS"), _rule(_account)] = None
    # GPU model a bare `/gpu reserve` asks for; None means any free GPU.
    default_gpu: Annotated[str | None, Env("GPUBOT_DEFAULT_GPU"), _rule(_gpu_model)] = None
    # Length of a reservation when the user gives none, and the most one may last.
    default_duration: Annotated[timedelta, Env("GPUBOT_DEFAULT_DURATION"), _duration()] = timedelta(
        hours=2
    )
    max_duration: Annotated[timedelta, Env("GPUBOT_MAX_DURATION"), _duration()] = timedelta(days=3)
    # How long before its end a holder is warned by DM.
    expiry_warning: Annotated[timedelta, Env("GPUBOT_EXPIRY_WARNING"), _duration()] = timedelta(
        minutes=10
    )
    # User ids (Slack ids, or names in the shell) allowed to release anyone's GPUs.
    admins: Annotated[tuple[str, ...], Env("GPUBOT_ADMINS"), _rule(_names)] = ()
    # Who may start runs (`/gpu run`, the run form, `gpubot submit`): these user ids (Slack
    # ids, or names in the shell) and the members of these Slack user group ids. Both
    # empty: everyone who can use /gpu. Admins always may.
    run_users: Annotated[tuple[str, ...], Env("GPUBOT_RUN_USERS"), _rule(_names)] = ()
    run_groups: Annotated[
        tuple[str, ...],
        Env("GPUBOT_RUN_GROUPS"),
        _slack_ids(r"S[A-Z0-9]{2,}", "S0614TZR7 (a user group's id, not its @handle)"),
    ] = ()
    # Slack channel ids where `/gpu run` is accepted; empty: any channel, and DMs.
    run_channels: Annotated[
        tuple[str, ...],
        Env("GPUBOT_RUN_CHANNELS"),
        _slack_ids(r"[CGD][A-Z0-9]{2,}", "C0123ABCD (a channel's id, not its #name)"),
    ] = ()
    # Whether anyone may read any run's log; off: the run's owner and admins only.
    shared_logs: Annotated[bool, Env("GPUBOT_SHARED_LOGS"), _rule(_flag)] = False
    # Channel for team posts (utilization snapshots, digest, pool notes).
    channel: Annotated[str, Env("GPUBOT_CHANNEL"), _rule(_channel)] = "gpu"
    # Seconds between worker ticks (expiry, grants, notification delivery).
    tick_seconds: Annotated[float, Env("GPUBOT_TICK_SECONDS"), _number(0.05, 3600.0, "seconds")] = (
        15.0
    )
    # How old the shared part of /gpu status may be when another process changed it
    # (this process's own writes drop it at once); 0 turns the cache off.
    status_cache_s: Annotated[
        float, Env("GPUBOT_STATUS_CACHE_SECONDS"), _number(0.0, 60.0, "seconds")
    ] = 1.0
    # A run that fails on a host with less free disk than this where runs live there
    # fails "disk full on HOST", and the host takes nothing new until a check finds
    # this much free again (bot.app.hosts.room).
    min_free_mb: Annotated[float, Env("GPUBOT_MIN_FREE_MB"), _number(0.0, 1e9, "MB")] = 256.0
    # The team's time zone, for the digest and for "today"/"this week".
    timezone: Annotated[str, Env("GPUBOT_TIMEZONE"), _rule(_timezone)] = "UTC"
    # --- the fleet (EC2) -----------------------------------------------------------
    # With owned places and a cloud (GPUBOT_PROVIDERS=slurm,aws): how long a run waits
    # for the owned GPUs before its owner is offered the cloud, priced (bot.app.burst);
    # None (`never`): never offered.
    burst_after_s: Annotated[float | None, Env("GPUBOT_BURST_AFTER"), _rule(_burst_after)] = (
        BURST_AFTER_S
    )
    # An admin's caps on what bursting buys (0: none): the most one instance bought for a
    # waiting run may cost an hour, and how many such instances may run at once.
    burst_max_usd_per_hour: Annotated[
        float, Env("GPUBOT_BURST_MAX_USD_PER_HOUR"), _number(0.0, 1e6)
    ] = 0.0
    burst_max_instances: Annotated[int, Env("GPUBOT_BURST_MAX_INSTANCES"), _whole(0, 1024)] = 0
    # A rented instance with no reservation and no run for this long is stopped, and one
    # stopped for terminate_after is terminated (each with a channel note).
    idle_stop_after: Annotated[timedelta, Env("GPUBOT_IDLE_STOP_AFTER"), _duration()] = timedelta(
        seconds=IDLE_STOP_S  # the simulator's default too (bot.domain.scheduling)
    )
    terminate_after: Annotated[timedelta, Env("GPUBOT_TERMINATE_AFTER"), _duration()] = timedelta(
        days=3
    )
    # Caps per instance type unless `/gpu pool` set one: how many may exist (running or
    # booting), and what all of that type may cost per running hour (0: no cap).
    pool_max_instances: Annotated[int, Env("GPUBOT_POOL_MAX_INSTANCES"), _whole(0, 64)] = 4
    pool_max_usd_per_hour: Annotated[
        float, Env("GPUBOT_POOL_MAX_USD_PER_HOUR"), _number(0.0, 1e6)
    ] = 0.0
    # The root volume of each instance and its price: what a stopped instance costs.
    ebs_gb: Annotated[float, Env("GPUBOT_EBS_GB"), _number(0.0, 1e5)] = DEFAULT_COSTS.ebs_gb
    ebs_usd_gb_month: Annotated[float, Env("GPUBOT_EBS_USD_GB_MONTH"), _number(0.0, 100.0)] = (
        DEFAULT_COSTS.ebs_usd_gb_month
    )
    # --- utilization --------------------------------------------------------------
    # How often the worker samples every busy host's GPUs, and posts a snapshot to the
    # channel (only while something runs; 0 turns the post off).
    util_sample_s: Annotated[
        float, Env("GPUBOT_UTIL_SAMPLE_SECONDS"), _number(0.05, 3600.0, "seconds")
    ] = 60.0
    util_post_interval: Annotated[
        timedelta, Env("GPUBOT_UTIL_POST_INTERVAL"), _duration(off_allowed=True)
    ] = timedelta(hours=1)
    # A held GPU under idle_util_pct for idle_window is idle; its holder is asked
    # Keep/Release and, with no answer in idle_grace, it is released.
    idle_util_pct: Annotated[float, Env("GPUBOT_IDLE_UTIL_PCT"), _number(0.0, 100.0)] = 5.0
    idle_window: Annotated[timedelta, Env("GPUBOT_IDLE_WINDOW"), _duration()] = timedelta(
        minutes=30
    )
    idle_grace: Annotated[timedelta, Env("GPUBOT_IDLE_GRACE"), _duration()] = timedelta(minutes=15)
    # --- the weekly digest --------------------------------------------------------
    # When the digest is posted, in the team's time zone: "<weekday> HH:MM".
    digest_at: Annotated[str, Env("GPUBOT_DIGEST_AT"), _rule(_weekly_time)] = "mon 09:00"
    # --- prices -------------------------------------------------------------------
    # The catalog CSV `gpubot prices refresh` writes and the bot prefers over the shipped
    # snapshot when it exists; None means <home>/prices.csv.
    prices_file: Annotated[Path | None, Env("GPUBOT_PRICES_FILE"), _rule(_optional_path)] = None
    # --- Slack: the credentials come from the environment only ----------------------
    slack_bot_token: Annotated[SecretStr, Env("SLACK_BOT_TOKEN", in_file=False), _rule(_secret)] = (
        SecretStr("")
    )
    slack_signing_secret: Annotated[
        SecretStr, Env("SLACK_SIGNING_SECRET", in_file=False), _rule(_secret)
    ] = SecretStr("")
    slack_app_token: Annotated[SecretStr, Env("SLACK_APP_TOKEN", in_file=False), _rule(_secret)] = (
        SecretStr("")
    )
    slack_api_url: Annotated[str, Env("SLACK_API_URL"), _rule(_text)] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only the arguments: a `Settings()` built in code (a test, a bench) never picks up
        the environment it runs in. `load_settings` layers the file and the environment."""
        return (init_settings,)

    @property
    def prices_path(self) -> Path:
        return self.prices_file or self.home / "prices.csv"

    @property
    def sqlalchemy_url(self) -> str:
        """The database URL for `make_engine`, password included: it leaves only here."""
        return self.database_url.get_secret_value() or f"sqlite:///{self.home / 'gpubot.db'}"

    def is_admin(self, user_key: str) -> bool:
        return user_key in self.admins

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """What `repr` and `str` show: secrets as `<set>`/`<unset>` (the database URL with
        its password masked, since where the database is helps and the password never
        does), durations the way a person types them."""
        for name, value in super().__repr_args__():
            if name == "database_url":
                yield name, _URL_PASSWORD.sub(r"\1***@", self.database_url.get_secret_value())
            elif isinstance(value, SecretStr):
                yield name, "<set>" if value else "<unset>"
            elif isinstance(value, timedelta):
                yield name, format_duration(value)
            else:
                yield name, value


_URL_PASSWORD = re.compile(r"(://[^\s:/@]*:)[^\s@/]+@")

# Each setting's environment variable, and which settings a config file may not hold.
_ENV: Final[dict[str, str]] = {
    meta.var: name
    for name, info in Settings.model_fields.items()
    for meta in info.metadata
    if isinstance(meta, Env)
}
_ENV_ONLY: Final[frozenset[str]] = frozenset(
    name
    for name, info in Settings.model_fields.items()
    for meta in info.metadata
    if isinstance(meta, Env) and not meta.in_file
)


def _checked(name: str, raw: Any, source: str) -> Any:
    """One value through its setting's rule, a refusal worded as a ConfigError that says
    where the value came from (the variable, the file, or an override in code)."""
    try:
        return getattr(Settings.model_validate({name: raw}), name)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = error.get("ctx", {}).get("error")
        where = f"{name} (from {source})"
        if isinstance(cause, _Refusal):
            raise ConfigError(f"{where}{cause.sep}{cause.text}") from None
        raise ConfigError(f"{where}: {error['msg']}") from None


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Reads the config once; callers pass the result down instead of reading env again.

    The layers are read here rather than by pydantic-settings' own environment source
    because every refusal names where its value came from (`local_slots (from
    GPUBOT_LOCAL_SLOTS) must be …`), `env` may be a given mapping (tests, doctor), and
    list settings are comma-separated text rather than JSON. Every layer, overrides
    included, goes through the same per-setting rules; a bad value in a lower layer is
    refused even when a higher one sets the same setting, as before.
    """
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
        for key, raw in data.items():
            if key not in Settings.model_fields:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            if key in _ENV_ONLY:
                raise ConfigError(f"{path}: {key} is a secret; set it in the environment instead")
            values[key] = _checked(key, raw, str(path))
    for var, name in _ENV.items():
        if var in env and env[var] != "":
            values[name] = _checked(name, env[var], var)
    for name, raw in overrides.items():
        if name not in Settings.model_fields:
            raise ConfigError(f"unknown setting {name!r}")
        values[name] = _checked(name, raw, "override")
    settings = Settings(**values)
    if settings.default_duration > settings.max_duration:
        settings = settings.model_copy(update={"default_duration": settings.max_duration})
    return settings
