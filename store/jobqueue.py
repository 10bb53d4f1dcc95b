"""The job queue's operations on the jobs table: claim under a lease, progress, finish, release, heartbeat and
the sweeper.

Each model of the deployment has a queue of its own: a worker serves one model (`Settings.worker_model`) and
claims only that model's jobs and batches, interactive before batch and tenants taking turns within it.

Exactly-once effects on at-least-once delivery: every state change of a claimed job is conditional on
`lease_owner` still being this worker and the job still running, so a worker that lost its lease (killed,
paused past the lease, or swept) cannot write a result that another worker also writes.
"""

import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy import ARRAY, String, any_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.sql import ColumnElement, Select
from sqlalchemy.orm import Session

from store.batches import expire_uploads, settle_batch
from store.counters import count, count_pass
from store.db import session_scope
from store.models import PRIORITY_BATCH, Batch, Job, JobResult, Pass, Worker, utcnow
from store.outbox import enqueue_job_webhook
from store.settings import Settings

log = logging.getLogger(__name__)


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


# The hot statements below use the table's columns (SQLAlchemy Core): the ORM's statement handling was most of
# a pass boundary's Python time.
_JOBS = Job.__table__.c
_CLAIMED = (_JOBS.id, _JOBS.priority, _JOBS.model, _JOBS.tokens, _JOBS.batch_id, _JOBS.webhook_url, _JOBS.query_key)


def _among(session: Session, column: ColumnElement, values: list[str]) -> ColumnElement:
    """`column IN values`. On Postgres as `= ANY(array)`: one statement text whatever the number of values, so
    SQLAlchemy's and psycopg's statement caches serve it (each IN-list length was a statement of its own)."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(bindparam(None, list(values), type_=ARRAY(String)))
    return column.in_(values)


def claim_jobs(owner: str, settings: Settings, batch_round_tokens: int | None = None) -> list[ClaimedJob]:
    """Both lanes of the worker's model in turn: the ready interactive jobs if any, else one batch round (see
    the two below)."""
    return claim_interactive(owner, settings) or claim_batch_round(owner, settings, batch_round_tokens)


def claim_interactive(owner: str, settings: Settings) -> list[ClaimedJob]:
    """Leases the next ready interactive jobs of the worker's model (highest priority, oldest first) up to the
    drain bounds."""
    with session_scope() as session:
        # SKIP LOCKED: concurrent workers claim disjoint jobs without waiting (Postgres; SQLite ignores it and
        # runs a single worker, and the status condition on the UPDATE keeps the claim atomic there too).
        # The priority bound keeps a backfill's queued requests out of this index scan.
        candidates = session.execute(
            select(Job.id, Job.items_total).where(Job.model == settings.worker_model, Job.status == "queued",
                                                  Job.priority > PRIORITY_BATCH)
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
    BATCH_ROUND_TOKENS, else one request). Rounds are small so that an interactive job submitted during a backfill waits little."""
    with session_scope() as session:
        for round_ in _batch_rounds(session, settings, tokens or settings.batch_round_tokens or 0):
            if claimed := _lease(session, owner, settings, round_):
                return claimed
        return []


def _lease(session: Session, owner: str, settings: Settings, ids: list[str] | Select) -> list[ClaimedJob]:
    """Leases these queued jobs (ids, or a query of them: then the claim is this one statement)."""
    if isinstance(ids, list) and not ids:
        return []
    now = utcnow()
    chosen = _JOBS.id.in_(ids) if isinstance(ids, Select) else _among(session, _JOBS.id, ids)
    claimed = session.execute(
        update(Job.__table__).where(chosen, _JOBS.status == "queued")
        .values(status="running", lease_owner=owner, lease_expires_at=now + timedelta(seconds=settings.lease_seconds),
                attempts=_JOBS.attempts + 1, items_done=0, started_at=func.coalesce(_JOBS.started_at, now))
        .returning(*_CLAIMED)).all()
    untokenized = [row.id for row in claimed if row.tokens is None]
    texts = dict(session.execute(select(Job.id, Job.request).where(Job.id.in_(untokenized))).all()) \
        if untokenized else {}
    # By query within a batch: the engine gets requests sharing a query together (prefix reuse).
    return [ClaimedJob(row.id, row.priority, row.model, row.tokens, texts.get(row.id), row.batch_id, row.webhook_url)
            for row in sorted(claimed, key=lambda row: (-row.priority, row.query_key or "", row.id))]


