"""trainingrun.checkpoints: the owner's command checkpoints and resumes (--checkpoints)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trainingrun", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("checkpoints", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("trainingrun", schema=None) as batch_op:
        batch_op.drop_column("checkpoints")
