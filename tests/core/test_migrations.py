"""The Alembic history creates exactly the tables the models describe, on both databases."""

from __future__ import annotations

from datetime import UTC, datetime

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

import db.models  # noqa: F401
from bot.app.money.rollups import Sums, stored_rollups
from db.migrate import alembic_config, current_revision, head_revision, upgrade


def test_migrations_match_the_models(engine: Engine) -> None:
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    assert diff == []


def test_upgrade_twice_is_a_no_op(engine: Engine) -> None:
    assert upgrade(engine) == head_revision()
    assert current_revision(engine) == head_revision()


def _to(engine: Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def test_0011_regroups_the_kept_rollups_per_person_and_per_run(engine: Engine) -> None:
    """A database of 0010 keeps its rollups keyed per host and run: after the upgrade the
    same sums are per person, market and instance type (hours and days), and per run
    (hours and days), to the micro-dollar, with nothing rebuilt."""
    _to(engine, "0010")
    h1, h2 = datetime(2026, 3, 2, 10), datetime(2026, 3, 2, 11)
    day = datetime(2026, 3, 2)
    with engine.begin() as conn:
        conn.execute(
            text(
                'INSERT INTO "user" (id, key, display_name, role, budget_period, created_at)'
                " VALUES (1, 'alice', 'Alice', 'member', 'week', :t),"
                " (2, 'bob', 'Bob', 'member', 'week', :t)"
            ),
            {"t": day},
        )
        conn.execute(
            text(
                "INSERT INTO host (id, name, provider, instance_type, market, state, address,"
                " ssh_user, ssh_port, hourly_usd, tags, created_at, updated_at, check_failures)"
                " VALUES (1, 'a', 'aws', 'p4d.24xlarge', 'ondemand', 'ready', '', '', 22, 8.0,"
                " '{}', :t, :t, 0), (2, 'b', 'aws', 'p4d.24xlarge', 'ondemand', 'ready', '', '',"
                " 22, 8.0, '{}', :t, :t, 0), (3, 'c', 'ssh', NULL, 'owned', 'ready', '', '', 22,"
                " 0.0, '{}', :t, :t, 0)"
            ),
            {"t": day},
        )
        conn.execute(
            text(
                "INSERT INTO trainingrun (id, user_id, command, source, gpu_count, precision,"
                " spot, checkpoints, priority, state, placement, submitted_at, metrics, options)"
                " VALUES (7, 1, 'x', '', 1, 'auto', false, false, 0, 'succeeded', '{}', :t,"
                " '{}', '{}'), (8, 2, 'y', '', 2, 'auto', false, false, 0, 'failed', '{}', :t,"
                " '{}', '{}')"
            ),
            {"t": day},
        )
        hourly = [  # hour, user, host, market, run, micro, held, covered
            (h1, 1, 1, "ondemand", 0, 100, 10, 90),
            (h1, 1, 2, "ondemand", 7, 200, 20, 180),
            (h1, 1, 1, "ondemand", 7, 300, 30, 270),
            (h2, 1, 1, "ondemand", 7, 5, 1, 4),
            (h1, 2, 2, "ondemand", 8, 7_000_000_000, 70, 6),
            (h1, 2, 3, "owned", 8, 0, 50, 0),
        ]
        for row in hourly:
            conn.execute(
                text(
                    "INSERT INTO usagerollup (hour, user_id, host_id, market, run_id, micro_usd,"
                    " held_us, covered_micro) VALUES (:h, :u, :host, :m, :r, :mu, :held, :c)"
                ),
                dict(zip(("h", "u", "host", "m", "r", "mu", "held", "c"), row, strict=True)),
            )
        daily = [  # user, market, instance type, run, micro, held, covered
            (1, "ondemand", "p4d.24xlarge", 0, 100, 10, 90),
            (1, "ondemand", "p4d.24xlarge", 7, 505, 51, 454),
            (2, "ondemand", "p4d.24xlarge", 8, 7_000_000_000, 70, 6),
            (2, "owned", "", 8, 0, 50, 0),
        ]
        for per_day in daily:
            conn.execute(
                text(
                    "INSERT INTO usagerollupday (day, user_id, market, instance_type, run_id,"
                    " micro_usd, held_us, covered_micro) VALUES (:d, :u, :m, :i, :r, :mu, :held,"
                    " :c)"
                ),
                {
                    "d": day,
                    **dict(zip(("u", "m", "i", "r", "mu", "held", "c"), per_day, strict=True)),
                },
            )
    assert upgrade(engine) == head_revision()
    with Session(engine) as s:
        rolled, _ = stored_rollups(s)
    p4d = "p4d.24xlarge"
    assert rolled.hours == {
        (_utc(h1), 1, "ondemand", p4d): Sums(600, 60, 540),
        (_utc(h2), 1, "ondemand", p4d): Sums(5, 1, 4),
        (_utc(h1), 2, "ondemand", p4d): Sums(7_000_000_000, 70, 6),
        (_utc(h1), 2, "owned", ""): Sums(0, 50, 0),
    }
    assert rolled.days == {
        (_utc(day), 1, "ondemand", p4d): Sums(605, 61, 544),
        (_utc(day), 2, "ondemand", p4d): Sums(7_000_000_000, 70, 6),
        (_utc(day), 2, "owned", ""): Sums(0, 50, 0),
    }
    assert rolled.runs == {
        (_utc(h1), 7): Sums(500, 50),
        (_utc(h2), 7): Sums(5, 1),
        (_utc(h1), 8): Sums(7_000_000_000, 120),
    }
    assert rolled.run_days == {
        (_utc(day), 7): Sums(505, 51),
        (_utc(day), 8): Sums(7_000_000_000, 120),
    }


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC)
