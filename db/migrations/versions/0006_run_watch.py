"""watching runs: recipe options and sweep groups on runs; outbox rows that edit a message

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trainingrun", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("options", sa.JSON(), nullable=False, server_default=sa.text("'{}'"))
        )
        batch_op.add_column(
            sa.Column("sweep", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True)
        )
        batch_op.create_index(batch_op.f("ix_trainingrun_sweep"), ["sweep"], unique=False)
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.add_column(sa.Column("edit_of", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_notification_edit_of"), ["edit_of"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("notification", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_notification_edit_of"))
        batch_op.drop_column("edit_of")
    with op.batch_alter_table("trainingrun", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_trainingrun_sweep"))
        batch_op.drop_column("sweep")
        batch_op.drop_column("options")
