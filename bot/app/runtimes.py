"""Run-time estimates kept as runs end, so that the worker's tick reads the predictions of
the runs it weighs, not a month of runs.

The scheduler predicts a run's time from the runs that finished in the last 30 days, per
user and size (bot.domain.scheduling.RunHistory). What it needs of a finished run is three
numbers: whose it was, its GPUs, and how long it ran, all its segments together. They
are kept in `RunTime` in the transaction that ends the run (`note_run_ended`), which also
counts the end in the bookkeeping row of `RunEstimate`. From them each (user, GPUs)'s
predictions are made (`keep_estimates`: a queued run's expected length and a running
run's stepped ends) and kept in `RunEstimate`, current until a run ends or the oldest run
they count leaves the 30 days. The tick reads the rows of the keys it asks about
(`estimates`); when they are not current it makes them again from the kept times, once,
and keeps them. Either way its predictions are exactly those that the runs themselves give
(tests/core/test_runtimes.py), without reading a month of runs and their metrics on every
tick: at 34,000 runs in 30 days that read was over a second of every tick.

`rebuild_run_times` makes the kept times again from the runs (`gpubot db rebuild-rollups`,
and once after the upgrade that brought them in: `backfill_run_times`).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, or_, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bot.domain.scheduling import RunHistory
from db.models import RUN_FAILED, RUN_SUCCEEDED, RunEstimate, RunTime, TrainingRun, User
from db.session import insert_rows, transaction

# The runs the predictions count: those that finished in the last 30 days.
WINDOW = timedelta(days=30)
_ENDED = (RUN_SUCCEEDED, RUN_FAILED)
# The bookkeeping row's key (everybody's predictions).
_BOOK = (0, 0)
# PostgreSQL: one process makes the predictions at a time (an advisory lock of this
# schema, "gprt" in ASCII; db.session's pool lock is "gpup"). SQLite's write transaction
# is that lock already.
_MAKING_SQL = text("SELECT pg_advisory_xact_lock(hashtext(current_schema()), 1735422580)")


def attained_s(metrics: Any) -> float:
    """Seconds a run ran in its earlier segments, as `RunRecords.requeue` sums them into
    its metrics: what the scheduler's reclaim rules read (a resumed run queues behind ones
    that never ran and is not moved again before it has run that long once more), and
    part of a finished run's time."""
    value = metrics.get("attained_s") if isinstance(metrics, dict) else None
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def ran_s(started: datetime, finished: datetime, metrics: Any) -> float:
    """A finished run's time: its last segment (`started_at` is that segment's start) plus
    what its earlier ones ran, as the simulator learns a preempted job's whole duration."""
    return (finished - started).total_seconds() + attained_s(metrics)


# --- kept as runs end -------------------------------------------------------------------


def note_run_ended(s: Session, run: TrainingRun) -> None:
    """Keeps a run's time if it counts (it succeeded or failed after it started), in the
    transaction that ends it, and says the predictions are no longer current."""
    if run.state not in _ENDED or run.started_at is None or run.finished_at is None:
        return
    assert run.id is not None
    s.add(
        RunTime(
            run_id=run.id,
            user_id=run.user_id,
            gpus=run.gpu_count,
            finished_at=run.finished_at,
            ran_s=ran_s(run.started_at, run.finished_at, run.metrics),
        )
    )
    _bump(s)


def _bump(s: Session) -> None:
    """One more run end: the kept predictions are not current any more. An upsert of the
    bookkeeping row that adds to its version: it never waits on a making of predictions
    (which holds its own lock, not this row, while it reads)."""
    conn = s.connection()
    conn.execute(
        _bump_stmt(conn.dialect.name), {"user_id": 0, "gpus": 0, "version": 1, "ends_s": []}
    )


@functools.cache
def _bump_stmt(dialect: str) -> Any:
    stmt = (pg_insert if dialect == "postgresql" else sqlite_insert)(RunEstimate)
    return stmt.on_conflict_do_update(
        index_elements=["user_id", "gpus"],
        set_={"version": stmt.table.c.version + 1},
    )


