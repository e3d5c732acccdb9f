"""host periods, GPU samples, pool limits, launch requests, idle prompts, attachments

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import db.types

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hostperiod",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("started_at", db.types.UTCDateTime(), nullable=False),
        sa.Column("ended_at", db.types.UTCDateTime(), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("usd_per_hour", sa.Float(), nullable=False),
        sa.Column("storage_usd_per_hour", sa.Float(), nullable=False),
        sa.Column("market", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.ForeignKeyConstraint(["host_id"], ["host.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("hostperiod", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_hostperiod_host_id"), ["host_id"], unique=False)
        batch_op.create_index(
            "uq_hostperiod_open_host",
            ["host_id"],
            unique=True,
            sqlite_where=sa.text("ended_at IS NULL"),
            postgresql_where=sa.text("ended_at IS NULL"),
        )
    op.create_table(
        "gpusample",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("at", db.types.UTCDateTime(), nullable=False),
        sa.Column("span_s", sa.Integer(), nullable=False),
        sa.Column("util_pct", sa.Float(), nullable=False),
        sa.Column("mem_used_mb", sa.Float(), nullable=False),
        sa.Column("mem_total_mb", sa.Float(), nullable=False),
        sa.Column("temperature_c", sa.Float(), nullable=True),
        sa.Column("power_w", sa.Float(), nullable=True),
        sa.Column("user_id", sa.Integer(), nullable=True),
        sa.Column("reservation_id", sa.Integer(), nullable=True),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["host_id"], ["host.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"]),
        sa.ForeignKeyConstraint(["reservation_id"], ["reservation.id"]),
        sa.ForeignKeyConstraint(["run_id"], ["trainingrun.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("gpusample", schema=None) as batch_op:
        batch_op.create_index("ix_gpusample_host_at", ["host_id", "at"], unique=False)
    op.create_table(
        "poollimit",
        sa.Column("instance_type", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("max_instances", sa.Integer(), nullable=True),
        sa.Column("max_usd_per_hour", sa.Float(), nullable=True),
        sa.Column("updated_by", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("updated_at", db.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("instance_type"),
    )
    op.create_table(
        "launchrequest",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("request_key", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("gpu_model", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("market", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("reservation_id", sa.Integer(), nullable=True),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("instance_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("error", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True),
        sa.Column("created_at", db.types.UTCDateTime(), nullable=False),
        sa.Column("updated_at", db.types.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["reservation_id"], ["reservation.id"]),
        sa.ForeignKeyConstraint(["run_id"], ["trainingrun.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("request_key"),
    )
    with op.batch_alter_table("launchrequest", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_launchrequest_state"), ["state"], unique=False)
    with op.batch_alter_table("reservation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idle_prompted_at", db.types.UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("idle_keep_until", db.types.UTCDateTime(), nullable=True))
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attachment", sa.LargeBinary(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "attachment_name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.drop_column("attachment_name")
        batch_op.drop_column("attachment")
    with op.batch_alter_table("reservation", schema=None) as batch_op:
        batch_op.drop_column("idle_keep_until")
        batch_op.drop_column("idle_prompted_at")
    with op.batch_alter_table("launchrequest", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_launchrequest_state"))
    op.drop_table("launchrequest")
    op.drop_table("poollimit")
    with op.batch_alter_table("gpusample", schema=None) as batch_op:
        batch_op.drop_index("ix_gpusample_host_at")
    op.drop_table("gpusample")
    with op.batch_alter_table("hostperiod", schema=None) as batch_op:
        batch_op.drop_index("uq_hostperiod_open_host")
        batch_op.drop_index(batch_op.f("ix_hostperiod_host_id"))
    op.drop_table("hostperiod")
