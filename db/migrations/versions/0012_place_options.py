"""place options: where a cluster is to hold a reservation or run a run, as asked

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

`/gpu reserve` and `/gpu run` take `--partition`, `--account`, `--qos` and `--constraint`
for a Slurm cluster (bot.providers.slurm checks them against what the cluster and its
accounting allow the person); they are kept on the row, so a holding job submitted
later (the controller was down) or a run dispatched later is submitted as asked.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("reservation", "trainingrun"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("place", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    for table in ("trainingrun", "reservation"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("place")
