"""Indexes for retention (store/retention.py): finished jobs by finish time, passes by creation time, so
that finding the next chunk to delete does not scan the tables.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 17:30:00
"""

from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_finished", "jobs", ["finished_at"])
    op.create_index("ix_passes_created", "passes", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_passes_created", "passes")
    op.drop_index("ix_jobs_finished", "jobs")
