"""The pass loop's database writes in a thread of its own (`JobWriter`), behind the device."""

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from store import finishing
from store.db import session_scope
from store.finishing import Boundary, finish, finish_succeeded, release, settle_batches
from store.settings import Settings

log = logging.getLogger(__name__)


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
            closed = finishing.write_boundaries(session, [task for task, _, _ in tasks])
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

    def claimed_again(self, job_id: str) -> None:
        """The loop holds this job under a new lease (its claim was written after any close of the old one):
        a close not yet taken is the old lease's. Taken after the new claim, it would drop the job, whose items
        would then never run while the heartbeat kept its lease."""
        with self._lock:
            self._closed.discard(job_id)

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
            finish(session, owner, [job.id], "failed", error)
            return {job.id}
        return self._in_session(write, {job.id: job.batch_id} if job.batch_id else {})

    def release(self, owner: str, settings: Settings, job_ids: list[str], error: str | None,
                batch_ids: set[str]) -> Future:
        def work() -> None:
            release(owner, settings, job_ids, error)
            settle_batches(batch_ids)  # after an error a request may have failed for good
            self._on_closed(set(job_ids))  # the loop let them go already: not for take_closed
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
