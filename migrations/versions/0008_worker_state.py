"""workers.state: "warming" while a worker compiles its programs (WARMUP=ladder), then "ready" (/readyz).

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-23 20:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("state", sa.String(16), nullable=False, server_default="ready"))


def downgrade() -> None:
    op.drop_column("workers", "state")
