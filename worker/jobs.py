"""Jobs as a source of the pass loop (worker/drain.py), beside reference chunks (worker/lake.py).

`JobSource` claims interactive jobs and uploaded batches' rounds (store.claims) as the policy asks
(worker/policy.py); each job comes as a `JobSink` bound to its loop's `JobBook`, where its progress and results
go: a pass's writes in one boundary through the writer thread (store.job_writer): its progress and the items it
scored of the jobs it did not finish (kept: a job handed back or lost resumes from them), the jobs handed back in
one release. `active_jobs` are the leases this process's heartbeat extends: a job's from its claim, though the loop
admits it later (a claim made ahead waits behind the passes the loop holds), until it ends or goes back.
"""

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from core import PassResult, Scorer, TokenizedRequest
from store import claims
from store.claims import ClaimedJob, KeptItems
from store.finishing import Boundary
from store.job_writer import JobWriter, WriterFailed
from store.settings import Settings


class ActiveJobs:
    """The jobs this process holds (claimed, not yet finished or handed back): the only leases its heartbeat
    extends. A job left "running" by a failed loop (say the database went away) is dropped from here, so its
    lease expires and another worker runs it."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._ids.update(ids)

    def discard(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._ids.difference_update(ids)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()

    def snapshot(self) -> set[str]:
        with self._lock:
            return set(self._ids)


active_jobs = ActiveJobs()


class JobBook:
    """The jobs a pass loop holds, and their writes through the writer: a pass's progress and results go in one
    boundary (a few statements whatever the number of jobs), the jobs handed back in one release. Called from
    the loop's thread only."""

    def __init__(self, writer: JobWriter, owner: str, settings: Settings) -> None:
        self.writer, self.owner, self.settings = writer, owner, settings
        self.held: dict[str, ClaimedJob] = {}  # their cancel flags and leases are checked at each boundary
        self._progress: list[tuple[str, int]] = []
        self._parts: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._finished: list[tuple[ClaimedJob, np.ndarray]] = []
        self._released: list[ClaimedJob] = []
        self._release_error: str | None = None

    def claimed(self, jobs: list[ClaimedJob]) -> None:
        """Jobs just leased (in the writer's thread, after any close of an earlier lease of theirs): the heartbeat
        extends their leases from now on, until the writer closes them."""
        active_jobs.add(job.id for job in jobs)

    def hold(self, job: ClaimedJob) -> None:
        self.held[job.id] = job
        self.writer.claimed_again(job.id)

    def advance(self, job: ClaimedJob, done: int, items: np.ndarray, logprobs: np.ndarray) -> None:
        self._progress.append((job.id, done))
        self._parts.append((job.id, items, logprobs))

    def finish(self, job: ClaimedJob, logprobs: np.ndarray) -> None:
        self.held.pop(job.id, None)
        self._finished.append((job, logprobs))

    def fail(self, job: ClaimedJob, error: tuple[str, str]) -> None:
        self.held.pop(job.id, None)
        self.writer.fail(self.owner, job, error)

    def release(self, job: ClaimedJob, error: str | None) -> None:
        self.held.pop(job.id, None)
        self._released.append(job)
        self._release_error = error

    def take_closed(self) -> set[str]:
        """The jobs the writer found cancelled or no longer ours: no longer held."""
        closed = self.writer.take_closed()
        for job_id in closed:
            self.held.pop(job_id, None)
        return closed

    def write_pass(self, result: PassResult, device_idle_seconds: float) -> None:
        """Queues a pass's boundary: written whether or not a job was in it (the pass's totals).
        `device_idle_seconds`: how long the device waited for the host before the pass."""
        finished, self._finished = self._finished, []
        progress, self._progress = self._progress, []
        parts, self._parts = self._parts, []
        jobs = [*(job for job, _ in finished), *self.held.values()]
        self.writer.boundary(Boundary(
            owner=self.owner, n_items=sum(len(p.items) for p in result.scores), tokens=result.tokens,
            padded_tokens=result.padded_tokens, seconds=result.seconds, host_seconds=result.host_seconds,
            device_seconds=result.device_seconds, device_idle_seconds=device_idle_seconds, progress=progress,
            parts=parts, finished=finished, open_ids=list(self.held)),
            {job.id: job.batch_id for job in jobs if job.batch_id})

    def write(self) -> None:
        """Queues the writes reported outside a pass: jobs with no item to score, jobs handed back."""
        finished, self._finished = self._finished, []
        for job, logprobs in finished:
            self.writer.finish(self.owner, job, logprobs)
        released, self._released = self._released, []
        if released:
            try:
                self.writer.release(self.owner, self.settings, [job.id for job in released], self._release_error,
                                    {job.batch_id for job in released if job.batch_id})
            except WriterFailed:
                pass  # their leases expire


@dataclass(eq=False)
class JobSink:
    """A claimed job as the pass loop holds it (worker/scheduler.py Sink): its outcomes go to its book."""

    job: ClaimedJob
    book: JobBook

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def priority(self) -> int:
        return self.job.priority

    @property
    def batch_id(self) -> str | None:
        return self.job.batch_id

    @property
    def kept(self) -> KeptItems | None:
        return self.job.kept

    def request_for(self, scorer: Scorer) -> TokenizedRequest:
        """The request as the API tokenized it at submission; a job queued before tokens were stored (or for
        another model) is tokenized from its text here."""
        job = self.job
        if job.tokens is not None and job.model == scorer.model_name:
            return scorer.requests.check_stored(job.tokens)  # this worker's limits may differ from the API's
        r = job.request
        return scorer.tokenize(r["query"], r["items"], r["label_token_ids"], r["item_first"])

    def start(self) -> None:
        self.book.hold(self.job)

    def advance(self, done: int, items: np.ndarray, logprobs: np.ndarray) -> None:
        self.book.advance(self.job, done, items, logprobs)

    def finish(self, logprobs: np.ndarray) -> None:
        self.book.finish(self.job, logprobs)

    def fail(self, error: tuple[str, str]) -> None:
        self.book.fail(self.job, error)

    def abandon(self, error: str | None) -> None:
        self.book.release(self.job, error)


class JobSource:
    """A pass loop's claims of jobs (in the writer's thread), each job bound to the loop's book."""

    def __init__(self, owner: str, settings: Settings, book: JobBook, interactive_above: int,
                 round_tokens: int | None = None) -> None:
        """`interactive_above`: the priority over which a job is interactive; `round_tokens`: a batch round's
        prompt tokens (the policy's)."""
        self.owner, self.settings, self.book = owner, settings, book
        self.interactive_above, self.round_tokens = interactive_above, round_tokens

    def sinks(self, jobs: list[ClaimedJob]) -> list[JobSink]:
        self.book.claimed(jobs)
        return [JobSink(job, self.book) for job in jobs]

    def claim_interactive(self) -> list[JobSink]:
        return self.sinks(claims.claim_interactive(self.owner, self.settings, self.interactive_above))

    def claim_round(self) -> list[JobSink]:
        return self.sinks(claims.claim_batch_round(self.owner, self.settings, self.round_tokens))
