"""What becomes of a claimed job: progress, results, failure, cancellation, a hand-back.

Exactly-once effects on at-least-once delivery: every state change of a claimed job is conditional on
`lease_owner` still being this worker and the job still running, so a worker that lost its lease (killed,
paused past the lease, or swept) cannot write a result that another worker also writes. The items a pass scored
of a job it did not finish are kept as its parts (JobPart) under the same condition, in the transaction that
writes its progress: the next attempt resumes from them (store/claims.py), and the job's result, once written,
replaces them.
"""

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Row, bindparam, delete, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from store.batch_counts import add_ended
from store.batches import settle_batch
from store.counters import count, count_pass
from store.db import among, session_scope
from store.models import Job, JobPart, JobResult, Pass, Worker, utcnow
from store.outbox import enqueue_job_webhook
from store.settings import Settings

log = logging.getLogger(__name__)
_JOBS = Job.__table__.c  # Core statements: the ORM's statement handling would be most of a boundary's Python time


def finish(session: Session, owner: str, job_ids: list[str], status: str, error: tuple[str, str] | None = None,
           results: dict[str, np.ndarray] | None = None, **values: Any) -> list[str]:
    """Moves those of these jobs still running under our lease to `status`, in one statement, and queues the
    webhooks of those that have one; returns their ids."""
    ended = _end(session, owner, job_ids, status, error, results, **values)
    add_ended(session, [(row.batch_id, status, row.items_done) for row in ended])
    return [row.id for row in ended]


def _end(session: Session, owner: str, job_ids: list[str], status: str, error: tuple[str, str] | None = None,
         results: dict[str, np.ndarray] | None = None, **values: Any) -> list[Row]:
    """`finish` but for its batches' counts (the caller adds them): the rows ended, with batch_id and
    items_done."""
    if not job_ids:
        return []
    values.update(status=status, finished_at=utcnow(), lease_owner=None, lease_expires_at=None)
    if error is not None:
        values.update(error_code=error[0], error_message=error[1])
    changed = session.execute(
        update(Job.__table__).where(among(session, _JOBS.id, job_ids), _JOBS.lease_owner == owner,
                                    _JOBS.status == "running")
        .values(**values).returning(_JOBS.id, _JOBS.webhook_url, _JOBS.batch_id, _JOBS.items_done)).all()
    if changed:
        count(session, "jobs_finished", len(changed), label=status)
        _enqueue_webhooks(session, [row.id for row in changed if row.webhook_url], results)
        drop_parts(session, [row.id for row in changed])
    return changed


def finish_succeeded(session: Session, owner: str, results: dict[str, np.ndarray]) -> list[str]:
    """Finishes these jobs as succeeded with their [items, labels] log-probabilities: one UPDATE for all of
    them, one multi-row INSERT of the results of those still ours (the lease condition: a job swept and run by
    another worker gets no second result). Returns their ids. Each records the dtype it was computed in: the
    worker's, as it registered (store.workers.register)."""
    ended = _end_succeeded(session, owner, results)
    add_ended(session, [(row.batch_id, "succeeded", row.items_done) for row in ended])
    return [row.id for row in ended]


def _end_succeeded(session: Session, owner: str, results: dict[str, np.ndarray]) -> list[Row]:
    dtype = select(Worker.dtype).where(Worker.id == owner).scalar_subquery()
    done = _end(session, owner, list(results), "succeeded", results=results, items_done=_JOBS.items_total,
                dtype=dtype)
    if done:
        session.execute(insert(JobResult.__table__), [
            {"job_id": row.id, "n_labels": results[row.id].shape[1],
             "logprobs": np.ascontiguousarray(results[row.id], np.float32).tobytes()} for row in done])
    return done


def _enqueue_webhooks(session: Session, job_ids: list[str], results: dict[str, np.ndarray] | None = None) -> None:
    """Queues the webhooks of these jobs (each has one)."""
    if not job_ids:
        return
    for job in session.scalars(select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)):
        enqueue_job_webhook(session, job, (results or {}).get(job.id))


def record_pass(session: Session, owner: str, n_jobs: int, boundary: "Boundary") -> None:
    """The pass's running totals (/metrics); a Pass row too where it ran jobs. A pass of reference-batch
    chunks only leaves no row: a billion-row backfill would leave hundreds of thousands of them, where its
    chunk rows are the record (at most chunks + 100 rows per batch)."""
    if n_jobs:
        session.add(Pass(worker=owner, n_jobs=n_jobs, n_items=boundary.n_items, tokens=boundary.tokens,
                         padded_tokens=boundary.padded_tokens, seconds=boundary.seconds))
    count_pass(session, boundary.n_items, boundary.tokens, boundary.seconds, boundary.host_seconds,
               boundary.device_seconds, boundary.device_idle_seconds)


def set_progress(session: Session, owner: str, progress: list[tuple[str, int]]) -> None:
    """items_done of these running jobs of ours: one statement (executemany)."""
    if progress:
        table = Job.__table__
        session.execute(update(table).where(table.c.id == bindparam("job"), table.c.lease_owner == owner)
                        .values(items_done=bindparam("done")), [{"job": j, "done": n} for j, n in progress])


# A part goes in only while its job is running under the writer's lease. The writer's progress UPDATE of the job
# (set_progress, same transaction, before it) holds the row's lock until the commit, so the sweeper cannot hand the
# job to another worker between this check and the commit: a resumed attempt reads every part written before it.
_PART = insert(JobPart.__table__).from_select(
    ["job_id", "first_item", "n_labels", "items", "logprobs"],
    select(_JOBS.id, bindparam("first"), bindparam("n_labels"), bindparam("items", type_=JobPart.items.type),
           bindparam("logprobs", type_=JobPart.logprobs.type))
    .where(_JOBS.id == bindparam("job"), _JOBS.lease_owner == bindparam("owner"), _JOBS.status == literal("running")))


