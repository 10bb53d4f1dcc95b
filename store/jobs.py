"""Job rows as the API creates, reads, lists and cancels them (the worker owns running jobs)."""

import hashlib
import json

import numpy as np
from sqlalchemy import delete, inspect, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import RequestTokenizer
from store.batch_counts import add_ended
from store.counters import count
from store.db import newest_first
from store.errors import ServiceError
from store.models import ApiKey, Job, JobPart, JobResult, WebhookDelivery, new_id, utcnow
from store.outbox import enqueue_job_webhook, vet_webhook_url
from store.priorities import PRIORITY_JOB
from store.schemas import JobOut, ScoreInput, job_out
from store.settings import Settings


def _request_hash(body: ScoreInput, rerank: dict | None, model: str) -> str:
    # Without `kind`: the hashes stored with existing jobs leave it out. With the model that scores it, not
    # the name the body gives: the default model named, or left out, is the same request.
    fields = {**body.model_dump(mode="json", exclude={"kind"}), "model": model}
    canonical = json.dumps({**fields, "rerank": rerank} if rerank else fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _find_idempotent(session: Session, key: ApiKey, idempotency_key: str, request_hash: str) -> Job | None:
    job = session.scalar(select(Job).where(Job.api_key_id == key.id, Job.idempotency_key == idempotency_key))
    if job is not None and job.request_hash != request_hash:
        raise ServiceError(409, "idempotency_conflict",
                       "this Idempotency-Key was already used with a different request body")
    return job


def job_request(body: ScoreInput, rerank: dict | None = None) -> dict:
    """A job's stored request: what the worker scores, and for a rerank job how to present its scores."""
    request = body.model_dump(mode="json", include={"query", "items", "label_token_ids", "apply_softmax",
                                                    "item_first"})
    return {**request, "rerank": rerank} if rerank else request


# A new job is written with this one statement, compiled once (SQLAlchemy caches it), with every column's value
# given: an ORM flush of the row would cost the API about twice the CPU of the insert itself.
_INSERT_JOB = insert(Job.__table__)
_JOB_COLUMNS = [(attribute.key, attribute.columns[0].name) for attribute in inspect(Job).column_attrs]


def create_job(session: Session, key: ApiKey, body: ScoreInput, request_tokenizer: RequestTokenizer,
               settings: Settings, *, priority: int = PRIORITY_JOB, idempotency_key: str | None = None,
               rerank: dict | None = None) -> tuple[Job, bool]:
    """Validates and stores a queued job of `request_tokenizer`'s model (the one the request names, resolved by
    the caller: store.catalog); returns (job, created). An Idempotency-Key replay returns the
    earlier job with created=False. `rerank` (store/rerank.py) makes it a rerank job: kept with the request,
    it says how to present the scores. A created job is not in the session (read it with session.get)."""
    request_hash = _request_hash(body, rerank, request_tokenizer.model_name)
    if idempotency_key is not None:
        if not 1 <= len(idempotency_key) <= 255:
            raise ServiceError(400, "invalid_input", "Idempotency-Key must be 1 to 255 characters")
        existing = _find_idempotent(session, key, idempotency_key, request_hash)
        if existing is not None:
            return existing, False
    tokenized = request_tokenizer.tokenize(body.query, body.items, body.label_token_ids, body.item_first)
    webhook_url = getattr(body, "webhook_url", None)
    vet_webhook_url(webhook_url, settings.webhook_allowlist)
    job = Job(
        id=new_id("job"),
        api_key_id=key.id,
        status="queued",
        priority=priority,
        model=request_tokenizer.model_name,
        request=job_request(body, rerank),
        tokens=tokenized.to_bytes(),
        return_logprobs=getattr(body, "return_logprobs", False),
        metadata_=getattr(body, "metadata", None),
        webhook_url=webhook_url,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        items_total=tokenized.n_items,
        items_done=0,
        items_at_claim=0,
        prompt_tokens=tokenized.prompt_tokens,
        attempts=0,
        cancel_requested=False,
        created_at=utcnow(),
    )
    if not session.in_transaction():  # no Idempotency-Key lookup came first
        # A lone INSERT needs no transaction block: in autocommit it is one round trip instead of three (BEGIN,
        # INSERT, COMMIT). Nothing else may be written here then (a count() would commit on its own).
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    try:
        # The columns not set above (lease, error, batch...) are NULL. `job` stays out of the session: it is the
        # row as written, all that the answer shows.
        session.execute(_INSERT_JOB, {column: getattr(job, attribute) for attribute, column in _JOB_COLUMNS})
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the insert.
        session.rollback()
        existing = _find_idempotent(session, key, idempotency_key or "", request_hash)
        if existing is None:
            raise
        return existing, False
    return job, True


def get_job(session: Session, key: ApiKey, job_id: str) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, Job.api_key_id == key.id))
    if job is None:  # another tenant's job is indistinguishable from a missing one
        raise ServiceError(404, "not_found", f"no job {job_id!r}")
    return job


def read_logprobs(session: Session, job: Job) -> np.ndarray | None:
    """A succeeded job's [items, labels] log-probabilities."""
    result = session.get(JobResult, job.id) if job.status == "succeeded" else None
    if result is None:
        return None
    return np.frombuffer(result.logprobs, np.float32).reshape(job.items_total, result.n_labels)


def read_job(session: Session, job: Job, with_scores: bool = True) -> JobOut:
    logprobs = read_logprobs(session, job) if with_scores else None
    delivery = session.scalar(select(WebhookDelivery).where(WebhookDelivery.job_id == job.id)
                              .order_by(WebhookDelivery.created_at.desc()).limit(1))
    return job_out(job, logprobs, delivery)


def list_jobs(session: Session, key: ApiKey, status: str | None, limit: int,
              cursor: str | None) -> tuple[list[Job], str | None]:
    """A page of the key's jobs, newest first (`newest_first`)."""
    # A batch's requests are listed through the batch (GET /batches/{id}/results), not as jobs.
    query = select(Job).where(Job.api_key_id == key.id, Job.batch_id.is_(None))
    if status:
        query = query.where(Job.status == status)
    return newest_first(session, query, Job.id, limit, cursor)


def cancel_job(session: Session, job: Job) -> Job:
    """queued -> cancelled now; running -> cancelled by its worker at the next pass boundary; terminal -> 409."""
    now = utcnow()
    # The flag first, for a queued or a running job: the row is then locked until the commit, so a worker
    # cannot hand the job back (running -> queued) between the two statements, where neither would match and
    # the cancel would be lost; a job handed back before it keeps the flag, and a hand-back after it reads it.
    flagged = session.execute(update(Job).where(Job.id == job.id, Job.status.in_(("queued", "running")))
                              .values(cancel_requested=True)).rowcount
    done = session.execute(update(Job).where(Job.id == job.id, Job.status == "queued")
                           .values(status="cancelled", finished_at=now)).rowcount
    if done:
        count(session, "jobs_finished", label="cancelled")
        session.refresh(job)
        add_ended(session, [(job.batch_id, "cancelled", job.items_done)])
        enqueue_job_webhook(session, job)
        session.execute(delete(JobPart).where(JobPart.job_id == job.id))  # items kept by an earlier attempt
    session.commit()
    session.refresh(job)
    # Cancelled since by its worker (a hand-back waiting on the flag's lock reads it at once) is this cancel's
    # doing, not an earlier one's: a 409 "already cancelled" would tell the client its cancel had not counted.
    if job.status in ("succeeded", "failed") or (job.status == "cancelled" and not flagged):
        raise ServiceError(409, "job_finished", f"job {job.id} is already {job.status}")
    return job
