"""The scheduling policy: which source the pass loop takes work from, how much, and how long each pass is.

The pass loop (worker/drain.py) has three sources (`Source`): interactive jobs and uploaded batches' rounds
(worker/jobs.py), and reference batches' chunks (worker/lake.py). The loop, the scheduler (worker/scheduler.py)
and the sources ask a `Policy` each such question and hold no rule of their own; within a source, tenants and
batches take turns in its claim's SQL (store/claims.py, store/lake/chunks.py), ordered by what the policy hands
down. Pure code, no thread, database or device (tests/test_policy.py).

`policy_for` builds the order that `ORDER` names. A new scheduling order is a `Policy` subclass (most override
`claim` alone), its `SourceOrder` member and its `ORDERS` entry: this file only.
"""

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol, TypeVar

from store.priorities import PRIORITY_BATCH
from store.settings import Settings

if TYPE_CHECKING:
    from core import PassResult

# Batch passes on CPU, in tokens, unless BATCH_ROUND_TOKENS says otherwise. An interactive job waits for the
# batch pass on the engine: on a 2-core AVX2 host a pass of the bundled model takes 10 s at 4,096 tokens, 2.3 s
# at 1,024 and 1 s at 512. So batch passes are CPU_BATCH_PASS_TOKENS long while interactive jobs came in the
# last INTERACTIVE_RECENT_SECONDS, twice that otherwise: on an AVX-512 host a backfill alone runs 7-12% faster
# in 1,024-token passes than in 512 (`python -m benchmarks.latency`: README, Performance).
CPU_BATCH_PASS_TOKENS = 512
INTERACTIVE_RECENT_SECONDS = 30.0
# Hosts of one machine type differ 2-3x (a 1-item call beside a 3,000-item job waits 1.9 s at p50 for 1,024-token
# passes on the AVX2-only kind). So on CPU the passes a small call may wait for (interactive ones, and batch ones
# while interactive jobs come) are cut to what this host runs in about CPU_WAIT_SECONDS at its pace, down to
# MIN_CPU_PASS_TOKENS (shorter ones cost more in per-pass overhead than they save).
CPU_WAIT_SECONDS = 0.8
MIN_CPU_PASS_TOKENS = 256
# The loop claims while it holds less than this many batch passes of work: a claim and its decoding take longer
# than a pass on an accelerator, and the device must not run dry meanwhile.
CLAIM_AHEAD_PASSES = 4
# Until this worker has measured a pass, the first piece of a chunk it cuts is this many batch passes long.
FIRST_PIECE_PASSES = 4


class Source(Enum):
    """Where the pass loop's requests come from."""

    INTERACTIVE = "interactive"  # /v1/score calls and POST /jobs (worker/jobs.py)
    UPLOADS = "uploads"  # rounds of uploaded batches' requests (worker/jobs.py)
    CHUNKS = "chunks"  # chunks of reference batches (worker/lake.py)


class PassShapes(Protocol):
    """What the policy asks of the engine (core.Scorer): its pass lengths, and whether passes launch ahead
    (an accelerator) or run one at a time on the host's cores (CPU)."""

    pass_tokens: int
    launches_ahead: bool

    @property
    def pass_lengths(self) -> list[int]: ...


class ChunkClock(Protocol):
    """What the policy asks of the chunk source (worker/lake.py ChunkFeed): how its last chunk went."""

    last_chunk_seconds: float | None  # from its take to its last request's scores
    last_chunk_done_at: float  # when a chunk taken was last done or handed back (monotonic)


class Queued(Protocol):
    """A request the scheduler holds, as the policy orders it."""

    @property
    def priority(self) -> int: ...

    @property
    def order(self) -> int: ...  # admission order


Q = TypeVar("Q", bound=Queued)
T = TypeVar("T")


