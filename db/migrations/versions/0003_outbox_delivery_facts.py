"""outbox delivery facts: attempt/ts per notification, stored channel ids, Slack pause

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import db.types

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "slackconversation",
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("channel_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("resolved_at", db.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("kind", "name"),
    )
    op.create_table(
        "deliverypause",
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("until", db.types.UTCDateTime(), nullable=False),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "attempt_channel", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True
            )
        )
        batch_op.add_column(sa.Column("attempt_started_at", db.types.UTCDateTime(), nullable=True))
        batch_op.add_column(
            sa.Column("posted_ts", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True)
        )
        batch_op.add_column(sa.Column("upload_started_at", db.types.UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("uploaded_at", db.types.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.drop_column("uploaded_at")
        batch_op.drop_column("upload_started_at")
        batch_op.drop_column("posted_ts")
        batch_op.drop_column("attempt_started_at")
        batch_op.drop_column("attempt_channel")
    op.drop_table("deliverypause")
    op.drop_table("slackconversation")