@functools.cache
def _book_stmt(dialect: str) -> Any:
    """The bookkeeping row, made if it is not there yet (a database where no run ended)."""
    stmt = (pg_insert if dialect == "postgresql" else sqlite_insert)(RunEstimate)
    return stmt.on_conflict_do_nothing(index_elements=["user_id", "gpus"])


def rebuild_run_times(s: Session) -> int:
    """Makes the kept run times again from the runs themselves; returns how many."""
    s.execute(delete(RunTime))
    columns: tuple[Any, ...] = (
        TrainingRun.id,
        TrainingRun.user_id,
        TrainingRun.gpu_count,
        TrainingRun.started_at,
        TrainingRun.finished_at,
        TrainingRun.metrics,
    )
    rows = [
        (run_id, user_id, gpus, finished, ran_s(started, finished, metrics))
        for run_id, user_id, gpus, started, finished, metrics in s.exec(
            select(*columns).where(*_counted())
        )
    ]
    insert_rows(
        s,
        RunTime.__table__,  # type: ignore[attr-defined]
        ("run_id", "user_id", "gpus", "finished_at", "ran_s"),
        rows,
    )
    _bump(s)
    return len(rows)


def _counted() -> tuple[Any, ...]:
    """The runs whose times count: those that succeeded or failed after they started."""
    return (
        col(TrainingRun.state).in_(_ENDED),
        col(TrainingRun.started_at).is_not(None),
        col(TrainingRun.finished_at).is_not(None),
    )


def backfill_run_times(s: Session) -> int | None:
    """On start: a database upgraded from before the run times were kept has finished
    runs and no times; made once. None when nothing needed doing (two cheap queries)."""
    if s.exec(select(RunTime.run_id).limit(1)).first() is not None:
        return None
    if s.exec(select(TrainingRun.id).where(*_counted()).limit(1)).first() is None:
        return None
    return rebuild_run_times(s)


# --- the predictions --------------------------------------------------------------------


def history_of_kept(
    s: Session, now: datetime
) -> tuple[RunHistory, dict[str, int], datetime | None]:
    """The estimator over the kept times of the runs that finished in the 30 days before
    `now`, in the order they finished (as it learns them); each user's id by key; and
    when the first of those runs leaves the 30 days (None: none counts). Plain numbers
    are read for each run, no time stamps (turning 34,000 of them into datetimes was half
    of the time), and each user's key once."""
    since = now - WINDOW
    conn = s.connection()
    keys: dict[int, str] = dict(conn.execute(select(User.id, User.key)).all())
    columns: tuple[Any, ...] = (RunTime.user_id, RunTime.gpus, RunTime.ran_s)
    rows = conn.execute(
        select(*columns)
        .where(col(RunTime.finished_at) > since)
        .order_by(col(RunTime.finished_at), col(RunTime.run_id))
    )
    history = RunHistory.of((keys[user], gpus, ran) for user, gpus, ran in rows)
    oldest = conn.execute(
        select(func.min(RunTime.finished_at)).where(col(RunTime.finished_at) > since)
    ).scalar_one()
    return (
        history,
        {key: user for user, key in keys.items()},
        None if oldest is None else oldest + WINDOW,
    )


@dataclass(frozen=True)
class Kept:
    """One (user, GPUs)'s predictions (or everybody's) as `RunEstimate` keeps them."""

    first_s: float | None
    ends_s: tuple[float, ...]


class KeptEstimates:
    """The scheduler's two questions of the estimator (`RunHistory.predict_duration` and
    `predict_end`), answered from the kept predictions of the keys asked about, with
    everybody's for a (user, GPUs) with too few runs of its own."""

    def __init__(self, everybody: Kept, own: dict[tuple[str, int], Kept]) -> None:
        self._everybody = everybody
        self._own = own

    def _of(self, user: str, gpus: int) -> Kept:
        return self._own.get((user, gpus), self._everybody)

    def predict_duration(self, user: str, gpus: int) -> float | None:
        return self._of(user, gpus).first_s

    def predict_end(self, user: str, gpus: int, started_s: float, now: float) -> float | None:
        for total in self._of(user, gpus).ends_s:
            if started_s + total > now:
                return started_s + total
        return None

    @classmethod
    def of(cls, history: RunHistory, keys: Iterable[tuple[str, int]]) -> KeptEstimates:
        """What the kept rows of these keys would say, made from the estimator itself."""
        own = {
            k: _predictions(history, *k)
            for k in keys
            if k in history.own and len(history.own[k]) >= history.min_own
        }
        return cls(_predictions(history, "", -1), own)


