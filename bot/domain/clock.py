"""Time as a seam: the service never reads the wall clock itself.

The shell and the worker use `SystemClock`; tests and the simulator use
`VirtualClock`, so that a reservation can expire without anybody waiting.
All times are timezone-aware UTC.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class VirtualClock:
    """A clock that moves only when told to; thread-safe because the worker reads it too."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
        if self._now.tzinfo is None:
            raise ValueError("VirtualClock needs a timezone-aware start")
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta) -> datetime:
        if delta < timedelta(0):
            raise ValueError("time does not run backwards")
        with self._lock:
            self._now += delta
            return self._now

    def set(self, when: datetime) -> None:
        with self._lock:
            if when < self._now:
                raise ValueError("time does not run backwards")
            self._now = when
