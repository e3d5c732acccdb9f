"""`make bench` part: the tick, costs, the digest and the views as history grows.

A synthetic history (50 people on H hosts of 8 GPUs, N closed usage intervals spread
over the 90 days before "now"; each host's GPUs split into lanes whose work runs back to
back with gaps: reservations, and training runs of the lane's size, a run per ten
intervals or so, with their metrics, as a team with sweeps has them) is bulk inserted,
streamed, with its rollups, fair-share counters and run times (`bot.app.money.rollups`'s
rebuild, the same arithmetic the bot uses when intervals close and runs end). The present
is the same at every size: 36 runs going on whole hosts, one person holding a GPU. Then the
real use cases run through the service with a virtual clock: an idle worker tick, `/gpu
cost team month`, the weekly digest's numbers (chart aside), `/gpu status`, `/gpu queue`,
App Home, a reserve + release, the same by a person with a monthly budget, and (no goal)
the run-time estimates made again, what the tick after a run ended adds. Each is the
median of REPEATS calls, with its statement count and its median CPU time in this thread
(`cpu_ms`: on SQLite all of a call's work); peak memory is tracemalloc's peak over one call
of each, after the build. Each cell also has `yardstick_ms`, a fixed
piece of Python timed beside every call (and on PostgreSQL `db_yardstick_ms`, the same
kind of work inside the server, whose backend runs on the other core), and the headline
says how much slower each ran in each cell than in its fastest: a shared machine's speed
moves by half between runs, so compare cells of one run, and read a cell against its
yardsticks.

Sizes: 1k, 10k, 100k intervals at 100 hosts (and 1 and 10 hosts at 1k for the views),
on SQLite and on PostgreSQL when it is reachable. 1M intervals only with
GPUBOT_BENCH_HISTORY_1M=1 (its build: 45-100 s of wall clock per database on a shared
2-core machine, as busy as that is);
GPUBOT_BENCH_HISTORY_SIZES=1000,100000 measures only those sizes;
GPUBOT_BENCH_HISTORY_DBS=sqlite only that database.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import json
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

from sqlalchemy import event, func, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, col, select

from bot.app.config import Settings
from bot.app.money.digest import digest_for
from bot.app.money.rollups import (
    ClosedRow,
    FairShareCounters,
    HourlyRollups,
    RollupKey,
    Sums,
    write_rollups,
)
from bot.app.places import RunParts, Wiring
from bot.app.ports import Actor
from bot.app.runs import LocalAccess
from bot.app.runtimes import keep_estimates, ran_s
from bot.app.service import GpuService
from bot.domain.commands import Release, Reserve
from bot.faces.dispatch import handle_text
from bot.faces.slack.home import home_view
from bot.faces.worker import tick_job
from db.migrate import upgrade
from db.models import (
    Gpu,
    Host,
    HostPeriod,
    Reservation,
    RunTime,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import insert_rows, make_engine, transaction
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
# GPUBOT_BENCH_HISTORY_DBS=sqlite: one database only (a quicker look).
DATABASES = tuple(
    d for d in os.environ.get("GPUBOT_BENCH_HISTORY_DBS", "sqlite,postgresql").split(",") if d
)
GOALS_MS = {
    "idle_tick": 20,
    "cost_team_month": 50,
    "digest": 100,
    "status": 30,
    "queue": 30,
    "app_home": 30,
    "reserve_release": 15,
    "reserve_release_budget": 15,
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
    """The service over a synthetic history of about `intervals` closed intervals (bulk
    inserted, rollups computed as the bot computes them), of reservations and of training
    runs as a team with sweeps has them, and the present: RUNNING runs holding GPUs, and
    one person holding a GPU."""
    clock = BenchClock(NOW - timedelta(days=91))
    runs = RunParts(
        LocalAccess(LocalRunner(), LOCAL_TARGET, Path(tempfile.mkdtemp()) / "runs"),
        Catalog.load(),
    )
    svc = GpuService(
        engine,
        Settings(admins=("root",), status_cache_s=0.0),
        clock,
        lambda core: [Wiring("local", runs=runs)],
    )
    svc.sync_hosts(_instances(hosts))  # opens each host's billed period 91 days ago
    for u in range(USERS):
        svc.actor(f"user{u:02d}")
    with Session(engine) as s:
        by_host: dict[int, list[int]] = {}
        for g in s.exec(select(Gpu).order_by(col(Gpu.host_id), col(Gpu.index))).all():
            assert g.id is not None
            by_host.setdefault(g.host_id, []).append(g.id)
        users = [
            u.id for u in s.exec(select(User).order_by(col(User.id))).all() if u.id is not None
        ]
        host_names = {h.id: h.name for h in s.exec(select(Host)).all()}
    # Each host's GPUs are split into lanes (a 4-GPU run beside a 2-GPU one and single-GPU
    # sweep variants, ...), each lane a stream of work back to back with gaps from 90 days
    # ago: a reservation (an interval per GPU of the lane) or a run of the lane's size.
    # Each lane's work comes from its own seeded generator, so nothing holds the million
    # rows (which would otherwise be most of the bench's peak memory): the lanes' streams
    # are merged by start and go, in one pass, into the tables in chunks (the driver's
    # executemany on SQLite, COPY on PostgreSQL: db.session.insert_rows), into the hourly
    # rollups (bot.app.money.rollups.HourlyRollups, the bot's own arithmetic, written by the
    # rebuild's own write_rollups) and, put back in the order they end by a small heap,
    # into the fair-share counters (bot.app.money.rollups.FairShareCounters).
    lanes: list[tuple[int, tuple[int, ...]]] = []
    for n, host_id in enumerate(sorted(by_host)):
        ids = by_host[host_id]
        at = 0
        for size in _LAYOUTS[n % len(_LAYOUTS)]:
            lanes.append((host_id, tuple(ids[at : at + size])))
            at += size
    start = NOW - timedelta(days=90)
    end = NOW - timedelta(hours=1)
    n_gpus = sum(len(g) for g in by_host.values())
    per_lane = max(1, -(-intervals // n_gpus))  # items per lane: each GPU's share of N
    gap_mean = max(60.0, (end - start).total_seconds() / per_lane - 3600)
    rate = HOURLY / GPUS_PER_HOST
    # Each person's runs have their own typical length (what the estimator learns).
    scale = {u: random.Random(seed + u).choice((900.0, 1800.0, 3600.0, 7200.0)) for u in users}
    sql = engine.dialect.name == "sqlite"
    as_json: Callable[[Any], Any] = json.dumps if sql else (lambda v: v)
    run_ids = itertools.count(1)
    res_ids = itertools.count(1)
    last_end: dict[int, datetime] = {}
    run_rows: list[tuple[object, ...]] = []  # finished runs' rows, inserted in chunks
    # and their times as the bot keeps them when a run ends (bot.app.runtimes)
    time_rows: list[tuple[object, ...]] = []
    # Ended reservations, one per reservation item (a person's thousands over 90 days):
    # what `/gpu status` and App Home search for the person's live ones.
    res_rows: list[tuple[object, ...]] = []

    def one_lane(i: int, host_id: int, gpu_ids: tuple[int, ...]) -> Iterator[_Made]:
        rng = random.Random(seed * 1_000_003 + i)
        t = start + timedelta(seconds=rng.uniform(0, gap_mean))
        for _ in range(per_lane):
            user = rng.choice(users)
            run = rng.random() < RUN_SHARE
            mean = scale[user] if run else 3600.0
            dur = timedelta(seconds=min(12 * 3600.0, max(60.0, rng.expovariate(1 / mean))))
            if t + dur > end:
                break
            if not run:
                res_id = next(res_ids)
                res_rows.append(
                    _ended_reservation(rng, res_id, user, host_id, gpu_ids, t, dur, as_json)
                )
                for g in gpu_ids:
                    yield t, t + dur, g, host_id, user, None, res_id
                t += dur
            else:
                run_id = next(run_ids)
                # One run in twenty was preempted once and resumed later on the same GPUs:
                # its first segment's length is in its metrics, as RunRecords.requeue keeps it.
                first: timedelta | None = None
                if rng.random() < 0.05:
                    first = dur * rng.uniform(0.2, 0.8)
                    resume = t + first + timedelta(seconds=rng.expovariate(1 / 1800))
                    rest = dur - first
                    if resume + rest > end:
                        break
                    for g in gpu_ids:
                        yield t, t + first, g, host_id, user, run_id, None
                    seg, t = resume, resume + rest
                else:
                    seg, t = t, t + dur
                for g in gpu_ids:
                    yield seg, t, g, host_id, user, run_id, None
                host = host_names[host_id]
                run_rows.append(
                    _finished_run(rng, run_id, user, len(gpu_ids), host, seg, t, first, as_json)
                )
                earlier = {"attained_s": first.total_seconds()} if first is not None else {}
                time_rows.append((run_id, user, len(gpu_ids), t, ran_s(seg, t, earlier)))
            last_end[i] = t
            t += timedelta(seconds=rng.expovariate(1 / gap_mean))

    made = 0
    with _bulk_load(engine) as s, _Loader() as insert:
        rollups = HourlyRollups(s.exec(select(HostPeriod)).all())
        fair = FairShareCounters()
        table = UsageInterval.__table__  # type: ignore[attr-defined]
        runs_table = TrainingRun.__table__  # type: ignore[attr-defined]
        times_table = RunTime.__table__  # type: ignore[attr-defined]
        res_table = Reservation.__table__  # type: ignore[attr-defined]

        def hourly() -> Iterator[tuple[RollupKey, Sums]]:
            nonlocal made
            chunk: list[tuple[object, ...]] = []
            ends: list[tuple[datetime, datetime, int, int]] = []  # heap: end, start, GPU, user
            streams = [one_lane(i, h, g) for i, (h, g) in enumerate(lanes)]
            for a, b, gpu_id, host_id, user_id, run_id, res_id in heapq.merge(*streams):
                chunk.append((gpu_id, host_id, user_id, run_id, res_id, a, b, rate, "ondemand"))
                made += 1
                if len(chunk) >= _CHUNK:
                    # A reservation's row before its intervals (their foreign key).
                    insert(s, res_table, _RES_COLUMNS, list(res_rows))
                    res_rows.clear()
                    insert(s, table, _INTERVAL_COLUMNS, chunk)
                    chunk = []
                if len(run_rows) >= _RUN_CHUNK:
                    insert(s, runs_table, _RUN_COLUMNS, list(run_rows))
                    insert(s, times_table, _TIME_COLUMNS, list(time_rows))
                    run_rows.clear()
                    time_rows.clear()
                # Every interval still to come ends after `a`: those that ended by then
                # are final in the order they ended.
                while ends and ends[0][0] <= a:
                    ended, started, _, who = heapq.heappop(ends)
                    fair.add(ended, started, who)
                heapq.heappush(ends, (b, a, gpu_id, user_id))
                yield from rollups.add(ClosedRow(a, b, user_id, host_id, "ondemand", run_id, rate))
            insert(s, res_table, _RES_COLUMNS, list(res_rows))
            res_rows.clear()
            insert(s, table, _INTERVAL_COLUMNS, chunk)
            insert(s, runs_table, _RUN_COLUMNS, list(run_rows))
            insert(s, times_table, _TIME_COLUMNS, list(time_rows))
            run_rows.clear()
            time_rows.clear()
            while ends:
                ended, started, _, who = heapq.heappop(ends)
                fair.add(ended, started, who)
            yield from rollups.rest()

        # write_rollups reads the counters only after the last hourly row.
        write_rollups(s, hourly(), fair.fair, insert)
    if not sql:  # runs and reservations came with their ids: the sequences go on after them
        with engine.begin() as conn:
            for name in ("trainingrun", "reservation"):
                conn.execute(
                    text(
                        f"SELECT setval(pg_get_serial_sequence('{name}', 'id'),"
                        f" (SELECT coalesce(max(id), 0) + 1 FROM {name}), false)"
                    )
                )
    _settle(engine)
    clock.set(NOW)
    _running(engine, lanes, last_end, users, host_names, seed)
    svc.reserve(svc.actor("user00"), Reserve(count=1, duration=timedelta(hours=8)))
    with transaction(engine) as s:  # the person whose reservations are checked against a budget
        budgeted = s.exec(select(User).where(User.key == BUDGETED)).one()
        budgeted.budget_usd = 1_000_000.0
        budgeted.budget_period = "month"
        s.add(budgeted)
    svc.history_made = made  # type: ignore[attr-defined]
    return svc


# How a host's 8 GPUs are split among the work on it (cycled over the hosts).
_LAYOUTS = ((4, 2, 1, 1), (8,), (2, 2, 2, 2), (1,) * 8, (4, 4), (4, 1, 1, 1, 1), (2, 2, 1, 1, 1, 1))
# Of the lanes' items, the share that are runs (the rest reservations): about 30,000
# runs end in the last 30 days of a million intervals, a run per 10 intervals or so.
RUN_SHARE = 0.2
RUNNING = 36  # runs holding GPUs now, whatever the size of the history
BUDGETED = "user02"  # has a monthly budget (reserve_release_budget)
_RECIPES = ("digits", "cifar10", "tinylm")


def _finished_run(
    rng: random.Random,
    run_id: int,
    user_id: int,
    gpus: int,
    host: str,
    started: datetime,
    finished: datetime,
    first: timedelta | None,
    as_json: Callable[[Any], Any],
) -> tuple[object, ...]:
    """A finished run's row as the bot leaves it: its command or recipe (a sweep variant
    of a recipe on one GPU, often), its placement, and the metrics the runner reported,
    with its result and cost (bot.app.runs.records.finish)."""
    ok = rng.random() < 0.85
    recipe = rng.choice(_RECIPES) if rng.random() < 0.6 else None
    sweep = (
        f"s{run_id // 8:05d}" if recipe is not None and gpus == 1 and rng.random() < 0.7 else None
    )
    lr = rng.choice((1e-4, 3e-4, 1e-3, 3e-3))
    steps = rng.randrange(500, 20_000)
    wall = (finished - started).total_seconds()
    loss = round(rng.uniform(0.05, 2.5), 4)
    metrics: dict[str, Any] = {
        "state": "done" if ok else "failed",
        "step": steps if ok else steps // 2,
        "total_steps": steps,
        "epoch": 9 if ok else 4,
        "total_epochs": 10,
        "loss": loss,
        "metrics": {"accuracy": round(rng.uniform(0.5, 0.99), 4), "val_loss": loss * 1.1},
        "precision": "bf16",
        "samples_per_s": round(rng.uniform(200, 5000), 1),
        "eta_s": 0.0,
        "progress": {"step": steps, "at": finished.isoformat()},
        "live": {"message": run_id * 3, "edits": int(wall // 60)},
        "summary": {
            "state": "done" if ok else "failed",
            "precision": "bf16",
            "error": None if ok else "loss became NaN at step 1200",
            "final_metrics": {"accuracy": 0.97},
            "final_loss": loss,
            "wall_s": round(wall, 1),
        },
        "cost_usd": round(HOURLY / GPUS_PER_HOST * gpus * wall / 3600, 4),
    }
    if first is not None:
        metrics["attained_s"] = first.total_seconds()
    placement = {
        "host": host,
        "pgid": 10_000 + run_id % 50_000,
        "status": f"/home/gpubot/.gpubot/runs/{run_id}/status.json",
        "log": f"/home/gpubot/.gpubot/runs/{run_id}/log.txt",
        "gpus": list(range(gpus)),
    }
    return (
        run_id,
        user_id,
        "" if recipe else "python train.py --config configs/base.yaml",
        recipe,
        "",
        gpus,
        "A100",
        "auto",
        False,
        False,
        None,
        0,
        "succeeded" if ok else "failed",
        None,
        as_json(placement),
        started - timedelta(seconds=rng.uniform(5, 900)),
        started,
        finished,
        0 if ok else 1,
        as_json(metrics),
        as_json({"lr": lr} if recipe else {}),
        sweep,
    )


def _running(
    engine: Engine,
    lanes: list[tuple[int, tuple[int, ...]]],
    last_end: dict[int, datetime],
    users: list[int],
    host_names: dict[int | None, str],
    seed: int,
) -> None:
    """RUNNING runs holding their lanes' GPUs now, started in the last hours (each after
    its lane's last piece of history): sweeps of recipes mostly, which the scheduler may
    move (so an idle tick still weighs them), the rest commands; a few with a --max."""
    rng = random.Random(seed * 7919)
    # Whole hosts, as the scheduler packs runs (it moves a movable run off a half-empty
    # instance so that the instance can stop): hosts in a seeded order, each taken only
    # while its lanes still fit in RUNNING.
    by_host: dict[int, list[int]] = {}
    for i, (host_id, _) in enumerate(lanes):
        by_host.setdefault(host_id, []).append(i)
    chosen: list[int] = []
    for host_id in rng.sample(sorted(by_host), len(by_host)):
        if len(chosen) + len(by_host[host_id]) <= RUNNING:
            chosen += by_host[host_id]
    with transaction(engine) as s:
        for i in chosen:
            host_id, gpu_ids = lanes[i]
            began = NOW - timedelta(seconds=rng.uniform(300, 4 * 3600))
            if i in last_end:
                began = max(began, last_end[i] + timedelta(minutes=1))
            began = min(began, NOW - timedelta(minutes=1))
            recipe = rng.choice(_RECIPES) if rng.random() < 0.7 else None
            steps = rng.randrange(2_000, 20_000)
            run = TrainingRun(
                user_id=rng.choice(users),
                command="" if recipe else "python train.py --config configs/base.yaml",
                recipe=recipe,
                gpu_count=len(gpu_ids),
                gpu_model="A100",
                max_seconds=6 * 3600 if rng.random() < 0.2 else None,
                state="running",
                host_id=host_id,
                placement={
                    "host": host_names[host_id],
                    "pgid": 20_000 + i,
                    "status": f"/home/gpubot/.gpubot/runs/r{i}/status.json",
                    "log": f"/home/gpubot/.gpubot/runs/r{i}/log.txt",
                    "gpus": list(range(len(gpu_ids))),
                },
                submitted_at=began - timedelta(minutes=2),
                started_at=began,
                metrics={
                    "state": "running",
                    "step": steps // 3,
                    "total_steps": steps,
                    "epoch": 3,
                    "total_epochs": 10,
                    "loss": 0.8,
                    "metrics": {"accuracy": 0.7},
                    "precision": "bf16",
                    "samples_per_s": 1800.0,
                    "eta_s": 3600.0,
                    "progress": {"step": steps // 3, "at": NOW.isoformat()},
                    "live": {"message": 9_000_000 + i, "edits": 12},
                },
                options={"lr": 3e-4} if recipe else {},
                sweep=f"now{i % 6}" if recipe and len(gpu_ids) == 1 else None,
            )
            s.add(run)
            s.flush()
            for g in gpu_ids:
                s.add(
                    UsageInterval(
                        gpu_id=g,
                        host_id=host_id,
                        user_id=run.user_id,
                        run_id=run.id,
                        started_at=began,
                        usd_per_hour=HOURLY / GPUS_PER_HOST,
                        market="ondemand",
                    )
                )


def _settle(engine: Engine) -> None:
    if engine.dialect.name == "postgresql":
        # Settled as a year of slowly grown history is: vacuumed and analyzed, its WAL
        # checkpointed. Left to itself, the server vacuumed the freshly loaded million
        # rows and checkpointed them while the cells were measured, on the same two
        # cores: every figure of the 1M cell doubled (its yardstick 1.5x) in one run.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for name in _SETTLED:
                conn.execute(text(f"VACUUM (ANALYZE) {name}"))
            # not a superuser: the checkpoint comes in its own time
            with suppress(DBAPIError):
                conn.execute(text("CHECKPOINT"))


_SETTLED = (
    "usageinterval",
    "usagerollup",
    "usagerollupday",
    "runrollup",
    "runrollupday",
    "hostperiod",
    "fairshareusage",
    "trainingrun",
    "runtime",
)


_CHUNK = 10_000
# Runs carry their metrics (a kilobyte of JSON each): fewer of them at a time, so that the
# chunks waiting for the loader do not hold megabytes.
_RUN_CHUNK = 1_000
# start, end, GPU, host, user, run, reservation
_Made = tuple[datetime, datetime, int, int, int, int | None, int | None]
_INTERVAL_COLUMNS = (
    "gpu_id",
    "host_id",
    "user_id",
    "run_id",
    "reservation_id",
    "started_at",
    "ended_at",
    "usd_per_hour",
    "market",
)
_RUN_COLUMNS = (
    "id",
    "user_id",
    "command",
    "recipe",
    "source",
    "gpu_count",
    "gpu_model",
    "precision",
    "spot",
    "checkpoints",
    "max_seconds",
    "priority",
    "state",
    "host_id",
    "placement",
    "submitted_at",
    "started_at",
    "finished_at",
    "exit_code",
    "metrics",
    "options",
    "sweep",
)
# The tables the build fills: their secondary indexes are made after the load.
_LOADED = (
    "usageinterval",
    "usagerollup",
    "usagerollupday",
    "runrollup",
    "runrollupday",
    "trainingrun",
    "runtime",
    "reservation",
)
_TIME_COLUMNS = ("run_id", "user_id", "gpus", "finished_at", "ran_s")
_RES_COLUMNS = (
    "id",
    "user_id",
    "gpu_model",
    "gpu_count",
    "duration_s",
    "state",
    "requested_at",
    "granted_at",
    "ends_at",
    "ended_at",
    "host_id",
    "external",
    "place",
)


def _ended_reservation(
    rng: random.Random,
    res_id: int,
    user_id: int,
    host_id: int,
    gpu_ids: tuple[int, ...],
    start: datetime,
    held: timedelta,
    as_json: Callable[[Any], Any],
) -> tuple[object, ...]:
    """An ended reservation's row as the bot leaves it: asked for a whole number of hours,
    granted at once or after a wait, released early (most) or expired at its end."""
    asked = timedelta(hours=max(1, -(-int(held.total_seconds()) // 3600)))
    released = rng.random() < 0.8
    return (
        res_id,
        user_id,
        "A100",
        len(gpu_ids),
        int(asked.total_seconds()),
        "released" if released else "expired",
        start - timedelta(seconds=rng.uniform(1, 600)),
        start,
        start + asked,
        start + held,
        host_id,
        as_json({}),
        as_json({}),
    )


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
            queue.Queue(maxsize=2)
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
    cpu: list[float] | None = None,
) -> float:
    """The median of REPEATS calls of `fn`. Before each, the yardsticks are timed: this
    process's into `yard`, the server's (`server_work`, when given) into `db_yard`. Each
    call's CPU time in this thread goes into `cpu`: on SQLite all of a call's work, and
    what a machine whose other processes keep its cores busy cannot stretch (the wall
    clock waits for a core; a yardstick of a millisecond often gets one at once)."""
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
        c0 = time.thread_time()
        fn()
        c1, t2 = time.thread_time(), time.perf_counter()
        times.append((t2 - t1) * 1000)
        if cpu is not None:
            cpu.append((c1 - c0) * 1000)
    return round(statistics.median(times), 2)


def _ops(svc: GpuService) -> dict[str, Callable[[], object]]:
    me = svc.actor("user01")
    budgeted = svc.actor(BUDGETED)
    clock = svc.clock
    assert isinstance(clock, BenchClock)

    def reserve_release(who: Actor) -> None:
        # Released 90 minutes after it was granted, across an hour boundary, as in real
        # use: a release at the instant of the grant closes an empty interval, which
        # skips the rollup writes that every real release does.
        svc.reserve(who, Reserve(count=1, duration=timedelta(hours=2)))
        clock.set(NOW + timedelta(minutes=90))
        try:
            svc.release(who, Release(all=True))
        finally:
            clock.set(NOW)

    return {
        "idle_tick": lambda: tick_job(svc, None),
        "cost_team_month": lambda: handle_text(svc, me, "/gpu cost team month"),
        "digest": lambda: digest_for(svc),
        "status": lambda: handle_text(svc, me, "/gpu status"),
        "queue": lambda: handle_text(svc, me, "/gpu queue"),
        "app_home": lambda: home_view(svc, me),
        "reserve_release": lambda: reserve_release(me),
        "reserve_release_budget": lambda: reserve_release(budgeted),
        # What the tick after a run ended (or after the oldest counted run left the 30
        # days) adds: the run-time estimates made again from the kept times. No goal of
        # its own; at 30,000 runs in 30 days it comes about twice in three minutes.
        "remake_estimates": lambda: keep_estimates(svc.engine, NOW),
    }


def _measure(svc: GpuService, only: tuple[str, ...] | None = None) -> dict[str, object]:
    ops = _ops(svc)
    yard: list[float] = []
    db_yard: list[float] = []
    server_work: Callable[[], object] | None = None
    if svc.engine.dialect.name == "postgresql":

        def server_work() -> object:
            with svc.engine.connect() as conn:
                return conn.execute(_DB_YARDSTICK).scalar_one()

    cpu: dict[str, list[float]] = {k: [] for k in ops}
    out: dict[str, object] = {
        k: _median_ms(fn, yard, db_yard, server_work, cpu[k])
        for k, fn in ops.items()
        if only is None or k in only
    }
    out["cpu_ms"] = {k: round(statistics.median(v), 2) for k, v in cpu.items() if v}
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
    # How many statements one call of each issues: a figure that must not grow with the
    # history, the runs or the hosts, whatever the machine's speed.
    counted: dict[str, int] = {}
    for k, fn in ops.items():
        if only is None or k in only:
            counted[k] = _statements(svc.engine, fn)
    out["statements"] = counted
    return out


def _give_back_memory() -> None:
    """Hands the heap the build freed back to the system (glibc's malloc_trim): a build's
    buffers (SQLite's sorts for the indexes made after the load, the loader's chunks) stay
    in the process's heap otherwise, and each cell's would count in the next one's peak
    RSS, which then grew with the number of cells measured, not with what a cell needs."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _shape(engine: Engine) -> dict[str, int]:
    """What the history holds: intervals, runs finished in the 30 days the run-time
    estimates read, and runs holding GPUs now."""
    with Session(engine) as s:
        since = NOW - timedelta(days=30)
        return {
            "intervals": s.exec(select(func.count()).select_from(UsageInterval)).one(),
            "runs": s.exec(select(func.count()).select_from(TrainingRun)).one(),
            "runs_ended_30d": s.exec(
                select(func.count())
                .select_from(TrainingRun)
                .where(col(TrainingRun.finished_at) > since)
            ).one(),
            "reservations": s.exec(select(func.count()).select_from(Reservation)).one(),
            "running": s.exec(
                select(func.count()).select_from(TrainingRun).where(TrainingRun.state == "running")
            ).one(),
        }


def _statements(engine: Engine, fn: Callable[[], object]) -> int:
    seen = 0

    def note(*_: object) -> None:
        nonlocal seen
        seen += 1

    event.listen(engine, "before_cursor_execute", note)
    try:
        fn()
    finally:
        event.remove(engine, "before_cursor_execute", note)
    return seen


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
        for kind in DATABASES:
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
                    _give_back_memory()
                    if hosts == 100:
                        by_size[name] = {
                            "hosts": 100,
                            "build_s": build_s,
                            **_shape(engine),
                            **_measure(svc),
                        }
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
        remade = [
            f"{k} {v['remake_estimates']} ms"
            for k, v in by_size.items()
            if isinstance(v, dict) and "remake_estimates" in v
        ]
        if remade:
            lines.append(f"{kind} remake_estimates (no goal): {', '.join(remade)}")
    lines.append(f"max RSS {figures.get('max_rss_mb')} MB")
    return lines