class Pace:
    """This worker's recent seconds per token, from its passes that compiled nothing (a compiling pass is no
    measure; short passes are mostly per-pass overhead). One per engine, kept from one pass loop to the next (a
    loop that starts after an idle spell cuts its passes from its first one): the loop records each pass, and the
    policy cuts CPU passes and reference chunks to it."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def record(self, result: "PassResult") -> None:
        if not result.compiled and result.tokens >= MIN_CPU_PASS_TOKENS:
            pace = result.seconds / result.tokens
            self.seconds_per_token = pace if self.seconds_per_token is None else \
                0.7 * self.seconds_per_token + 0.3 * pace

    def tokens_per_second(self) -> float | None:
        return 1 / self.seconds_per_token if self.seconds_per_token else None


def batch_pass_tokens(engine: PassShapes, settings: Settings, interactive_recently: bool = False) -> int:
    """Tokens of a batch pass, and of a batch claim's round: BATCH_ROUND_TOKENS; unset, a full pass on an
    accelerator, on CPU CPU_BATCH_PASS_TOKENS after recent interactive jobs and twice that otherwise (at most a
    pass either way). A shorter batch pass is a shorter wait for an interactive job arriving during a
    backfill, which waits for the batch pass on the engine."""
    default = engine.pass_tokens if engine.launches_ahead else CPU_BATCH_PASS_TOKENS * (
        1 if interactive_recently else 2)
    return min(settings.batch_round_tokens or default, engine.pass_tokens)


def chunk_piece_tokens(engine: PassShapes, settings: Settings, pace: Pace) -> tuple[float, bool] | None:
    """How long a piece of a reference chunk is, in tokens, and whether that comes from a measured pace: on CPU,
    BATCH_CHUNK_SECONDS of this worker's passes (until a pass was measured, FIRST_PIECE_PASSES batch passes for
    the first piece, the rest one chunk), so that uploads and other batches get their turn within that long.
    None on an accelerator: chunks run whole."""
    if engine.launches_ahead:
        return None
    speed = pace.tokens_per_second()
    if speed:
        return speed * settings.batch_chunk_seconds, True
    return FIRST_PIECE_PASSES * batch_pass_tokens(engine, settings), False


class Policy(ABC):
    """The scheduling policy's contract: one per pass loop, asked by the loop (its claims, in the writer's thread)
    and by the scheduler (its passes, in the loop's thread). Each answer is plain and cheap; only `claim` keeps
    state (the sources' turns)."""

    def __init__(self, engine: PassShapes, settings: Settings, pace: Pace, chunks: ChunkClock | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`pace`: the engine's, which the loop records; `chunks`: the chunk source, if the loop has one;
        `clock`: monotonic seconds."""
        self.engine, self.settings, self.pace, self.chunks, self.clock = engine, settings, pace, chunks, clock

    # ---- the requests held ------------------------------------------------------------------------------

    @property
    @abstractmethod
    def interactive_above(self) -> int:
        """The priority above which a job is interactive: claimed on a wake-up, and ahead of batch work.
        The interactive claim's SQL takes only jobs above it."""

    def interactive(self, priority: int) -> bool:
        """Whether a request of this priority is interactive."""
        return priority > self.interactive_above

    @abstractmethod
    def lane(self, waiting: Sequence[Q]) -> tuple[list[Q], bool]:
        """Of the requests with items to launch: those the next pass takes from, first to last, and whether
        that is batch work. Every request of the list may end up in the pass."""

    @abstractmethod
    def share(self, remaining: int, wanted_after: int, batch: bool) -> int:
        """The most tokens a request may take of the `remaining` ones of a pass, when those after it in the lane
        would take `wanted_after`."""

    # ---- passes -------------------------------------------------------------------------------------------

    @abstractmethod
    def pass_tokens(self, batch: bool, fresh_tokens: int, interactive_at: float) -> int:
        """The next pass's tokens: `batch` for batch work (see `lane`), `fresh_tokens` the pending tokens of
        interactive requests no pass took from yet, `interactive_at` when one was last admitted (`clock`)."""

    # ---- claims -------------------------------------------------------------------------------------------

    @abstractmethod
    def claim_tokens(self) -> int:
        """The prompt tokens of a batch claim's round of uploaded requests."""

    @abstractmethod
    def short_of_work(self, pending_tokens: int) -> bool:
        """Whether the loop, holding `pending_tokens` not yet launched, claims more."""

    @abstractmethod
    def claims_batch(self, pending_tokens: int, runs_interactive: bool) -> bool:
        """Whether the loop's next claim may take batch work, else interactive jobs only."""

    @abstractmethod
    def claim(self, take: Callable[[Source], list[T]], interactive_only: bool) -> list[T]:
        """One claim: takes from the sources in this policy's order (`take(source)` claims the next requests of
        one, [] if none) and returns the first requests found, or []. `interactive_only`: from
        Source.INTERACTIVE alone. Called from one thread at a time."""


class TurnTaking(Policy):
    """Interactive jobs first: highest priority, then oldest. In the batch lane uploaded batches and reference
    batches take turns: a chunk, then uploaded batches' rounds for as long as that chunk took (at most
    BATCH_CHUNK_SECONDS), then the next chunk, and so on; either kind alone runs without waiting."""

    def __init__(self, engine: PassShapes, settings: Settings, pace: Pace, chunks: ChunkClock | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(engine, settings, pace, chunks, clock)
        # When a chunk is due; None: after a chunk, until the uploads' turn begins (at the first round claimed
        # once that chunk is done: the turn lasts as long as the chunk took).
        self._chunk_due_at: float | None = 0.0
        self._chunk_taken_at = 0.0

    @property
    def interactive_above(self) -> int:
        return PRIORITY_BATCH

    def lane(self, waiting: Sequence[Q]) -> tuple[list[Q], bool]:
        # Batch requests wait while interactive ones run.
        ordered = sorted(waiting, key=lambda r: (-r.priority, r.order))
        batch = bool(ordered) and not self.interactive(ordered[0].priority)
        return (ordered if batch else [r for r in ordered if self.interactive(r.priority)]), batch

    def share(self, remaining: int, wanted_after: int, batch: bool) -> int:
        # Interactive requests take what the ones after them would leave, but at least half the pass: a job that
        # comes while a long one runs joins the next pass, and two long jobs share passes. Batch requests fill
        # the pass in order instead: shared out, a 512-token batch pass holds parts of several lines, each reading
        # its query from the prefix cache, and runs a quarter fewer tokens/s on CPU.
        return remaining if batch else max(remaining - wanted_after, remaining // 2)

    def pass_tokens(self, batch: bool, fresh_tokens: int, interactive_at: float) -> int:
        # A full pass; or while interactive jobs wait that no pass took from yet (a /v1/score call holds a
        # connection open for its job), the shortest pass length that holds them, older jobs filling the rest. On
        # CPU interactive passes are at most 2 x CPU_BATCH_PASS_TOKENS long: a small call that comes while a job of
        # many passes runs waits for one such pass (0.7 s on the bundled model), not a full one (3 s).
        engine = self.engine
        if batch:
            recently = self.clock() - interactive_at < INTERACTIVE_RECENT_SECONDS
            tokens = batch_pass_tokens(engine, self.settings, recently)
            return self._within_wait(tokens) if recently and self.settings.batch_round_tokens is None else tokens
        longest = engine.pass_tokens if engine.launches_ahead else self._within_wait(
            min(2 * CPU_BATCH_PASS_TOKENS, engine.pass_tokens))
        lengths = engine.pass_lengths
        return min(next((n for n in lengths if n >= fresh_tokens), lengths[-1]), longest) if fresh_tokens \
            else longest

    def _within_wait(self, tokens: int) -> int:
        """On CPU, the longest pass length up to `tokens` that runs within CPU_WAIT_SECONDS at the recent pace
        (at least MIN_CPU_PASS_TOKENS), at most CPU_BATCH_PASS_TOKENS until a pass was timed (a 1,024-token pass
        takes 2.3 s on the AVX2-only kind); `tokens` on accelerators."""
        pace = self.pace.seconds_per_token
        if self.engine.launches_ahead:
            return tokens
        if pace is None:
            return min(tokens, CPU_BATCH_PASS_TOKENS)
        fits = [n for n in self.engine.pass_lengths
                if MIN_CPU_PASS_TOKENS <= n <= tokens and n * pace <= CPU_WAIT_SECONDS]
        return max(fits, default=min(tokens, MIN_CPU_PASS_TOKENS))

    def claim_tokens(self) -> int:
        # On an accelerator a batch claim takes the passes the loop claims ahead in one go: a claim costs the
        # database and the writer's thread about as much for 30 lines as for 130. On CPU the claim's work shares
        # the cores with the passes, and an interactive job's own claim waits behind it: a claim takes at most a
        # pass of tokens, but as many short rounds as that holds, so that the claims keep up with the passes.
        rounds = batch_pass_tokens(self.engine, self.settings)
        if self.engine.launches_ahead:
            return CLAIM_AHEAD_PASSES * rounds
        return max(rounds, min(CLAIM_AHEAD_PASSES * rounds, self.engine.pass_tokens))

    def short_of_work(self, pending_tokens: int) -> bool:
        # Counted in batch passes, not full ones: held work runs first, so a chunk (or another batch's round)
        # claimed behind many full passes' worth of short batch passes waits all of them.
        return pending_tokens < CLAIM_AHEAD_PASSES * batch_pass_tokens(self.engine, self.settings)

    def claims_batch(self, pending_tokens: int, runs_interactive: bool) -> bool:
        # With work in hand, or interactive jobs running (batch rounds wait for them, claims included): interactive
        # jobs only.
        return self.short_of_work(pending_tokens) and not runs_interactive

    def uploads_turn(self) -> float:
        """How long uploads' rounds run after a chunk: as long as the last chunk took, at most BATCH_CHUNK_SECONDS."""
        last = self.chunks.last_chunk_seconds if self.chunks else None
        limit = self.settings.batch_chunk_seconds
        return min(last, limit) if last is not None else limit

    def claim(self, take: Callable[[Source], list[T]], interactive_only: bool) -> list[T]:
        if interactive_only:
            return take(Source.INTERACTIVE)
        if claimed := take(Source.INTERACTIVE):
            return claimed
        now = self.clock()
        chunks = self.chunks
        due = chunks is not None and self._chunk_due_at is not None and now >= self._chunk_due_at
        if due and (claimed := take(Source.CHUNKS)):
            self._chunk_due_at, self._chunk_taken_at = None, now
            return claimed
        if claimed := take(Source.UPLOADS):
            # The uploads' turn begins once the chunk taken is done: begun at its take, it would have no chunk time
            # to go by. A chunk due but not there (being read, or none waiting) stays due: the next claim looks
            # again, so a reference batch submitted behind a running upload starts at once.
            if self._chunk_due_at is None and chunks is not None and chunks.last_chunk_done_at >= self._chunk_taken_at:
                self._chunk_due_at = now + self.uploads_turn()
            return claimed
        self._chunk_due_at = now  # no upload waits: chunks run back to back
        return take(Source.CHUNKS) if chunks is not None and not due else []


class SourceOrder(Enum):
    """The scheduling orders there are, each a `Policy` class (`ORDERS`)."""

    TURNS = "turns"


ORDERS: dict[SourceOrder, type[Policy]] = {SourceOrder.TURNS: TurnTaking}
# The order the workers run.
ORDER = SourceOrder.TURNS


def policy_for(engine: PassShapes, settings: Settings, pace: Pace | None = None, chunks: ChunkClock | None = None,
               order: SourceOrder = ORDER) -> Policy:
    """A pass loop's policy (`pace`: the engine's, a new one by default; `chunks`: the chunk source, if any)."""
    return ORDERS[order](engine, settings, pace or Pace(), chunks)
