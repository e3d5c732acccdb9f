"""Engine, transactions, row locks and retries.

SQLite is the embedded default, so it is set up to behave under threads:
WAL (readers never block the writer), a busy timeout (writers queue instead of
failing), foreign keys on, and write transactions that start with
`BEGIN IMMEDIATE` — a deferred transaction that reads and then writes can fail
at once with "database is locked" instead of waiting, which is exactly what 50
threads reserving at once would hit. One writer at a time is the whole lock
story on SQLite. PostgreSQL lets writers run together, so there every change
follows the lock order below.

Lock order (PostgreSQL; every row lock is `FOR NO KEY UPDATE`, which does not
block the foreign-key checks of inserts that merely point at the row):

  1. the pool: one transaction-scoped advisory lock per schema (`lock_pool`);
  2. users, by id;
  3. reservations, by id;
  4. runs, by id;
  5. hosts, by id.

A transaction that changes who holds a GPU (opens or closes a usage interval:
reserve, release, expiry, an idle release, a run's claim, end or requeue, a
lost host; anything that runs the grant pass) or the length of a reservation
takes the pool first, before it reads anything it will change. Pool holders
run one at a time, so whatever they lock after it cannot deadlock with each
other, and every row they read after it is the latest committed one. Each row
it is about to change it then reads again under its lock (`locked`) and checks
its state there, never trusting a copy read earlier: a `release all` that read
"waiting" before a grant pass made it "active" would otherwise write
"cancelled" over the grant and leave the GPU held for good.

A transaction without the pool locks at most one of these rows, through
`locked`, and waits for no other lock after it (a budget change: one user;
Keep: one reservation; a run's cancel, start record, placement or metrics: one
run), so it can never close a cycle either.

What is left — a deadlock the order misses, a serialization failure, SQLite's
"database is locked" after its busy timeout — is retried whole by `retrying`
around the use case: a few attempts with jittered backoff. A retried attempt
starts from nothing (the failed one rolled back), and a request that carries a
request key finds its own earlier success by that key, so a retry never does
a thing twice.
"""

from __future__ import annotations

import functools
import logging
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, SQLModel, create_engine
from sqlmodel.sql.expression import SelectOfScalar

from db.decay import register_sqlite
from db.types import UTCDateTime

log = logging.getLogger(__name__)

_WRITE = "gpubot_write"
# Per thread: how many `transaction`s are open (`retrying` retries only the outermost).
_local = threading.local()


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
        register_sqlite(dbapi_conn)
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
    `bot.app.service` does this for the shared part of `/gpu status`.
    """
    return _generation


def _bump_generation() -> None:
    global _generation
    with _generation_lock:
        _generation += 1


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


@contextmanager
def transaction(engine: Engine, write: bool = True, *, seen: bool = True) -> Iterator[Session]:
    """One unit of work: commits on success, rolls back on any exception.

    `write=True` takes SQLite's write lock up front; reads pass `write=False`
    so that `/gpu status` never queues behind a writer. `seen=False`: a write that no
    cached view shows (a new person's row), which leaves `write_generation` as it is.
    """
    bound = engine.execution_options(**{_WRITE: True}) if write else engine
    queue = _writers(engine) if write else None
    queued = queue is not None and queue.acquire(timeout=_WRITER_WAIT_S)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with Session(bound, expire_on_commit=False) as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise
            finally:
                if write and seen:
                    _bump_generation()
    finally:
        _local.depth -= 1
        if queued:
            assert queue is not None
            queue.release()


# SQLite lets one writer in at a time, and one that finds the lock taken sleeps in
# SQLite's busy handler (1, 2, 5 … 100 ms) before it looks again: sixteen first commands
# at once queued there for up to 300 ms each, most of it asleep with the lock free.
# This process's writers queue on a lock of its own first, handed on the moment it is
# free; SQLite's busy timeout is left for writers in other processes (the worker). An
# RLock: a write nested in a write on one thread behaves as it did without this queue.
# After as long as SQLite's own timeout a writer goes on to SQLite's lock regardless.
_WRITER_WAIT_S = 30.0
# Keyed by the engine's pool, the one under every execution_options() copy of it; gone
# with the engine.
_writer_queues: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_writer_queues_lock = threading.Lock()


def _writers(engine: Engine) -> threading.RLock | None:
    """The engine's writer queue on SQLite; None on PostgreSQL (writers run together)."""
    if engine.dialect.name != "sqlite":
        return None
    with _writer_queues_lock:
        found = _writer_queues.get(engine.pool)
        if found is None:
            found = _writer_queues[engine.pool] = threading.RLock()
        return found


def core(s: Session) -> Connection:
    """The session's connection, for a statement run as Core (plain rows, no ORM execute
    path), after the flush that the Session's own execute would do first (autoflush, and
    not inside `no_autoflush`): a read through it sees what the session has pending, as
    an ORM read would. Hot paths use it: the ORM's execute path cost more CPU than the
    statements of a reserve and a release."""
    if s.autoflush and (s.new or s.dirty or s.deleted):
        s.flush()
    return s.connection()


# --- row locks -------------------------------------------------------------------------

M = TypeVar("M", bound=SQLModel)


_POOL_LOCK = "gpubot.pool_lock"  # Session.info key: where lock_pool took the pool


# The pool's advisory lock: pg_advisory_xact_lock(int4, int4) with the schema's hash as
# the first key, so that databases kept as schemas of one server (the tests, the bench)
# each have a pool of their own; the two-int form is a key space apart from the bigint
# keys of the leader and the host sync. 1735423344 is "gpup" in ASCII.
POOL_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext(current_schema()), 1735423344)"
_POOL_LOCK_TEXT = text(POOL_LOCK_SQL)


