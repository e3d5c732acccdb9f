"""usage rollups, decayed fair-share counters, indexes for every window and queue query

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

The rollups start empty; the bot's start-up fills them once from the intervals closed
before this upgrade (bot.app.money.rollups.backfill_rollups; db never imports bot, so the upgrade
cannot), and `gpubot db rebuild-rollups` recomputes them at any time.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import db.types

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
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
    op.create_table(
        "fairshareusage",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("decayed_s", sa.Float(), nullable=False),
        sa.Column("as_of", db.types.UTCDateTime(), nullable=False),
        sa.Column("half_life_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.PrimaryKeyConstraint("user_id"),
    )
    op.create_index("ix_usageinterval_ended_started", "usageinterval", ["ended_at", "started_at"])
    op.create_index("ix_hostperiod_ended_started", "hostperiod", ["ended_at", "started_at"])
    op.create_index("ix_gpusample_at", "gpusample", ["at"])
    op.create_index(
        "ix_notification_unsent",
        "notification",
        ["id"],
        sqlite_where=sa.text("sent_at IS NULL"),
        postgresql_where=sa.text("sent_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_notification_unsent", table_name="notification")
    op.drop_index("ix_gpusample_at", table_name="gpusample")
    op.drop_index("ix_hostperiod_ended_started", table_name="hostperiod")
    op.drop_index("ix_usageinterval_ended_started", table_name="usageinterval")
    op.drop_table("fairshareusage")
    op.drop_table("usagerollupday")
    op.drop_table("usagerollup")
