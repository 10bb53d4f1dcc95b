"""The pass loop's scheduler (worker/scheduler.py) under its policy (worker/policy.py), on its own: no thread,
database or device. A fake engine stands in for the Scorer: its pass shapes, its prefix cache, and a planner that
takes every item given."""

import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from core import TokenizedRequest
from store.priorities import PRIORITY_BATCH, PRIORITY_JOB, PRIORITY_SYNC
from store.settings import get_settings
from worker import policy as policy_module
from worker.policy import Pace, policy_for
from worker.scheduler import Running, Scheduler

LABELS = (5, 7)


@dataclass
class Sink:
    id: str
    priority: int


class FakeEngine:
    """An engine of 64..pass_tokens passes; `prefix_bytes(n)` is 100 n bytes."""

    def __init__(self, pass_tokens: int = 4096, launches_ahead: bool = True, prefix_cache_bytes: int = 10**9) -> None:
        self.pass_tokens, self.launches_ahead, self.prefix_cache_bytes = pass_tokens, launches_ahead, prefix_cache_bytes
        self.cached: set[tuple[int, ...]] = set()

    @property
    def pass_lengths(self) -> list[int]:
        return [n for n in (64, 128, 256, 512, 1024, 2048, 4096) if n <= self.pass_tokens]

    def is_cached(self, prefix: tuple[int, ...]) -> bool:
        return prefix in self.cached

    def prefix_bytes(self, tokens: int) -> int:
        return 100 * tokens

    def plan_pass(self, requests, needed=()):  # type: ignore[no-untyped-def]
        return SimpleNamespace(sequences=[SimpleNamespace(items=[(r, i, item) for i, item in enumerate(req.items)],
                                                          scored_at_prefix_end=[]) for r, req in enumerate(requests)])


def make_scheduler(engine, settings, pace: Pace | None = None) -> Scheduler:  # type: ignore[no-untyped-def]
    return Scheduler(engine, policy_for(engine, settings, pace))


def request(query_tokens: int, items: int, item_tokens: int, first: int = 1000) -> TokenizedRequest:
    """Token ids from `first` on: requests given different `first`s have different queries."""
    query = tuple(range(first, first + query_tokens))
    return TokenizedRequest(query, tuple(tuple(range(item_tokens)) for _ in range(items)), LABELS, False)


def scores_of(scheduled, tokens: int = 100, shape: tuple = ("shape",), compiled: bool = False):  # type: ignore[no-untyped-def]
    """The pass result of a scheduled pass in which every item launched was scored."""
    parts = [SimpleNamespace(request=r, items=np.arange(len(view.items)),
                             logprobs=np.full((len(view.items), len(LABELS)), -1.0))
             for r, view in enumerate(scheduled.views)]
    return SimpleNamespace(scores=parts, tokens=tokens, seconds=1.0, shape_key=shape, compiled=compiled)


def in_pass(scheduled) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    return {run.sink.id: taken for run, taken in scheduled.owners}


def settings(batch_round_tokens: int | None = None):  # type: ignore[no-untyped-def]
    return get_settings().model_copy(update={"batch_round_tokens": batch_round_tokens})


def test_interactive_requests_go_before_batch_ones() -> None:
    scheduler = make_scheduler(FakeEngine(), settings())
    scheduler.add_request(Sink("batch", PRIORITY_BATCH), request(8, 4, 4, first=1000))
    scheduler.add_request(Sink("job", PRIORITY_JOB), request(8, 4, 4, first=2000))
    scheduler.add_request(Sink("call", PRIORITY_SYNC), request(8, 4, 4, first=3000))
    first = scheduler.schedule()
    assert list(in_pass(first)) == ["call", "job"]  # highest priority first; the batch request waits for them
    assert scheduler.runs_interactive
    finished = scheduler.update_from_output(first, scores_of(first))
    assert [run.sink.id for run in finished] == ["call", "job"] and all(run.finished for run in finished)
    assert np.all(finished[0].logprobs == -1.0)
    assert [run.sink.id for run in scheduler.running] == ["batch"] and not scheduler.runs_interactive
    second = scheduler.schedule()
    assert list(in_pass(second)) == ["batch"]
    scheduler.update_from_output(second, scores_of(second))
    assert scheduler.idle and scheduler.schedule() is None