def lock_pool(s: Session) -> None:
    """Takes the pool until the transaction ends (lock order, 1).

    Call it first, before reading what the transaction will change. Taking it again
    in the same transaction is harmless and costs nothing: a second call in the same
    transaction (and savepoint) returns at once. On SQLite the write transaction is the
    lock.

    On PostgreSQL it is one advisory lock, not a lock on every GPU row as it once was:
    that wrote a row lock into each of a hundred hosts' 800 GPU rows (and the WAL) in
    every reserve, release and grant, most of their time at that size. Only pool holders
    write GPU rows (`GpuService.sync_hosts`), so nothing relied on the row locks beyond
    the serialization, and a transaction's advisory locks, like its row locks, are let go
    only once its commit is visible: the next holder reads what the last one wrote.
    """
    if _on_postgres(s):
        # The (transaction, savepoint) the lock was taken in: a commit, a rollback or
        # another savepoint gives another pair, so the lock is taken again there (a lock
        # taken in a savepoint that is rolled back is let go with it).
        taken = (s.get_transaction(), s.get_nested_transaction())
        if taken[0] is not None and s.info.get(_POOL_LOCK) == taken:
            return
        # Through the connection (Core): the ORM's execute path costs more CPU than the
        # statement, in every reserve, release and grant pass.
        s.connection().execute(_POOL_LOCK_TEXT)
        s.info[_POOL_LOCK] = (s.get_transaction(), s.get_nested_transaction())


def locked(s: Session, model: type[M], row_id: int | None) -> M | None:
    """The row read again under its lock, held until the transaction ends.

    The read replaces whatever copy the session held (`populate_existing`), so the
    state checked after this is the state that will be overwritten.
    """
    if row_id is None:
        return None
    lock = {"key_share": True} if _on_postgres(s) else None
    return s.get(model, row_id, populate_existing=True, with_for_update=lock)


def locked_rows(s: Session, stmt: SelectOfScalar[M]) -> list[M]:
    """The rows a query finds, read under their locks (`locked`, for many rows).

    The caller orders the query by id (the lock order). On PostgreSQL a row changed
    by a transaction this one waited for is checked against the WHERE clause again,
    so a row that no longer matches is not returned.
    """
    stmt = stmt.execution_options(populate_existing=True)
    if _on_postgres(s):
        stmt = stmt.with_for_update(key_share=True)
    return list(s.exec(stmt).all())


def insert_many(s: Session, table: Any, rows: list[dict[str, Any]]) -> None:
    """Many rows (same keys each) into `table` (a SQLAlchemy Table) in the session's
    transaction (`insert_rows`)."""
    if not rows:
        return
    names = list(rows[0])
    insert_rows(s, table, names, [tuple(row[n] for n in names) for row in rows])


