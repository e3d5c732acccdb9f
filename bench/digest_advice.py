"""`make bench` part: the weekly digest with its advice, on a 100-host, 50-person week.

Goal (issue 32): the digest, its largest wastes and the replayed advice included, in
under 2 s for a week of 100 rented 8-GPU hosts and 50 people. The week (and the week
before, for "vs last wk") is written as the bot writes it: every host running all week in
billed periods, runs and reservations placed on free GPUs as usage intervals, hourly
utilization samples of the reservations, the rollups rebuilt from the intervals
(`bot.app.money.rollups.rebuild_rollups`, what `gpubot db rebuild-rollups` does). Then
`digest_for` is timed without the advice and with it (the simulator behind the port, as
the CLI and the worker hand it), and the text view with both; each the median of the
history bench's repeats (GPUBOT_BENCH_HISTORY_REPEATS), beside its yardstick (a fixed
piece of Python) so a reader can tell a slow machine from slow code. SQLite; sizes by GPUBOT_BENCH_ADVICE_RUNS (runs per person
per week, default 10).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlmodel import Session

from bench.history import _median_ms as _history_median_ms
from bot.app.config import Settings
from bot.app.money.advice import parting_text, replay_jobs, week_wastes
from bot.app.money.digest import digest_for, digest_view
from bot.app.money.rollups import rebuild_rollups
from bot.app.runs.context import scheduler_config
from bot.app.service import GpuService
from bot.domain.clock import VirtualClock
from bot.faces.replay import SimReplayer
from db.migrate import upgrade
from db.models import (
    Gpu,
    GpuSample,
    Host,
    HostPeriod,
    Reservation,
    TrainingRun,
    UsageInterval,
    User,
)
from db.session import insert_rows, make_engine, transaction
from provisioning.catalog import Catalog, InstanceType

HOSTS = 100
USERS = 50
RUNS_PER_PERSON = int(os.environ.get("GPUBOT_BENCH_ADVICE_RUNS", "10"))
HOLDS_PER_PERSON = 5
MON = datetime(2026, 3, 9, tzinfo=UTC)  # 2026-W11
NOW = datetime(2026, 3, 17, 9, tzinfo=UTC)
WEEK = "2026-W11"
H = timedelta(hours=1)
GOAL_MS = 2000.0
_SAMPLE_COLUMNS = (
    "host_id",
    "gpu_index",
    "at",
    "span_s",
    "util_pct",
    "user_id",
    "reservation_id",
    "mem_used_mb",
    "mem_total_mb",
)


def build(engine_url: str, seed: int = 11) -> tuple[GpuService, dict[str, int]]:
    engine = make_engine(engine_url)
    upgrade(engine)
    catalog = Catalog.load()
    # Half the fleet A100s, half H100s: a pool cap (at most 64 instances of a type) that a
    # fleet of 100 instances fits in, as the team's settings must allow.
    kinds = [catalog.get("p4d.24xlarge"), catalog.get("p5.48xlarge")]
    types = [k for k in kinds if k is not None]
    assert len(types) == 2
    kind_of: dict[int | None, InstanceType] = {}
    rng = random.Random(seed)
    start = MON - 7 * 24 * H  # the week before too
    end = MON + 7 * 24 * H
    counts = {"runs": 0, "reservations": 0, "intervals": 0, "samples": 0}
    with Session(engine) as s:
        users = [
            User(key=f"user{u:02d}", display_name=f"User {u:02d}", created_at=start)
            for u in range(USERS)
        ]
        s.add_all(users)
        hosts = [
            Host(
                name=f"{types[i % 2].instance_type.split('.')[0]}-{i:03d}",
                provider="aws",
                instance_id=f"i-{i:08x}",
                instance_type=types[i % 2].instance_type,
                market="ondemand",
                hourly_usd=types[i % 2].ondemand_usd_hr,
                created_at=start,
                updated_at=start,
            )
            for i in range(HOSTS)
        ]
        s.add_all(hosts)
        s.flush()
        for i, h in enumerate(hosts):
            kind_of[h.id] = types[i % 2]
        gpus = [
            Gpu(host_id=h.id, index=i, model=kind_of[h.id].gpu_model)  # type: ignore[arg-type]
            for h in hosts
            for i in range(8)
        ]
        s.add_all(gpus)
        s.flush()
        for h in hosts:  # running all fortnight but a night's stop midweek on a third
            spans = [(start, end)]
            if (h.id or 0) % 3 == 0:
                stop = MON + (2 * 24 + 20) * H
                spans = [(start, stop), (stop, stop + 10 * H), (stop + 10 * H, end)]
            for k, (a, b) in enumerate(spans):
                s.add(
                    HostPeriod(
                        host_id=h.id,  # type: ignore[arg-type]
                        state="stopped" if k == 1 else "running",
                        started_at=a,
                        ended_at=b,
                        gpus=8,
                        usd_per_hour=kind_of[h.id].ondemand_usd_hr,
                        storage_usd_per_hour=0.0055 if k == 1 else 0.0,
                        market="ondemand",
                    )
                )
        s.flush()
        free = {g.id: start for g in gpus}  # each GPU's next free instant
        by_host = {h.id: [g for g in gpus if g.host_id == h.id] for h in hosts}
        ivs: list[tuple[object, ...]] = []
        samples: list[tuple[object, ...]] = []

        def share(h: Host) -> float:
            return kind_of[h.id].ondemand_usd_hr / 8

        def place(n: int, submit: datetime, hours: float) -> tuple[Host, list[Gpu], datetime]:
            h = rng.choice(hosts)
            pick = sorted(by_host[h.id], key=lambda g: free[g.id])[:n]
            at = max([submit] + [free[g.id] for g in pick])
            for g in pick:
                free[g.id] = at + hours * H
            return h, pick, at

        for week_start in (start, MON):
            for u in users:
                for _ in range(RUNS_PER_PERSON):
                    submit = week_start + timedelta(seconds=rng.uniform(0, 6.5 * 86400))
                    hours = min(24.0, rng.expovariate(1 / 2.0) + 0.1)
                    n = rng.choice((1, 1, 2, 4, 8))
                    h, pick, at = place(n, submit, hours)
                    if at + hours * H > end:
                        continue
                    state = rng.choices(("succeeded", "failed", "cancelled"), (8, 1, 1))[0]
                    r = TrainingRun(
                        user_id=u.id,  # type: ignore[arg-type]
                        command="python train.py",
                        gpu_count=n,
                        gpu_model=kind_of[h.id].gpu_model,
                        state=state,
                        checkpoints=rng.random() < 0.4,
                        submitted_at=submit,
                        started_at=at,
                        finished_at=at + hours * H,
                        host_id=h.id,
                    )
                    s.add(r)
                    s.flush()
                    counts["runs"] += 1
                    for g in pick:
                        ivs.append(
                            (g.id, h.id, u.id, None, r.id, at, at + hours * H, share(h), "ondemand")
                        )
                for _ in range(HOLDS_PER_PERSON):
                    asked = week_start + timedelta(seconds=rng.uniform(0, 6.5 * 86400))
                    hours = float(rng.choice((1, 2, 3, 4, 8)))
                    h, pick, at = place(1, asked, hours)
                    if at + hours * H > end:
                        continue
                    res = Reservation(
                        user_id=u.id,  # type: ignore[arg-type]
                        gpu_model=kind_of[h.id].gpu_model,
                        gpu_count=1,
                        duration_s=int(hours * 3600),
                        state="released",
                        requested_at=asked,
                        granted_at=at,
                        ends_at=at + hours * H,
                        ended_at=at + hours * H,
                        host_id=h.id,
                    )
                    s.add(res)
                    s.flush()
                    counts["reservations"] += 1
                    g = pick[0]
                    ivs.append(
                        (g.id, h.id, u.id, res.id, None, at, at + hours * H, share(h), "ondemand")
                    )
                    for k in range(int(hours)):
                        util = 0.0 if rng.random() < 0.3 else rng.uniform(20, 99)
                        samples.append(
                            (
                                h.id,
                                g.index,
                                at + (k + 1) * H,
                                3600,
                                util,
                                u.id,
                                res.id,
                                0.0,
                                40960.0,
                            )
                        )
        insert_rows(
            s,
            UsageInterval.__table__,  # type: ignore[attr-defined]
            (
                "gpu_id",
                "host_id",
                "user_id",
                "reservation_id",
                "run_id",
                "started_at",
                "ended_at",
                "usd_per_hour",
                "market",
            ),
            ivs,
        )
        insert_rows(
            s,
            GpuSample.__table__,  # type: ignore[attr-defined]
            _SAMPLE_COLUMNS,
            samples,
        )
        counts["intervals"], counts["samples"] = len(ivs), len(samples)
        rebuild_rollups(s)
        s.commit()
    # The pool cap the fleet needs (50 of each type); the rest as shipped.
    settings = Settings(admins=("root",), pool_max_instances=64)
    return GpuService(engine, settings, VirtualClock(NOW)), counts


def _median_ms(fn: Callable[[], object], yard: list[float]) -> float:
    """The history bench's median of its repeats, with its yardstick, on SQLite."""
    return _history_median_ms(fn, yard, [], None)


