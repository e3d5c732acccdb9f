"""Durations as people type them: `3h`, `90m`, `1h30m`, `2d`, `45s`, `1.5h`.

Shared by the `/gpu` grammar and the config file so that both accept the same
spellings and print them back the same way.
"""

from __future__ import annotations

import re
from datetime import timedelta


def ascii_digits(text: str) -> bool:
    """ASCII digits only: `str.isdigit()` also says yes to "²", which `int()` refuses
    (a 500 in Slack). The one test for every count, id and clock time people type."""
    return text.isascii() and text.isdigit()


_UNITS = {
    "s": 1,
    "sec": 1,
    "secs": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "mins": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hr": 3600,
    "hrs": 3600,
    "hour": 3600,
    "hours": 3600,
    "d": 86400,
    "day": 86400,
    "days": 86400,
    "w": 604800,
    "week": 604800,
    "weeks": 604800,
}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")
_WHOLE = re.compile(r"^(?:\d+(?:\.\d+)?\s*[a-z]+\s*)+$")


def parse_duration(text: str) -> timedelta | None:
    """Returns None for anything that is not a positive duration (the caller words the error)."""
    t = text.strip().lower()
    if not t or len(t) > 32 or not _WHOLE.match(t):
        return None
    total = 0.0
    for number, unit in _PART.findall(t):
        if unit not in _UNITS:
            return None
        total += float(number) * _UNITS[unit]
    if total <= 0 or total > 366 * 86400:
        return None
    return timedelta(seconds=round(total))


def parse_threshold(text: str) -> float | None:
    """A wait threshold as the bot writes them (GPUBOT_BURST_AFTER, `gpubot simulate
    --burst-after`): `90s`, `15m`, `0` (at once) or `never` (None); raises ValueError
    saying what it wants."""
    t = text.strip().lower()
    if t == "never":
        return None
    if t in ("0", "0s", "0m", "0h"):
        return 0.0
    span = parse_duration(t)
    if span is None:
        raise ValueError(f"wants a duration like 90s, 15m or 1h, 0 or never, not {text!r}")
    return span.total_seconds()


def format_seconds(seconds: float) -> str:
    """`format_duration` of a count of seconds, to the nearest second."""
    return format_duration(timedelta(seconds=round(seconds)))


def format_duration(delta: timedelta) -> str:
    """Short and exact to the minute above an hour: `2h`, `1h30m`, `45m`, `30s`, `3d4h`."""
    secs = round(delta.total_seconds())
    if secs < 0:
        return "-" + format_duration(-delta)
    if secs < 60:
        return f"{secs}s"
    days, rem = divmod(secs, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, seconds = divmod(rem, 60)
    parts = []
    if days:
        parts.append(f"{days}d")
    if hours:
        parts.append(f"{hours}h")
    if minutes and not days:
        parts.append(f"{minutes}m")
    if seconds and not days and not hours:
        parts.append(f"{seconds}s")
    return "".join(parts) or "0s"