def insert_rows(
    s: Session, table: Any, names: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    """Many rows, given as plain tuples in the order of `names`, into `table` (a SQLAlchemy
    Table) in the session's transaction: the driver's own executemany on SQLite, COPY on
    PostgreSQL. Neither goes through SQLAlchemy's per-row parameter processing, which was
    most of the time of a million-row load (a rollup rebuild, the history bench); psycopg
    sends an executemany a row at a time, and batching it into multi-row INSERTs spends
    its time parsing the huge statements. On PostgreSQL the table's name is looked up on
    the search path (the bench's and the tests' schemas). Aware datetimes are written as
    `db.types.UTCDateTime` stores them: naive UTC (on SQLite, as the text SQLAlchemy
    writes, so that the stored values compare and sort with the ones it wrote)."""
    raw: Any = s.connection().connection.driver_connection
    postgres = _on_postgres(s)
    stamps = [i for i, n in enumerate(names) if isinstance(table.c[n].type, UTCDateTime)]
    if stamps:
        rows = _stamped(rows, stamps, _naive_utc if postgres else UTCDateTime.sqlite_text)
    if not postgres:
        sql = (
            f"INSERT INTO {table.name} ({', '.join(names)}) "
            f"VALUES ({', '.join('?' for _ in names)})"
        )
        raw.executemany(sql, rows)
        return
    # Binary COPY, each value sent as its column's own type: a quarter of the text
    # format's CPU here (the types are the table's, read from the catalog).
    catalog = text(
        "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute"
        " WHERE attrelid = to_regclass(:t) AND attnum > 0 AND NOT attisdropped"
    )
    types = {n: t for n, t in s.connection().execute(catalog, {"t": table.name})}
    sql = f"COPY {table.name} ({', '.join(names)}) FROM STDIN (FORMAT BINARY)"
    with raw.cursor() as cur, cur.copy(sql) as copy:
        copy.set_types([types[n] for n in names])
        for row in rows:
            copy.write_row(row)


def _stamped(
    rows: Iterable[Sequence[Any]], stamps: list[int], convert: Callable[[datetime], Any]
) -> Iterator[Sequence[Any]]:
    """The rows with the datetimes at `stamps` converted, each distinct one once (a
    rollup's hour comes back in hundreds of rows)."""
    memo: dict[datetime, Any] = {}
    for row in rows:
        out = list(row)
        for i in stamps:
            v = out[i]
            if v is not None:
                got = memo.get(v)
                if got is None:
                    got = memo[v] = convert(v)
                out[i] = got
        yield out


def _naive_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("naive datetime given to a UTC column; pass an aware datetime")
    return value.astimezone(UTC).replace(tzinfo=None)


def _on_postgres(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


# --- retries -------------------------------------------------------------------------

# SQLSTATEs after which the whole transaction may simply run again.
_RETRY_SQLSTATES = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure
RETRY_ATTEMPTS = 5
_BACKOFF_S = 0.02

P = ParamSpec("P")
R = TypeVar("R")


def retryable(exc: BaseException) -> bool:
    """A failure that says "run the transaction again", not "this is wrong": a deadlock
    or serialization failure on PostgreSQL, a lock that stayed busy on SQLite."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if getattr(orig, "sqlstate", None) in _RETRY_SQLSTATES:
        return True
    return isinstance(orig, sqlite3.OperationalError) and (
        "database is locked" in str(orig) or "database table is locked" in str(orig)
    )


def retrying(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs a use case again, whole, when its transaction lost a race the database
    detects (`retryable`): at most `RETRY_ATTEMPTS` times, with jittered backoff so
    that two transactions that deadlocked do not meet again at once.

    Only the outermost call retries: called inside an open transaction or another
    retrying call (a use case calling another), it runs once and the failure reaches
    the outermost caller, which runs it all again. What the function does outside the
    database must be safe to repeat or come after its last transaction.
    """

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if getattr(_local, "depth", 0) or getattr(_local, "retrying", False):
            return fn(*args, **kwargs)
        _local.retrying = True
        try:
            attempt = 1
            while True:
                try:
                    return fn(*args, **kwargs)
                except DBAPIError as exc:
                    if attempt >= RETRY_ATTEMPTS or not retryable(exc):
                        raise
                    pause = _BACKOFF_S * (2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
                    log.info(
                        "%s lost a race in the database (%s); attempt %d of %d in %.0f ms",
                        fn.__qualname__,
                        getattr(exc.orig, "sqlstate", None) or type(exc.orig).__name__,
                        attempt + 1,
                        RETRY_ATTEMPTS,
                        pause * 1000,
                    )
                    time.sleep(pause)
                    attempt += 1
        finally:
            _local.retrying = False

    return run