def keep_parts(session: Session, owner: str, parts: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    """The (job id, item indices, [items, labels] log-probabilities) a pass scored of running jobs of ours, kept
    as their parts: one statement (executemany)."""
    if parts:
        session.execute(_PART, [
            {"job": job_id, "owner": owner, "first": int(items.min()), "n_labels": logprobs.shape[1],
             "items": np.ascontiguousarray(items, np.int32).tobytes(),
             "logprobs": np.ascontiguousarray(logprobs, np.float32).tobytes()} for job_id, items, logprobs in parts])


def drop_parts(session: Session, job_ids: list[str]) -> None:
    """The parts of these jobs, ended: their result (if any) holds every item."""
    if job_ids:
        session.execute(delete(JobPart.__table__).where(among(session, JobPart.__table__.c.job_id, job_ids)))


@dataclass
class Boundary:
    """The writes of one pass boundary (see write_boundaries)."""

    owner: str
    n_items: int
    tokens: int
    padded_tokens: int
    seconds: float
    host_seconds: float  # the PassResult's, as are the two above and below
    device_seconds: float
    device_idle_seconds: float  # the device waiting for the host before the pass (see worker/drain.py)
    progress: list[tuple[str, int]]  # (job id, items done) of jobs the pass advanced
    parts: list[tuple[str, np.ndarray, np.ndarray]]  # (job id, item indices, their logprobs) of those jobs
    finished: list[tuple[Any, np.ndarray]]  # (claimed job, its log-probabilities) of jobs the pass completed
    open_ids: list[str]  # the jobs still running after it: their cancel flags and leases are checked


def write_boundaries(session: Session, boundaries: list[Boundary]) -> set[str]:
    """After one or more passes, in the caller's transaction and a few statements whatever the number of jobs
    or passes: the Pass rows, cancellations, finished results, progress and the parts of jobs under way. Returns
    the ids the pass loop must drop: finished, cancelled, or no longer leased to it."""
    owner = boundaries[0].owner
    for b in boundaries:
        record_pass(session, owner, len(b.progress) + len(b.finished), b)
    finished = {job.id: logprobs for b in boundaries for job, logprobs in b.finished}
    progress = {job_id: done for b in boundaries for job_id, done in b.progress if job_id not in finished}
    open_ids = {job_id for b in boundaries for job_id in b.open_ids} - finished.keys()
    # Only the exceptions come back (cancelled, or no longer ours): usually none, whatever the jobs held.
    odd = dict(session.execute(select(_JOBS.id, _JOBS.cancel_requested & (_JOBS.lease_owner == owner)
                                      & (_JOBS.status == "running")).where(
        among(session, _JOBS.id, [*open_ids, *finished]),
        or_(_JOBS.cancel_requested, _JOBS.lease_owner.is_(None), _JOBS.lease_owner != owner,
            _JOBS.status != "running"))).all())
    lost = {job_id for job_id, ours_and_cancelled in odd.items() if not ours_and_cancelled}
    cancelled = [job_id for job_id, ours_and_cancelled in odd.items() if ours_and_cancelled]
    for job_id in lost & open_ids:
        log.warning("job %s is no longer leased to %s; dropping it", job_id, owner)
    # Their batches' counts in one go: each batch's row is updated once, in one order (add_ended), so two workers
    # ending jobs of the same batches never wait on each other's rows in a cycle.
    ended = [(row.batch_id, "cancelled", row.items_done) for row in _end(session, owner, cancelled, "cancelled")]
    succeeded = _end_succeeded(session, owner, {job_id: lp for job_id, lp in finished.items() if job_id not in odd})
    add_ended(session, ended + [(row.batch_id, "succeeded", row.items_done) for row in succeeded])
    set_progress(session, owner, [(job_id, n) for job_id, n in progress.items() if job_id not in odd])
    keep_parts(session, owner, [part for b in boundaries for part in b.parts if part[0] in progress
                                and part[0] not in odd])
    return lost | set(cancelled) | finished.keys()


def release(owner: str, settings: Settings, job_ids: list[str], error: str | None) -> None:
    """Those of these jobs still ours go back to the queue. After an unexpected error, the attempt counts
    (the job fails after max_attempts); when the worker stops (`error` None), it does not. Only these jobs:
    the other lane of this process may be running jobs of its own."""
    with session_scope() as session:
        # Locked: the sweeper may end an expired lease meanwhile, and this write, by id, would undo its.
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids), Job.lease_owner == owner,
                                                 Job.status == "running").order_by(Job.id).with_for_update()).all()
        for job in jobs:
            if error is None:
                job.attempts -= 1
            end_attempt(session, job, settings, "internal_error", error or "")


def end_attempt(session: Session, job: Job, settings: Settings, code: str, message: str) -> None:
    """A job whose attempt ended without its result (`Leased.requeue_or_fail`): queued again, it keeps its items
    done (its parts); one that ends here is counted, its webhook queued and its parts dropped."""
    if job.requeue_or_fail(settings.max_attempts, code, message, job.cancel_requested, utcnow()) == "queued":
        return
    drop_parts(session, [job.id])
    count(session, "jobs_finished", label=job.status)
    add_ended(session, [(job.batch_id, job.status, job.items_done)])
    session.flush()
    enqueue_job_webhook(session, job)


def settle_batches(batch_ids: set[str]) -> None:
    if batch_ids:
        with session_scope() as session:
            for batch_id in sorted(batch_ids):
                settle_batch(session, batch_id)
