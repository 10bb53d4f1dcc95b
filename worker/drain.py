"""The pass loop: one engine thread per worker process keeps the device busy with packed passes.

It works like the serving engines' overlap schedulers: pass n+1 is planned, packed and launched while pass n
runs on the device, and only then does the loop wait for pass n's scores. Everything that touches the
database runs in a writer thread behind it (`store.job_writer.JobWriter`): each pass boundary's writes (the Pass
row, progress, finished results, cancellations, in a few statements) and the claims of the next jobs, which
the loop asks for while it still has work (one round ahead). The device waits for neither.

The loop only moves data: claims, launches, collects, writes. Which items go into the next pass is the
scheduler's (worker/scheduler.py: continuous batching, claimed requests joining the next pass); where a
request's scores go is its sink's: a job's row (JobSink, its writes gathered per pass by JobBook) or a chunk's
result object (worker/lake.py ChunkRequest).

Exactly-once effects hold as before: every write keeps the lease condition, so a result written after the
lease was lost (or by a worker killed with writes still queued, whose jobs run again) is not written.
"""

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core import InFlightPass, PassResult, Scorer, ScoringError, TokenizedRequest
from store import claims, workers
from store.broker import clear_pending_kick
from store.claims import ClaimedJob
from store.finishing import Boundary
from store.job_writer import JobWriter, WriterFailed
from store.settings import Settings, get_settings
from worker import lake as chunk_feed
from worker.scheduler import Pace, ScheduledPass, Scheduler, batch_pass_tokens

log = logging.getLogger(__name__)

CLAIM_AHEAD_PASSES = 4
# How long the loop waits, before it plans a pass, for a wake-up's claim still on its way (in the writer's
# queue behind a boundary write, or reading the queue): far less than the pass its job would otherwise miss.
URGENT_CLAIM_WAIT_SECONDS = 1.0