def test_a_small_call_joins_the_next_pass_beside_a_long_job() -> None:
    """A job of many passes takes what the small call leaves; the pass is the shortest that holds the call."""
    scheduler = make_scheduler(FakeEngine(pass_tokens=256), settings())
    scheduler.add_request(Sink("long", PRIORITY_SYNC), request(10, 100, 10, first=1000))
    first = scheduler.schedule()  # the long job alone: a whole pass
    assert list(in_pass(first)) == ["long"] and len(in_pass(first)["long"]) == 24
    scheduler.add_request(Sink("small", PRIORITY_SYNC), request(10, 2, 5, first=2000))
    second = scheduler.schedule()  # planned while the first pass runs
    taken = in_pass(second)
    assert taken["small"] == [0, 1]
    assert taken["long"] == [24, 25, 26]  # 40 of the 64-token pass that holds the call's 20 tokens
    assert scheduler.pending_tokens == 100 * 10 - 27 * 10 + 10  # the long job's rest, its query with it
    assert second.needed == {tuple(range(1000, 1010))}  # the long job's query: its next items need it
    scheduler.update_from_output(first, scores_of(first))
    done = scheduler.update_from_output(second, scores_of(second))
    assert {run.sink.id: run.done for run in done} == {"long": 27, "small": 2}
    assert [run.sink.id for run in scheduler.running] == ["long"]


def test_a_job_spanning_passes_starts_when_the_prefix_cache_keeps_its_query() -> None:
    """Two jobs of many passes: the second starts beside the first only if the prefix cache holds both queries
    (else it would compute its query again each pass); first in a pass, a job always starts."""
    for cache_bytes, both in ((6000, False), (20_000, True)):
        engine = FakeEngine(pass_tokens=256, prefix_cache_bytes=cache_bytes)  # a 50-token query: 5,000 bytes
        scheduler = make_scheduler(engine, settings())
        scheduler.add_request(Sink("a", PRIORITY_SYNC), request(50, 40, 10, first=1000))
        scheduler.add_request(Sink("b", PRIORITY_SYNC), request(50, 40, 10, first=2000))
        scheduled = scheduler.schedule()
        assert sorted(in_pass(scheduled)) == (["a", "b"] if both else ["a"]), cache_bytes
        queries = {tuple(range(1000, 1050))} | ({tuple(range(2000, 2050))} if both else set())
        assert scheduled.needed == queries
    # Its query cached, the second job's share is all items: it starts whatever the cache holds.
    engine = FakeEngine(pass_tokens=256, prefix_cache_bytes=6000)
    scheduler = make_scheduler(engine, settings())
    scheduler.add_request(Sink("a", PRIORITY_SYNC), request(50, 40, 10, first=1000))
    scheduler.add_request(Sink("b", PRIORITY_SYNC), request(50, 3, 10, first=2000))
    assert sorted(in_pass(scheduler.schedule())) == ["a", "b"]  # b is done in this pass: its query not kept


def test_a_fresh_interactive_job_gets_the_shortest_pass_that_holds_it() -> None:
    engine = FakeEngine(pass_tokens=4096)
    scheduler = make_scheduler(engine, settings())
    small = Running(Sink("small", PRIORITY_SYNC), request(10, 3, 10), 0)  # 40 tokens
    middling = Running(Sink("m", PRIORITY_SYNC), request(10, 30, 10), 1)  # 310 tokens
    batch = Running(Sink("b", PRIORITY_BATCH), request(10, 3, 10), 2)
    assert scheduler.pass_budget([small]) == 64
    assert scheduler.pass_budget([small, middling]) == 512
    assert scheduler.pass_budget([batch]) == 4096  # an accelerator's batch pass: a full one
    assert scheduler.pass_budget([]) == 4096


def test_pace_counts_passes_that_compiled_nothing() -> None:
    scheduler = make_scheduler(FakeEngine(launches_ahead=False), settings())
    scheduler.add_request(Sink("a", PRIORITY_SYNC), request(4, 1000, 4))
    for tokens, compiled, expected in ((512, True, None), (512, False, 1 / 512), (100, False, 1 / 512),
                                       (1024, True, 1 / 512), (256, False, 0.7 / 512 + 0.3 / 256)):
        scheduled = scheduler.schedule()
        scheduler.update_from_output(scheduled, scores_of(scheduled, tokens, ("x",), compiled))
        assert scheduler.pace.seconds_per_token == expected
    assert make_scheduler(FakeEngine(), settings(), scheduler.pace).pace is scheduler.pace


