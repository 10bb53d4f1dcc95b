"""The pass loop's scheduling policy (worker/drain.py runs it): which pending items go into the next pass.

Plain code, in the manner of the serving engines' schedulers: `add_request` takes a claimed request,
`schedule` plans the next pass from what is pending, `update_from_output` takes a pass's scores back,
`finish_requests` drops requests the loop no longer holds. No thread, database or device: of the engine it asks
only its pass shapes, its prefix cache and its pass planner (core.packing), so a fake engine tests it.

Continuous batching: a request added meanwhile joins the next pass. Each pass takes the pending items of the
running requests, interactive before batch and oldest first, with a request's share capped at half a pass while
others wait, so that a long job advances a pass at a time beside new ones instead of holding them back.
"""

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from core.prefix_cache import PrefixNeeds
from core.requests import TokenizedRequest
from store.models import PRIORITY_BATCH
from store.settings import Settings

if TYPE_CHECKING:
    from core import PassResult
    from core.packing import PassPlan

# Batch passes on CPU, in tokens, unless BATCH_ROUND_TOKENS says otherwise. An interactive job waits for the
# batch pass on the engine: on a 2-core AVX2 host a pass of the bundled model took 10 s at 4,096 tokens, 2.3 s
# at 1,024 and 1 s at 512. So batch passes are CPU_BATCH_PASS_TOKENS long while interactive jobs came in the
# last INTERACTIVE_RECENT_SECONDS, twice that otherwise: on an AVX-512 host a backfill alone ran 7-12% faster
# in 1,024-token passes than in 512 (`python -m benchmarks.latency`: README, Performance).
CPU_BATCH_PASS_TOKENS = 512
INTERACTIVE_RECENT_SECONDS = 30.0
# Hosts of one machine type differ 2-3x: on the AVX2-only kind a 1-item call beside a 3,000-item job waited 1.9 s
# (p50) for 1,024-token passes. So on CPU the passes a small call may wait for (interactive ones, and batch ones
# while interactive jobs come) are cut to what this host runs in about CPU_WAIT_SECONDS at the pace its passes
# showed, down to MIN_CPU_PASS_TOKENS (shorter ones cost more in per-pass overhead than they save).
CPU_WAIT_SECONDS = 0.8
MIN_CPU_PASS_TOKENS = 256


class Engine(Protocol):
    """What the scheduler asks of the engine (core.Scorer)."""

    pass_tokens: int
    launches_ahead: bool
    prefix_cache_bytes: int

    @property
    def pass_lengths(self) -> list[int]: ...

    def is_cached(self, prefix: tuple[int, ...]) -> bool: ...

    def prefix_bytes(self, tokens: int) -> int: ...

    def plan_pass(self, requests: Sequence[TokenizedRequest],
                  needed: Collection[tuple[int, ...]] = ()) -> "PassPlan | None": ...


class Sink(Protocol):
    """Whoever takes a request's scores (a job, a chunk's request): the scheduler needs its id and priority."""

    @property
    def id(self) -> str: ...

    @property
    def priority(self) -> int: ...


@dataclass(eq=False)
class Running:
    """A request the scheduler holds: its items not yet launched, and its scores so far."""

    sink: Sink
    request: TokenizedRequest
    order: int  # admission order: oldest first within a priority
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
    def interactive(self) -> bool:
        return self.sink.priority > PRIORITY_BATCH

    @property
    def finished(self) -> bool:
        return self.done == self.request.n_items


@dataclass
class ScheduledPass:
    """The next pass: what to launch (`views`, `plan`, `needed`) and whose items it holds."""

    views: list[TokenizedRequest]
    plan: "PassPlan | None"
    needed: set[tuple[int, ...]]  # the queries the requests under way still need (kept in the prefix cache)
    owners: list[tuple[Running, list[int]]]  # per request of the pass: its request and the item indices taken


