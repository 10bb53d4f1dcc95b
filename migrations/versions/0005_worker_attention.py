"""workers.attention: the attention path each worker's engine runs (heartbeat), shown by /metrics.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 17:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("attention", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "attention")
