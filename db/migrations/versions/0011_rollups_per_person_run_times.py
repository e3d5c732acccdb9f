"""rollups per person (the runs' own in runrollup and runrollupday); finished runs' times
and the run-time estimates kept as runs end

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

A team month read the daily rollups keyed per run as well as per person: 20,659 of 22,559
rows of a month were per run with a run-heavy history. The hourly and daily rows are now
per person, market and instance type (the hour rows name the host's instance type, as the
day rows did, instead of the host), and a run's pieces are kept per run, per hour in
`runrollup` and per day in `runrollupday`. The kept rows are regrouped here in SQL (sums
of integers: exact), so no rebuild is needed. The worker's tick read every run of the last
30 days with its metrics to predict run times: `runtime` keeps a finished run's time and
`runestimate` the predictions. The times of runs that ended before this upgrade are made
once at the bot's start-up (bot.app.runtimes.backfill_run_times; db never imports bot, so
the upgrade cannot), and `gpubot db rebuild-rollups` makes them again at any time. The
queue reads its running runs' latest GPU samples through a new (run, time) index.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import db.types

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SUMS = "SUM(micro_usd) AS micro_usd, SUM(held_us) AS held_us"


def _per_person(name: str, at: str, key: str) -> None:
    op.create_table(
        name,
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(at, db.types.UTCDateTime(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("market", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("instance_type", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("held_us", sa.BigInteger(), nullable=False),
        sa.Column("covered_micro", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(at, "user_id", "market", "instance_type", name=key),
    )


def upgrade() -> None:
    # The kept rows regrouped, aside while their tables are made again.
    op.execute(
        "CREATE TEMPORARY TABLE rollup_hours_0011 AS"
        " SELECT r.hour AS hour, r.user_id AS user_id, r.market AS market,"
        " COALESCE(h.instance_type, '') AS instance_type, SUM(r.micro_usd) AS micro_usd,"
        " SUM(r.held_us) AS held_us, SUM(r.covered_micro) AS covered_micro"
        " FROM usagerollup r JOIN host h ON h.id = r.host_id"
        " GROUP BY r.hour, r.user_id, r.market, COALESCE(h.instance_type, '')"
    )
    op.execute(
        "CREATE TEMPORARY TABLE rollup_days_0011 AS"
        f" SELECT day, user_id, market, instance_type, {_SUMS},"
        " SUM(covered_micro) AS covered_micro"
        " FROM usagerollupday GROUP BY day, user_id, market, instance_type"
    )
    op.execute(
        "CREATE TEMPORARY TABLE rollup_runs_0011 AS"
        f" SELECT hour, run_id, {_SUMS} FROM usagerollup WHERE run_id <> 0 GROUP BY hour, run_id"
    )
    op.execute(
        "CREATE TEMPORARY TABLE rollup_run_days_0011 AS"
        f" SELECT day, run_id, {_SUMS} FROM usagerollupday WHERE run_id <> 0 GROUP BY day, run_id"
    )
    op.drop_table("usagerollup")
    op.drop_table("usagerollupday")
    _per_person("usagerollup", "hour", "uq_usagerollup_key")
    _per_person("usagerollupday", "day", "uq_usagerollupday_key")
    for name, at in (("runrollup", "hour"), ("runrollupday", "day")):
        op.create_table(
            name,
            sa.Column("id", sa.Integer(), nullable=False),
            sa.Column(at, db.types.UTCDateTime(), nullable=False),
            sa.Column("run_id", sa.Integer(), nullable=False),
            sa.Column("micro_usd", sa.BigInteger(), nullable=False),
            sa.Column("held_us", sa.BigInteger(), nullable=False),
            sa.ForeignKeyConstraint(["run_id"], ["trainingrun.id"]),
            sa.PrimaryKeyConstraint("id"),
            sa.UniqueConstraint(at, "run_id", name=f"uq_{name}_key"),
        )
    op.create_index(
        "ix_runrollupday_cost", "runrollupday", ["day", "run_id", "micro_usd"], unique=False
    )
    sums = "micro_usd, held_us, covered_micro"
    for table, at, aside in (
        ("usagerollup", "hour", "rollup_hours_0011"),
        ("usagerollupday", "day", "rollup_days_0011"),
    ):
        columns = f"{at}, user_id, market, instance_type, {sums}"
        op.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {aside}")
    for table, at, aside in (
        ("runrollup", "hour", "rollup_runs_0011"),
        ("runrollupday", "day", "rollup_run_days_0011"),
    ):
        columns = f"{at}, run_id, micro_usd, held_us"
        op.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {aside}")
    for aside in (
        "rollup_hours_0011",
        "rollup_days_0011",
        "rollup_runs_0011",
        "rollup_run_days_0011",
    ):
        op.execute(f"DROP TABLE {aside}")
    op.create_table(
        "runtime",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("finished_at", db.types.UTCDateTime(), nullable=False),
        sa.Column("ran_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["trainingrun.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_index(op.f("ix_runtime_finished_at"), "runtime", ["finished_at"], unique=False)
    op.create_index("ix_gpusample_run_at", "gpusample", ["run_id", "at"], unique=False)
    op.create_table(
        "runestimate",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("first_s", sa.Float(), nullable=True),
        sa.Column("ends_s", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("computed_version", sa.Integer(), nullable=False),
        sa.Column("as_of", db.types.UTCDateTime(), nullable=True),
        sa.Column("valid_until", db.types.UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("user_id", "gpus"),
    )


def downgrade() -> None:
    # The rollups of before come back empty: that version's start-up rebuilds them from
    # the intervals (bot.app.money.rollups.backfill_rollups).
    op.drop_table("runestimate")
    op.drop_index("ix_gpusample_run_at", table_name="gpusample")
    op.drop_index(op.f("ix_runtime_finished_at"), table_name="runtime")
    op.drop_table("runtime")
    op.drop_index("ix_runrollupday_cost", table_name="runrollupday")
    op.drop_table("runrollupday")
    op.drop_table("runrollup")
    op.drop_table("usagerollupday")
    op.drop_table("usagerollup")
    op.create_table(
        "usagerollup",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hour", db.types.UTCDateTime(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("market", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("held_us", sa.BigInteger(), nullable=False),
        sa.Column("covered_micro", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["host_id"], ["host.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(
            "hour", "user_id", "host_id", "market", "run_id", name="uq_usagerollup_key"
        ),
    )
    op.create_table(
        "usagerollupday",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("day", db.types.UTCDateTime(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("market", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("instance_type", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("held_us", sa.BigInteger(), nullable=False),
        sa.Column("covered_micro", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(
            "day", "user_id", "market", "instance_type", "run_id", name="uq_usagerollupday_key"
        ),
    )
