"""Which worker leads: two workers must never both act (dispatch, expire, deliver).

On PostgreSQL the leader holds a session-level advisory lock on a connection of
its own; if the process dies, the connection closes and the lock is free at once,
so another worker leads within one tick. SQLite has no such locks: the leader
holds a lease row (`workerlock`) that it renews every tick and that lapses after
`lease` — a killed leader is replaced once its lease runs out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from datetime import timedelta
from typing import Protocol

from sqlalchemy import text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import col

from bot.domain.clock import Clock
from db.models import WorkerLock
from db.session import is_postgres, transaction

log = logging.getLogger(__name__)

_ADVISORY_KEY = 0x6770_7562_7770  # "gpubwp"


class Leadership(Protocol):
    def hold(self) -> bool:
        """Takes or keeps the lead; True while this process may act."""
        ...

    def release(self) -> None:
        """Gives the lead up (graceful shutdown), so a standby takes over at once."""
        ...


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class AdvisoryLeadership:
    """PostgreSQL: `pg_try_advisory_lock` on a dedicated connection."""

    def __init__(self, engine: Engine, key: int = _ADVISORY_KEY) -> None:
        self._engine = engine
        self._key = key
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def hold(self) -> bool:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute(text("SELECT 1"))
                    self._conn.commit()  # never sit idle in a transaction
                    return True
                except OperationalError:
                    log.warning("lost the leader connection; trying to lead again")
                    self._drop()
            conn = self._engine.connect()
            try:
                got = conn.execute(
                    text("SELECT pg_try_advisory_lock(:k)"), {"k": self._key}
                ).scalar()
                conn.commit()
            except OperationalError:
                conn.close()
                return False
            if got:
                self._conn = conn
                log.info("this worker leads")
                return True
            conn.close()
            return False

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OperationalError):
                self._conn.close()
            self._conn = None

    def release(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
                    self._conn.commit()
                except OperationalError:
                    pass
                self._drop()


class LeaseLeadership:
    """SQLite (or any database): a lease row renewed every tick."""

    def __init__(
        self, engine: Engine, clock: Clock, lease: timedelta, name: str = "worker"
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._lease = lease
        self._name = name
        self.holder = holder_id()

    def hold(self) -> bool:
        now = self._clock.now()
        try:
            with transaction(self._engine) as s:
                won = s.exec(
                    update(WorkerLock)
                    .where(
                        col(WorkerLock.name) == self._name,
                        (col(WorkerLock.holder) == self.holder)
                        | (col(WorkerLock.expires_at) < now),
                    )
                    .values(holder=self.holder, expires_at=now + self._lease)
                )
                if won.rowcount == 1:
                    return True
                if s.get(WorkerLock, self._name) is not None:
                    return False
                s.add(WorkerLock(name=self._name, holder=self.holder, expires_at=now + self._lease))
            return True
        except IntegrityError:
            return False  # another worker created the row first

    def release(self) -> None:
        with transaction(self._engine) as s:
            row = s.get(WorkerLock, self._name)
            if row is not None and row.holder == self.holder:
                s.delete(row)


def leadership_for(engine: Engine, clock: Clock, tick_s: float) -> Leadership:
    if is_postgres(engine):
        return AdvisoryLeadership(engine)
    # Three missed ticks: a slow tick does not lose the lead, a dead worker is replaced soon.
    return LeaseLeadership(engine, clock, timedelta(seconds=max(3 * tick_s, 1.0)))


def worker_running(
    engine: Engine, clock: Clock, name: str = "worker", key: int = _ADVISORY_KEY
) -> bool:
    """Whether some worker leads now, so that what is queued will be placed: the advisory
    lock is held by another session (PostgreSQL), or the lease row has not lapsed (SQLite).
    Asked by `gpubot submit`, which queues and leaves."""
    if is_postgres(engine):
        with engine.connect() as conn:
            free = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
            if free:  # nobody held it: give it straight back
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            conn.commit()
        return not free
    with transaction(engine, write=False) as s:
        row = s.get(WorkerLock, name)
        return row is not None and row.expires_at > clock.now()