def _batch_rounds(session: Session, settings: Settings, tokens: int) -> Iterator[Select]:
    """Queries of the queued batch requests of one round, a batch of the worker's model at a time (a batch runs
    one model), for the lease's UPDATE (so that it locks and takes them in one statement). Tenants take turns (the one whose batches were claimed from least
    recently goes first, however many batches it has); a tenant's batches run oldest first; within a batch,
    requests are taken grouped by query, up to `tokens` prompt tokens (at least one request)."""
    # Uploaded batches only: a reference batch has no requests here, and its turn (`last_claimed_at`) is its
    # chunks' (store.lake.chunks); bumped here by every round, it lost its turn to older reference batches.
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


def _finish(session: Session, owner: str, job_ids: list[str], status: str, error: tuple[str, str] | None = None,
            results: dict[str, np.ndarray] | None = None, **values: Any) -> list[str]:
    """Moves those of these jobs still running under our lease to `status`, in one statement, and queues the
    webhooks of those that have one; returns their ids."""
    if not job_ids:
        return []
    values.update(status=status, finished_at=utcnow(), lease_owner=None, lease_expires_at=None)
    if error is not None:
        values.update(error_code=error[0], error_message=error[1])
    changed = session.execute(
        update(Job.__table__).where(_among(session, _JOBS.id, job_ids), _JOBS.lease_owner == owner,
                                    _JOBS.status == "running")
        .values(**values).returning(_JOBS.id, _JOBS.webhook_url)).all()
    if changed:
        count(session, "jobs_finished", len(changed), label=status)
        _enqueue_webhooks(session, [row.id for row in changed if row.webhook_url], results)
    return [row.id for row in changed]


def finish_succeeded(session: Session, owner: str, results: dict[str, np.ndarray]) -> list[str]:
    """Finishes these jobs as succeeded with their [items, labels] log-probabilities: one UPDATE for all of
    them, one multi-row INSERT of the results of those still ours (the lease condition: a job swept and run by
    another worker gets no second result). Returns their ids."""
    done = _finish(session, owner, list(results), "succeeded", results=results, items_done=_JOBS.items_total)
    if done:
        session.execute(insert(JobResult.__table__), [
            {"job_id": job_id, "n_labels": results[job_id].shape[1],
             "logprobs": np.ascontiguousarray(results[job_id], np.float32).tobytes()} for job_id in done])
    return done


def _enqueue_webhooks(session: Session, job_ids: list[str], results: dict[str, np.ndarray] | None = None) -> None:
    """Queues the webhooks of these jobs (each has one)."""
    if not job_ids:
        return
    for job in session.scalars(select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)):
        enqueue_job_webhook(session, job, (results or {}).get(job.id))


def record_pass(session: Session, owner: str, n_jobs: int, n_items: int, tokens: int, padded_tokens: int,
                seconds: float) -> None:
    """The pass's running totals (/metrics); a Pass row too where it ran jobs. A pass of reference-batch
    chunks only leaves no row: a billion-row backfill would leave hundreds of thousands of them, where its
    chunk rows are the record (at most chunks + 100 rows per batch)."""
    if n_jobs:
        session.add(Pass(worker=owner, n_jobs=n_jobs, n_items=n_items, tokens=tokens, padded_tokens=padded_tokens,
                         seconds=seconds))
    count_pass(session, n_items, tokens, seconds)


def set_progress(session: Session, owner: str, progress: list[tuple[str, int]]) -> None:
    """items_done of these running jobs of ours: one statement (executemany)."""
    if progress:
        table = Job.__table__
        session.execute(update(table).where(table.c.id == bindparam("job"), table.c.lease_owner == owner)
                        .values(items_done=bindparam("done")), [{"job": j, "done": n} for j, n in progress])


@dataclass
class Boundary:
    """The writes of one pass boundary (see write_boundaries)."""

    owner: str
    n_items: int
    tokens: int
    padded_tokens: int
    seconds: float
    progress: list[tuple[str, int]]  # (job id, items done) of jobs the pass advanced
    finished: list[tuple[Any, np.ndarray]]  # (claimed job, its log-probabilities) of jobs the pass completed
    open_ids: list[str]  # the jobs still running after it: their cancel flags and leases are checked


