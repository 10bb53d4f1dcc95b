"""The chunk feed: reference batches as a source of the pass loop (worker/drain.py), beside jobs (worker/jobs.py).

Off the device's path, in threads of its own:
- the reader claims a chunk (store.lake.chunks), reads it from storage and tokenizes it, one chunk ahead of
  what the pass loop has taken. A chunk longer than the policy's piece (worker/policy.py chunk_piece_tokens: on
  a CPU worker, BATCH_CHUNK_SECONDS at the pace the pass loop measures) is cut into pieces that long, at request
  boundaries; the worker keeps the first and the others become chunks of their own (store.lake.chunks.split_chunk);
- the pass loop takes a chunk's requests (`take`) when the policy says it is the reference batches' turn, and
  reports each request's log-probabilities back, and its items done after each pass.
  A chunk read ahead whose batch is not next in turn (another reference batch's chunk waits that started
  less recently, or the batch was cancelled) goes back instead of being started;
- the committer writes a finished chunk's results as one object and commits it under the lease
  (store.lake.chunks.commit_chunk); an object whose commit finds the lease lost is removed;
- the keeper extends the leases of the chunks held and writes the progress of those running (no statement
  while none is held); a chunk read ahead that waited READY_TURNS chunk lengths goes back.
The worker's maintenance round (worker/tasks.py) calls `sweep`: chunks of dead workers are queued again (or
cancelled, their batch cancelled) and batches that are over are settled. A stopping worker calls
`close_feeds`: chunks read and not taken go back.
"""

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from core import Scorer, TokenizedRequest
from store.broker import kick_drain
from store.lake import chunks
from store.lake.tables import (ChunkRows, InputError, chunk_requests, cut_positions, read_input, result_table,
                               write_table)
from store.priorities import PRIORITY_BATCH
from store.settings import Settings
from worker.policy import Pace, chunk_piece_tokens

log = logging.getLogger(__name__)

# How long a failed object write is retried (the store down for a while) before the chunk is handed back.
WRITE_RETRY_SECONDS = 60.0
# How long the pass loop's claim waits for a chunk being read (it has nothing else to take).
TAKE_WAIT_SECONDS = 0.2
# A stopping worker waits this long at most for the chunk being read and the commits queued (`serve` gives
# the whole worker 8 s); a chunk still held after that runs again once its lease expires.
STOP_SECONDS = 4.0
LOG_EVERY_CHUNKS = 20
# A last piece shorter than this share of a piece stays with the one before it.
MIN_PIECE_SHARE = 0.25
# A chunk read ahead that waited this many chunk lengths (BATCH_CHUNK_SECONDS; at least a lease) without
# starting goes back.
READY_TURNS = 2
# The reader claims no chunk while this many finished chunks wait for the committer.
MAX_UNCOMMITTED = 2


def request_cost(request: TokenizedRequest) -> int:
    """A request's tokens as its passes compute them (the query once, or once per item when items go first)."""
    items = sum(len(item) for item in request.items)
    return items + len(request.query) * (request.n_items if request.item_first else 1)


@dataclass(eq=False)
class ChunkRequest:
    """A request of a chunk, as the pass loop holds it (worker/scheduler.py Sink): it has no job row, its
    results go to its chunk (`work`), which commits them as one object."""

    id: str
    work: "ChunkWork"
    k: int  # its index among the chunk's requests
    tokenized: TokenizedRequest
    priority: int = PRIORITY_BATCH

    def request_for(self, scorer: Scorer) -> TokenizedRequest:
        return self.tokenized  # the reader tokenized it

    # A chunk's results are one object, written whole: a chunk handed back is read and scored again.
    kept = None

    def start(self) -> None:
        pass  # its chunk is held by the feed from its take (its lease kept by the keeper)

    def advance(self, done: int, items: np.ndarray, logprobs: np.ndarray) -> None:
        self.work.advance(self.k, done)

    def finish(self, logprobs: np.ndarray) -> None:
        self.work.done(self.k, logprobs)

    def fail(self, error: tuple[str, str]) -> None:
        self.work.abandon(error[1])

    def abandon(self, error: str | None) -> None:
        self.work.abandon(error)