def _predictions(history: RunHistory, user: str, gpus: int) -> Kept:
    """A key's predictions (user "" and GPUs -1: nobody's own, so everybody's)."""
    return Kept(history.predict_duration(user, gpus), tuple(history.stepped_ends(user, gpus)))


def estimates(
    engine: Engine, s: Session, now: datetime, keys: Collection[tuple[str, int]]
) -> KeptEstimates:
    """The predictions for these (user key, GPUs), as the runs of the 30 days before `now`
    give them: read from the kept rows of these keys (one statement), or, when those are
    not current, made from the kept times and kept again (`keep_estimates`, in a
    transaction of its own)."""
    users = sorted({user for user, _ in keys})
    columns: tuple[Any, ...] = (
        RunEstimate.user_id,
        RunEstimate.gpus,
        User.key,
        RunEstimate.first_s,
        RunEstimate.ends_s,
        RunEstimate.version,
        RunEstimate.computed_version,
        RunEstimate.as_of,
        RunEstimate.valid_until,
    )
    rows = (
        s.connection()
        .execute(
            select(*columns)
            .join(User, col(User.id) == col(RunEstimate.user_id), isouter=True)
            .where(or_(col(RunEstimate.user_id) == 0, col(User.key).in_(users)))
        )
        .all()
    )
    book = next((r for r in rows if (r.user_id, r.gpus) == _BOOK), None)
    if book is None or not _current(book, now):
        return keep_estimates(engine, now, keys)
    own = {
        (r.key, r.gpus): Kept(r.first_s, tuple(r.ends_s))
        for r in rows
        if (r.user_id, r.gpus) != _BOOK and (r.key, r.gpus) in keys
    }
    return KeptEstimates(Kept(book.first_s, tuple(book.ends_s)), own)


def _current(book: Any, now: datetime) -> bool:
    """Whether the kept predictions are those of `now`: no run ended since they were made,
    no run they count has left the 30 days, and the clock has not gone back before them
    (earlier runs would count again)."""
    return (
        book.computed_version == book.version
        and book.as_of is not None
        and book.as_of <= now
        and (book.valid_until is None or now < book.valid_until)
    )


def keep_estimates(
    engine: Engine, now: datetime, keys: Collection[tuple[str, int]] = ()
) -> KeptEstimates:
    """Makes every (user, GPUs)'s predictions for `now` from the kept run times and keeps
    them, one process at a time; returns those of `keys`. The version is read before the
    times: a run that ends meanwhile leaves them marked not current, never the reverse."""
    with transaction(engine) as s:
        conn = s.connection()
        if conn.dialect.name == "postgresql":
            conn.execute(_MAKING_SQL)
        conn.execute(_book_stmt(conn.dialect.name), {"user_id": 0, "gpus": 0, "ends_s": []})
        version = s.exec(
            select(RunEstimate.version).where(
                RunEstimate.user_id == _BOOK[0], RunEstimate.gpus == _BOOK[1]
            )
        ).one()
        history, ids, valid_until = history_of_kept(s, now)
        rows = [
            {"user_id": ids[user], "gpus": gpus, **_columns(_predictions(history, user, gpus))}
            for user, gpus in history.trusted_keys()
        ]
        conn.execute(
            delete(RunEstimate).where(
                or_(col(RunEstimate.user_id) != _BOOK[0], col(RunEstimate.gpus) != _BOOK[1])
            )
        )
        if rows:
            conn.execute(insert(RunEstimate), rows)
        conn.execute(
            update(RunEstimate)
            .where(col(RunEstimate.user_id) == _BOOK[0], col(RunEstimate.gpus) == _BOOK[1])
            .values(
                **_columns(_predictions(history, "", -1)),
                computed_version=version,
                as_of=now,
                valid_until=valid_until,
            )
        )
    return KeptEstimates.of(history, keys)


def _columns(kept: Kept) -> dict[str, Any]:
    return {"first_s": kept.first_s, "ends_s": list(kept.ends_s)}