def write_boundaries(session: Session, boundaries: list[Boundary]) -> set[str]:
    """After one or more passes, in the caller's transaction and a few statements whatever the number of jobs
    or passes: the Pass rows, cancellations, finished results, progress. Returns the ids the pass loop must
    drop: finished, cancelled, or no longer leased to it."""
    owner = boundaries[0].owner
    for b in boundaries:
        record_pass(session, owner, len(b.progress) + len(b.finished), b.n_items, b.tokens, b.padded_tokens,
                    b.seconds)
    finished = {job.id: logprobs for b in boundaries for job, logprobs in b.finished}
    progress = {job_id: done for b in boundaries for job_id, done in b.progress if job_id not in finished}
    open_ids = {job_id for b in boundaries for job_id in b.open_ids} - finished.keys()
    # Only the exceptions come back (cancelled, or no longer ours): usually none, whatever the jobs held.
    odd = dict(session.execute(select(_JOBS.id, _JOBS.cancel_requested & (_JOBS.lease_owner == owner)
                                      & (_JOBS.status == "running")).where(
        _among(session, _JOBS.id, [*open_ids, *finished]),
        or_(_JOBS.cancel_requested, _JOBS.lease_owner.is_(None), _JOBS.lease_owner != owner,
            _JOBS.status != "running"))).all())
    lost = {job_id for job_id, ours_and_cancelled in odd.items() if not ours_and_cancelled}
    cancelled = [job_id for job_id, ours_and_cancelled in odd.items() if ours_and_cancelled]
    for job_id in lost & open_ids:
        log.warning("job %s is no longer leased to %s; dropping it", job_id, owner)
    _finish(session, owner, cancelled, "cancelled")
    finish_succeeded(session, owner, {job_id: lp for job_id, lp in finished.items() if job_id not in odd})
    set_progress(session, owner, [(job_id, n) for job_id, n in progress.items() if job_id not in odd])
    return lost | set(cancelled) | finished.keys()


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


class WriterFailed(Exception):
    """A write of the JobWriter failed (the database went away): the pass loop ends."""


