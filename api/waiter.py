"""Wakes the /v1/score calls waiting for their jobs: one listener and one shared poll per API process, never a
query per waiter, and no thread or database connection held while a call waits.

On Postgres a trigger NOTIFYs `packscore_jobs` with the id of each job that ends (migration 0003); a slow poll
covers notifications missed while the listening connection was down. On SQLite (embedded mode) the poll is all
there is: one query every SCORE_POLL_SECONDS for all the waiting calls together.
"""

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime

import psycopg
from sqlalchemy import make_url, select
from starlette.concurrency import run_in_threadpool

from store.db import session_factory
from store.models import TERMINAL_STATUSES, Job

log = logging.getLogger(__name__)

CHANNEL = "packscore_jobs"
# With notifications, polling only catches what the listener missed (a reconnect, a database restart).
POSTGRES_POLL_SECONDS = 1.0
# How often a poll reads every waiting job's progress, not only the finished ones (on SQLite it polls 20 times as
# often, for hundreds of waiting calls at times).
PROGRESS_SECONDS = 1.0
RECONNECT_SECONDS = 1.0


class JobWaiter:
    def __init__(self, database_url: str, poll_seconds: float) -> None:
        self._database_url = database_url
        self._listens = make_url(database_url).get_backend_name() == "postgresql"
        self._poll_seconds = POSTGRES_POLL_SECONDS if self._listens else poll_seconds
        self._waiting: dict[str, set[asyncio.Event]] = {}
        # What a poll saw of each waiting job (in the same query, once a PROGRESS_SECONDS): for the 504 of a call
        # that timed out.
        self._seen: dict[str, JobProgress] = {}
        self._seen_at = 0.0
        self._poll_now = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set once the process is stopping: every waiting call returns, so that it answers before the server
        # cuts its connection.
        self.stopping = False

    async def wait(self, job_id: str, timeout: float) -> bool:
        """True once job `job_id` is terminal; False after `timeout` seconds, or once the process is stopping
        (`stopping`)."""
        if self.stopping:
            return False
        self._start()
        event = asyncio.Event()
        self._waiting.setdefault(job_id, set()).add(event)
        # The job may have ended before this call registered (its notification came and went): poll at once.
        self._poll_now.set()
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return not self.stopping
        except TimeoutError:
            return False
        finally:
            events = self._waiting.get(job_id, set())
            events.discard(event)
            if not events:
                self._waiting.pop(job_id, None)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._tasks:
            return
        self._loop = loop
        self._poll_now = asyncio.Event()
        self._tasks = [loop.create_task(self._poll(), name="job-waiter-poll")]
        if self._listens:
            self._tasks.append(loop.create_task(self._listen(), name="job-waiter-listen"))

    def stop_waiting(self) -> None:
        """Returns every waiting call now (and any later one at once), with `stopping` set. Safe from a signal
        handler: the wake-up runs on the event loop."""
        self.stopping = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for events in self._waiting.values():
            for event in events:
                event.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    def progress(self, job_id: str) -> "JobProgress | None":
        """Job `job_id`'s progress as the last poll saw it (None if no poll has seen it yet)."""
        return self._seen.get(job_id)

    def _wake(self, job_id: str) -> None:
        for event in self._waiting.get(job_id, ()):
            event.set()

    async def _poll(self) -> None:
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._poll_now.wait(), self._poll_seconds)
            self._poll_now.clear()
            if not self._waiting:
                continue
            try:
                every = time.monotonic() - self._seen_at >= PROGRESS_SECONDS
                seen = await run_in_threadpool(_progress, list(self._waiting), every)
                if every:
                    self._seen, self._seen_at = seen, time.monotonic()
                for job_id, job in seen.items():
                    if job.terminal:
                        self._wake(job_id)
            except Exception as exc:  # the database is down: the waiting calls time out, the next round retries
                log.warning("polling for finished jobs failed: %s", exc)
                await asyncio.sleep(RECONNECT_SECONDS)

    async def _listen(self) -> None:
        conninfo = make_url(self._database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True,
                                                                 connect_timeout=5) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._poll_now.set()  # whatever ended while we were not listening
                    async for notify in conn.notifies():
                        self._wake(notify.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("listening for finished jobs failed (polling meanwhile): %s", exc)
            await asyncio.sleep(RECONNECT_SECONDS)


@dataclass(frozen=True)
class JobProgress:
    terminal: bool
    items_done: int
    items_total: int
    started_at: datetime | None  # naive UTC, as stored
    claimed_at: datetime | None  # of its current attempt (its eta's pace is since then), naive UTC
    items_at_claim: int  # its items done then (kept from earlier attempts)


def _progress(job_ids: list[str], every: bool) -> dict[str, JobProgress]:
    """These jobs' progress: the finished ones, or (`every`) all of them."""
    query = select(Job.id, Job.status, Job.items_done, Job.items_total, Job.started_at, Job.claimed_at,
                   Job.items_at_claim).where(Job.id.in_(job_ids))
    with session_factory()() as session:
        rows = session.execute(query if every else query.where(Job.status.in_(TERMINAL_STATUSES)))
        return {job_id: JobProgress(status in TERMINAL_STATUSES, done, total, started, claimed, at_claim)
                for job_id, status, done, total, started, claimed, at_claim in rows}
