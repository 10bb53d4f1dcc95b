"""The pass loop: one engine thread per worker process keeps the device busy with packed passes.

It works like the serving engines' overlap schedulers: pass n+1 is planned, packed and launched while pass n
runs on the device, and only then does the loop wait for pass n's scores. Everything that touches the
database runs in a writer thread behind it (`store.job_writer.JobWriter`): each pass boundary's writes (the Pass
row, progress, finished results, cancellations, in a few statements) and the claims of the next requests, which
the loop asks for while it still has work. The device waits for neither.

The loop only moves data: claims, launches, collects, writes. Which source a claim takes from, how much, and how
long each pass is are the policy's (worker/policy.py); which items go into the next pass is the scheduler's
(worker/scheduler.py); where a request's scores go is its sink's, bound at its claim: a job's row (worker/jobs.py
JobSink, its writes gathered per pass by the loop's JobBook) or a chunk's result object (worker/lake.py).

Exactly-once effects hold: every write keeps the lease condition, so a result written after the lease was lost
(or by a worker killed with writes still queued, whose jobs run again) is not written.
"""

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from core import InFlightPass, Scorer, ScoringError, TokenizedRequest
from store import workers
from store.broker import clear_pending_kick
from store.job_writer import JobWriter, WriterFailed
from store.settings import Settings
from worker import lake as chunk_feed
from worker.jobs import JobBook, JobSource, active_jobs
from worker.policy import Pace, Policy, Source, policy_for
from worker.scheduler import ScheduledPass, Scheduler, Sink

log = logging.getLogger(__name__)

# How long the loop waits, before it plans a pass, for a wake-up's claim still on its way (in the writer's
# queue behind a boundary write, or reading the queue): far less than the pass its job would otherwise miss.
URGENT_CLAIM_WAIT_SECONDS = 1.0


class WakeUp(threading.Event):
    """Set when a job may be waiting (a broker kick, the sweeper). A running pass loop listens: it claims the
    interactive jobs at once, from the setter's thread, so they join the next pass without waiting for the
    loop to come round."""

    listener: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        if (listener := self.listener) is not None:
            listener()


# A claim: `claim(interactive_only)` leases the next requests (in the writer's thread).
Claim = Callable[[bool], list[Sink]]


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


# Each engine's pace, kept from one pass loop to the next.
_PACES: "weakref.WeakKeyDictionary[Scorer, Pace]" = weakref.WeakKeyDictionary()


def pace_for(scorer: Scorer) -> Pace:
    """The engine's pace, as this process's pass loops measured it."""
    return _PACES.setdefault(scorer, Pace())