class JobWriter:
    """The database work of a pass loop, in a thread of its own behind the device: pass boundaries, claims,
    finishes and hand-backs, run one at a time in the order given (an urgent claim goes first). Boundaries
    queued behind one another are written together, in one transaction. At most `depth` boundaries wait, so a
    loop that outruns the database waits instead of piling up results. After a failed write the rest are
    dropped (their jobs' leases expire and they run again: every write keeps the lease condition) and every
    later call raises WriterFailed."""

    def __init__(self, on_closed: Callable[[set[str]], None], depth: int = 4) -> None:
        """`on_closed(ids)`: called with the jobs that ended or were dropped (the heartbeat stops on them)."""
        self._tasks: deque[tuple[Callable[[], Any] | Boundary | None, Future, dict]] = deque()
        self._changed = threading.Condition()
        self._urgent = 0  # urgent tasks at the head of the queue
        self._depth = depth
        self._on_closed = on_closed
        self._closed: set[str] = set()
        self._lock = threading.Lock()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)
        self._thread.start()

    def _next(self) -> list[tuple]:
        """What to write next: an urgent claim, else every queued boundary (together), else the oldest task.
        Boundaries go before claims and hand-backs queued earlier: they hold finished jobs whose callers wait,
        and the others do not depend on them."""
        with self._changed:
            while not self._tasks:
                self._changed.wait()
            if not self._urgent and any(isinstance(task[0], Boundary) for task in self._tasks):
                taken = [task for task in self._tasks if isinstance(task[0], Boundary)]
                self._tasks = deque(task for task in self._tasks if not isinstance(task[0], Boundary))
            else:
                taken = [self._tasks.popleft()]
                self._urgent = max(self._urgent - 1, 0)
            self._changed.notify_all()
            return taken

    def _run(self) -> None:
        while (tasks := self._next())[0][0] is not None:  # None: the end (see close)
            try:
                if self.failure is not None:
                    raise WriterFailed(repr(self.failure))
                if isinstance(tasks[0][0], Boundary):
                    self._write_boundaries(tasks)
                    results = [None] * len(tasks)
                else:
                    results = [tasks[0][0]()]
            except BaseException as exc:  # noqa: BLE001  (handed to whoever waits, and ends the loop)
                if self.failure is None:
                    log.exception("a database write of the pass loop failed")
                    self.failure = exc
                for _, future, _ in tasks:
                    future.set_exception(exc)
                continue
            for (_, future, _), result in zip(tasks, results):
                future.set_result(result)

    def _put(self, task: Callable[[], Any] | Boundary | None, batch_of: dict | None = None,
             urgent: bool = False) -> Future:
        if self.failure is not None:
            raise WriterFailed(repr(self.failure))
        future: Future = Future()
        with self._changed:
            if isinstance(task, Boundary):
                while sum(isinstance(t[0], Boundary) for t in self._tasks) >= self._depth and self.failure is None:
                    self._changed.wait()
            if urgent:
                self._tasks.appendleft((task, future, batch_of or {}))
                self._urgent += 1
            else:
                self._tasks.append((task, future, batch_of or {}))
            self._changed.notify_all()
        return future

    def submit(self, work: Callable[[], Any], urgent: bool = False) -> Future:
        """Runs `work()` in the writer's thread, after what was queued before (before it, if urgent); its
        result comes in the future."""
        return self._put(work, urgent=urgent)

    def _write_boundaries(self, tasks: list[tuple]) -> None:
        batch_of: dict[str, str] = {}
        for _, _, batches in tasks:
            batch_of.update(batches)
        with session_scope() as session:
            closed = write_boundaries(session, [task for task, _, _ in tasks])
        # A batch of which the loop still runs requests cannot have ended: not worth a transaction to ask.
        running = {batch_of[job_id] for job_id in tasks[-1][0].open_ids if job_id in batch_of and job_id not in closed}
        self._settle_and_close(closed, batch_of, running)

    def _in_session(self, write: Callable[[Session], set[str]], batch_of: dict[str, str]) -> Future:
        def work() -> None:
            with session_scope() as session:
                closed = write(session)
            self._settle_and_close(closed, batch_of)
        return self.submit(work)

    def _settle_and_close(self, closed: set[str], batch_of: dict[str, str], running: set[str] | None = None) -> None:
        # A batch whose last request ended just now ends too; in a transaction of its own, so that no job row
        # lock is held while the batch row is taken (cancel takes them the other way round).
        settle_batches({batch_of[job_id] for job_id in closed if job_id in batch_of} - (running or set()))
        self._close(closed)

    def _close(self, ids: set[str]) -> None:
        if ids:
            with self._lock:
                self._closed |= ids
            self._on_closed(ids)

    def take_closed(self) -> set[str]:
        """The jobs found cancelled or lost since the last call (the loop drops them)."""
        with self._lock:
            closed, self._closed = self._closed, set()
            return closed

    def boundary(self, b: Boundary, batch_of: dict[str, str]) -> Future:
        """Queues a pass boundary's writes (`batch_of`: the batch of each of its jobs that has one)."""
        return self._put(b, batch_of)

    def finish(self, owner: str, job: Any, logprobs: np.ndarray) -> Future:
        def write(session: Session) -> set[str]:
            finish_succeeded(session, owner, {job.id: logprobs})
            return {job.id}
        return self._in_session(write, {job.id: job.batch_id} if job.batch_id else {})

    def fail(self, owner: str, job: Any, error: tuple[str, str]) -> Future:
        def write(session: Session) -> set[str]:
            _finish(session, owner, [job.id], "failed", error)
            return {job.id}
        return self._in_session(write, {job.id: job.batch_id} if job.batch_id else {})

    def release(self, owner: str, settings: Settings, job_ids: list[str], error: str | None,
                batch_ids: set[str]) -> Future:
        def work() -> None:
            release(owner, settings, job_ids, error)
            settle_batches(batch_ids)  # after an error a request may have failed for good
            self._close(set(job_ids))
        return self.submit(work)

    def close(self, timeout: float = 60) -> BaseException | None:
        """Waits for the queued writes, ends the thread; returns the failure that stopped it, if any."""
        with self._changed:
            while self._tasks and self._thread.is_alive():  # the end marker must come after every boundary
                self._changed.wait(0.1)
            self._tasks.append((None, Future(), {}))
            self._changed.notify_all()
        self._thread.join(timeout)
        return self.failure


def settle_batches(batch_ids: set[str]) -> None:
    if batch_ids:
        with session_scope() as session:
            for batch_id in sorted(batch_ids):
                settle_batch(session, batch_id)


