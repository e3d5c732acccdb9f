"""Every time a person reads, in one style and in the team's time zone.

The bot keeps and compares times in UTC (`bot.domain.clock`); a reply, a DM or a channel post
shows them here, in `GPUBOT_TIMEZONE` with the zone's own abbreviation, and where it
helps with the distance from now ("in 3h", "5m ago"), so nobody has to do sums across
zones. The strftime patterns live only in this module.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

from bot.domain.durations import format_duration

# Within this much of now, "now" reads better than "in 0s".
_NOW = timedelta(seconds=30)


@lru_cache(maxsize=64)
def zone(tz: str) -> ZoneInfo:
    """The team's zone; `Settings` has already refused a name the system does not know."""
    return ZoneInfo(tz)


def local(at: datetime, tz: str) -> datetime:
    return at.astimezone(zone(tz))


def clock(at: datetime, tz: str) -> str:
    """`14:30 CET`: a time of day with its zone."""
    here = local(at, tz)
    return f"{here:%H:%M} {here.tzname()}"


def day(at: datetime, tz: str, year: bool = False) -> str:
    """`Thu 03 Dec` (with `2026` when asked): the calendar day in the team's zone."""
    return local(at, tz).strftime("%a %d %b %Y" if year else "%a %d %b")


def date_time(at: datetime, tz: str) -> str:
    """`2026-12-03 14:30`: sortable, for a chart's title."""
    return f"{local(at, tz):%Y-%m-%d %H:%M}"


def stamp(at: datetime, tz: str) -> str:
    """`Thu 03 Dec 14:30 CET`: a day and a time, for a moment not close to today."""
    return f"{day(at, tz)} {clock(at, tz)}"


def relative(at: datetime, now: datetime) -> str:
    """`in 3h`, `5m ago`, or `now`."""
    delta = at - now
    if abs(delta) < _NOW:
        return "now"
    if delta > timedelta(0):
        return f"in {format_duration(delta)}"
    return f"{format_duration(-delta)} ago"


def when(at: datetime, now: datetime, tz: str) -> str:
    """`14:30 CET (in 2h)`: absolute for the record, relative for the reader; the day is
    named when it is not today in the team's zone."""
    same_day = local(at, tz).date() == local(now, tz).date()
    shown = clock(at, tz) if same_day else stamp(at, tz)
    return f"{shown} ({relative(at, now)})"


def days(start: datetime, end: datetime, tz: str, year: bool = False) -> str:
    """The calendar days of [start, end) in the team's zone: `Thu 03 Dec` for one day,
    `Mon 30 Nov – Sun 06 Dec` for several (the end is exclusive, so a window that ends at
    midnight names the day before)."""
    first = local(start, tz)
    last = local(max(end - timedelta(seconds=1), start), tz)
    if first.date() == last.date():
        return day(start, tz, year)
    return f"{day(start, tz)} – {day(last, tz, year)}"
