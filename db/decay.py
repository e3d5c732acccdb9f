"""Exponential decay, the same in Python and in SQL: the fair-share counters
(`bot.app.money.rollups`) are brought forward inside the upsert that adds to them, so a
release writes its users' counters without reading them first.

Why one function in three forms: the counters are compared with a rebuild from the raw
intervals (Python), and the two must agree to the last bits, not roughly. PostgreSQL
computes `value * power(0.5, greatest(0, seconds) / half_life)` with the elapsed
seconds from `EXTRACT(EPOCH ...)` (exact, then rounded once to a double, as
`timedelta.total_seconds` rounds) and C's `pow`, as Python's `math.pow` does. SQLite has
no interval arithmetic on its datetime text (`julianday` keeps only about 50 µs at
today's dates), so there the expression calls `gpubot_decay`, this module's Python,
registered on every connection (`register_sqlite`).
"""

from __future__ import annotations

import math
import sqlite3
from datetime import datetime
from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import Float


def decay(value: float, seconds: float, half_life_s: float) -> float:
    """`value` after `seconds` of decay (never grown by a clock step back)."""
    return value * math.pow(0.5, max(0.0, seconds) / half_life_s)


def _sqlite_decay(value: float, since: str, until: str, half_life_s: float) -> float:
    """`decay` over two datetimes as SQLAlchemy keeps them in SQLite (naive UTC text)."""
    elapsed = datetime.fromisoformat(until) - datetime.fromisoformat(since)
    return decay(value, elapsed.total_seconds(), half_life_s)


def register_sqlite(dbapi_conn: sqlite3.Connection) -> None:
    """Makes `decayed` work on this SQLite connection (db.session calls it on connect)."""
    dbapi_conn.create_function("gpubot_decay", 4, _sqlite_decay, deterministic=True)


class decayed(FunctionElement[float]):
    """SQL: `value` decayed from the datetime `since` to `until` at `half_life_s`."""

    type = Float()
    inherit_cache = True
    name = "gpubot_decay"


@compiles(decayed, "postgresql")
def _pg(element: decayed, compiler: SQLCompiler, **kw: Any) -> str:
    value, since, until, half_life = (compiler.process(c, **kw) for c in element.clauses)
    elapsed = f"CAST(EXTRACT(EPOCH FROM ({until}) - ({since})) AS DOUBLE PRECISION)"
    return f"(({value}) * power(0.5, GREATEST(0.0, {elapsed}) / ({half_life})))"


@compiles(decayed, "sqlite")
def _sqlite(element: decayed, compiler: SQLCompiler, **kw: Any) -> str:
    args = ", ".join(compiler.process(c, **kw) for c in element.clauses)
    return f"gpubot_decay({args})"
