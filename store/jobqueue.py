"""The job queue's operations on the jobs table: claim under a lease, progress, finish, release, heartbeat and
the sweeper.

Exactly-once effects on at-least-once delivery: every state change of a claimed job is conditional on
`lease_owner` still being this worker and the job still running, so a worker that lost its lease (killed,
paused past the lease, or swept) cannot write a result that another worker also writes.
"""

import logging
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from store.batches import expire_uploads, settle_batch
from store.counters import count, count_pass
from store.db import session_scope
from store.models import PRIORITY_BATCH, Batch, Job, JobResult, Pass, Worker, utcnow
from store.outbox import enqueue_job_webhook
from store.settings import Settings

log = logging.getLogger(__name__)


def claim_jobs(owner: str, settings: Settings, batch_round_tokens: int | None = None) -> list[Job]:
    """Both lanes in turn: the ready interactive jobs if any, else one batch round (see the two below)."""
    return claim_interactive(owner, settings) or claim_batch_round(owner, settings, batch_round_tokens)


def claim_interactive(owner: str, settings: Settings) -> list[Job]:
    """Leases the next ready interactive jobs (highest priority, oldest first) up to the drain bounds."""
    with session_scope() as session:
        # SKIP LOCKED: concurrent workers claim disjoint jobs without waiting (Postgres; SQLite ignores it and
        # runs a single worker, and the status condition on the UPDATE keeps the claim atomic there too).
        # The priority bound keeps a backfill's queued requests out of this index scan.
        candidates = session.execute(
            select(Job.id, Job.items_total).where(Job.status == "queued", Job.priority > PRIORITY_BATCH)
            .order_by(Job.priority.desc(), Job.id).limit(settings.drain_max_jobs)
            .with_for_update(skip_locked=True)).all()
        ids, items = [], 0
        for job_id, n in candidates:
            if ids and items + n > settings.drain_max_items:
                break
            ids.append(job_id)
            items += n
        return _lease(session, owner, settings, ids)


def claim_batch_round(owner: str, settings: Settings, tokens: int | None = None) -> list[Job]:
    """Leases one round of batch requests of at most `tokens` prompt tokens (None: BATCH_ROUND_TOKENS, else
    one request). Rounds are small so that an interactive job submitted during a backfill waits little."""
    with session_scope() as session:
        ids = _batch_round(session, settings, tokens or settings.batch_round_tokens or 0)
        return _lease(session, owner, settings, ids)


def _lease(session: Session, owner: str, settings: Settings, ids: list[str]) -> list[Job]:
    if not ids:
        return []
    now = utcnow()
    claimed = session.scalars(
        update(Job).where(Job.id.in_(ids), Job.status == "queued")
        .values(status="running", lease_owner=owner, lease_expires_at=now + timedelta(seconds=settings.lease_seconds),
                attempts=Job.attempts + 1, items_done=0, started_at=func.coalesce(Job.started_at, now))
        .returning(Job)).all()
    # By query within a batch: the engine gets requests sharing a query together (prefix reuse).
    return sorted(claimed, key=lambda job: (-job.priority, job.query_key or "", job.id))


def _batch_round(session: Session, settings: Settings, tokens: int) -> list[str]:
    """Ids of queued batch requests for one round. Tenants take turns (the one whose batches were claimed
    from least recently goes first, however many batches it has); a tenant's batches run oldest first; within
    a batch, requests are taken grouped by query, up to `tokens` prompt tokens (at least one request)."""
    batches = session.execute(select(Batch.id, Batch.api_key_id, Batch.last_claimed_at)
                              .where(Batch.status == "in_progress").order_by(Batch.id)).all()
    served: dict[str, datetime] = {}
    for _, tenant, claimed_at in batches:
        if claimed_at is not None and claimed_at > served.get(tenant, datetime.min):
            served[tenant] = claimed_at
    for batch_id, _, _ in sorted(batches, key=lambda b: (served.get(b.api_key_id, datetime.min), b.api_key_id)):
        # The batch row before its requests: the order in which POST /batches/{id}/cancel locks them too, so
        # a claim and a cancel cannot deadlock.
        session.execute(update(Batch).where(Batch.id == batch_id).values(last_claimed_at=utcnow()))
        rows = session.execute(
            select(Job.id, Job.prompt_tokens).where(Job.batch_id == batch_id, Job.status == "queued")
            .order_by(Job.query_key, Job.id).limit(settings.drain_max_jobs).with_for_update(skip_locked=True)).all()
        ids, used = [], 0
        for job_id, n in rows:
            if ids and used + n > tokens:
                break
            ids.append(job_id)
            used += n
        if ids:
            return ids
    return []


def finish_job(session: Session, owner: str, job_id: str, status: str, *, logprobs: np.ndarray | None = None,
            error: tuple[str, str] | None = None) -> bool:
    """Moves one of our running jobs to a terminal state; False if it is no longer ours."""
    values: dict = {"status": status, "finished_at": utcnow(), "lease_owner": None, "lease_expires_at": None}
    if logprobs is not None:
        values["items_done"] = len(logprobs)
    if error is not None:
        values.update(error_code=error[0], error_message=error[1])
    changed = session.execute(update(Job).where(Job.id == job_id, Job.lease_owner == owner, Job.status == "running")
                              .values(**values).returning(Job.webhook_url)).first()
    if changed is None:
        return False
    count(session, "jobs_finished", label=status)
    if logprobs is not None:
        session.add(JobResult(job_id=job_id, n_labels=logprobs.shape[1],
                              logprobs=np.ascontiguousarray(logprobs, np.float32).tobytes()))
    if changed.webhook_url:  # loading the job only for its webhook keeps a batch round's writes few
        job = session.get(Job, job_id)
        session.refresh(job)
        enqueue_job_webhook(session, job, logprobs)
    return True


