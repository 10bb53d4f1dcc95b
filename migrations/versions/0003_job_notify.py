"""Postgres: NOTIFY packscore_jobs with the job id when a job (not a batch request) reaches a terminal status,
so the API's waiting /v1/score calls wake up without polling. A trigger, so that every path that ends a job
(worker, sweeper, cancel) notifies. SQLite has no NOTIFY: the API polls there.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 13:50:00
"""

from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

CHANNEL = "packscore_jobs"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"""
        CREATE FUNCTION packscore_notify_job_finished() RETURNS trigger AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', NEW.id);
            RETURN NULL;
        END
        $$ LANGUAGE plpgsql""")
    op.execute("""
        CREATE TRIGGER jobs_notify_finished AFTER UPDATE OF status ON jobs FOR EACH ROW
        WHEN (NEW.batch_id IS NULL AND NEW.status IN ('succeeded', 'failed', 'cancelled')
              AND OLD.status IS DISTINCT FROM NEW.status)
        EXECUTE FUNCTION packscore_notify_job_finished()""")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER jobs_notify_finished ON jobs")
    op.execute("DROP FUNCTION packscore_notify_job_finished()")
