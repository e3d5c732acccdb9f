"""Column types shared by the tables.

`UTCDateTime` exists because SQLite has no time zones: it stores naive UTC and
hands back aware UTC on both SQLite and PostgreSQL, so comparisons in Python
never mix naive and aware datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; pass an aware datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    @staticmethod
    def sqlite_text(value: datetime) -> str:
        """An aware datetime as SQLAlchemy stores it in SQLite (naive UTC text, always
        with microseconds): for writers that bypass SQLAlchemy (`db.session.insert_rows`),
        whose values must compare and sort with the ones it wrote."""
        if value.tzinfo is UTC:  # the usual case: the text less its "+00:00"
            return value.isoformat(" ", "microseconds")[:26]
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; pass an aware datetime")
        return value.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
