"""batches.output_key and batches.source_key: a key's reference batch owns its output prefix,
so the same command run again finds its batch (running or completed) instead of scoring every row again, and
another input sent to that prefix is refused (409 `output_in_use`). Unique among the batches that hold one;
NULL for uploads, cancelled batches and those an overwrite replaced.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 00:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

HELD = "output_key IS NOT NULL"


def upgrade() -> None:
    op.add_column("batches", sa.Column("output_key", sa.String(64), nullable=True))
    op.add_column("batches", sa.Column("source_key", sa.String(64), nullable=True))
    op.create_index("uq_batches_output", "batches", ["api_key_id", "output_key"], unique=True,
                    postgresql_where=sa.text(HELD), sqlite_where=sa.text(HELD))


def downgrade() -> None:
    op.drop_index("uq_batches_output", "batches")
    op.drop_column("batches", "source_key")
    op.drop_column("batches", "output_key")
