"""job_parts: a running job's scored items, written per pass, so that a job handed back (a worker stopped) or
whose worker died resumes where it stopped instead of scoring its items again. jobs.claimed_at and
jobs.items_at_claim: when the current attempt was claimed and the items done then, for an eta counted from the
pace since that claim.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-08 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("claimed_at", sa.DateTime(), nullable=True))
    op.add_column("jobs", sa.Column("items_at_claim", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "job_parts",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("first_item", sa.Integer(), primary_key=True),
        sa.Column("n_labels", sa.Integer(), nullable=False),
        sa.Column("items", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_parts")
    op.drop_column("jobs", "items_at_claim")
    op.drop_column("jobs", "claimed_at")