def heartbeat(owner: str, model: str, settings: Settings, job_ids: set[str], attention: str | None = None,
              state: str = "ready", warmup: tuple[int, int] | None = None) -> None:
    """Extends the leases of `job_ids` (the jobs the process is scoring) and marks the worker alive (for
    /readyz), with its state ("warming" or "ready"), its warm-up's programs (done, total) while it warms,
    and the attention path its engine runs (for /metrics)."""
    done, total = warmup if warmup is not None and state == "warming" else (None, None)
    now = utcnow()
    lease = timedelta(seconds=settings.lease_seconds)
    with session_scope() as session:
        if job_ids:
            # Only leases past half their length (and never closer to expiry than three heartbeats): each
            # extension is a new row version, and a job held for a second or two (a batch line) needs none.
            due = now + max(lease / 2, timedelta(seconds=3 * settings.sweep_interval_seconds))
            session.execute(update(Job.__table__).where(_among(session, _JOBS.id, list(job_ids)),
                                                        _JOBS.lease_owner == owner, _JOBS.status == "running",
                                                        _JOBS.lease_expires_at < due)
                            .values(lease_expires_at=now + lease))
        if not session.execute(update(Worker).where(Worker.id == owner)
                               .values(last_seen_at=now, attention=attention, state=state, warmup_done=done,
                                       warmup_total=total)).rowcount:
            session.add(Worker(id=owner, model=model, started_at=now, last_seen_at=now, attention=attention,
                               state=state, host=socket.gethostname(), device_group=settings.device_group,
                               warmup_done=done, warmup_total=total))


def live_workers(session: Session, settings: Settings) -> dict[str, dict[str, int]]:
    """Workers seen within WORKER_STALE_SECONDS: model -> state ("ready", "warming") -> how many."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    found: dict[str, dict[str, int]] = {}
    for model, state, n in session.execute(select(Worker.model, Worker.state, func.count())
                                           .where(Worker.last_seen_at >= cutoff).group_by(Worker.model, Worker.state)):
        found.setdefault(model, {})[state] = n
    return found


def live_device_groups(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """Workers seen within WORKER_STALE_SECONDS, each with its host, the chips it was given (`packscore worker
    --devices`; None for a worker started alone), its model and state, and while it warms its `programs`
    {done, total}; by host and device group."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    rows = session.execute(select(Worker.host, Worker.device_group, Worker.model, Worker.state, Worker.warmup_done,
                                  Worker.warmup_total).where(Worker.last_seen_at >= cutoff)).all()
    return [{"host": host, "device_group": group, "model": model, "state": state,
             **({"programs": {"done": done, "total": total}} if state == "warming" and total else {})}
            for host, group, model, state, done, total in sorted(rows, key=lambda row: (row[0] or "", row[1] or "",
                                                                                        row[2]))]


def waiting_models(session: Session, models: list[str]) -> set[str]:
    """Those of these models with a job queued (one index probe each, however long the queue)."""
    return {model for model in models
            if session.scalar(select(Job.id).where(Job.model == model, Job.status == "queued").limit(1))}


def deregister(owner: str) -> None:
    """A worker stopping cleanly leaves /readyz's count at once (not a stale-heartbeat interval later)."""
    with session_scope() as session:
        session.execute(delete(Worker).where(Worker.id == owner))


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
            _requeue_or_fail(session, job, settings, "worker_lost", "the worker running this job stopped")
        batch_ids = {job.batch_id for job in expired if job.batch_id}
        requeued_here = any(job.model == settings.worker_model for job in expired)
        stale = now - timedelta(seconds=settings.sweep_interval_seconds)
        waiting = session.scalar(select(Job.id).where(Job.model == settings.worker_model, Job.status == "queued",
                                                      Job.created_at < stale).limit(1))
        session.execute(delete(Worker).where(Worker.last_seen_at < now - timedelta(days=1)))
        for batch_id in expire_uploads(session, settings):
            log.warning("batch %s was still uploading after %s s; failed", batch_id,
                        settings.batch_upload_timeout_seconds)
    # A batch whose last request failed just now ends; in a transaction of its own, so that no job row lock
    # is held while the batch row is taken (cancel takes them the other way round).
    settle_batches(batch_ids)
    return requeued_here or waiting is not None
