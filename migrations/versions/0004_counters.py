"""counters: running totals kept as events happen (passes run, jobs finished, webhook attempts), so that a
/metrics scrape reads a few rows instead of aggregating the passes, jobs and webhook_deliveries tables.
Totals up to this revision are carried over once, here.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 16:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

ITEMS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def upgrade() -> None:
    op.create_table(
        "counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("label", sa.String(64), primary_key=True),
        sa.Column("shard", sa.Integer, primary_key=True),
        sa.Column("value", sa.Float, nullable=False),
    )
    # Each SELECT gives (name, label, value); the carried-over totals go in shard 0.
    totals = [
        "SELECT 'passes', '', COUNT(*) FROM passes",
        "SELECT 'pass_items', '', COALESCE(SUM(n_items), 0) FROM passes",
        "SELECT 'pass_tokens', '', COALESCE(SUM(tokens), 0) FROM passes",
        "SELECT 'pass_seconds', '', COALESCE(SUM(seconds), 0) FROM passes",
        "SELECT 'webhook_attempts', '', COALESCE(SUM(attempts), 0) FROM webhook_deliveries",
        "SELECT 'jobs_finished', status, COUNT(*) FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') "
        "GROUP BY status",
        "SELECT 'webhook_deliveries_finished', status, COUNT(*) FROM webhook_deliveries "
        "WHERE status IN ('delivered', 'failed') GROUP BY status",
    ]
    totals += [f"SELECT 'pass_items_bucket', '{b}', COUNT(*) FROM passes WHERE n_items <= {b}" for b in ITEMS_BUCKETS]
    totals += [f"SELECT 'pass_seconds_bucket', '{b}', COUNT(*) FROM passes WHERE seconds <= {b}"
               for b in SECONDS_BUCKETS]
    for select in totals:
        op.execute(f"INSERT INTO counters (name, label, value, shard) SELECT *, 0 FROM ({select}) AS totals")


def downgrade() -> None:
    op.drop_table("counters")
