"""workers.host and workers.device_group: the chips `packscore worker --devices` gave each worker,
shown by /readyz and /metrics.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 20:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("host", sa.String(200), nullable=True))
    op.add_column("workers", sa.Column("device_group", sa.String(100), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "device_group")
    op.drop_column("workers", "host")
