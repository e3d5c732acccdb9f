"""`make bench` part: the tick, costs, the digest and the views as history grows.

A synthetic history (50 people on H hosts of 8 GPUs, N closed usage intervals spread
over the 90 days before "now", each GPU's intervals back to back with gaps) is bulk
inserted, streamed, with its rollups and fair-share counters (`bot.app.rollups`'s rebuild,
the same arithmetic the bot uses when intervals close), then the real use cases run
through the service with a virtual clock: an idle worker tick, `/gpu cost team month`,
the weekly digest's numbers (chart aside), `/gpu status`, `/gpu queue`, App Home, and a
reserve + release. Each is the median of REPEATS calls; peak memory is tracemalloc's
peak over one call of each, after the build. Each cell also has `yardstick_ms`, a fixed
piece of Python timed beside every call (and on PostgreSQL `db_yardstick_ms`, the same
kind of work inside the server, whose backend runs on the other core), and the headline
says how much slower each ran in each cell than in its fastest: a shared machine's speed
moves by half between runs, so compare cells of one run, and read a cell against its
yardsticks.

Sizes: 1k, 10k, 100k intervals at 100 hosts (and 1 and 10 hosts at 1k for the views),
on SQLite and on PostgreSQL when it is reachable. 1M intervals only with
GPUBOT_BENCH_HISTORY_1M=1 (its build: 35-50 s of CPU; 45-90 s of wall clock on a
shared 2-core machine, as busy as that is);
GPUBOT_BENCH_HISTORY_SIZES=1000,100000 measures only those sizes.
"""

from __future__ import annotations

import heapq
import os
import queue
import random
import resource
import secrets
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, select

from bot.app.config import Settings
from bot.app.digest import digest_for
from bot.app.rollups import (
    ClosedRow,
    FairShareCounters,
    HourlyRollups,
    RollupKey,
    Sums,
    write_rollups,
)
from bot.app.runs import LocalAccess, RunService
from bot.app.service import GpuService
from bot.domain.commands import Release, Reserve
from bot.faces.dispatch import handle_text
from bot.faces.slack.home import home_view
from bot.faces.worker import tick_job
from db.migrate import upgrade
from db.models import Gpu, HostPeriod, UsageInterval, User
from db.session import insert_rows, make_engine
from provisioning.base import GpuDevice, Instance
from provisioning.catalog import Catalog
from provisioning.local_runner import LOCAL_TARGET, LocalRunner

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
NOW = datetime(2026, 3, 30, 12, 0, tzinfo=UTC)  # a Monday; March is the month costed
USERS = 50
GPUS_PER_HOST = 8
HOURLY = 21.96  # $2.745 per GPU-hour: a finite decimal share
REPEATS = int(os.environ.get("GPUBOT_BENCH_HISTORY_REPEATS", "7"))
SIZES = [1_000, 10_000, 100_000] + (
    [1_000_000] if os.environ.get("GPUBOT_BENCH_HISTORY_1M") == "1" else []
)
if os.environ.get("GPUBOT_BENCH_HISTORY_SIZES"):  # e.g. "1000,100000": a quicker look
    SIZES = [int(n) for n in os.environ["GPUBOT_BENCH_HISTORY_SIZES"].split(",")]
GOALS_MS = {
    "idle_tick": 20,
    "cost_team_month": 50,
    "digest": 100,
    "status": 30,
    "queue": 30,
    "app_home": 30,
    "reserve_release": 15,
}


def _instances(hosts: int) -> list[Instance]:
    return [
        Instance(
            name=f"h{i:03d}",
            provider="sim",
            state="ready",
            gpus=tuple(
                GpuDevice(index=g, model="A100", memory_gb=40.0) for g in range(GPUS_PER_HOST)
            ),
            instance_id=f"i-{i:03d}",
            instance_type="p4d.24xlarge",
            market="ondemand",
            hourly_usd=HOURLY,
        )
        for i in range(hosts)
    ]