@dataclass(eq=False)
class ChunkWork:
    chunk: chunks.ClaimedChunk
    rows: ChunkRows | None
    feed: "ChunkFeed"
    logprobs: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0
    over: bool = False  # committed or handed back: late reports are dropped
    input_error: InputError | None = None
    # Progress (the pass loop's thread writes, the keeper reads): rows and items of the requests done, and items
    # done of those under way (a pair table's item is a row).
    rows_scored: int = 0
    items_scored: int = 0
    partial: dict[int, int] = field(default_factory=dict)
    items_partial: int = 0
    taken_at: float = 0.0
    read_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.rows is not None:
            self.logprobs = [None] * len(self.rows.requests)
            self.left = len(self.rows.requests)

    def done(self, k: int, logprobs: np.ndarray) -> None:
        """Request k's scores (from the pass loop's thread)."""
        if self.over or self.logprobs[k] is not None:
            return
        self.logprobs[k] = logprobs
        covered, request, _ = self.rows.requests[k]
        self.items_partial -= self.partial.pop(k, 0)
        self.rows_scored += len(covered)
        self.items_scored += request.n_items
        self.left -= 1
        if self.left == 0:
            self.over = True
            self.feed.complete(self)

    def advance(self, k: int, items: int) -> None:
        """Request k has `items` items scored (after a pass; from the pass loop's thread)."""
        if not self.over and self.logprobs[k] is None:
            self.items_partial += items - self.partial.get(k, 0)
            self.partial[k] = items

    def progress(self) -> chunks.ChunkProgress:
        rows = self.rows
        under_way = self.items_partial if rows.pair_table else 0
        return chunks.ChunkProgress(rows_done=len(rows.errors) + self.rows_scored + under_way,
                                    rows_failed=len(rows.errors), items_done=self.items_scored + self.items_partial,
                                    rows_total=rows.n_rows)

    def request_id(self, k: int) -> str:
        """Request k's id in the pass loop (with the attempt: a chunk claimed again is other requests)."""
        chunk = self.chunk
        return f"{chunk.batch_id}:{chunk.index}:{chunk.attempt}:{k}"

    def open_ids(self) -> set[str]:
        """The ids of the requests not done yet."""
        return {self.request_id(k) for k, lp in enumerate(self.logprobs) if lp is None}

    def abandon(self, error: str | None) -> None:
        """The pass loop gave up on the chunk's requests: it is handed back (the attempt counts after an error)."""
        if not self.over:
            self.over = True
            self.feed.hand_back(self, error)


