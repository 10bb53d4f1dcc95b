"""workers.dtype: the dtype a worker's engine computes in, shown by /v1/models; a worker whose dtype differs from its
model's other live workers is refused at registration (store/workers.py). jobs.dtype: the dtype a job's scores
were computed in, given with its result. workers.platform: its devices' platform, GET /workers' device kind.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 02:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("dtype", sa.String(16), nullable=True))
    op.add_column("workers", sa.Column("platform", sa.String(16), nullable=True))
    op.add_column("jobs", sa.Column("dtype", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "dtype")
    op.drop_column("workers", "platform")
    op.drop_column("workers", "dtype")
