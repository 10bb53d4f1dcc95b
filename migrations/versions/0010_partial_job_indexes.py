"""Partial job indexes, and lz4 for the stored requests: Postgres CPU per batch line.

Each index of the jobs table holds only the rows its queries read.

A job's row is written three times (queued, claimed, finished), and a change of status cannot be a HOT update,
so every version went into all seven indexes. Now the queue's index holds live jobs only, the batch lane's its
lines while they are live, the tenant listing jobs outside batches, the batch results index batch lines, and
the retention index finished jobs: a batch line's life inserts 14 index entries instead of 21, an interactive
job's 13. Every query that used an index still can (each one's conditions imply the index's). The
idempotency keys' uniqueness is kept by a unique index of the jobs that have one (Postgres; SQLite keeps its
table constraint, which cannot be dropped without rebuilding the table).

A request's text and token ids are compressed with lz4 instead of pglz where the server has it (Postgres 14
and later, built with lz4: the Debian and Docker builds): compressing them took a third of an upload's Postgres
time.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 00:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

LIVE = "status IN ('queued', 'running')"
# (name, columns, condition)
PARTIAL = [
    ("ix_jobs_ready", ["status", "priority", "created_at"], LIVE),
    ("ix_jobs_tenant_list", ["api_key_id", "id"], "batch_id IS NULL"),
    ("ix_jobs_batch_claim", ["batch_id", "status", "query_key", "id"], f"batch_id IS NOT NULL AND {LIVE}"),
    ("ix_jobs_batch_results", ["batch_id", "id"], "batch_id IS NOT NULL"),
    ("ix_jobs_finished", ["finished_at"], "finished_at IS NOT NULL"),
]


def upgrade() -> None:
    for name, columns, condition in PARTIAL:
        op.drop_index(name, "jobs")
        op.create_index(name, "jobs", columns, postgresql_where=sa.text(condition), sqlite_where=sa.text(condition))
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint("jobs_api_key_id_idempotency_key_key", "jobs", type_="unique")
    op.create_index("uq_jobs_idempotency", "jobs", ["api_key_id", "idempotency_key"], unique=True,
                    postgresql_where=sa.text("idempotency_key IS NOT NULL"))
    bind = op.get_bind()
    try:
        with bind.begin_nested():  # a server without lz4 refuses it: pglz stays
            for column in ("request", "tokens"):
                bind.execute(sa.text(f"ALTER TABLE jobs ALTER COLUMN {column} SET COMPRESSION lz4"))
    except sa.exc.DBAPIError:
        pass


def downgrade() -> None:
    for name, columns, _ in PARTIAL:
        op.drop_index(name, "jobs")
        op.create_index(name, "jobs", columns)
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index("uq_jobs_idempotency", "jobs")
    op.create_unique_constraint("jobs_api_key_id_idempotency_key_key", "jobs", ["api_key_id", "idempotency_key"])
    for column in ("request", "tokens"):
        op.execute(f"ALTER TABLE jobs ALTER COLUMN {column} SET COMPRESSION DEFAULT")
