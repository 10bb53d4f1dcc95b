"""The pass loop: one engine thread per worker process keeps the device busy with packed passes.

It works like the serving engines' overlap schedulers: pass n+1 is planned, packed and launched while pass n
runs on the device, and only then does the loop wait for pass n's scores. Everything that touches the
database runs in a writer thread behind it (`store.jobqueue.JobWriter`): each pass boundary's writes (the Pass
row, progress, finished results, cancellations, in a few statements) and the claims of the next jobs, which
the loop asks for while it still has work (one round ahead). The device waits for neither.

Continuous batching: claimed jobs join the next pass. Each pass takes the pending items of the running jobs,
interactive before batch and oldest first, with a job's share capped at half a pass while other jobs wait,
so that a long job advances a pass at a time beside new ones instead of holding them back.

Exactly-once effects hold as before: every write keeps the lease condition, so a result written after the
lease was lost (or by a worker killed with writes still queued, whose jobs run again) is not written.
"""

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import numpy as np

from core import InFlightPass, Scorer, ScoringError, TokenizedRequest
from store import jobqueue
from store.broker import clear_pending_kick
from store.jobqueue import Boundary, ClaimedJob, JobWriter, WriterFailed
from store.models import PRIORITY_BATCH
from store.settings import Settings, get_settings
from worker import lake

log = logging.getLogger(__name__)

CLAIM_AHEAD_PASSES = 4
# How long the loop waits, before it plans a pass, for a wake-up's claim still on its way (in the writer's
# queue behind a boundary write, or reading the queue): far less than the pass its job would otherwise miss.
URGENT_CLAIM_WAIT_SECONDS = 1.0
# Batch passes on CPU, in tokens, unless BATCH_ROUND_TOKENS says otherwise. An interactive job waits for the
# batch pass on the engine: on a 2-core AVX2 host a pass of the bundled model took 10 s at 4,096 tokens, 2.3 s
# at 1,024 and 1 s at 512. So batch passes are CPU_BATCH_PASS_TOKENS long while interactive jobs came in the
# last INTERACTIVE_RECENT_SECONDS, twice that otherwise: on an AVX-512 host a backfill alone ran 7-12% faster
# in 1,024-token passes than in 512 (`python -m worker.latency`: README, Performance).
CPU_BATCH_PASS_TOKENS = 512
INTERACTIVE_RECENT_SECONDS = 30.0
# Hosts of one machine type differ 2-3x: on the AVX2-only kind a 1-item call beside a 3,000-item job waited 1.9 s
# (p50) for 1,024-token passes. So on CPU the passes a small call may wait for (interactive ones, and batch ones
# while interactive jobs come) are cut to what this host runs in about CPU_WAIT_SECONDS at the pace its passes
# showed, down to MIN_CPU_PASS_TOKENS (shorter ones cost more in per-pass overhead than they save).
CPU_WAIT_SECONDS = 0.8
MIN_CPU_PASS_TOKENS = 256


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


@dataclass
class RunningJob:
    claimed: ClaimedJob
    request: TokenizedRequest
    order: int  # claim order: oldest first within a priority
    logprobs: np.ndarray = field(init=False)
    pending: list[int] = field(init=False)  # items not yet in a launched pass
    pending_tokens: int = field(init=False)  # their tokens (with the query, which runs once per item first)
    done: int = 0

    def __post_init__(self) -> None:
        self.logprobs = np.full((self.request.n_items, len(self.request.label_token_ids)), np.nan, np.float32)
        self.pending = list(range(self.request.n_items))
        self.pending_tokens = sum(self.item_cost(i) for i in self.pending) + (
            0 if self.request.item_first else len(self.request.query))

    def item_cost(self, i: int) -> int:
        return len(self.request.items[i]) + (len(self.request.query) if self.request.item_first else 0)

    @property
    def job_id(self) -> str:
        return self.claimed.id


@dataclass
class _Launched:
    flight: InFlightPass
    owners: list[tuple[RunningJob, list[int]]]  # per request of the pass: its job and the job's item indices


