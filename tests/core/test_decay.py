"""The fair-share counters' decay in SQL equals Python's to the last bit, on both
databases: the counters written by a release's upsert are compared with a rebuild from
the raw intervals (Python), and a decay that drifted would show up there as a mismatch
after enough releases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import literal, select
from sqlalchemy.engine import Engine

from db.decay import decay, decayed
from db.types import UTCDateTime

T0 = datetime(2026, 3, 30, 12, 0, tzinfo=UTC)
WEEK = 7 * 86400.0


@pytest.mark.parametrize(
    "value, elapsed, half_life",
    [
        (3600.0, timedelta(0), WEEK),
        (3600.0, timedelta(days=7), WEEK),  # one half-life: exactly half
        (12345.678, timedelta(days=3, seconds=17, microseconds=123457), WEEK),
        (1e9, timedelta(days=400, microseconds=1), WEEK),
        (5400.0, timedelta(seconds=-90), WEEK),  # a clock step back decays nothing
        (7.25, timedelta(hours=5, microseconds=999999), 3600.0),
    ],
)
def test_decay_in_sql_is_pythons_to_the_bit(
    engine: Engine, value: float, elapsed: timedelta, half_life: float
) -> None:
    since, until = T0, T0 + elapsed
    expr = decayed(
        literal(value),
        literal(since, UTCDateTime()),
        literal(until, UTCDateTime()),
        literal(half_life),
    )
    with engine.connect() as conn:
        got = conn.execute(select(expr)).scalar_one()
    want = decay(value, elapsed.total_seconds(), half_life)
    assert got == want  # exact, not approximate
    if elapsed <= timedelta(0):
        assert got == value
    if elapsed == timedelta(seconds=half_life):
        assert got == value / 2