def test_dropped_and_unscored_requests_leave_the_scheduler() -> None:
    scheduler = make_scheduler(FakeEngine(), settings())
    assert scheduler.add_request(Sink("empty", PRIORITY_SYNC), request(4, 0, 4)).finished  # nothing to score
    scheduler.add_request(Sink("a", PRIORITY_SYNC), request(4, 2, 4))
    scheduler.add_request(Sink("b", PRIORITY_SYNC), request(4, 2, 4, first=2000))
    assert [run.sink.id for run in scheduler.running] == ["a", "b"]
    scheduler.finish_requests({"a"})
    assert [run.sink.id for run in scheduler.running] == ["b"]
    assert scheduler.take_unscored() == []  # b's items are still to launch
    scheduler.schedule()  # launched, and its scores never come back
    assert [run.sink.id for run in scheduler.take_unscored()] == ["b"] and scheduler.idle


def test_cpu_batch_passes_shorten_while_interactive_jobs_come() -> None:
    """On CPU a backfill alone runs 1,024-token passes; for INTERACTIVE_RECENT_SECONDS after an interactive
    job they are 512 long (an interactive job waits for the batch pass on the engine). An interactive job of many
    passes runs in 1,024-token passes after its first."""
    from core import Scorer

    scorer = Scorer.from_pretrained("tiny-random", pass_tokens=4096)
    assert not scorer.launches_ahead
    settings = get_settings().model_copy(update={"batch_round_tokens": None})
    scheduler = make_scheduler(scorer, settings)
    request = scorer.tokenize("a query", [" one", " two"], [5])
    batch_job = Running(Sink("b", PRIORITY_BATCH), request, 0)
    assert scheduler.pass_budget([batch_job]) == 2 * policy_module.CPU_BATCH_PASS_TOKENS == 1024
    scheduler.add_request(Sink("i", PRIORITY_SYNC), request)
    assert scheduler.pass_budget([batch_job]) == policy_module.CPU_BATCH_PASS_TOKENS
    scheduler.interactive_at -= policy_module.INTERACTIVE_RECENT_SECONDS
    assert scheduler.pass_budget([batch_job]) == 1024
    # An interactive job of many passes runs in 1,024-token passes, its first included, so that a small call
    # coming meanwhile (or claimed with it) waits for a short pass; a small call's own pass is short.
    big = Running(Sink("big", PRIORITY_SYNC), scorer.tokenize("a query", [" item"] * 3000, [5]), 0)
    small = Running(Sink("small", PRIORITY_SYNC), request, 0)
    assert scheduler.pass_budget([big]) == 512  # until a pass was timed: the host may be a slow one
    scheduler.pace.seconds_per_token = 0.7 / 1024  # the AVX-512 kind's pace
    assert scheduler.pass_budget([big]) == 1024
    assert scheduler.pass_budget([big, small]) == 1024
    big.pending = big.pending[1000:]
    assert scheduler.pass_budget([big]) == 1024
    assert scheduler.pass_budget([big, small]) == 64
    middling = Running(Sink("m", PRIORITY_SYNC), scorer.tokenize("a query", [" item"] * 300, [5]), 0)
    assert scheduler.pass_budget([middling]) == 512  # the shortest pass that holds it (302 tokens)
    # A host whose passes ran at the AVX2-only kind's pace (2.3 s per 1,024 tokens) cuts the passes a small call
    # may wait for to what it runs in about CPU_WAIT_SECONDS; one at the AVX-512 kind's (0.7 s) keeps them.
    scheduler.pace.seconds_per_token = 2.3 / 1024
    assert scheduler.pass_budget([big]) == 256
    scheduler.interactive_at = time.monotonic()
    assert scheduler.pass_budget([batch_job]) == 256
    scheduler.interactive_at -= policy_module.INTERACTIVE_RECENT_SECONDS  # a backfill alone keeps its passes
    assert scheduler.pass_budget([batch_job]) == 1024
    scheduler.pace.seconds_per_token = 0.7 / 1024
    assert scheduler.pass_budget([big]) == 1024
    # BATCH_ROUND_TOKENS wins; accelerators (passes launched ahead) keep whole passes.
    assert policy_module.batch_pass_tokens(scorer, settings.model_copy(update={"batch_round_tokens": 256}),
                                              True) == 256
    scorer.launches_ahead = True
    assert policy_module.batch_pass_tokens(scorer, settings, True) == 4096
    assert scheduler.pass_budget([big]) == 4096
