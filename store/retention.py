"""Data retention, run by the workers' sweeper: finished jobs (with their results and webhook deliveries) and
finished batches (with their requests, or a reference batch's chunk rows) go after RESULT_TTL_DAYS, passes
after PASS_HISTORY_DAYS.

Rows go in chunks of RETENTION_CHUNK_ROWS, each chunk in a transaction of its own, so that no lock is held
for long: claims and result writes run between chunks. The running totals of /metrics (the counters table)
are kept. A deleted job is gone: GET /jobs/{id} answers 404 `not_found`, as for an id that never existed.
"""

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from store.models import (BATCH_TERMINAL_STATUSES, TERMINAL_STATUSES, Batch, Chunk, Job, JobResult, Pass,
                          WebhookDelivery, utcnow)
from store.settings import Settings


@dataclass
class Pruned:
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows deleted
    transactions: int = 0

    def add(self, table: str, n: int) -> None:
        self.rows[table] = self.rows.get(table, 0) + n


def _delete_jobs(session: Session, job_ids: list[str], pruned: Pruned) -> None:
    pruned.add("job_results", session.execute(delete(JobResult).where(JobResult.job_id.in_(job_ids))).rowcount)
    pruned.add("webhook_deliveries", session.execute(
        delete(WebhookDelivery).where(WebhookDelivery.job_id.in_(job_ids))).rowcount)
    pruned.add("jobs", session.execute(delete(Job).where(Job.id.in_(job_ids))).rowcount)


def _chunks(sessions: sessionmaker[Session], pruned: Pruned, step) -> None:  # type: ignore[no-untyped-def]
    """Runs `step(session)` (which deletes at most one chunk and says whether it found anything) in
    transactions of its own until it finds nothing."""
    while True:
        with sessions() as session, session.begin():
            found = step(session)
        pruned.transactions += 1
        if not found:
            return


def prune(sessions: sessionmaker[Session], settings: Settings, now: datetime | None = None) -> Pruned:
    now = now or utcnow()
    results_cutoff = now - timedelta(days=settings.result_ttl_days)
    passes_cutoff = now - timedelta(days=settings.pass_history_days)
    chunk = settings.retention_chunk_rows
    pruned = Pruned()

    def finished_jobs(session: Session) -> bool:  # jobs of no batch (a batch's requests go with their batch)
        ids = list(session.scalars(select(Job.id).where(
            Job.finished_at < results_cutoff, Job.status.in_(TERMINAL_STATUSES), Job.batch_id.is_(None))
            .limit(chunk).with_for_update(skip_locked=True)))  # another worker's sweeper takes other rows
        if ids:
            _delete_jobs(session, ids, pruned)
        return bool(ids)

    def finished_batches(session: Session) -> bool:
        batch_id = session.scalar(select(Batch.id).where(
            Batch.finished_at < results_cutoff, Batch.status.in_(BATCH_TERMINAL_STATUSES)).limit(1))
        if batch_id is None:
            return False
        ids = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id).limit(chunk)
                                   .with_for_update(skip_locked=True)))
        if ids:
            _delete_jobs(session, ids, pruned)
            return True
        # A reference batch's chunk rows (up to BATCH_MAX_CHUNKS) too, rather than all at once by the cascade.
        indexes = list(session.scalars(select(Chunk.index).where(Chunk.batch_id == batch_id).limit(chunk)
                                       .with_for_update(skip_locked=True)))
        if indexes:
            pruned.add("chunks", session.execute(
                delete(Chunk).where(Chunk.batch_id == batch_id, Chunk.index.in_(indexes))).rowcount)
        else:  # its last requests or chunks went in earlier transactions
            pruned.add("webhook_deliveries", session.execute(
                delete(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id)).rowcount)
            pruned.add("batches", session.execute(delete(Batch).where(Batch.id == batch_id)).rowcount)
        return True

    def old_passes(session: Session) -> bool:
        ids = list(session.scalars(select(Pass.id).where(Pass.created_at < passes_cutoff).limit(chunk)
                                   .with_for_update(skip_locked=True)))
        if ids:
            pruned.add("passes", session.execute(delete(Pass).where(Pass.id.in_(ids))).rowcount)
        return bool(ids)

    for step in (finished_jobs, finished_batches, old_passes):
        _chunks(sessions, pruned, step)
    return pruned
