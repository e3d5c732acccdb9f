"""host health: down since, why, failed checks in a row, next check (bot.app.hosts.hostcheck)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import db.types

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("host", schema=None) as batch_op:
        batch_op.add_column(sa.Column("down_since", db.types.UTCDateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("down_reason", sqlmodel.sql.sqltypes.AutoString(length=300), nullable=True)
        )
        batch_op.add_column(
            sa.Column("check_failures", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("next_check_at", db.types.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("host", schema=None) as batch_op:
        batch_op.drop_column("next_check_at")
        batch_op.drop_column("check_failures")
        batch_op.drop_column("down_reason")
        batch_op.drop_column("down_since")
