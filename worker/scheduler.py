"""The pass loop's scheduler (worker/drain.py runs it): which pending items go into the next pass.

Plain code, in the manner of the serving engines' schedulers: `add_request` takes a claimed request,
`schedule` plans the next pass from what is pending, `update_from_output` takes a pass's scores back,
`finish_requests` drops requests the loop no longer holds. No thread, database or device: of the engine it asks
only its pass shapes, its prefix cache and its pass planner (core.packing), so a fake engine tests it.

Continuous batching: a request added meanwhile joins the next pass. Which requests a pass takes from, in which
order, how much each may take and how long the pass is are the policy's (worker/policy.py); the scheduler keeps
the requests, fits their items to the pass and to the prefix cache, and counts what comes back.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from core.prefix_cache import PrefixNeeds
from core.requests import TokenizedRequest
from worker.policy import Pace, PassShapes, Policy

if TYPE_CHECKING:
    from core import PassResult, Scorer
    from core.packing import PassPlan
    from store.claims import KeptItems


class Engine(PassShapes, Protocol):
    """What the scheduler asks of the engine (core.Scorer)."""

    prefix_cache_bytes: int

    def is_cached(self, prefix: tuple[int, ...]) -> bool: ...

    def prefix_bytes(self, tokens: int) -> int: ...

    def plan_pass(self, requests: Sequence[TokenizedRequest],
                  needed: Collection[tuple[int, ...]] = ()) -> "PassPlan | None": ...


class Sink(Protocol):
    """Where a claimed request's scores go: a job's row (worker/jobs.py JobSink) or a chunk's result object
    (worker/lake.py ChunkRequest). Each holds its destination from its claim; the pass loop hands it the
    outcomes of its passes, and the scheduler orders it by its priority."""

    @property
    def id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    def request_for(self, scorer: "Scorer") -> TokenizedRequest:
        """The request in token space (in the writer's thread, off the pass loop's)."""

    @property
    def kept(self) -> "KeptItems | None":
        """Items an earlier attempt scored and kept, with their log-probabilities: not scored again."""

    def start(self) -> None:
        """The loop holds the request from now on (in the loop's thread, as the scheduler takes it)."""

    def advance(self, done: int, items: np.ndarray, logprobs: np.ndarray) -> None:
        """After a pass: `done` items scored so far; `items`, the indices of those the pass scored, and their
        [items, labels] log-probabilities."""

    def finish(self, logprobs: np.ndarray) -> None:
        """Every item scored."""

    def fail(self, error: tuple[str, str]) -> None:
        """The request cannot run (code, message)."""

    def abandon(self, error: str | None) -> None:
        """The loop gives the request back: after `error` the attempt counts; when the worker stops, it does not."""


@dataclass(eq=False)
class Running:
    """A request the scheduler holds: its items not yet launched, and its scores so far (from the items an
    earlier attempt kept, which are not launched again)."""

    sink: Sink
    request: TokenizedRequest
    order: int  # admission order: oldest first within a priority
    kept: "KeptItems | None" = None
    logprobs: np.ndarray = field(init=False)
    pending: list[int] = field(init=False)  # items not yet in a launched pass
    pending_tokens: int = field(init=False)  # their tokens (with the query, which runs once per item first)
    done: int = field(init=False)
    resumed: int = field(init=False)  # items kept when it was added
    last_scored: np.ndarray = field(init=False)  # the indices of the items the last pass that advanced it scored

    def __post_init__(self) -> None:
        self.logprobs = np.full((self.request.n_items, len(self.request.label_token_ids)), np.nan, np.float32)
        scored: set[int] = set()
        if self.kept is not None:
            self.logprobs[self.kept.items] = self.kept.logprobs
            scored = set(self.kept.items.tolist())
        self.pending = [i for i in range(self.request.n_items) if i not in scored]
        self.done = self.resumed = len(scored)
        self.pending_tokens = sum(self.item_cost(i) for i in self.pending) + (
            0 if self.request.item_first else len(self.request.query))

    def item_cost(self, i: int) -> int:
        return len(self.request.items[i]) + (len(self.request.query) if self.request.item_first else 0)

    @property
    def priority(self) -> int:
        return self.sink.priority

    @property
    def finished(self) -> bool:
        return self.done == self.request.n_items

    @property
    def launched(self) -> bool:
        """Whether a pass of this loop took any of its items."""
        return len(self.pending) + self.resumed < self.request.n_items


@dataclass
class ScheduledPass:
    """The next pass: what to launch (`views`, `plan`, `needed`) and whose items it holds."""

    views: list[TokenizedRequest]
    plan: "PassPlan | None"
    needed: set[tuple[int, ...]]  # the queries the requests under way still need (kept in the prefix cache)
    owners: list[tuple[Running, list[int]]]  # per request of the pass: its request and the item indices taken


class Scheduler:
    def __init__(self, engine: Engine, policy: Policy) -> None:
        self.engine, self.policy = engine, policy
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
    def pace(self) -> Pace:
        return self.policy.pace

    @property
    def runs_interactive(self) -> bool:
        return any(self.policy.interactive(r.priority) for r in self.running)

    # ---- requests in and out ---------------------------------------------------------------------------

    def add_request(self, sink: Sink, request: TokenizedRequest, kept: "KeptItems | None" = None) -> Running:
        """Holds the request until its items are scored (but those `kept`); one with none left is finished as it
        comes."""
        run = Running(sink, request, self._order, kept)
        self._order += 1
        if self.policy.interactive(run.priority):
            self.interactive_at = self.policy.clock()
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
        """Keeps a pass's scores; returns the requests it advanced (those it finished no longer held), each with
        the items it scored as its `last_scored`."""
        self.pace.record(result)
        touched: dict[Running, list[np.ndarray]] = {}
        for part in result.scores:
            run, taken = scheduled.owners[part.request]
            items = np.asarray(taken, np.int64)[part.items]
            run.logprobs[items] = part.logprobs
            run.done += len(items)
            touched.setdefault(run, []).append(items)
        for run, items in touched.items():
            run.last_scored = np.concatenate(items)
        self.running = [r for r in self.running if not r.finished]
        return list(touched)

    # ---- fitting a pass -----------------------------------------------------------------------------------

    def _window(self) -> tuple[list[tuple[Running, list[int]]], set[tuple[int, ...]]]:
        """The pending items the next pass is planned from, up to a pass of tokens: the policy's lane, in its
        order, each request taking up to its share. A request whose items span passes starts only when the prefix
        cache can keep its query beside those of the requests under way (or first in the pass). Also returns the
        queries the requests under way will still need."""
        waiting, batch = self.policy.lane([r for r in self.running if r.pending])
        remaining = self._pass_tokens(waiting, batch)
        wanted_after = [0] * (len(waiting) + 1)  # what the requests after each one would take
        for k in range(len(waiting) - 1, -1, -1):
            wanted_after[k] = min(remaining, wanted_after[k + 1] + waiting[k].pending_tokens)
        under_way = PrefixNeeds(self.engine.prefix_bytes, self.engine.prefix_cache_bytes)
        for run in self.running:
            if run.pending and run.launched and not run.request.item_first:
                under_way.add(run.request.query, run.sink.id)
        window, queries = [], set()
        for k, run in enumerate(waiting):
            if remaining <= 0:
                break
            req = run.request
            cap = self.policy.share(remaining, wanted_after[k + 1], batch)
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
        """The tokens of a pass planned from these requests (first to last, as the policy's lane orders them)."""
        return self._pass_tokens(waiting, bool(waiting) and not self.policy.interactive(waiting[0].priority))

    def _pass_tokens(self, waiting: list[Running], batch: bool) -> int:
        fresh = sum(r.pending_tokens for r in waiting if self.policy.interactive(r.priority) and not r.launched)
        return self.policy.pass_tokens(batch, fresh, self.interactive_at)
