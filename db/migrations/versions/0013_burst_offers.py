"""burst offers: the cloud offered, priced, to a run that waits for the owned GPUs

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

With owned places and a cloud (GPUBOT_PROVIDERS=slurm,aws), a run or a reservation that
has waited past GPUBOT_BURST_AFTER is offered the cloud with its price (bot.app.burst); the
offer is a row, one per request, so one request is never bought twice; `--cloud ok|never` is kept
on the run; an admin's word for a person (`/gpu cloud @alice ok|never|ask`) on the user.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.types import UTCDateTime

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("trainingrun", "user"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("cloud", sa.String(length=8), nullable=True))
    op.create_table(
        "burstoffer",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("trainingrun.id"), nullable=True),
        sa.Column("reservation_id", sa.Integer(), sa.ForeignKey("reservation.id"), nullable=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("user.id"), nullable=False),
        sa.Column("place", sa.String(length=32), nullable=False),
        sa.Column("instance_type", sa.String(length=64), nullable=False),
        sa.Column("usd_per_hour", sa.Float(), nullable=False),
        sa.Column("hours", sa.Float(), nullable=False),
        sa.Column("assumed", sa.Boolean(), nullable=False),
        sa.Column("estimate_usd", sa.Float(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("expected_start", UTCDateTime(), nullable=True),
        sa.Column("cloud_start", UTCDateTime(), nullable=True),
        sa.Column("note", sa.Text(), nullable=False, server_default=""),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("decided_at", UTCDateTime(), nullable=True),
        sa.UniqueConstraint("run_id"),
        sa.UniqueConstraint("reservation_id"),
    )
    op.create_index("ix_burstoffer_user_id", "burstoffer", ["user_id"])
    op.create_index("ix_burstoffer_state", "burstoffer", ["state"])


def downgrade() -> None:
    op.drop_index("ix_burstoffer_state", table_name="burstoffer")
    op.drop_index("ix_burstoffer_user_id", table_name="burstoffer")
    op.drop_table("burstoffer")
    for table in ("user", "trainingrun"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("cloud")