def batch_pass_tokens(engine: Engine, settings: Settings, interactive_recently: bool = False) -> int:
    """Tokens of a batch pass, and of a batch claim's round: BATCH_ROUND_TOKENS; unset, a full pass on an
    accelerator, on CPU CPU_BATCH_PASS_TOKENS after recent interactive jobs and twice that otherwise (at most a
    pass either way). A shorter batch pass is a shorter wait for an interactive job arriving during a
    backfill, which waits for the batch pass on the engine."""
    default = engine.pass_tokens if engine.launches_ahead else CPU_BATCH_PASS_TOKENS * (
        1 if interactive_recently else 2)
    return min(settings.batch_round_tokens or default, engine.pass_tokens)


class Pace:
    """The recent passes' seconds per token on this host (CPU: see CPU_WAIT_SECONDS), from the first pass that
    compiled nothing. An engine's pace outlives a pass loop: kept per worker, a loop that starts after an idle
    spell cuts its passes from its first one. (Measured afresh by each loop from each shape's second pass, the
    first small calls beside a 3,000-item call waited 2-2.8 s on the AVX2-only host, behind 1,024-token passes.)"""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def record(self, result: "PassResult") -> None:
        # A pass that compiled its program is no measure; short passes are mostly per-pass overhead.
        if not result.compiled and result.tokens >= MIN_CPU_PASS_TOKENS:
            pace = result.seconds / result.tokens
            self.seconds_per_token = pace if self.seconds_per_token is None else \
                0.7 * self.seconds_per_token + 0.3 * pace