class ActiveJobs:
    """The jobs this process holds (claimed, not yet finished or handed back): the only leases its heartbeat
    extends. A job left "running" by a failed loop (say the database went away) is dropped from here, so its
    lease expires and another worker runs it."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, ids) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self._ids.update(ids)

    def discard(self, ids) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self._ids.difference_update(ids)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()

    def snapshot(self) -> set[str]:
        with self._lock:
            return set(self._ids)


active_jobs = ActiveJobs()


class WakeUp(threading.Event):
    """Set when a job may be waiting (a broker kick, the sweeper). A running pass loop listens: it claims the
    interactive jobs at once, from the setter's thread, so they join the next pass without waiting for the
    loop to come round."""

    listener: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        if (listener := self.listener) is not None:
            listener()


class ResultSink(Protocol):
    """Where a claimed request's scores go: a job's row (JobSink), or a chunk's result object
    (worker/lake.py ChunkRequest). The pass loop hands each the outcomes of its passes."""

    @property
    def id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    def request_for(self, scorer: Scorer) -> TokenizedRequest:
        """The request in token space (in the writer's thread, off the pass loop's)."""

    def hold(self, jobs: "JobBook") -> None:
        """The loop holds the request from now on (`jobs`: where a job's writes go)."""

    def advance(self, done: int) -> None:
        """After a pass: `done` items scored so far."""

    def finish(self, logprobs: np.ndarray) -> None:
        """Every item scored."""

    def fail(self, error: tuple[str, str]) -> None:
        """The request cannot run (code, message)."""

    def abandon(self, error: str | None) -> None:
        """The loop gives the request back: after `error` the attempt counts; when the worker stops, it does not."""


class JobBook:
    """The jobs a pass loop holds, and their writes through the writer: a pass's progress and results go in one
    boundary (a few statements whatever the number of jobs), the jobs handed back in one release."""

    def __init__(self, writer: JobWriter, owner: str, settings: Settings) -> None:
        self.writer, self.owner, self.settings = writer, owner, settings
        self.held: dict[str, ClaimedJob] = {}  # their cancel flags and leases are checked at each boundary
        self._progress: list[tuple[str, int]] = []
        self._finished: list[tuple[ClaimedJob, np.ndarray]] = []
        self._released: list[ClaimedJob] = []
        self._release_error: str | None = None

    def hold(self, job: ClaimedJob) -> None:
        self.held[job.id] = job
        self.writer.claimed_again(job.id)
        active_jobs.add([job.id])

    def advance(self, job: ClaimedJob, done: int) -> None:
        self._progress.append((job.id, done))

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
        jobs = [*(job for job, _ in finished), *self.held.values()]
        self.writer.boundary(Boundary(
            owner=self.owner, n_items=sum(len(p.items) for p in result.scores), tokens=result.tokens,
            padded_tokens=result.padded_tokens, seconds=result.seconds, host_seconds=result.host_seconds,
            device_seconds=result.device_seconds, device_idle_seconds=device_idle_seconds, progress=progress,
            finished=finished, open_ids=list(self.held)), {job.id: job.batch_id for job in jobs if job.batch_id})

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


class JobSink:
    """A claimed job as the pass loop holds it: its progress and results go to its row (through its JobBook)."""

    _book: JobBook

    def __init__(self, job: ClaimedJob) -> None:
        self.job = job

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def priority(self) -> int:
        return self.job.priority

    @property
    def batch_id(self) -> str | None:
        return self.job.batch_id

    def request_for(self, scorer: Scorer) -> TokenizedRequest:
        """The request as the API tokenized it at submission; a job queued before tokens were stored (or for
        another model) is tokenized from its text here."""
        job = self.job
        if job.tokens is not None and job.model == scorer.model_name:
            return scorer.requests.check_stored(job.tokens)  # this worker's limits may differ from the API's
        r = job.request
        return scorer.tokenize(r["query"], r["items"], r["label_token_ids"], r["item_first"])

    def hold(self, jobs: JobBook) -> None:
        self._book = jobs
        jobs.hold(self.job)

    def advance(self, done: int) -> None:
        self._book.advance(self.job, done)

    def finish(self, logprobs: np.ndarray) -> None:
        self._book.finish(self.job, logprobs)

    def fail(self, error: tuple[str, str]) -> None:
        self._book.fail(self.job, error)

    def abandon(self, error: str | None) -> None:
        self._book.release(self.job, error)


def job_sinks(jobs: list[ClaimedJob]) -> list[JobSink]:
    return [JobSink(job) for job in jobs]


@dataclass
class _Launched:
    scheduled: ScheduledPass
    flight: InFlightPass
    after_dry_spell: bool  # the loop had nothing to launch since the pass before: the device's wait was not the host's


@dataclass
class _Claim:
    """A claim the writer is running for the loop."""

    future: Future
    all_lanes: bool  # whether it may take batch work too, else interactive jobs only


# Each engine's pace (worker/scheduler.py, Pace), kept from one pass loop to the next.
_PACES: "weakref.WeakKeyDictionary[Scorer, Pace]" = weakref.WeakKeyDictionary()


class PassLoop:
    """Runs claimed requests in packed passes until none is left or it is told to stop (see the module's doc):
    it moves data between the claims, the scheduler (worker/scheduler.py), the engine and the sinks."""

    def __init__(self, scorer: Scorer, owner: str, settings: Settings, writer: JobWriter,
                 claim: Callable[[bool], list[ResultSink]], busy: Callable[[], bool] = lambda: False) -> None:
        """`claim(interactive_only)` leases the next requests (called in the writer's thread); `busy()`: whether
        a claim that found nothing may still find work soon (the chunk feed is reading a chunk)."""
        self.scorer, self.owner, self.settings, self.writer = scorer, owner, settings, writer
        self._claim = claim
        self._busy = busy
        self.scheduler = Scheduler(scorer, settings, _PACES.setdefault(scorer, Pace()))
        self.jobs = JobBook(writer, owner, settings)
        self.claimed_total = 0
        self._urgent: list[Future] = []  # claims made for wake-ups (see WakeUp)
        self._urgent_lock = threading.Lock()
        self._urgent_busy = False  # a wake-up's claim is queued or running in the writer
        self._claim_again = False  # a wake-up came while it ran: it may have read the queue before that job
        # The loop is handing its requests back: a wake-up's thread that read the listener just before the loop
        # cleared it claims nothing (its jobs would be leased to a loop that no longer admits them).
        self._handing_back = False
        self._ran_dry = True  # nothing to launch since the last pass launched (or none launched yet)

    def _claim_now(self) -> None:
        with self._urgent_lock:
            if self._handing_back:
                return
            if self._urgent_busy:
                self._claim_again = True  # the claim on its way claims once more before it returns
                return
            try:
                self._urgent.append(self.writer.submit(self._urgent_claim, urgent=True))
                self._urgent_busy = True
            except WriterFailed:
                pass

    def _urgent_claim(self) -> list[tuple[ResultSink, TokenizedRequest | ScoringError]]:
        claimed = []
        while True:
            try:
                claimed += self._claim_requests(True)
            except BaseException:
                with self._urgent_lock:
                    self._urgent_busy = self._claim_again = False
                raise
            with self._urgent_lock:
                if not self._claim_again:
                    self._urgent_busy = False
                    return claimed
                self._claim_again = False

    def _admit_urgent(self, wait: float = 0.0) -> None:
        """Admits the wake-ups' claims that are done; with `wait`, first waits up to that long for those on
        their way (a claim takes milliseconds; a job it leaves behind waits a whole pass)."""
        with self._urgent_lock:
            claims = list(self._urgent)
        if wait and claims:
            futures_wait(claims, timeout=wait)
        with self._urgent_lock:
            done = [claim for claim in self._urgent if claim.done()]
            self._urgent = [claim for claim in self._urgent if not claim.done()]
        for claim in done:
            self._admit(claim.result())

    # ---- claims -----------------------------------------------------------------------------------------

    def _claim_requests(self, interactive_only: bool) -> list[tuple[ResultSink, TokenizedRequest | ScoringError]]:
        """Claims (in the writer's thread) and decodes the requests there too, off the pass loop's thread."""
        claimed: list[tuple[ResultSink, TokenizedRequest | ScoringError]] = []
        for sink in self._claim(interactive_only):
            try:
                claimed.append((sink, sink.request_for(self.scorer)))
            except ScoringError as exc:  # limits changed since the API accepted it
                claimed.append((sink, exc))
        return claimed

    def _short_of_work(self) -> bool:
        """Claims run ahead by a few passes: a claim and its decoding take longer than a pass on an accelerator,
        and the device must not run dry meanwhile. Batch passes, not full ones: held work runs first, so a chunk
        (or another batch's round) claimed after 16 full passes' worth of 1,024-token batch passes waited all of
        them (a reference batch 82 s behind an upload)."""
        return self.scheduler.pending_tokens < CLAIM_AHEAD_PASSES * batch_pass_tokens(self.scorer, self.settings)

    def _start_claim(self) -> _Claim:
        # With work in hand, or interactive jobs running (batch rounds wait for them, claims included), it claims
        # interactive jobs only.
        all_lanes = self._short_of_work() and not self.scheduler.runs_interactive
        return _Claim(self.writer.submit(lambda: self._claim_requests(not all_lanes)), all_lanes)

    def _admit(self, claimed: list[tuple[ResultSink, TokenizedRequest | ScoringError]]) -> None:
        self.claimed_total += len(claimed)
        for sink, request in claimed:
            sink.hold(self.jobs)
            if isinstance(request, ScoringError):
                sink.fail((request.code, request.message))
            elif (run := self.scheduler.add_request(sink, request)).finished:  # no item to score
                sink.finish(run.logprobs)
        self.jobs.write()

    def _admit_claim(self, claim: _Claim, exhausted: bool) -> bool:
        """Admits a claim's requests; returns whether no work is left (the loop may end)."""
        claimed = claim.future.result()
        # An interactive-only claim that finds nothing says nothing of the batch lane: taken as "no work left",
        # it ended the loop with batch requests queued (the sweeper restarted it later).
        exhausted = not claimed and (not self._busy() if claim.all_lanes else exhausted)
        self._admit(claimed)
        return exhausted

    # ---- passes -----------------------------------------------------------------------------------------

    def _launch_next(self) -> _Launched | None:
        planned_from = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            self._ran_dry = True
            return None
        flight = self.scorer.launch(scheduled.views, scheduled.plan, scheduled.needed, planned_from)
        after_dry_spell, self._ran_dry = self._ran_dry, False
        return _Launched(scheduled, flight, after_dry_spell)

    def _collect(self, launched: _Launched) -> None:
        """Waits for a launched pass, hands its scores to their sinks and queues the jobs' boundary writes."""
        result = launched.flight.result()
        chunk_feed.record_pass(result.tokens, result.seconds)  # the feed cuts chunks to this worker's pace
        for run in self.scheduler.update_from_output(launched.scheduled, result):
            if run.finished:
                run.sink.finish(run.logprobs)
            else:
                run.sink.advance(run.done)
        # The device's idle time before the pass counts as waiting for the host only where the loop had work.
        self.jobs.write_pass(result, 0.0 if launched.after_dry_spell else result.device_idle_seconds)

    # ---- the loop ---------------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool], wake: threading.Event) -> None:
        """Until no work is left (or `should_stop`): claims ahead, launches pass n+1, then collects pass n.
        `wake` set (a new job was queued) makes it claim again. On stop, the pass in flight is finished and
        written; every other held request goes back."""
        inflight: _Launched | None = None
        claim: _Claim | None = None  # the claim the writer is running for us
        exhausted = False  # the last claim of every lane found nothing, and the chunk feed is reading none
        self._handing_back = False
        if isinstance(wake, WakeUp):
            wake.listener = self._claim_now
        try:
            while True:
                self.scheduler.finish_requests(self.jobs.take_closed())  # cancelled, or no longer ours
                # An interactive job claimed while the last pass ran goes into the next one: its claim is
                # waited for here (bounded), before the pass is planned.
                self._admit_urgent(URGENT_CLAIM_WAIT_SECONDS)
                if claim is not None and (claim.future.done() or (self.scheduler.idle and inflight is None)):
                    exhausted = self._admit_claim(claim, exhausted)
                    claim = None
                if should_stop():
                    break
                if claim is None and (wake.is_set() or (self._short_of_work() and not exhausted)):
                    wake.clear()
                    claim = self._start_claim()
                launched = self._launch_next()
                if inflight is not None:
                    self._collect(inflight)
                inflight = launched
                if inflight is not None and not self.scorer.launches_ahead:
                    self._collect(inflight)  # before the next claim: a job that came meanwhile joins the next pass
                    inflight = None
                if inflight is None:
                    self._fail_unscored()
                    if self.scheduler.idle and claim is None and exhausted:
                        break  # a wake-up's claim still on its way is handed back below (the wake-up drains again)
        except WriterFailed:
            # Its jobs are left to their leases; a chunk's requests go back through the chunk feed's own
            # thread (held, the feed kept extending their leases: the chunk ran for good, its batch never ended).
            self._abandon_held(None)
            raise
        except Exception as exc:
            log.exception("the pass loop failed; handing its jobs back")
            self._hand_back(None, claim, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if isinstance(wake, WakeUp):
                wake.listener = None
        self._hand_back(inflight, claim, None)

    def _fail_unscored(self) -> None:
        """Requests with nothing left to launch and nothing in flight, yet not every item scored: an engine
        bug, not the user's fault."""
        for run in self.scheduler.take_unscored():
            run.sink.fail(("internal_error", "the engine did not score every item"))

    def _hand_back(self, inflight: _Launched | None, claim: _Claim | None, error: str | None) -> None:
        """Finishes the pass in flight and hands every other held request back: after `error` the attempt
        counts (a job fails after max_attempts); when the worker stops (None), it does not."""
        with self._urgent_lock:
            self._handing_back, urgent_claims, self._urgent = True, self._urgent, []
        try:
            if inflight is not None:
                self._collect(inflight)
            if claim is not None:
                self._admit(claim.future.result())
            for urgent in urgent_claims:
                self._admit(urgent.result())
        except Exception:
            log.exception("the pass loop could not finish its last pass")
        self._abandon_held(error)

    def _abandon_held(self, error: str | None) -> None:
        for run in self.scheduler.take_all():
            run.sink.abandon(error)
        self.jobs.write()


class Claimer:
    """A pass loop's claims (`claim(interactive_only)`). In the batch lane, uploaded batches and reference
    batches take turns: a chunk, then uploaded batches' rounds for as long as that chunk took (at most
    BATCH_CHUNK_SECONDS), then the next chunk, and so on; either kind alone runs without waiting. Within a
    kind, tenants and batches take turns (store.claims for rounds, store.lake.chunks for chunks)."""

    def __init__(self, owner: str, settings: Settings, round_tokens: int,
                 feed: chunk_feed.ChunkFeed | None = None) -> None:
        self.owner, self.settings, self.round_tokens, self.feed = owner, settings, round_tokens, feed
        # When a chunk is due (monotonic); None: after a chunk, until the uploads' turn begins (at the first
        # round claimed once that chunk is done: the turn lasts as long as the chunk took).
        self._chunk_due_at: float | None = 0.0
        self._chunk_taken_at = 0.0

    def _uploads_turn(self) -> float:
        last = self.feed.last_chunk_seconds if self.feed else None
        return min(last, self.settings.batch_chunk_seconds) if last is not None else self.settings.batch_chunk_seconds

    def __call__(self, interactive_only: bool) -> list[ResultSink]:
        settings = self.settings
        # Jobs committed from now on send a kick; those before are seen by this claim.
        clear_pending_kick(settings.worker_model)
        if interactive_only:
            return job_sinks(claims.claim_interactive(self.owner, settings))
        if (jobs := claims.claim_interactive(self.owner, settings)):
            return job_sinks(jobs)
        now = time.monotonic()
        due = self.feed is not None and self._chunk_due_at is not None and now >= self._chunk_due_at
        if due and (chunk := self.feed.take()):
            self._chunk_due_at, self._chunk_taken_at = None, now
            return chunk
        if jobs := claims.claim_batch_round(self.owner, settings, self.round_tokens):
            # The uploads' turn begins once the chunk taken is done (begun at its take, the turn had no chunk time
            # to go by and took BATCH_CHUNK_SECONDS). A chunk due but not there (being read, or none waiting) stays
            # due: the next claim looks again (a new turn here left a batch submitted behind an upload a whole
            # BATCH_CHUNK_SECONDS behind it: 82 s against 15 s alone).
            if self._chunk_due_at is None and self.feed.last_chunk_done_at >= self._chunk_taken_at:
                self._chunk_due_at = now + self._uploads_turn()
            return job_sinks(jobs)
        self._chunk_due_at = now  # no upload waits: chunks run back to back
        return self.feed.take() if self.feed is not None and not due else []


def drain(scorer: Scorer, owner: str, settings: Settings, should_stop: Callable[[], bool] = lambda: False,
          wake: threading.Event | None = None) -> int:
    """Runs the ready jobs until none is left (interactive before batch); returns how many it claimed. A
    failed database write ends it: the jobs it held are left to their leases (the heartbeat stops extending
    them) and the failure is raised."""
    # On an accelerator a batch claim takes the passes the loop claims ahead in one go: a claim costs the
    # database and the writer's thread about as much for 30 lines as for 130. On CPU the claim's work shares
    # the cores with the passes, and an interactive job's own claim waits behind it: a claim takes at most a
    # pass of tokens, but as many short rounds as that holds (one short round a claim left a batch pass one
    # line long, the claims not keeping up with the passes). Passes stay BATCH_ROUND_TOKENS long either way.
    round_tokens = batch_pass_tokens(scorer, settings)
    claim_tokens = CLAIM_AHEAD_PASSES * round_tokens if scorer.launches_ahead else \
        max(round_tokens, min(CLAIM_AHEAD_PASSES * round_tokens, scorer.pass_tokens))
    feed = chunk_feed.feed_for(scorer, owner, settings, round_tokens)
    claim = Claimer(owner, settings, claim_tokens, feed)
    return _run_loop(scorer, owner, settings, claim, should_stop, wake or threading.Event(), feed.busy)


def run_jobs(scorer: Scorer, owner: str, jobs: list[ClaimedJob]) -> None:
    """Runs these claimed jobs (and claims nothing else)."""
    given = [job_sinks(jobs)]
    _run_loop(scorer, owner, get_settings(), lambda _: given.pop() if given else [], lambda: False,
              threading.Event())


def _run_loop(scorer: Scorer, owner: str, settings: Settings, claim: Callable[[bool], list[ResultSink]],
              should_stop: Callable[[], bool], wake: threading.Event,
              busy: Callable[[], bool] = lambda: False) -> int:
    writer = JobWriter(active_jobs.discard)
    loop = PassLoop(scorer, owner, settings, writer, claim, busy)
    try:
        while True:
            try:
                loop.run(should_stop, wake)
                break
            except WriterFailed:
                break  # the writer's own failure is raised below
            except Exception:  # an engine fault: its jobs went back to the queue (the attempt counts)
                continue
    finally:
        failure = writer.close()
    if failure is not None:
        log.error("database writes failed (%s); the jobs held are left to their leases", failure)
        active_jobs.clear()
        raise failure
    return loop.claimed_total


def heartbeat(owner: str, model: str, settings: Settings, attention: str | None = None,
              state: str = "ready", warmup: tuple[int, int] | None = None) -> None:
    """Extends the leases of the jobs this process holds and marks the worker alive."""
    workers.heartbeat(owner, model, settings, active_jobs.snapshot(), attention, state, warmup)
