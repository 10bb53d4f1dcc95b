"""workers.warmup_done and workers.warmup_total: a warming worker's programs compiled so far, of how many, shown
by /readyz and `packscore wait-ready`.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 04:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("warmup_done", sa.Integer, nullable=True))
    op.add_column("workers", sa.Column("warmup_total", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "warmup_total")
    op.drop_column("workers", "warmup_done")