class ChunkFeed:
    def __init__(self, scorer: Scorer, owner: str, settings: Settings, pace: Pace | None = None) -> None:
        """`pace`: the engine's, which the pass loop records (chunks are cut to it)."""
        self.scorer, self.owner, self.settings = scorer, owner, settings
        self.pace = pace or Pace()
        self._ready: deque[ChunkWork] = deque()
        self._held: dict[tuple[str, int], chunks.ClaimedChunk] = {}
        self._running: dict[tuple[str, int], ChunkWork] = {}  # taken by the pass loop: their progress is written
        self._closed: set[str] = set()  # requests of chunks lost since the pass loop last asked (take_closed)
        self.last_chunk_seconds: float | None = None  # from take to the last request's scores
        self.last_chunk_done_at = float("-inf")  # when a chunk taken was last done or handed back (monotonic)
        self._changed = threading.Condition()
        self._want = threading.Event()
        self._reading = False
        self._stop = threading.Event()
        self._commits: queue.Queue[ChunkWork | None] = queue.Queue()
        # CPU seconds of this feed's threads, and what they did (logged every LOG_EVERY_CHUNKS chunks).
        self.stats = {"chunks": 0, "rows": 0, "read_cpu_s": 0.0, "tokenize_cpu_s": 0.0, "write_cpu_s": 0.0}
        loops = ((self._read_loop, "chunk-reader"), (self._commit_loop, "chunk-committer"),
                 (self._keep_loop, "chunk-keeper"))
        self._threads = [threading.Thread(target=target, name=name, daemon=True) for target, name in loops]
        for thread in self._threads:
            thread.start()

    # ---- the pass loop's side ---------------------------------------------------------------------------

    def take(self) -> list[ChunkRequest]:
        """The requests of the next chunk read, if one is (waiting a little for one being read) and its batch's
        turn is now (else it goes back, and the reader reads the one whose turn it is); asks the reader for
        the one after it."""
        self._want.set()
        with self._changed:
            # The reader clears `_want` when it finds no chunk: then there is none to wait for.
            self._changed.wait_for(lambda: self._ready or not (self._reading or self._want.is_set()),
                                   TAKE_WAIT_SECONDS)
            if not self._ready:
                return []
            work = self._ready.popleft()
        self._want.set()
        chunk = work.chunk
        try:
            turn = chunks.take_turn(chunk, self.settings)
        except Exception:
            work.abandon(None)
            raise
        if not turn:
            work.abandon(None)
            return []
        work.taken_at = time.monotonic()
        with self._changed:
            self._running[chunk.key] = work
        return [ChunkRequest(work.request_id(k), work, k, request)
                for k, (_, request, _) in enumerate(work.rows.requests)]

    def take_closed(self) -> set[str]:
        """The requests of the chunks no longer this worker's since the last call (their batch was cancelled, or
        the lease lapsed): the pass loop drops them."""
        with self._changed:
            closed, self._closed = self._closed, set()
        return closed

    def busy(self) -> bool:
        """Whether a chunk is being read or waits to be taken (the pass loop does not end meanwhile)."""
        with self._changed:
            return bool(self._ready) or self._reading or self._want.is_set()

    # ---- reading ----------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            if not self._want.wait(1.0) or self._stop.is_set():
                continue
            with self._changed:
                if self._ready:  # one chunk ahead is enough
                    self._want.clear()
                    self._changed.notify_all()
                    continue
                if self._commits.qsize() >= MAX_UNCOMMITTED:
                    # Chunks wait to be committed (the store is slow): the next is read when they are, not
                    # claimed to wait too. Still wanted meanwhile, so the pass loop does not end.
                    self._changed.wait(TAKE_WAIT_SECONDS)
                    continue
                self._reading = True
            try:
                work = self._read_next()
            except Exception:  # noqa: BLE001  (the database is down: try again later)
                log.exception("claiming a chunk failed")
                work = None
                time.sleep(1.0)
            with self._changed:
                self._reading = False
                if work is not None:
                    self._ready.append(work)
                else:
                    self._want.clear()
                self._changed.notify_all()
            del work  # the pass loop holds it now (see _keep)

    def _read_next(self) -> ChunkWork | None:
        chunk = chunks.claim_chunk(self.owner, self.settings)
        if chunk is None:
            return None
        with self._changed:
            self._held[chunk.key] = chunk
        started = time.thread_time()
        try:
            data = read_input(chunk.input, chunk.part, chunk.start, chunk.stop, chunk.options, chunk.input_version)
            read = time.thread_time()
            self.stats["read_cpu_s"] += read - started
            rows = chunk_requests(data, chunk.options, self.scorer.requests)
            self.stats["tokenize_cpu_s"] += time.thread_time() - read
        except InputError as exc:
            self._commits.put(ChunkWork(chunk, None, self, over=True, input_error=exc))
            return None
        except Exception as exc:  # noqa: BLE001  (the store unreachable, say: the chunk runs again later)
            log.warning("reading chunk %s/%s failed: %s", chunk.batch_id, chunk.index, exc)
            self._release(chunk, f"{type(exc).__name__}: {exc}")
            return None
        if (piece := chunk_piece_tokens(self.scorer, self.settings, self.pace)) is not None:
            try:
                fitted = self._fit(chunk, data, rows, *piece)
            except Exception as exc:  # noqa: BLE001  (the database or the store: the chunk runs again later)
                log.warning("cutting chunk %s/%s failed: %s", chunk.batch_id, chunk.index, exc)
                self._release(chunk, f"{type(exc).__name__}: {exc}")
                return None
            if fitted is None:
                return None
            chunk, rows = fitted
        work = ChunkWork(chunk, rows, self)
        for k, (_, request, _) in enumerate(rows.requests):  # an empty items list is done as it is
            if request.n_items == 0:
                work.done(k, np.zeros((0, len(request.label_token_ids)), np.float32))
        if not work.left and not work.over:  # nothing to score (no line starts in its range, every row failed)
            work.over = True
            self.complete(work)
        if work.over:
            return None
        return work

    def _fit(self, chunk: chunks.ClaimedChunk, data, rows: ChunkRows, budget: float,  # type: ignore[no-untyped-def]
             measured: bool) -> tuple[chunks.ClaimedChunk, ChunkRows] | None:
        """Cuts a chunk longer than `budget` tokens (Parquet rows, or plain JSONL lines: CSV and compressed JSONL
        chunks run whole); returns the piece to run, or None if the chunk went back (its batch was cancelled
        meanwhile). `measured`: whether the budget comes from this worker's pace, else only the first piece is
        cut off."""
        costs = [request_cost(request) for _, request, _ in rows.requests]
        cut_rows, used = [], 0
        for (covered, _, _), cost in zip(rows.requests, costs):
            if used and used + cost > budget:
                cut_rows.append(covered[0])
                used = 0
                if not measured:  # the rest is cut once this worker knows its pace
                    used = -float("inf")
            used += cost
        if cut_rows and measured and used < MIN_PIECE_SHARE * budget:
            cut_rows.pop()
        if not cut_rows:
            return chunk, rows
        positions = cut_positions(chunk.input, chunk.part, chunk.start, chunk.options, data, cut_rows)
        if positions is None:
            return chunk, rows
        bounds = [*cut_rows, rows.n_rows]
        piece = chunks.split_chunk(self.owner, chunk, [(at, bounds[k + 1] - bounds[k]) for k, at in
                                                       enumerate(positions)], cut_rows[0])
        if piece is None:
            self._release(chunk, None)
            return None
        log.info("chunk %s/%s cut into %d pieces of about %.0f tokens", chunk.batch_id, chunk.index,
                 len(cut_rows) + 1, budget)
        with self._changed:
            self._held[piece.key] = piece
        return piece, rows.first(cut_rows[0])

    # ---- committing -------------------------------------------------------------------------------------

    def complete(self, work: ChunkWork) -> None:
        self.last_chunk_done_at = time.monotonic()
        if work.taken_at:
            self.last_chunk_seconds = self.last_chunk_done_at - work.taken_at
        self._commits.put(work)

    def hand_back(self, work: ChunkWork, error: str | None) -> None:
        if work.taken_at:
            self.last_chunk_done_at = time.monotonic()
        self._commits.put(ChunkWork(work.chunk, None, self, over=True,
                                    input_error=None if error is None else InputError("", error)))
        # (a ChunkWork with no rows and an InputError with no code: handed back, see _commit)

    def _commit_loop(self) -> None:
        while (work := self._commits.get()) is not None:
            try:
                self._commit(work)
            except Exception:  # noqa: BLE001  (the database is down: the lease expires and the chunk runs again)
                log.exception("committing chunk %s/%s failed", work.chunk.batch_id, work.chunk.index)
                with self._changed:
                    self._held.pop(work.chunk.key, None)
            del work  # not held while waiting for the next (see _keep)

    def _commit(self, work: ChunkWork) -> None:
        chunk = work.chunk
        if work.rows is None:
            error = work.input_error
            if error is not None and error.code:
                chunks.commit_chunk(self.owner, chunk, 0, 0, 0, (error.code, error.message))
            else:
                self._release(chunk, error.message if error is not None else None)
                return
        else:
            started = time.thread_time()
            table = result_table(work.rows, work.logprobs, chunk.options)
            failure = self._write(chunk, table)
            if failure == "":
                self._release(chunk, "the result object could not be written")
                return
            self.stats["write_cpu_s"] += time.thread_time() - started
            if failure is None:
                self._commit_object(work)
            else:  # the output refuses it for good: the chunk fails now, and its batch with it (chunks.settle)
                chunks.commit_chunk(self.owner, chunk, 0, 0, 0, failure)
        self.stats["chunks"] += 1
        if self.stats["chunks"] % LOG_EVERY_CHUNKS == 0:
            log.info("chunk feed: %s", json.dumps({k: round(v, 2) for k, v in self.stats.items()}))
        with self._changed:
            self._held.pop(chunk.key, None)
            self._running.pop(chunk.key, None)
            self._changed.notify_all()
        chunks.settle(chunk.batch_id)

    def _commit_object(self, work: ChunkWork) -> None:
        chunk, rows = work.chunk, work.rows
        self.stats["rows"] += rows.n_rows
        if chunks.commit_chunk(self.owner, chunk, rows.n_rows, len(rows.errors) + sum(
                len(covered) for (covered, _, _), lp in zip(rows.requests, work.logprobs) if lp is None), rows.items):
            chunks.remove_lost_attempts(chunk)
        else:
            log.warning("chunk %s/%s is no longer leased to %s; removing its object", chunk.batch_id, chunk.index,
                        self.owner)
            chunk.object.fs.rm(chunk.object.path)

    def _write(self, chunk: chunks.ClaimedChunk, table) -> tuple[str, str] | str | None:  # type: ignore[no-untyped-def]
        """Writes the chunk's object, retrying while the store is unreachable. None once written; "" if the store
        stayed unreachable; the chunk's error if the output refuses it for good (`chunks.write_refused`: a full
        disk, denied credentials: waiting would only hold the chunk's lease, the commit queue and the batch). A
        write that failed leaves no part of the object behind."""
        deadline = time.monotonic() + WRITE_RETRY_SECONDS
        wait = 0.5
        while True:
            try:
                write_table(chunk.object, table, chunk.options.output_format)
                return None
            except Exception as exc:  # noqa: BLE001  (the store unreachable: try again)
                refused = chunks.write_refused(chunk.object, exc)
                if refused or time.monotonic() > deadline or self._stop.is_set():
                    # str: a record that keeps the exception keeps its frames, and the chunk's rows with them
                    log.warning("writing %s failed: %s", chunk.object.uri, str(exc))
                    chunks.remove_object(chunk.object)
                    return refused or ""
                time.sleep(wait)
                wait = min(wait * 2, 5.0)

    def _release(self, chunk: chunks.ClaimedChunk, error: str | None) -> None:
        with self._changed:
            self._held.pop(chunk.key, None)
            self._running.pop(chunk.key, None)
            self._changed.notify_all()
        try:
            chunks.release_chunk(self.owner, self.settings, chunk, error)
            chunks.settle(chunk.batch_id)  # a cancelled batch's chunk that went back may have been its last
        except Exception:  # noqa: BLE001  (its lease expires)
            log.exception("handing chunk %s/%s back failed", chunk.batch_id, chunk.index)

    # ---- leases ------------------------------------------------------------------------------------------

    def _keep_loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_seconds):
            try:
                self._keep()
            except Exception as exc:  # noqa: BLE001  (the database is down: keep trying)
                log.warning("the chunk keeper failed: %s: %s", type(exc).__name__, str(exc).splitlines()[0])

    def _keep(self) -> None:
        """Extends the leases of the chunks held, and hands back those read and not started soon. A method of
        its own so that its locals end with each round: bound in the loop's frame, the last chunk's ChunkWork (its
        rows and tokens) would outlive its batch, in an idle worker for good."""
        with self._changed:
            held = {key: work.progress() if (work := self._running.get(key)) else None for key in self._held}
            waited = max(READY_TURNS * self.settings.batch_chunk_seconds, self.settings.lease_seconds)
            stale = [w for w in self._ready if time.monotonic() - w.read_at > waited]
            self._ready = deque(w for w in self._ready if w not in stale)
        for work in stale:  # not started soon: another worker may start it
            work.abandon(None)
        if lost := chunks.extend_leases(self.owner, self.settings, held):
            self._drop(lost)
        if self._ready:  # a chunk read and not taken (the pass loop had ended): a pass loop takes it
            kick_drain(self.settings.worker_model)

    def _drop(self, lost: set[tuple[str, int]]) -> None:
        """Stops the chunks no longer this worker's: their requests are dropped from the pass loop (take_closed),
        a chunk read ahead is forgotten, and nothing of theirs is committed (a commit on its way is refused by
        its lease condition, and removes its object)."""
        with self._changed:
            for key in lost:
                self._held.pop(key, None)
                work = self._running.pop(key, None)
                if work is not None and not work.over:
                    work.over = True
                    self._closed |= work.open_ids()
                    self.last_chunk_done_at = time.monotonic()
                    log.info("chunk %s/%s is no longer this worker's (its batch was cancelled, or its lease "
                             "lapsed): stopped", *key)
            self._ready = deque(w for w in self._ready if w.chunk.key not in lost)
            self._changed.notify_all()

    def close(self, timeout: float = STOP_SECONDS) -> None:
        """Stops the threads; the chunks read but not taken (or being read) are handed back, and the
        committer ends after the commits queued. Chunks the pass loop took end with it (it stops first)."""
        self._stop.set()
        self._want.set()  # the reader is not left waiting for a request
        reader, committer, _ = self._threads
        reader.join(timeout / 2)
        with self._changed:
            ready, self._ready = list(self._ready), deque()
        for work in ready:
            work.abandon(None)
        self._commits.put(None)
        committer.join(timeout / 2)