def tokenized(scorer: Scorer, job: ClaimedJob) -> TokenizedRequest:
    """The request as the API tokenized it at submission; a job queued before tokens were stored (or for
    another model) is tokenized from its text here. A chunk's request comes tokenized by the chunk feed."""
    if (request := lake.request_of(job)) is not None:
        return request
    if job.tokens is not None and job.model == scorer.model_name:
        return scorer.requests.check_stored(job.tokens)  # this worker's limits may differ from the API's
    r = job.request
    return scorer.tokenize(r["query"], r["items"], r["label_token_ids"], r["item_first"])


class PassLoop:
    """Runs claimed jobs in packed passes until none is left or it is told to stop (see the module's doc)."""

    def __init__(self, scorer: Scorer, owner: str, settings: Settings, writer: JobWriter,
                 claim: Callable[[bool], list[ClaimedJob]], busy: Callable[[], bool] = lambda: False) -> None:
        """`claim(interactive_only)` leases the next jobs (called in the writer's thread); `busy()`: whether a
        claim that found nothing may still find work soon (the chunk feed is reading a chunk)."""
        self.scorer, self.owner, self.settings, self.writer = scorer, owner, settings, writer
        self._claim = claim
        self._busy = busy
        self.running: list[RunningJob] = []
        self._order = 0
        self.claimed_total = 0
        self._urgent: list[Future] = []  # claims made for wake-ups (see WakeUp)
        self._urgent_lock = threading.Lock()
        self._urgent_busy = False  # a wake-up's claim is queued or running in the writer
        self._claim_again = False  # a wake-up came while it ran: it may have read the queue before that job
        self._interactive_at = float("-inf")  # when an interactive job was last admitted (monotonic)
        self._seconds_per_token: float | None = None  # the recent passes' pace (CPU: see CPU_WAIT_SECONDS)
        self._timed_shapes: set[tuple] = set()

    def _claim_now(self) -> None:
        with self._urgent_lock:
            if self._urgent_busy:
                self._claim_again = True  # the claim on its way claims once more before it returns
                return
            try:
                self._urgent.append(self.writer.submit(self._urgent_claim, urgent=True))
                self._urgent_busy = True
            except WriterFailed:
                pass

    def _urgent_claim(self) -> list[tuple[ClaimedJob, TokenizedRequest | ScoringError]]:
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

    def _claim_requests(self, interactive_only: bool) -> list[tuple[ClaimedJob, TokenizedRequest | ScoringError]]:
        """Claims (in the writer's thread) and decodes the requests there too, off the pass loop's thread."""
        claimed = []
        for job in self._claim(interactive_only):
            try:
                claimed.append((job, tokenized(self.scorer, job)))
            except ScoringError as exc:  # limits changed since the API accepted it
                claimed.append((job, exc))
        return claimed

    def _admit(self, claimed: list[tuple[ClaimedJob, TokenizedRequest | ScoringError]]) -> None:
        self.claimed_total += len(claimed)
        active_jobs.add(job.id for job, _ in claimed if not lake.handles(job))
        for job, request in claimed:
            if isinstance(request, ScoringError):
                self.writer.fail(self.owner, job, (request.code, request.message))
                continue
            run = RunningJob(job, request, self._order)
            if job.priority > PRIORITY_BATCH:
                self._interactive_at = time.monotonic()
            self._order += 1
            if request.n_items == 0:
                self.writer.finish(self.owner, job, run.logprobs)
                continue
            self.running.append(run)

    def _pending_tokens(self) -> int:
        return sum(r.pending_tokens for r in self.running)

    def _window(self) -> tuple[list[tuple[RunningJob, list[int]]], set[tuple[int, ...]]]:
        """The pending items the next pass is planned from, up to a pass of tokens: interactive jobs before
        batch ones, oldest first, each taking what the jobs after it would leave, but at least half the pass
        (batch requests: as much as is left). So a job that arrives while a long one runs joins the next pass, and two long jobs share passes. A job
        whose items span passes starts only when the prefix cache can keep its query beside those of the jobs
        under way (or first in the pass). Also returns the queries the jobs under way will still need."""
        waiting = sorted((r for r in self.running if r.pending), key=lambda r: (-r.claimed.priority, r.order))
        batch = bool(waiting) and waiting[0].claimed.priority <= PRIORITY_BATCH
        if not batch:
            # The interactive lane goes before batch rounds: batch requests wait while interactive jobs run.
            waiting = [r for r in waiting if r.claimed.priority > PRIORITY_BATCH]
        remaining = self._pass_budget(waiting)
        wanted_after = [0] * (len(waiting) + 1)  # what the jobs after each one would take
        for k in range(len(waiting) - 1, -1, -1):
            wanted_after[k] = min(remaining, wanted_after[k + 1] + waiting[k].pending_tokens)
        # The queries of the jobs under way (some items run, some not), which their next items run against.
        under_way: dict[tuple[int, ...], set[str]] = {}
        for run in self.running:
            if run.pending and len(run.pending) < run.request.n_items and not run.request.item_first:
                under_way.setdefault(run.request.query, set()).add(run.job_id)
        window, queries = [], set()
        for k, run in enumerate(waiting):
            if remaining <= 0:
                break
            req = run.request
            # Batch requests fill the pass in order instead: shared out, a batch pass of 512 tokens held parts of
            # five lines (each reading its query from the prefix cache) and ran a quarter fewer tokens/s on CPU.
            cap = remaining if batch else max(remaining - wanted_after[k + 1], remaining // 2)
            shared = req.item_first or req.query in queries or self.scorer.is_cached(req.query)
            used, taken = 0 if shared else len(req.query), []
            for i in run.pending:
                cost = run.item_cost(i)
                if taken and used + cost > cap:
                    break
                taken.append(i)
                used += cost
            if window and used > remaining:
                continue
            if not req.item_first:
                if len(taken) == len(run.pending):  # done in this pass: its query is not needed after it
                    jobs = under_way.get(req.query, set())
                    jobs.discard(run.job_id)
                    if not jobs:
                        under_way.pop(req.query, None)
                elif window and req.query not in under_way and not self._cache_keeps([*under_way, req.query]):
                    # Started now, the job would find its query evicted by the time its next items run (and
                    # compute it again, maybe every pass): it starts when a job under way is done.
                    continue
                else:
                    under_way.setdefault(req.query, set()).add(run.job_id)
            queries.add(req.query)
            window.append((run, taken))
            remaining -= used
        return window, set(under_way)

    def _cache_keeps(self, queries: list[tuple[int, ...]]) -> bool:
        """Whether the prefix cache holds all these queries at once (one always goes in, however long)."""
        needs = sum(self.scorer.prefix_bytes(len(query)) for query in queries)
        return len(queries) <= 1 or needs <= self.scorer.prefix_cache_bytes

    def _pass_budget(self, waiting: list[RunningJob]) -> int:
        """A pass's tokens: a full pass; or while jobs that have not run yet wait (a /v1/score call holds a
        connection open for its job), the shortest pass length that holds them, older jobs filling the rest:
        they are answered after a short pass instead of a full one. A backlog still fills whole passes. On CPU
        interactive passes are at most 2 x CPU_BATCH_PASS_TOKENS long, not full ones: a small call that comes
        while a job of many passes runs (or with it, in its first pass) waits for one such pass (0.7 s on the
        bundled model), not a full one (3 s)."""
        if waiting and waiting[0].claimed.priority <= PRIORITY_BATCH:
            recently = time.monotonic() - self._interactive_at < INTERACTIVE_RECENT_SECONDS
            tokens = batch_pass_tokens(self.scorer, self.settings, recently)
            return self._within_wait(tokens) if recently and self.settings.batch_round_tokens is None else tokens
        longest = self.scorer.pass_tokens if self.scorer.launches_ahead else self._within_wait(
            min(2 * CPU_BATCH_PASS_TOKENS, self.scorer.pass_tokens))
        fresh = sum(r.pending_tokens for r in waiting
                    if r.claimed.priority > PRIORITY_BATCH and len(r.pending) == r.request.n_items)
        lengths = self.scorer.pass_lengths
        return min(next((n for n in lengths if n >= fresh), lengths[-1]), longest) if fresh else longest

    def _within_wait(self, tokens: int) -> int:
        """On CPU, the longest pass length up to `tokens` that runs within CPU_WAIT_SECONDS at the recent pace
        (at least MIN_CPU_PASS_TOKENS); `tokens` until a pass was timed, and on accelerators."""
        pace = self._seconds_per_token
        if self.scorer.launches_ahead or pace is None:
            return tokens
        fits = [n for n in self.scorer.pass_lengths if MIN_CPU_PASS_TOKENS <= n <= tokens and n * pace <= CPU_WAIT_SECONDS]
        return max(fits, default=min(tokens, MIN_CPU_PASS_TOKENS))

    def _launch_next(self) -> _Launched | None:
        window, needed = self._window()
        if not window:
            return None
        views = [TokenizedRequest(run.request.query, tuple(run.request.items[i] for i in taken),
                                  run.request.label_token_ids, run.request.item_first) for run, taken in window]
        plan = self.scorer.plan_pass(views)
        in_pass: dict[int, set[int]] = {}
        for seq in plan.sequences:
            for r, i, *_ in seq.items:
                in_pass.setdefault(r, set()).add(i)
            for r, i in seq.scored_at_prefix_end:
                in_pass.setdefault(r, set()).add(i)
        for r, (run, taken) in enumerate(window):
            chosen = {taken[i] for i in in_pass.get(r, ())}
            if chosen and len(chosen) == len(run.pending) and not run.request.item_first:
                run.pending_tokens = 0
            else:
                run.pending_tokens -= sum(run.item_cost(i) for i in chosen)
            run.pending = [i for i in run.pending if i not in chosen]
        return _Launched(self.scorer.launch(views, plan, needed), [(run, taken) for run, taken in window])

    def _collect(self, launched: _Launched) -> None:
        """Waits for a launched pass, keeps its scores and queues its boundary writes."""
        result = launched.flight.result()
        lake.record_pass(result.tokens, result.seconds)
        # A shape's first pass may have compiled its program; short passes are mostly per-pass overhead.
        if result.shape_key in self._timed_shapes and result.tokens >= MIN_CPU_PASS_TOKENS:
            pace = result.seconds / result.tokens
            self._seconds_per_token = pace if self._seconds_per_token is None else \
                0.7 * self._seconds_per_token + 0.3 * pace
        self._timed_shapes.add(result.shape_key)
        touched: dict[str, RunningJob] = {}
        for part in result.scores:
            run, taken = launched.owners[part.request]
            items = np.asarray(taken)[part.items]
            run.logprobs[items] = part.logprobs
            run.done += len(items)
            touched[run.job_id] = run
        finished = [r for r in touched.values() if r.done == r.request.n_items]
        for run in touched.values():
            if run.done < run.request.n_items:
                lake.advance(run.claimed, run.done)  # a chunk's progress moves within its requests
        self.running = [r for r in self.running if r.done < r.request.n_items]
        # A chunk's requests report to their chunk (which commits its object), not to the jobs table.
        finished = [r for r in finished if not lake.finish(r.claimed, r.logprobs)]
        touched = {job_id: r for job_id, r in touched.items() if not lake.handles(r.claimed)}
        self.writer.boundary(Boundary(
            owner=self.owner, n_items=sum(len(p.items) for p in result.scores), tokens=result.tokens,
            padded_tokens=result.padded_tokens, seconds=result.seconds,
            progress=[(r.job_id, r.done) for r in touched.values() if r.done < r.request.n_items],
            finished=[(r.claimed, r.logprobs) for r in finished],
            open_ids=[r.job_id for r in self.running if not lake.handles(r.claimed)]),
            {r.job_id: r.claimed.batch_id for r in [*finished, *self.running]
             if r.claimed.batch_id and not lake.handles(r.claimed)})

    def _drop_closed(self) -> None:
        """Drops the jobs the writer found cancelled or no longer ours (their items still in flight are
        discarded when their pass ends)."""
        closed = self.writer.take_closed()
        if closed:
            self.running = [r for r in self.running if r.job_id not in closed]

    # ---- the loop ---------------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool], wake: threading.Event) -> None:
        """Until no job is left (or `should_stop`): claims ahead, launches pass n+1, then collects pass n.
        `wake` set (a new job was queued) makes it claim again. On stop, the pass in flight is finished and
        written; every other held job goes back to the queue."""
        inflight: _Launched | None = None
        claiming = None  # the claim the writer is running for us
        claiming_all = False  # whether it may take batch requests too
        exhausted = False  # the last claim that could take any job found none
        if isinstance(wake, WakeUp):
            wake.listener = self._claim_now
        try:
            while True:
                self._drop_closed()
                # An interactive job claimed while the last pass ran goes into the next one: its claim is
                # waited for here (bounded), before the pass is planned.
                self._admit_urgent(URGENT_CLAIM_WAIT_SECONDS)
                if claiming is not None and (claiming.done() or (not self.running and inflight is None)):
                    jobs = claiming.result()
                    claiming = None
                    # An interactive-only claim that finds nothing says nothing of the batch lane: taken as "no
                    # work left", it ended the loop with batch requests queued (the sweeper restarted it later).
                    exhausted = not jobs and not self._busy() if claiming_all else exhausted and not jobs
                    self._admit(jobs)
                if should_stop():
                    break
                # Claims run ahead by a few passes: a claim and its decoding take longer than a pass on an
                # accelerator, and the device must not run dry meanwhile. Batch passes, not full ones: held
                # work runs first, so a chunk (or another batch's round) claimed after 16 full passes' worth of
                # 1,024-token batch passes waited all of them (a reference batch 82 s behind an upload).
                short = self._pending_tokens() < CLAIM_AHEAD_PASSES * batch_pass_tokens(self.scorer, self.settings)
                if claiming is None and (wake.is_set() or (short and not exhausted)):
                    wake.clear()
                    # With work in hand, or interactive jobs running (batch rounds wait for them, claims
                    # included), claim interactive jobs only.
                    interactive_only = not short or any(r.claimed.priority > PRIORITY_BATCH for r in self.running)
                    claiming_all = not interactive_only
                    claiming = self.writer.submit(lambda: self._claim_requests(interactive_only))
                launched = self._launch_next()
                if inflight is not None:
                    self._collect(inflight)
                inflight = launched
                if inflight is not None and not self.scorer.launches_ahead:
                    self._collect(inflight)  # before the next claim: a job that came meanwhile joins the next pass
                    inflight = None
                if inflight is None and self.running and not any(r.pending for r in self.running):
                    self._fail_unscored()
                if inflight is None and not self.running and claiming is None and exhausted:
                    break  # a wake-up's claim still on its way is handed back below (the wake-up drains again)
        except WriterFailed:
            raise
        except Exception as exc:
            log.exception("the pass loop failed; handing its jobs back")
            self._hand_back(None, claiming, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if isinstance(wake, WakeUp):
                wake.listener = None
        self._hand_back(inflight, claiming, None)

    def _fail_unscored(self) -> None:
        """Jobs with nothing left to launch and nothing in flight, yet not every item scored: an engine bug,
        not the user's fault."""
        for run in self.running:
            if not lake.abandon(run.claimed, "the engine did not score every item"):
                self.writer.fail(self.owner, run.claimed, ("internal_error", "the engine did not score every item"))
        self.running = []

    def _hand_back(self, inflight: _Launched | None, claiming, error: str | None) -> None:  # type: ignore[no-untyped-def]
        """Finishes the pass in flight and hands every other held job back to the queue: after `error` the
        attempt counts (the job fails after max_attempts); when the worker stops (None), it does not."""
        try:
            if inflight is not None:
                self._collect(inflight)
            if claiming is not None:
                self._admit(claiming.result())
            for claim in self._urgent:
                self._admit(claim.result())
            self._urgent = []
        except Exception:
            log.exception("the pass loop could not finish its last pass")
        held = [r for r in self.running if not lake.abandon(r.claimed, error)]
        self.running = []
        if held:
            try:
                self.writer.release(self.owner, self.settings, [r.job_id for r in held], error,
                                    {r.claimed.batch_id for r in held if r.claimed.batch_id})
            except WriterFailed:
                pass  # their leases expire


def batch_pass_tokens(scorer: Scorer, settings: Settings, interactive_recently: bool = False) -> int:
    """Tokens of a batch pass, and of a batch claim's round: BATCH_ROUND_TOKENS; unset, a full pass on an
    accelerator, on CPU CPU_BATCH_PASS_TOKENS after recent interactive jobs and twice that otherwise (at most a
    pass either way). A shorter batch pass is a shorter wait for an interactive job arriving during a
    backfill, which waits for the batch pass on the engine."""
    default = scorer.pass_tokens if scorer.launches_ahead else CPU_BATCH_PASS_TOKENS * (
        1 if interactive_recently else 2)
    return min(settings.batch_round_tokens or default, scorer.pass_tokens)


class Claimer:
    """A pass loop's claims (`claim(interactive_only)`). In the batch lane, uploaded batches and reference
    batches take turns: a chunk, then uploaded batches' rounds for as long as that chunk took (at most
    BATCH_CHUNK_SECONDS), then the next chunk, and so on; either kind alone runs without waiting. Within a
    kind, tenants and batches take turns (store.jobqueue for rounds, store.lake.chunks for chunks)."""

    def __init__(self, owner: str, settings: Settings, round_tokens: int, feed: lake.ChunkFeed | None = None) -> None:
        self.owner, self.settings, self.round_tokens, self.feed = owner, settings, round_tokens, feed
        # When a chunk is due (monotonic); None: after a chunk, until the uploads' turn begins (at the first
        # round claimed once that chunk is done: the turn lasts as long as the chunk took).
        self._chunk_due_at: float | None = 0.0
        self._chunk_taken_at = 0.0

    def _uploads_turn(self) -> float:
        last = self.feed.last_chunk_seconds if self.feed else None
        return min(last, self.settings.batch_chunk_seconds) if last is not None else self.settings.batch_chunk_seconds

    def __call__(self, interactive_only: bool) -> list[ClaimedJob]:
        settings = self.settings
        clear_pending_kick(settings.worker_model)  # jobs committed from now on send a kick; those before are seen by this claim
        if interactive_only:
            return jobqueue.claim_interactive(self.owner, settings)
        if (jobs := jobqueue.claim_interactive(self.owner, settings)):
            return jobs
        now = time.monotonic()
        due = self.feed is not None and self._chunk_due_at is not None and now >= self._chunk_due_at
        if due and (chunk := self.feed.take()):
            self._chunk_due_at, self._chunk_taken_at = None, now
            return chunk
        if jobs := jobqueue.claim_batch_round(self.owner, settings, self.round_tokens):
            # The uploads' turn begins once the chunk taken is done (begun at its take, the turn had no chunk time
            # to go by and took BATCH_CHUNK_SECONDS). A chunk due but not there (being read, or none waiting) stays
            # due: the next claim looks again (a new turn here left a batch submitted behind an upload a whole
            # BATCH_CHUNK_SECONDS behind it: 82 s against 15 s alone).
            if self._chunk_due_at is None and self.feed.last_chunk_done_at >= self._chunk_taken_at:
                self._chunk_due_at = now + self._uploads_turn()
            return jobs
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
    feed = lake.feed_for(scorer, owner, settings, round_tokens)
    claim = Claimer(owner, settings, claim_tokens, feed)
    return _run_loop(scorer, owner, settings, claim, should_stop, wake or threading.Event(), feed.busy)


def run_jobs(scorer: Scorer, owner: str, jobs: list[ClaimedJob]) -> None:
    """Runs these claimed jobs (and claims nothing else)."""
    given = [jobs]
    _run_loop(scorer, owner, get_settings(), lambda _: given.pop() if given else [], lambda: False,
              threading.Event())


def _run_loop(scorer: Scorer, owner: str, settings: Settings, claim: Callable[[bool], list[ClaimedJob]],
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
    jobqueue.heartbeat(owner, model, settings, active_jobs.snapshot(), attention, state, warmup)
