"""Retention's lookups (store/retention.py): ix_batches_finished for the batches that finished before its cutoff
(it read the whole batches table), and ix_jobs_finished for interactive jobs only (batch_id IS NULL): it held
every finished job, and the look for expired interactive ones went through the requests of batches not yet
expired (their finished_at is old, their batch's is not).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 17:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

FINISHED = "finished_at IS NOT NULL"
FINISHED_INTERACTIVE = "finished_at IS NOT NULL AND batch_id IS NULL"


def _jobs_finished(condition: str) -> None:
    op.drop_index("ix_jobs_finished", "jobs")
    op.create_index("ix_jobs_finished", "jobs", ["finished_at"], postgresql_where=sa.text(condition),
                    sqlite_where=sa.text(condition))


def upgrade() -> None:
    op.create_index("ix_batches_finished", "batches", ["finished_at"], postgresql_where=sa.text(FINISHED),
                    sqlite_where=sa.text(FINISHED))
    _jobs_finished(FINISHED_INTERACTIVE)


def downgrade() -> None:
    _jobs_finished(FINISHED)
    op.drop_index("ix_batches_finished", "batches")