_feeds: dict[str, ChunkFeed] = {}
_feeds_lock = threading.Lock()


def feed_for(scorer: Scorer, owner: str, settings: Settings, pace: Pace) -> ChunkFeed:
    """The worker process's feed (one per lease owner), started on first use (`pace`: the engine's)."""
    with _feeds_lock:
        if owner not in _feeds:
            _feeds[owner] = ChunkFeed(scorer, owner, settings, pace)
        return _feeds[owner]


def sweep(settings: Settings) -> bool:
    """The worker's maintenance round: re-queues chunks whose worker died and settles the batches that are
    over. Whether a chunk waits to be claimed that this process's feeds are not reading (then a pass loop
    should claim it: the caller wakes one)."""
    for batch_id in chunks.sweep_chunks(settings):
        try:
            chunks.settle(batch_id)
        except Exception as exc:  # noqa: BLE001  (its store unreachable now: the next round tries again)
            log.warning("batch %s could not be settled now: %s", batch_id, str(exc))
    with _feeds_lock:
        feeds = list(_feeds.values())
    return not any(feed.busy() for feed in feeds) and chunks.live_chunks(settings)


def close_feeds() -> None:
    """For a stopping worker, after its pass loop ended."""
    with _feeds_lock:
        feeds = list(_feeds.values())
        _feeds.clear()
    for feed in feeds:
        feed.close()