def run() -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="gpubot-bench-advice-"))
    t0 = time.perf_counter()
    svc, counts = build(f"sqlite:///{tmp / 'gpubot.db'}")
    build_s = time.perf_counter() - t0
    replay = SimReplayer(Catalog.load())  # the shipped prices: figures comparable run to run
    yard: list[float] = []
    plain = _median_ms(lambda: digest_for(svc, WEEK), yard)
    advised = _median_ms(lambda: digest_view(digest_for(svc, WEEK, replay=replay)), yard)
    d = digest_for(svc, WEEK, replay=replay)
    assert d.report is not None
    catalog = Catalog.load()
    now = svc.clock.now()
    with transaction(svc.engine, write=False) as s:
        jobs = replay_jobs(s, d.window, now)
        wastes = _median_ms(lambda: week_wastes(s, d.window, now, svc.settings, catalog), yard)
    cfg = scheduler_config(svc.settings, catalog)
    world = {"ebs_gb": svc.settings.ebs_gb, "ebs_usd_gb_month": svc.settings.ebs_usd_gb_month}
    one = _median_ms(lambda: replay(jobs, cfg, **world), yard)
    a = d.report.advice
    base = a.base
    return {
        "hosts": HOSTS,
        "people": USERS,
        **counts,
        "build_s": round(build_s, 2),
        "digest_ms": plain,
        "digest_with_advice_ms": advised,
        "advice_ms": round(advised - plain, 2),
        "wastes_ms": wastes,
        "one_replay_ms": one,
        "goal_ms": GOAL_MS,
        "replays": 1 + len(a.tried),
        "runs_replayed": a.runs,
        "replay_usd_today": None if base is None else base.usd,
        "best_change": None if not a.best or base is None else a.best[0].label,
        "best_saving_usd": None if not a.best or base is None else a.best[0].saved(base),
        # Where the bill and the replay part (the digest's "Where the bill and the replay
        # part"): the bill as held GPU time and idle overhead, and the empty hours.
        "bill_usd": float(d.instances_usd),
        "held_usd": float(d.held_usd),
        "idle_overhead_usd": float(d.idle_overhead_usd),
        "empty_hosts": None if d.report.empty is None else d.report.empty.hosts,
        "empty_h": None
        if d.report.empty is None
        else {
            "before_first_use": round(d.report.empty.before_use_h, 1),
            "within_idle_stop": round(d.report.empty.idle_stop_h, 1),
            "past_idle_stop": round(d.report.empty.beyond_h, 1),
        },
        "parting": parting_text(d.report),
        "yardstick_ms": round(statistics.median(yard), 3),
    }


def headline(figures: dict[str, object]) -> list[str]:
    return [
        f"digest with advice {figures['digest_with_advice_ms']} ms "
        f"(goal < {GOAL_MS:.0f} ms; without advice {figures['digest_ms']} ms, "
        f"{figures['replays']} replays of {figures['runs_replayed']} runs, one "
        f"{figures['one_replay_ms']} ms; wastes {figures['wastes_ms']} ms) on "
        f"{figures['hosts']} hosts, {figures['people']} people; yardstick "
        f"{figures['yardstick_ms']} ms"
    ]