class Scheduler:
    def __init__(self, engine: Engine, settings: Settings, pace: Pace | None = None) -> None:
        """`pace`: the engine's pace as earlier loops measured it (a new one by default)."""
        self.engine, self.settings = engine, settings
        self.pace = pace or Pace()
        self.running: list[Running] = []
        self._order = 0
        self.interactive_at = float("-inf")  # when an interactive request was last added (monotonic)

    # ---- what the loop asks ----------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.running

    @property
    def pending_tokens(self) -> int:
        return sum(r.pending_tokens for r in self.running)

    @property
    def runs_interactive(self) -> bool:
        return any(r.interactive for r in self.running)

    # ---- requests in and out ---------------------------------------------------------------------------

    def add_request(self, sink: Sink, request: TokenizedRequest) -> Running:
        """Holds the request until its items are scored; one with no item is finished as it comes."""
        run = Running(sink, request, self._order)
        self._order += 1
        if run.interactive:
            self.interactive_at = time.monotonic()
        if not run.finished:
            self.running.append(run)
        return run

    def finish_requests(self, ids: set[str]) -> None:
        """Drops these requests (cancelled, or no longer the loop's); their items in flight still come back."""
        if ids:
            self.running = [r for r in self.running if r.sink.id not in ids]

    def take_unscored(self) -> list[Running]:
        """With no pass in flight: requests with nothing left to launch, yet not every item scored (an engine
        bug), dropped."""
        if self.running and not any(r.pending for r in self.running):
            return self.take_all()
        return []

    def take_all(self) -> list[Running]:
        running, self.running = self.running, []
        return running

    # ---- passes ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledPass | None:
        """Plans the next pass and counts its items as launched; None when nothing is pending."""
        window, needed = self._window()
        if not window:
            return None
        views = [TokenizedRequest(run.request.query, tuple(run.request.items[i] for i in taken),
                                  run.request.label_token_ids, run.request.item_first) for run, taken in window]
        plan = self.engine.plan_pass(views, needed)
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
        return ScheduledPass(views, plan, needed, window)

    def update_from_output(self, scheduled: ScheduledPass, result: "PassResult") -> list[Running]:
        """Keeps a pass's scores; returns the requests it advanced (those it finished no longer held)."""
        self.pace.record(result)
        touched: dict[Running, None] = {}
        for part in result.scores:
            run, taken = scheduled.owners[part.request]
            items = np.asarray(taken)[part.items]
            run.logprobs[items] = part.logprobs
            run.done += len(items)
            touched[run] = None
        self.running = [r for r in self.running if not r.finished]
        return list(touched)

    # ---- the policy ----------------------------------------------------------------------------------------

    def _window(self) -> tuple[list[tuple[Running, list[int]]], set[tuple[int, ...]]]:
        """The pending items the next pass is planned from, up to a pass of tokens: interactive requests before
        batch ones, oldest first, each taking what the requests after it would leave, but at least half the pass
        (batch requests: as much as is left). So a job that arrives while a long one runs joins the next pass,
        and two long jobs share passes. A request whose items span passes starts only when the prefix cache can
        keep its query beside those of the requests under way (or first in the pass). Also returns the queries
        the requests under way will still need."""
        waiting = sorted((r for r in self.running if r.pending), key=lambda r: (-r.sink.priority, r.order))
        batch = bool(waiting) and not waiting[0].interactive
        if not batch:
            # The interactive lane goes before batch rounds: batch requests wait while interactive jobs run.
            waiting = [r for r in waiting if r.interactive]
        remaining = self.pass_budget(waiting)
        wanted_after = [0] * (len(waiting) + 1)  # what the requests after each one would take
        for k in range(len(waiting) - 1, -1, -1):
            wanted_after[k] = min(remaining, wanted_after[k + 1] + waiting[k].pending_tokens)
        under_way = PrefixNeeds(self.engine.prefix_bytes, self.engine.prefix_cache_bytes)
        for run in self.running:
            if run.pending and len(run.pending) < run.request.n_items and not run.request.item_first:
                under_way.add(run.request.query, run.sink.id)
        window, queries = [], set()
        for k, run in enumerate(waiting):
            if remaining <= 0:
                break
            req = run.request
            # Batch requests fill the pass in order instead: shared out, a batch pass of 512 tokens held parts of
            # five lines (each reading its query from the prefix cache) and ran a quarter fewer tokens/s on CPU.
            cap = remaining if batch else max(remaining - wanted_after[k + 1], remaining // 2)
            shared = req.item_first or req.query in queries or self.engine.is_cached(req.query)
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
                    under_way.release(req.query, run.sink.id)
                elif window and req.query not in under_way and not under_way.may_add(req.query):
                    continue  # it starts when a request under way is done
                else:
                    under_way.add(req.query, run.sink.id)
            queries.add(req.query)
            window.append((run, taken))
            remaining -= used
        return window, under_way.queries

    def pass_budget(self, waiting: list[Running]) -> int:
        """A pass's tokens: a full pass; or while jobs that have not run yet wait (a /v1/score call holds a
        connection open for its job), the shortest pass length that holds them, older jobs filling the rest:
        they are answered after a short pass instead of a full one. A backlog still fills whole passes. On CPU
        interactive passes are at most 2 x CPU_BATCH_PASS_TOKENS long, not full ones: a small call that comes
        while a job of many passes runs (or with it, in its first pass) waits for one such pass (0.7 s on the
        bundled model), not a full one (3 s)."""
        engine = self.engine
        if waiting and not waiting[0].interactive:
            recently = time.monotonic() - self.interactive_at < INTERACTIVE_RECENT_SECONDS
            tokens = batch_pass_tokens(engine, self.settings, recently)
            return self._within_wait(tokens) if recently and self.settings.batch_round_tokens is None else tokens
        longest = engine.pass_tokens if engine.launches_ahead else self._within_wait(
            min(2 * CPU_BATCH_PASS_TOKENS, engine.pass_tokens))
        fresh = sum(r.pending_tokens for r in waiting if r.interactive and len(r.pending) == r.request.n_items)
        lengths = engine.pass_lengths
        return min(next((n for n in lengths if n >= fresh), lengths[-1]), longest) if fresh else longest

    def _within_wait(self, tokens: int) -> int:
        """On CPU, the longest pass length up to `tokens` that runs within CPU_WAIT_SECONDS at the recent pace
        (at least MIN_CPU_PASS_TOKENS), at most CPU_BATCH_PASS_TOKENS until a pass was timed (a 1,024-token pass
        took 2.3 s on the AVX2-only kind); `tokens` on accelerators."""
        pace = self.pace.seconds_per_token
        if self.engine.launches_ahead:
            return tokens
        if pace is None:
            return min(tokens, CPU_BATCH_PASS_TOKENS)
        fits = [n for n in self.engine.pass_lengths
                if MIN_CPU_PASS_TOKENS <= n <= tokens and n * pace <= CPU_WAIT_SECONDS]
        return max(fits, default=min(tokens, MIN_CPU_PASS_TOKENS))
