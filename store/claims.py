"""Claims of the job queue: a worker leases ready jobs of its model under a lease.

Each model of the deployment has a queue of its own: a worker serves one model (`Settings.worker_model`) and
claims only that model's jobs and batches. Which lane a claim is for, and how many tokens a round holds, are the
worker's scheduling policy's (worker/policy.py), handed down as arguments; tenants take turns within the batch
lane here, where the rows are locked. What a claimed job becomes is store/finishing.py's.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from store.db import among, session_scope
from store.models import Batch, Job, JobPart, utcnow
from store.settings import Settings


@dataclass(frozen=True)
class KeptItems:
    """Items of a job that earlier attempts scored (its parts, store/finishing.py): not scored again."""

    items: np.ndarray  # item indices
    logprobs: np.ndarray  # [len(items), labels]


@dataclass(frozen=True)
class ClaimedJob:
    """What the worker needs of a job it leased (not its whole row)."""

    id: str
    priority: int
    model: str
    tokens: bytes | None  # the request as token ids (None: a job queued before they were stored)
    request: dict | None  # the request's text, read only for such a job
    batch_id: str | None
    webhook_url: str | None
    kept: KeptItems | None = None


# The hot statements below use the table's columns (SQLAlchemy Core): the ORM's statement handling would be most of
# a pass boundary's Python time.
_JOBS = Job.__table__.c
_CLAIMED = (_JOBS.id, _JOBS.priority, _JOBS.model, _JOBS.tokens, _JOBS.batch_id, _JOBS.webhook_url, _JOBS.query_key,
            _JOBS.items_done)


def claim_interactive(owner: str, settings: Settings, above: int) -> list[ClaimedJob]:
    """Leases the next ready interactive jobs of the worker's model, those of a priority over `above` (highest
    priority, oldest first), up to the drain bounds."""
    with session_scope() as session:
        # SKIP LOCKED: concurrent workers claim disjoint jobs without waiting (Postgres; SQLite ignores it and
        # runs a single worker, and the status condition on the UPDATE keeps the claim atomic there too).
        # The priority bound keeps a backfill's queued requests out of this index scan.
        candidates = session.execute(
            select(Job.id, Job.items_total).where(Job.model == settings.worker_model, Job.status == "queued",
                                                  Job.priority > above)
            .order_by(Job.priority.desc(), Job.id).limit(settings.drain_max_jobs)
            .with_for_update(skip_locked=True)).all()
        ids, items = [], 0
        for job_id, n in candidates:
            if ids and items + n > settings.drain_max_items:
                break
            ids.append(job_id)
            items += n
        return _lease(session, owner, settings, ids)


def claim_batch_round(owner: str, settings: Settings, tokens: int | None = None) -> list[ClaimedJob]:
    """Leases one round of the worker's model's batch requests of at most `tokens` prompt tokens (None:
    BATCH_ROUND_TOKENS, else one request). Rounds are small so that an interactive job submitted during a
    backfill waits little."""
    with session_scope() as session:
        for round_ in _batch_rounds(session, settings, tokens or settings.batch_round_tokens or 0):
            if claimed := _lease(session, owner, settings, round_):
                return claimed
        return []


def _lease(session: Session, owner: str, settings: Settings, ids: list[str] | Select) -> list[ClaimedJob]:
    """Leases these queued jobs (ids, or a query of them: then the claim is this one statement). A job that earlier
    attempts advanced keeps its items done and comes with their scores (`kept`)."""
    if isinstance(ids, list) and not ids:
        return []
    now = utcnow()
    chosen = _JOBS.id.in_(ids) if isinstance(ids, Select) else among(session, _JOBS.id, ids)
    claimed = session.execute(
        update(Job.__table__).where(chosen, _JOBS.status == "queued")
        .values(status="running", lease_owner=owner, lease_expires_at=now + timedelta(seconds=settings.lease_seconds),
                attempts=_JOBS.attempts + 1, started_at=func.coalesce(_JOBS.started_at, now), claimed_at=now,
                items_at_claim=_JOBS.items_done)
        .returning(*_CLAIMED)).all()
    untokenized = [row.id for row in claimed if row.tokens is None]
    texts = dict(session.execute(select(Job.id, Job.request).where(Job.id.in_(untokenized))).all()) \
        if untokenized else {}
    kept = _kept(session, [row.id for row in claimed if row.items_done])
    # By query within a batch: the engine gets requests sharing a query together (prefix reuse).
    return [ClaimedJob(row.id, row.priority, row.model, row.tokens, texts.get(row.id), row.batch_id, row.webhook_url,
                       kept.get(row.id))
            for row in sorted(claimed, key=lambda row: (-row.priority, row.query_key or "", row.id))]


def _kept(session: Session, job_ids: list[str]) -> dict[str, KeptItems]:
    """These jobs' parts, each job's as one KeptItems."""
    if not job_ids:
        return {}
    parts: dict[str, list] = {}
    for job_id, n_labels, items, logprobs in session.execute(
            select(JobPart.job_id, JobPart.n_labels, JobPart.items, JobPart.logprobs)
            .where(JobPart.job_id.in_(job_ids)).order_by(JobPart.job_id, JobPart.first_item)):
        parts.setdefault(job_id, []).append(
            (np.frombuffer(items, np.int32), np.frombuffer(logprobs, np.float32).reshape(-1, n_labels)))
    return {job_id: KeptItems(np.concatenate([i for i, _ in p]), np.concatenate([lp for _, lp in p]))
            for job_id, p in parts.items()}


def _batch_rounds(session: Session, settings: Settings, tokens: int) -> Iterator[Select]:
    """Queries of the queued batch requests of one round, a batch of the worker's model at a time (a batch runs
    one model), for the lease's UPDATE (so that it locks and takes them in one statement). Tenants take turns
    (the one whose batches were claimed from least recently goes first, however many batches it has); a
    tenant's batches run oldest first; within a batch, requests are taken grouped by query, up to `tokens`
    prompt tokens (at least one request)."""
    # Uploaded batches only: a reference batch has no requests here, and its turn (`last_claimed_at`) is its
    # chunks' (store.lake.chunks), which rounds leave alone.
    batches = session.execute(select(Batch.id, Batch.api_key_id, Batch.last_claimed_at)
                              .where(Batch.status == "in_progress", Batch.model == settings.worker_model,
                                     Batch.source.is_(None))
                              .order_by(Batch.id)).all()
    served: dict[str, datetime] = {}
    for _, tenant, claimed_at in batches:
        if claimed_at is not None and claimed_at > served.get(tenant, datetime.min):
            served[tenant] = claimed_at
    for batch_id, _, _ in sorted(batches, key=lambda b: (served.get(b.api_key_id, datetime.min), b.api_key_id)):
        # The batch row before its requests: the order in which POST /batches/{id}/cancel locks them too, so
        # a claim and a cancel cannot deadlock.
        session.execute(update(Batch).where(Batch.id == batch_id).values(last_claimed_at=utcnow()))
        queued = select(_JOBS.id, _JOBS.prompt_tokens, _JOBS.query_key) \
            .where(_JOBS.batch_id == batch_id, _JOBS.status == "queued").order_by(_JOBS.query_key, _JOBS.id)
        # Lock about as many requests as the round takes (the next one's size times the round's share), not
        # DRAIN_MAX_JOBS: each lock is a write, and most of them would be released unused.
        first = session.scalar(queued.with_only_columns(_JOBS.prompt_tokens).limit(1))
        if first is None:
            continue
        wanted = min(settings.drain_max_jobs, 2 * (tokens // max(first, 1)) + 4)
        locked = queued.limit(wanted).with_for_update(skip_locked=True).subquery()
        order = (locked.c.query_key, locked.c.id)
        ranked = select(locked.c.id, func.sum(locked.c.prompt_tokens).over(order_by=order).label("upto"),
                        func.row_number().over(order_by=order).label("k")).subquery()
        yield select(ranked.c.id).where(or_(ranked.c.upto <= tokens, ranked.c.k == 1))
