"""cluster holds: a reservation's holding job on a cluster, GPUs held by others' jobs

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04

A Slurm cluster grants its GPUs itself (bot.providers.slurm): a reservation there is a
holding job, whose id, state and Slurm's reason live in `reservation.external`; a GPU a
job of someone else's holds is shown as theirs (`gpu.held_by`) and never counted free.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("reservation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("external", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("gpu", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("held_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("gpu", schema=None) as batch_op:
        batch_op.drop_column("held_by")
    with op.batch_alter_table("reservation", schema=None) as batch_op:
        batch_op.drop_column("external")
