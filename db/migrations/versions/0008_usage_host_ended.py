"""usageinterval (host_id, ended_at): an idle host's last use in one index probe

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

Dispatch asks when each idle host was last used (the latest `ended_at` of its intervals)
and the idle stop asks it of each host it considers. With only the `host_id` index that
read every interval a host ever had, a million rows a tick after a busy year; on
(host_id, ended_at) the latest end is the last entry of the host's range. The new index
replaces `ix_usageinterval_host_id`, whose lookups it serves as well, so each new
interval still updates as many indexes as before.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_usageinterval_host_ended", "usageinterval", ["host_id", "ended_at"])
    op.drop_index("ix_usageinterval_host_id", table_name="usageinterval")


def downgrade() -> None:
    op.create_index("ix_usageinterval_host_id", "usageinterval", ["host_id"])
    op.drop_index("ix_usageinterval_host_ended", table_name="usageinterval")
