"""reservation (user_id, state): a person's live reservations in one index range

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

`/gpu status`, App Home and a new reservation's checks ask for a person's live
reservations (`user_id = ? AND state IN (waiting, active)`). On the `user_id` index alone
that read every reservation the person ever made (thousands after a busy year, each
looked up in the table for its state); on (user_id, state) it reads the live ones. The new
index replaces `ix_reservation_user_id`, whose lookups it serves as well, so each new
reservation still updates as many indexes as before.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_reservation_user_state", "reservation", ["user_id", "state"])
    op.drop_index("ix_reservation_user_id", table_name="reservation")


def downgrade() -> None:
    op.create_index("ix_reservation_user_id", "reservation", ["user_id"])
    op.drop_index("ix_reservation_user_state", table_name="reservation")
