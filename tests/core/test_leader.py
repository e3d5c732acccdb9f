"""Exactly one worker leads: a lease row on SQLite, an advisory lock on PostgreSQL."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from bot.adapters.leader import AdvisoryLeadership, LeaseLeadership, leadership_for
from bot.domain.clock import VirtualClock


def test_a_lease_is_held_renewed_and_taken_over_when_it_lapses(sqlite_engine: Engine) -> None:
    clock = VirtualClock()
    a = LeaseLeadership(sqlite_engine, clock, timedelta(seconds=30))
    b = LeaseLeadership(sqlite_engine, clock, timedelta(seconds=30))
    assert a.hold() and not b.hold()
    clock.advance(timedelta(seconds=20))
    assert a.hold(), "renewing keeps the lead"
    clock.advance(timedelta(seconds=20))
    assert not b.hold(), "renewed 20 s ago: still a's"
    clock.advance(timedelta(seconds=31))  # a died and stopped renewing
    assert b.hold() and not a.hold()
    b.release()
    assert a.hold(), "a graceful release hands over at once"


@pytest.mark.postgres
def test_an_advisory_lock_passes_on_when_the_leader_connection_dies(pg_engine: Engine) -> None:
    a, b = AdvisoryLeadership(pg_engine, key=4242), AdvisoryLeadership(pg_engine, key=4242)
    try:
        assert a.hold() and not b.hold()
        assert a.hold(), "holding twice is still holding"
        # The leader's process dies: its session ends, as when kill -9 closes the socket.
        assert a._conn is not None
        pid = a._conn.execute(text("SELECT pg_backend_pid()")).scalar()
        a._conn.commit()
        with pg_engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        # The server ends the backend asynchronously; the standby leads on a next tick.
        deadline = time.monotonic() + 5
        while not b.hold():
            assert time.monotonic() < deadline, "the standby never took the lead"
            time.sleep(0.05)
        assert not a.hold(), "the old leader finds it lost the lead"
    finally:
        a.release()
        b.release()


def test_the_runtime_picks_the_lock_that_fits_the_database(sqlite_engine: Engine) -> None:
    assert isinstance(leadership_for(sqlite_engine, VirtualClock(), 15.0), LeaseLeadership)


def test_a_standby_worker_does_nothing(sqlite_engine: Engine) -> None:
    from sqlmodel import Session, select

    from bot.domain.commands import Reserve
    from bot.faces.worker import tick_job
    from db.models import Reservation
    from tests.core.helpers import HOUR, actor, host, make_service

    svc, clock = make_service(sqlite_engine, [host("one", "A100", 1)])
    svc.reserve(actor(svc, "alice"), Reserve(duration=HOUR))
    leader = LeaseLeadership(sqlite_engine, clock, timedelta(seconds=30))
    standby = LeaseLeadership(sqlite_engine, clock, timedelta(seconds=30))
    assert leader.hold()
    clock.advance(2 * HOUR)
    leader.hold()  # the leader renews, but has not ticked yet
    tick_job(svc, None, standby)
    with Session(sqlite_engine) as s:
        assert s.exec(select(Reservation)).one().state == "active"
    tick_job(svc, None, leader)
    with Session(sqlite_engine) as s:
        assert s.exec(select(Reservation)).one().state == "expired"
