"""Engine and transactions.

SQLite is the embedded default, so it is set up to behave under threads:
WAL (readers never block the writer), a busy timeout (writers queue instead of
failing), foreign keys on, and write transactions that start with
`BEGIN IMMEDIATE` — a deferred transaction that reads and then writes can fail
at once with "database is locked" instead of waiting, which is exactly what 50
threads reserving at once would hit. PostgreSQL needs none of this; its
row locks (`FOR UPDATE`) serialize the grant path instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlmodel import Session, create_engine

_WRITE = "gpubot_write"


def make_engine(url: str, echo: bool = False) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"check_same_thread": False, "timeout": 30},
        )
        _tune_sqlite(engine)
        return engine
    if parsed.drivername in {"postgresql", "postgres"}:
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=40)


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite's own
        # implicit BEGIN is always DEFERRED).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get(_WRITE):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


_generation = 0
_generation_lock = threading.Lock()


def write_generation() -> int:
    """Counts write transactions committed by this process.

    A reader may cache what it computed at generation g for as long as the
    generation stays g (and, for other processes' writes, a short time limit):
    `bot.service` does this for the shared part of `/gpu status`.
    """
    return _generation


def _bump_generation() -> None:
    global _generation
    with _generation_lock:
        _generation += 1


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


@contextmanager
def transaction(engine: Engine, write: bool = True) -> Iterator[Session]:
    """One unit of work: commits on success, rolls back on any exception.

    `write=True` takes SQLite's write lock up front; reads pass `write=False`
    so that `/gpu status` never queues behind a writer.
    """
    bound = engine.execution_options(**{_WRITE: True}) if write else engine
    with Session(bound, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            if write:
                _bump_generation()
