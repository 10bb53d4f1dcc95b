"""The ready-jobs index by model first (several models in one deployment).

A worker serves one model and claims only its model's jobs (`WHERE model = ... AND status = 'queued'`): with
the model as the index's first column, its claim reads its own model's queue, never another's, however long
that one is (a model with no live worker keeps its jobs queued). Still partial: live jobs only.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

LIVE = "status IN ('queued', 'running')"


def _ready_index(columns: list[str]) -> None:
    op.drop_index("ix_jobs_ready", "jobs")
    op.create_index("ix_jobs_ready", "jobs", columns, postgresql_where=sa.text(LIVE), sqlite_where=sa.text(LIVE))


def upgrade() -> None:
    _ready_index(["model", "status", "priority", "created_at"])


def downgrade() -> None:
    _ready_index(["status", "priority", "created_at"])