class BenchClock:
    """The bench's clock: set anywhere, back as well as forward, so that every measured
    call sees the same "now" even though a reserve + release moves time on to release."""

    def __init__(self, start: datetime) -> None:
        self._now = start

    def now(self) -> datetime:
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when


def build_history(engine: Engine, hosts: int, intervals: int, seed: int = 7) -> GpuService:
    """The service over a synthetic history of `intervals` closed intervals (bulk
    inserted, rollups computed as the bot computes them) and one person holding a GPU now."""
    clock = BenchClock(NOW - timedelta(days=91))
    svc = GpuService(engine, Settings(admins=("root",), status_cache_s=0.0), clock)
    svc.sync_hosts(_instances(hosts))  # opens each host's billed period 91 days ago
    for u in range(USERS):
        svc.actor(f"user{u:02d}")
    with Session(engine) as s:
        gpus = [(g.id, g.host_id) for g in s.exec(select(Gpu)).all() if g.id is not None]
        users = [u.id for u in s.exec(select(User)).all() if u.id is not None]
    # Each GPU's intervals back to back from 90 days ago: a GPU-hour or so each (capped
    # at 12 h), with gaps that spread a GPU's share of the N intervals over the 90 days.
    # A GPU's intervals come from its own seeded generator, so nothing holds the million
    # rows (which would otherwise be most of the bench's peak memory): the GPUs' streams
    # are merged by start and go, in one pass, into the table in chunks (the driver's
    # executemany on SQLite, COPY on PostgreSQL: db.session.insert_rows), into the hourly
    # rollups (bot.app.rollups.HourlyRollups, the bot's own arithmetic, written by the
    # rebuild's own write_rollups) and, put back in the order they end by a small heap,
    # into the fair-share counters (bot.app.rollups.FairShareCounters).
    start = NOW - timedelta(days=90)
    end = NOW - timedelta(hours=1)
    per_gpu = max(1, -(-intervals // len(gpus)))
    gap_mean = max(60.0, (end - start).total_seconds() / per_gpu - 3600)
    rate = HOURLY / GPUS_PER_HOST

    def one_gpu(i: int, gpu_id: int, host_id: int) -> Iterator[_Made]:
        rng = random.Random(seed * 1_000_003 + gpu_id)
        t = start + timedelta(seconds=rng.uniform(0, gap_mean))
        for _ in range(max(0, min(per_gpu, intervals - i * per_gpu))):
            dur = timedelta(seconds=min(12 * 3600.0, max(60.0, rng.expovariate(1 / 3600))))
            if t + dur > end:
                return
            yield t, t + dur, gpu_id, host_id, rng.choice(users)
            t += dur + timedelta(seconds=rng.expovariate(1 / gap_mean))

    with _bulk_load(engine) as s, _Loader() as insert:
        rollups = HourlyRollups(s.exec(select(HostPeriod)).all())
        fair = FairShareCounters()
        table = UsageInterval.__table__  # type: ignore[attr-defined]

        def hourly() -> Iterator[tuple[RollupKey, Sums]]:
            chunk: list[tuple[object, ...]] = []
            ends: list[tuple[datetime, datetime, int, int]] = []  # heap: end, start, GPU, user
            streams = [one_gpu(i, g, h) for i, (g, h) in enumerate(gpus)]
            for a, b, gpu_id, host_id, user_id in heapq.merge(*streams):
                chunk.append((gpu_id, host_id, user_id, a, b, rate, "ondemand"))
                if len(chunk) >= _CHUNK:
                    insert(s, table, _INTERVAL_COLUMNS, chunk)
                    chunk = []
                # Every interval still to come ends after `a`: those that ended by then
                # are final in the order they ended.
                while ends and ends[0][0] <= a:
                    ended, started, _, who = heapq.heappop(ends)
                    fair.add(ended, started, who)
                heapq.heappush(ends, (b, a, gpu_id, user_id))
                yield from rollups.add(ClosedRow(a, b, user_id, host_id, "ondemand", None, rate))
            insert(s, table, _INTERVAL_COLUMNS, chunk)
            while ends:
                ended, started, _, who = heapq.heappop(ends)
                fair.add(ended, started, who)
            yield from rollups.rest()

        # write_rollups reads the counters only after the last hourly row.
        write_rollups(s, hourly(), fair.fair, insert)
    if engine.dialect.name == "postgresql":
        # Settled as a year of slowly grown history is: vacuumed and analyzed, its WAL
        # checkpointed. Left to itself, the server vacuumed the freshly loaded million
        # rows and checkpointed them while the cells were measured, on the same two
        # cores: every figure of the 1M cell doubled (its yardstick 1.5x) in one run.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for name in (
                "usageinterval",
                "usagerollup",
                "usagerollupday",
                "hostperiod",
                "fairshareusage",
            ):
                conn.execute(text(f"VACUUM (ANALYZE) {name}"))
            # not a superuser: the checkpoint comes in its own time
            with suppress(DBAPIError):
                conn.execute(text("CHECKPOINT"))
    clock.set(NOW)
    svc.reserve(svc.actor("user00"), Reserve(count=1, duration=timedelta(hours=8)))
    svc.runs = RunService(
        svc,
        LocalAccess(LocalRunner(), LOCAL_TARGET, Path(tempfile.mkdtemp()) / "runs"),
        Catalog.load(),
    )
    return svc


_CHUNK = 20_000
_Made = tuple[datetime, datetime, int, int, int]  # start, end, GPU, host, user
_INTERVAL_COLUMNS = (
    "gpu_id",
    "host_id",
    "user_id",
    "started_at",
    "ended_at",
    "usd_per_hour",
    "market",
)
# The tables the build fills: their secondary indexes are made after the load.
_LOADED = ("usageinterval", "usagerollup", "usagerollupday")


@contextmanager
def _bulk_load(engine: Engine) -> Iterator[Session]:
    """One transaction for the whole load, with the loaded tables' secondary indexes
    dropped before and made again after it (sorting a million keys once instead of
    inserting them one at a time into trees larger than the cache), and on SQLite,
    for this throwaway database only, no fsync. Foreign keys are
    not checked row by row (PRAGMA foreign_keys on SQLite, replica mode on PostgreSQL):
    the generator makes every row point at GPUs, hosts and users it read."""
    with engine.connect() as conn:
        sqlite = engine.dialect.name == "sqlite"
        raw: Any = conn.connection.driver_connection  # outside a transaction, as PRAGMAs want
        if sqlite:
            raw.execute("PRAGMA synchronous=OFF")
            raw.execute("PRAGMA foreign_keys=OFF")
        with Session(bind=conn) as s:
            if not sqlite:
                s.execute(text("SET LOCAL session_replication_role = replica"))
            indexes = _secondary_indexes(s)
            for name, _ in indexes:
                s.execute(text(f"DROP INDEX {name}"))
            yield s
            for _, ddl in indexes:
                s.execute(text(ddl))
            s.commit()
        if sqlite:
            raw.execute("PRAGMA synchronous=NORMAL")
            raw.execute("PRAGMA foreign_keys=ON")


class _Loader:
    """Inserts (db.session.insert_rows) done in order on a thread of their own while the
    caller computes the next rows: the database's part of an insert (SQLite's B-trees in
    this process, with the GIL let go; PostgreSQL's COPY) runs beside the generator
    instead of after it. Only this thread uses the session meanwhile: the build reads
    nothing while it loads, and the load ends (`__exit__` waits for the last insert and
    raises its error, if any) before the indexes are made and the transaction commits."""

    def __init__(self) -> None:
        self._todo: queue.Queue[tuple[Session, Any, Sequence[str], Sequence[Any]] | None] = (
            queue.Queue(maxsize=4)
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-loader", daemon=True)

    def __enter__(self) -> _Loader:
        self._thread.start()
        return self

    def __call__(self, s: Session, table: Any, names: Sequence[str], rows: Sequence[Any]) -> None:
        if self._error is not None:
            raise self._error
        if rows:
            self._todo.put((s, table, names, rows))

    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            if self._error is None:  # after a failure, only drained
                try:
                    insert_rows(*job)
                except BaseException as exc:  # handed to the building thread
                    self._error = exc

    def __exit__(self, *exc: object) -> None:
        self._todo.put(None)
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error


def _secondary_indexes(s: Session) -> list[tuple[str, str]]:
    """(name, CREATE statement) of the loaded tables' indexes that back no constraint."""
    tables = ", ".join(f"'{t}'" for t in _LOADED)
    if s.get_bind().dialect.name == "postgresql":
        rows = s.execute(
            text(
                "SELECT indexname, indexdef FROM pg_indexes"
                f" WHERE schemaname = current_schema() AND tablename IN ({tables})"
                " AND indexname NOT IN (SELECT conname FROM pg_constraint"
                " WHERE connamespace = current_schema()::regnamespace)"
            )
        )
    else:
        rows = s.execute(
            text(
                "SELECT name, sql FROM sqlite_master"
                f" WHERE type = 'index' AND tbl_name IN ({tables}) AND sql IS NOT NULL"
            )
        )
    return [(name, ddl) for name, ddl in rows]


def _yardstick() -> int:
    """A fixed piece of pure-Python work (about a millisecond on a quiet machine here):
    timed beside every measured call, it says how fast the machine ran while that cell
    was measured. This machine is shared: the same code's reserve + release read 10.7 ms
    in one run and 15.5 ms in the next, and its CPU time moved with it."""
    total = 0
    for i in range(20_000):
        total += i * i % 7
    return total


# The server's yardstick: the same kind of fixed work, run inside PostgreSQL. Its backend
# runs on the other core, which can be slowed while ours is not: in one run reserve +
# release read 16 ms with this process's yardstick at 1.1x its fastest.
_DB_YARDSTICK = text("SELECT sum(i * i % 7) FROM generate_series(1, 20000) AS i")


def _median_ms(
    fn: Callable[[], object],
    yard: list[float],
    db_yard: list[float],
    server_work: Callable[[], object] | None,
) -> float:
    """The median of REPEATS calls of `fn`. Before each, the yardsticks are timed: this
    process's into `yard`, the server's (`server_work`, when given) into `db_yard`."""
    fn()  # warm
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        _yardstick()
        t1 = time.perf_counter()
        yard.append((t1 - t0) * 1000)
        if server_work is not None:
            server_work()
            t0, t1 = t1, time.perf_counter()
            db_yard.append((t1 - t0) * 1000)
        fn()
        times.append((time.perf_counter() - t1) * 1000)
    return round(statistics.median(times), 2)


def _ops(svc: GpuService) -> dict[str, Callable[[], object]]:
    me = svc.actor("user01")
    clock = svc.clock
    assert isinstance(clock, BenchClock)

    def reserve_release() -> None:
        # Released 90 minutes after it was granted, across an hour boundary, as in real
        # use: a release at the instant of the grant closes an empty interval, which
        # skips the rollup writes that every real release does.
        svc.reserve(me, Reserve(count=1, duration=timedelta(hours=2)))
        clock.set(NOW + timedelta(minutes=90))
        try:
            svc.release(me, Release(all=True))
        finally:
            clock.set(NOW)

    return {
        "idle_tick": lambda: tick_job(svc, None),
        "cost_team_month": lambda: handle_text(svc, me, "/gpu cost team month"),
        "digest": lambda: digest_for(svc),
        "status": lambda: handle_text(svc, me, "/gpu status"),
        "queue": lambda: handle_text(svc, me, "/gpu queue"),
        "app_home": lambda: home_view(svc, me),
        "reserve_release": reserve_release,
    }


def _measure(svc: GpuService, only: tuple[str, ...] | None = None) -> dict[str, float]:
    ops = _ops(svc)
    yard: list[float] = []
    db_yard: list[float] = []
    server_work: Callable[[], object] | None = None
    if svc.engine.dialect.name == "postgresql":

        def server_work() -> object:
            with svc.engine.connect() as conn:
                return conn.execute(_DB_YARDSTICK).scalar_one()

    out = {
        k: _median_ms(fn, yard, db_yard, server_work)
        for k, fn in ops.items()
        if only is None or k in only
    }
    out["yardstick_ms"] = round(statistics.median(yard), 3)
    if db_yard:
        out["db_yardstick_ms"] = round(statistics.median(db_yard), 3)
    tracemalloc.start()
    for k, fn in ops.items():
        if only is None or k in only:
            fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["peak_traced_mb"] = round(peak / 2**20, 1)
    return out


@contextmanager
def _database(kind: str, tmp: Path) -> Iterator[Engine | None]:
    if kind == "sqlite":
        engine = make_engine(f"sqlite:///{tmp / f'h-{secrets.token_hex(4)}.db'}")
        upgrade(engine)
        try:
            yield engine
        finally:
            engine.dispose()
        return
    try:
        admin = make_engine(PG_URL)
        with admin.begin() as conn:
            schema = "bench_" + secrets.token_hex(6)
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    except Exception:
        yield None
        return
    engine = make_engine(f"{PG_URL}?options=-csearch_path%3D{schema}")
    try:
        upgrade(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def run() -> dict[str, object]:
    figures: dict[str, object] = {"repeats": REPEATS, "goals_ms": GOALS_MS}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("sqlite", "postgresql"):
            by_size: dict[str, object] = {}
            # The small cells first: measured right after a million-row schema is dropped,
            # PostgreSQL's checkpoint of the drop ran beside them and made 1 host read
            # slower than 100 (12.7 ms against 10.5 at the last stop; 8-9 ms alone).
            cells: list[tuple[str, int, int]] = [
                *((f"1000@{h}hosts", h, 1_000) for h in (1, 10)),
                *((str(n), 100, n) for n in SIZES),
            ]
            for name, hosts, n in cells:
                with _database(kind, Path(tmp)) as engine:
                    if engine is None:
                        figures[kind] = "not reachable"
                        break
                    t0 = time.perf_counter()
                    svc = build_history(engine, hosts, n)
                    build_s = round(time.perf_counter() - t0, 1)
                    # The disk settled too: the SQLite million's file, still being written
                    # back, slowed PostgreSQL's commits (fsync) in the cells after it, by
                    # half, with the yardstick (CPU only) unmoved.
                    os.sync()
                    if hosts == 100:
                        by_size[name] = {"hosts": 100, "build_s": build_s, **_measure(svc)}
                    else:
                        by_size[name] = {
                            "hosts": hosts,
                            **_measure(
                                svc, ("status", "queue", "app_home", "reserve_release", "idle_tick")
                            ),
                        }
            else:
                figures[kind] = by_size
    figures["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return figures


def headline(figures: dict[str, object]) -> list[str]:
    lines = []
    for kind in ("sqlite", "postgresql"):
        by_size = figures.get(kind)
        if not isinstance(by_size, dict):
            continue
        sizes = [k for k in by_size if k.isdigit()]
        if not sizes:
            continue
        small, big = by_size[sizes[0]], by_size[sizes[-1]]
        for op, goal in GOALS_MS.items():
            a, b = small.get(op), big.get(op)
            if a is None or b is None:
                continue
            growth = b / a if a else float("inf")
            lines.append(
                f"{kind} {op}: {a} ms @{sizes[0]} -> {b} ms @{sizes[-1]} "
                f"({growth:.1f}x; goal <= {goal} ms, <= 2x)"
            )
        for key, who in (("yardstick_ms", "this process"), ("db_yardstick_ms", "the server")):
            yards = {k: v.get(key) for k, v in by_size.items() if isinstance(v, dict)}
            if yards and all(isinstance(v, float) for v in yards.values()):
                fastest = min(v for v in yards.values() if isinstance(v, float))
                speed = ", ".join(
                    f"{k} {v / fastest:.2f}x" for k, v in yards.items() if isinstance(v, float)
                )
                lines.append(f"{kind} slowness of {who} per cell (vs its fastest): {speed}")
    lines.append(f"max RSS {figures.get('max_rss_mb')} MB")
    return lines