class PassLoop:
    """Runs claimed requests in packed passes until none is left or it is told to stop (see the module's doc):
    it moves data between the claims, the scheduler (worker/scheduler.py), the engine and the sinks."""

    def __init__(self, scorer: Scorer, policy: Policy, writer: JobWriter, jobs: JobBook, claim: Claim,
                 busy: Callable[[], bool] = lambda: False, closed: Callable[[], set[str]] = set) -> None:
        """`jobs`: where the jobs claimed write; `busy()`: whether a claim that found nothing may still find
        work soon (the chunk feed is reading a chunk); `closed()`: requests of other sources found cancelled
        or no longer ours since the last call (the chunk feed's), dropped as the jobs' are."""
        self.scorer, self.policy, self.writer, self.jobs = scorer, policy, writer, jobs
        self._claim = claim
        self._busy = busy
        self._closed = closed
        self.scheduler = Scheduler(scorer, policy)
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

    def _urgent_claim(self) -> list[tuple[Sink, TokenizedRequest | ScoringError]]:
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

    def _claim_requests(self, interactive_only: bool) -> list[tuple[Sink, TokenizedRequest | ScoringError]]:
        """Claims (in the writer's thread) and decodes the requests there too, off the pass loop's thread."""
        claimed: list[tuple[Sink, TokenizedRequest | ScoringError]] = []
        for sink in self._claim(interactive_only):
            try:
                claimed.append((sink, sink.request_for(self.scorer)))
            except ScoringError as exc:  # limits changed since the API accepted it
                claimed.append((sink, exc))
        return claimed

    def _short_of_work(self) -> bool:
        return self.policy.short_of_work(self.scheduler.pending_tokens)

    def _start_claim(self) -> _Claim:
        all_lanes = self.policy.claims_batch(self.scheduler.pending_tokens, self.scheduler.runs_interactive)
        return _Claim(self.writer.submit(lambda: self._claim_requests(not all_lanes)), all_lanes)

    def _admit(self, claimed: list[tuple[Sink, TokenizedRequest | ScoringError]]) -> None:
        self.claimed_total += len(claimed)
        for i, (sink, request) in enumerate(claimed):
            try:
                sink.start()
                if isinstance(request, ScoringError):
                    sink.fail((request.code, request.message))
                elif (run := self.scheduler.add_request(sink, request, sink.kept)).finished:  # no item left to score
                    sink.finish(run.logprobs)
            except Exception as exc:
                # Leased from their claim, this request and the rest would be heartbeated with nothing to run
                # them: they go back (the attempt counts).
                for rest, _ in claimed[i:]:
                    rest.abandon(f"{type(exc).__name__}: {exc}")
                self.jobs.write()
                raise
        self.jobs.write()

    def _admit_claim(self, claim: _Claim, exhausted: bool) -> bool:
        """Admits a claim's requests; returns whether no work is left (the loop may end)."""
        claimed = claim.future.result()
        # An interactive-only claim that finds nothing says nothing of the batch lane.
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
        for run in self.scheduler.update_from_output(launched.scheduled, result):
            if run.finished:
                run.sink.finish(run.logprobs)
            else:
                run.sink.advance(run.done, run.last_scored, run.logprobs[run.last_scored])
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
                # cancelled, or no longer ours
                self.scheduler.finish_requests(self.jobs.take_closed() | self._closed())
                # An interactive job claimed while the last pass ran goes into the next one: its claim is
                # waited for here (bounded), before the pass is planned.
                self._admit_urgent(URGENT_CLAIM_WAIT_SECONDS)
                if claim is not None and (claim.future.done() or (self.scheduler.idle and inflight is None)):
                    admitting, claim = claim, None  # admitted once: a failed admission hands its own claim back
                    exhausted = self._admit_claim(admitting, exhausted)
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
            # thread (held, the feed would extend their leases for good, and their batch would never end).
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
        except Exception:
            log.exception("the pass loop could not finish its last pass")
        # Each claim on its way on its own: its jobs are heartbeated from their claim, so one that failed must
        # not keep the others from going back.
        for pending in ([claim.future] if claim is not None else []) + urgent_claims:
            try:
                self._admit(pending.result())
            except Exception:
                log.exception("the pass loop could not take back a claim")
        self._abandon_held(error)

    def _abandon_held(self, error: str | None) -> None:
        for run in self.scheduler.take_all():
            run.sink.abandon(error)
        self.jobs.write()


class Claimer:
    """A pass loop's claim: the policy picks the sources, in the writer's thread."""

    def __init__(self, sources: dict[Source, Callable[[], list[Sink]]], policy: Policy, model: str) -> None:
        self.sources, self.policy, self.model = sources, policy, model

    def __call__(self, interactive_only: bool) -> list[Sink]:
        clear_pending_kick(self.model)  # jobs committed from now on send a kick; those before are seen by this claim
        return self.policy.claim(self._take, interactive_only)

    def _take(self, source: Source) -> list[Sink]:
        take = self.sources.get(source)
        return take() if take is not None else []


def drain(scorer: Scorer, owner: str, settings: Settings, should_stop: Callable[[], bool] = lambda: False,
          wake: threading.Event | None = None) -> int:
    """Runs the ready work (jobs, uploaded batches' rounds, reference chunks) until none is left; returns how many
    requests it claimed. A failed database write ends it: the jobs it held are left to their leases (the
    heartbeat stops extending them) and the failure is raised."""
    pace = pace_for(scorer)
    feed = chunk_feed.feed_for(scorer, owner, settings, pace)
    policy = policy_for(scorer, settings, pace, feed)

    def claim_for(book: JobBook) -> Claim:
        jobs = JobSource(owner, settings, book, policy.interactive_above, policy.claim_tokens())
        return Claimer({Source.INTERACTIVE: jobs.claim_interactive, Source.UPLOADS: jobs.claim_round,
                        Source.CHUNKS: feed.take}, policy, settings.worker_model)

    return run_loop(scorer, owner, settings, policy, claim_for, should_stop, wake or threading.Event(), feed.busy,
                    feed.take_closed)


def run_loop(scorer: Scorer, owner: str, settings: Settings, policy: Policy, claim_for: Callable[[JobBook], Claim],
             should_stop: Callable[[], bool], wake: threading.Event, busy: Callable[[], bool] = lambda: False,
             closed: Callable[[], set[str]] = set) -> int:
    """Runs a pass loop whose claim `claim_for(book)` makes (`book`: where its jobs write) until no work is left;
    after an engine fault its requests went back and it runs again. `busy`, `closed`: the chunk feed's (PassLoop)."""
    writer = JobWriter(active_jobs.discard)
    book = JobBook(writer, owner, settings)
    loop = PassLoop(scorer, policy, writer, book, claim_for(book), busy, closed)
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
