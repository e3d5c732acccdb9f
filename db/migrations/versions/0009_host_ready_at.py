"""host.ready_at: when a host last became ready, so idle counts from then, not from launch

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04

The fleet's idle stop and the scheduler's inputs counted a never-used instance as idle
from its launch (its billed period's start), the simulator from when it was ready: a
15-minute idle stop came boot + setup (7 minutes) sooner in production. Hosts that are
ready now keep NULL and are read as before (idle from their billed period's start).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import db.types

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("host", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ready_at", db.types.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("host", schema=None) as batch_op:
        batch_op.drop_column("ready_at")
