"""The sweeper: jobs whose worker died go back to the queue, and queued jobs left waiting are kicked."""

import logging
from datetime import timedelta

from sqlalchemy import delete, select

from store.batches import expire_uploads, unsettled_batches
from store.db import session_scope
from store.finishing import end_attempt, settle_batches
from store.models import Job, Worker, utcnow
from store.settings import Settings

log = logging.getLogger(__name__)


def sweep(settings: Settings) -> bool:
    """Re-queues jobs whose lease expired (their worker died); returns whether queued jobs of the worker's model
    wait for a kick (re-queued now, or older than one sweep interval: their broker message may have been lost).
    Another model's jobs are its own workers' to kick: one with no live worker waits in the queue."""
    now = utcnow()
    with session_scope() as session:
        expired = session.scalars(select(Job).where(Job.status == "running", Job.lease_expires_at < now)
                                  .with_for_update(skip_locked=True)).all()
        for job in expired:
            log.warning("lease of job %s held by %s expired; re-queueing", job.id, job.lease_owner)
            end_attempt(session, job, settings, "worker_lost", "the worker running this job stopped")
        batch_ids = {job.batch_id for job in expired if job.batch_id}
        requeued_here = any(job.model == settings.worker_model for job in expired)
        stale = now - timedelta(seconds=settings.sweep_interval_seconds)
        waiting = session.scalar(select(Job.id).where(Job.model == settings.worker_model, Job.status == "queued",
                                                      Job.created_at < stale).limit(1))
        session.execute(delete(Worker).where(Worker.last_seen_at < now - timedelta(days=1)))
        for batch_id in expire_uploads(session, settings):
            log.warning("batch %s was still uploading after %s s; failed", batch_id,
                        settings.batch_upload_timeout_seconds)
        over = unsettled_batches(session)
    # A batch whose last request failed just now ends; in a transaction of its own, so that no job row lock
    # is held while the batch row is taken (cancel takes them the other way round). And any other that is
    # over: its worker may have died between its last result and settling it.
    settle_batches(batch_ids | over)
    return requeued_here or waiting is not None
