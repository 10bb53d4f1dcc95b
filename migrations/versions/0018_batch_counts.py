"""An uploaded batch's counts on its row (store/batch_counts.py): its requests ended by status, the items of its
requests, and the items scored of its ended ones, kept as its requests end, so that GET /batches reads them
instead of summing every request of each listed batch. Filled in here for the batches already there.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 02:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

COLUMNS = ("succeeded", "failed", "cancelled", "items_total", "items_ended")
ENDED = "('succeeded', 'failed', 'cancelled')"


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    requests = "FROM jobs WHERE jobs.batch_id = batches.id"
    op.execute(f"""UPDATE batches SET
        succeeded = (SELECT count(*) {requests} AND jobs.status = 'succeeded'),
        failed = (SELECT count(*) {requests} AND jobs.status = 'failed'),
        cancelled = (SELECT count(*) {requests} AND jobs.status = 'cancelled'),
        items_total = (SELECT coalesce(sum(jobs.items_total), 0) {requests}),
        items_ended = (SELECT coalesce(sum(jobs.items_done), 0) {requests} AND jobs.status IN {ENDED})
        WHERE source IS NULL""")


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        for name in COLUMNS:
            batch_op.drop_column(name)
