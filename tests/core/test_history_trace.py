"""`gpubot simulate --history`: the team's own runs, read back as a trace and replayed."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session
from typer.testing import CliRunner

from bot.app.money.history_trace import history_trace
from bot.sim.simulate import parse_trace, run_simulation
from db.models import Gpu, Host, TrainingRun, UsageInterval, User
from provisioning.catalog import Catalog

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _seed(engine: Engine, now: datetime = NOW) -> None:
    with Session(engine) as s:
        then = now - timedelta(days=60)
        alice = User(key="alice", display_name="Alice", created_at=then)
        bob = User(key="bob", display_name="Bob", created_at=then)
        host = Host(
            name="gpu-1",
            provider="ssh",
            market="ondemand",
            hourly_usd=32.0,
            created_at=then,
            updated_at=then,
        )
        s.add_all([alice, bob, host])
        s.flush()
        gpus = [Gpu(host_id=host.id, index=i, model="A100") for i in range(2)]  # type: ignore[arg-type]
        s.add_all(gpus)
        s.flush()

        def run(user: User, n: int, submit: datetime, model: str | None = "A100") -> TrainingRun:
            r = TrainingRun(
                user_id=user.id,  # type: ignore[arg-type]
                command="python train.py",
                gpu_count=n,
                gpu_model=model,
                state="succeeded",
                submitted_at=submit,
            )
            s.add(r)
            s.flush()
            return r

        def used(r: TrainingRun, start: datetime, end: datetime | None, k: int) -> None:
            s.add(
                UsageInterval(
                    gpu_id=gpus[k].id,  # type: ignore[arg-type]
                    host_id=host.id,  # type: ignore[arg-type]
                    user_id=r.user_id,
                    run_id=r.id,
                    started_at=start,
                    ended_at=end,
                )
            )

        t0 = now - timedelta(days=3)
        a = run(alice, 2, t0)
        used(a, t0 + timedelta(minutes=5), t0 + timedelta(hours=2, minutes=5), 0)
        used(a, t0 + timedelta(minutes=5), t0 + timedelta(hours=2, minutes=5), 1)
        b = run(bob, 1, t0 + timedelta(hours=1))  # preempted once: two segments
        used(b, t0 + timedelta(hours=3), t0 + timedelta(hours=3, minutes=30), 0)
        used(b, t0 + timedelta(hours=5), t0 + timedelta(hours=5, minutes=30), 1)
        still = run(bob, 1, now - timedelta(minutes=20))  # running: counts to now
        used(still, now - timedelta(minutes=10), None, 0)
        run(alice, 1, t0, model=None)  # never ran anywhere: left out
        old = run(alice, 1, now - timedelta(days=40))  # outside the window
        used(old, now - timedelta(days=40), now - timedelta(days=39), 0)
        s.commit()


def test_the_teams_runs_become_a_trace_of_what_they_did(sqlite_engine: Engine) -> None:
    _seed(sqlite_engine)
    text, skipped = history_trace(sqlite_engine, NOW - timedelta(days=30), NOW)
    assert skipped == 1
    jobs = parse_trace(text.splitlines(), Catalog.load(), "A100")
    got = {(j.user, j.gpus, j.duration_s, j.submit_s) for j in jobs}
    base = 27 * 86400.0
    assert got == {
        ("alice", 2, 7200.0, base),
        ("bob", 1, 3600.0, base + 3600.0),  # its two segments, not the gap between
        ("bob", 1, 600.0, 30 * 86400.0 - 1200.0),
    }
    for policy in ("fair", "fifo", "per-job"):
        res = run_simulation(jobs, policy=policy, max_gpus=16)
        assert res.jobs == 3


def test_cli_history_replays_the_database(sqlite_engine: Engine, tmp_path: Path) -> None:
    from bot.faces.cli import app

    # the CLI reads the window back from now: seed it relative to the real clock
    _seed(sqlite_engine, datetime.now(UTC).replace(microsecond=0))
    url = str(sqlite_engine.url)
    env = {**os.environ, "DATABASE_URL": url, "GPUBOT_HOME": str(tmp_path)}
    r = CliRunner().invoke(app, ["simulate", "--history", "30d", "--json"], env=env)
    assert r.exit_code == 0, r.output
    assert '"jobs": 3' in r.stdout
    bad = CliRunner().invoke(app, ["simulate", "--history", "soon"], env=env)
    assert bad.exit_code == 2 and "--history" in bad.stderr
    both = CliRunner().invoke(app, ["simulate", "--history", "30d", "--trace", "x.csv"], env=env)
    assert both.exit_code == 2 and "either" in both.stderr
