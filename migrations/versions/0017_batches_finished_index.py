"""ix_batches_finished: retention looks for batches that finished before its cutoff (store/retention.py), which
read the whole batches table without it.

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


def upgrade() -> None:
    op.create_index("ix_batches_finished", "batches", ["finished_at"], postgresql_where=sa.text(FINISHED),
                    sqlite_where=sa.text(FINISHED))


def downgrade() -> None:
    op.drop_index("ix_batches_finished", "batches")