def record_pass(session: Session, owner: str, n_jobs: int, n_items: int, tokens: int, padded_tokens: int,
                seconds: float) -> None:
    session.add(Pass(worker=owner, n_jobs=n_jobs, n_items=n_items, tokens=tokens, padded_tokens=padded_tokens,
                     seconds=seconds))
    count_pass(session, n_items, tokens, seconds)


def leased(session: Session, owner: str, job_ids: list[str]) -> dict[str, bool]:
    """Of these jobs, those still running under our lease, with their cancel flag."""
    return dict(session.execute(select(Job.id, Job.cancel_requested).where(
        Job.id.in_(job_ids), Job.lease_owner == owner, Job.status == "running")).all())


def set_progress(session: Session, owner: str, job_id: str, items_done: int) -> None:
    session.execute(update(Job).where(Job.id == job_id, Job.lease_owner == owner).values(items_done=items_done))


def release(owner: str, settings: Settings, job_ids: list[str], error: str | None) -> None:
    """Those of these jobs still ours go back to the queue. After an unexpected error, the attempt counts
    (the job fails after max_attempts); when the worker stops (`error` None), it does not. Only these jobs:
    the other lane of this process may be running jobs of its own."""
    with session_scope() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids), Job.lease_owner == owner,
                                                 Job.status == "running")).all()
        for job in jobs:
            if error is None:
                job.attempts -= 1
            _requeue_or_fail(session, job, settings, "internal_error", error or "")


def _requeue_or_fail(session: Session, job: Job, settings: Settings, code: str, message: str) -> None:
    if job.cancel_requested:
        job.status = "cancelled"
    elif job.attempts >= settings.max_attempts:
        job.status, job.error_code, job.error_message = "failed", code, message
    else:
        job.status, job.items_done = "queued", 0
    job.lease_owner = job.lease_expires_at = None
    if job.status != "queued":
        count(session, "jobs_finished", label=job.status)
        job.finished_at = utcnow()
        session.flush()
        enqueue_job_webhook(session, job)


def settle_batches(batch_ids: set[str]) -> None:
    if batch_ids:
        with session_scope() as session:
            for batch_id in sorted(batch_ids):
                settle_batch(session, batch_id)


def heartbeat(owner: str, model: str, settings: Settings, job_ids: set[str], attention: str | None = None,
              state: str = "ready") -> None:
    """Extends the leases of `job_ids` (the jobs the process is scoring) and marks the worker alive (for
    /readyz), with its state ("warming" or "ready") and the attention path its engine runs (for /metrics)."""
    now = utcnow()
    with session_scope() as session:
        if job_ids:
            session.execute(update(Job).where(Job.id.in_(list(job_ids)), Job.lease_owner == owner,
                                              Job.status == "running")
                            .values(lease_expires_at=now + timedelta(seconds=settings.lease_seconds)))
        if not session.execute(update(Worker).where(Worker.id == owner)
                               .values(last_seen_at=now, attention=attention, state=state)).rowcount:
            session.add(Worker(id=owner, model=model, started_at=now, last_seen_at=now, attention=attention,
                               state=state))


def deregister(owner: str) -> None:
    """A worker stopping cleanly leaves /readyz's count at once (not a stale-heartbeat interval later)."""
    with session_scope() as session:
        session.execute(delete(Worker).where(Worker.id == owner))


def sweep(settings: Settings) -> bool:
    """Re-queues jobs whose lease expired (their worker died); returns whether queued jobs wait for a kick
    (re-queued now, or older than one sweep interval: their broker message may have been lost)."""
    now = utcnow()
    with session_scope() as session:
        expired = session.scalars(select(Job).where(Job.status == "running", Job.lease_expires_at < now)
                                  .with_for_update(skip_locked=True)).all()
        for job in expired:
            log.warning("lease of job %s held by %s expired; re-queueing", job.id, job.lease_owner)
            _requeue_or_fail(session, job, settings, "worker_lost", "the worker running this job stopped")
        batch_ids = {job.batch_id for job in expired if job.batch_id}
        stale = now - timedelta(seconds=settings.sweep_interval_seconds)
        waiting = session.scalar(select(Job.id).where(Job.status == "queued", Job.created_at < stale).limit(1))
        session.execute(delete(Worker).where(Worker.last_seen_at < now - timedelta(days=1)))
        for batch_id in expire_uploads(session, settings):
            log.warning("batch %s was still uploading after %s s; failed", batch_id,
                        settings.batch_upload_timeout_seconds)
    # A batch whose last request failed just now ends; in a transaction of its own, so that no job row lock
    # is held while the batch row is taken (cancel takes them the other way round).
    settle_batches(batch_ids)
    return bool(expired) or waiting is not None
