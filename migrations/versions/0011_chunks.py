"""Reference batches: a batch may name its data in storage instead of carrying it. Such a batch is
run as chunks, one row each (lease, attempts, sweeper, cancel, as jobs have), and no row per line. API keys may
be allowed storage prefixes.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 16:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

LIVE = "status IN ('queued', 'running')"


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("storage_prefixes", sa.JSON(), nullable=True))
    op.add_column("batches", sa.Column("source", sa.JSON(), nullable=True))
    op.add_column("batches", sa.Column("output_uri", sa.Text(), nullable=True))
    op.add_column("batches", sa.Column("chunks_total", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "chunks",
        sa.Column("batch_id", sa.String(40), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("index", sa.Integer(), primary_key=True),
        sa.Column("input", sa.Text(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("stop", sa.BigInteger(), nullable=False),
        sa.Column("rows_total", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("not_before", sa.DateTime(), nullable=True),
        sa.Column("rows_done", sa.Integer(), nullable=False),
        sa.Column("rows_failed", sa.Integer(), nullable=False),
        sa.Column("items_done", sa.Integer(), nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_chunks_ready", "chunks", ["status", "not_before"], postgresql_where=sa.text(LIVE),
                    sqlite_where=sa.text(LIVE))


def downgrade() -> None:
    op.drop_index("ix_chunks_ready", "chunks")
    op.drop_table("chunks")
    op.drop_column("batches", "chunks_total")
    op.drop_column("batches", "output_uri")
    op.drop_column("batches", "source")
    op.drop_column("api_keys", "storage_prefixes")
