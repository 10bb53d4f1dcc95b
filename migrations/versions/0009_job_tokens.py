"""jobs.tokens: the request in token space, stored when it is submitted (the API tokenizes to validate), so
workers never tokenize. NULL for jobs queued before this: workers tokenize their stored text.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 16:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("tokens", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "tokens")
