"""chunks.input_version: the input object's size and version (ETag, generation or mtime) when the batch was
planned, which the worker checks after reading a chunk: an object rewritten in between has other bytes at the
planned offsets, whose rows would be lost or read twice unnoticed (the chunk fails `input_changed` instead).
NULL for the chunks of batches planned before it (not checked).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 17:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("chunks", sa.Column("input_version", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("chunks", "input_version")
