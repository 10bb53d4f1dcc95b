"""The scheduling policy (worker/policy.py) on its own: no thread, database or device. Fake pass shapes, a fake
chunk source's clock and a clock the test moves stand in for the engine, the chunk feed and time."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from store.priorities import PRIORITY_BATCH, PRIORITY_JOB, PRIORITY_SYNC
from store.settings import get_settings
from worker import policy as policy_module
from worker.policy import ORDER, Pace, Source, SourceOrder, TurnTaking, chunk_piece_tokens, policy_for


@dataclass
class Shapes:
    pass_tokens: int = 4096
    launches_ahead: bool = True

    @property
    def pass_lengths(self) -> list[int]:
        return [n for n in (64, 128, 256, 512, 1024, 2048, 4096) if n <= self.pass_tokens]


@dataclass
class Chunks:
    last_chunk_seconds: float | None = None
    last_chunk_done_at: float = float("-inf")


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Queue:
    """What each source holds: `take` gives the next of a source (as a one-request claim) and logs it."""

    waiting: dict[Source, int] = field(default_factory=dict)
    asked: list[Source] = field(default_factory=list)

    def take(self, source: Source) -> list[str]:
        self.asked.append(source)
        if self.waiting.get(source, 0) <= 0:
            return []
        self.waiting[source] -= 1
        return [source.value]


@dataclass
class Held:
    priority: int
    order: int


def settings(**update):  # type: ignore[no-untyped-def]
    return get_settings().model_copy(update={"batch_round_tokens": None, "batch_chunk_seconds": 10.0, **update})


def turns(chunks: Chunks | None = None, engine: Shapes | None = None, clock: Clock | None = None,
          **update) -> TurnTaking:  # type: ignore[no-untyped-def]
    return TurnTaking(engine or Shapes(), settings(**update), Pace(), chunks, clock or Clock())


def test_the_workers_order_is_turn_taking() -> None:
    assert ORDER is SourceOrder.TURNS
    assert isinstance(policy_for(Shapes(), settings()), TurnTaking)
    pace = Pace()
    assert policy_for(Shapes(), settings(), pace).pace is pace


def test_interactive_jobs_come_first_and_alone_when_asked() -> None:
    policy, queue = turns(Chunks()), Queue({Source.INTERACTIVE: 1, Source.UPLOADS: 1, Source.CHUNKS: 1})
    assert policy.claim(queue.take, interactive_only=True) == ["interactive"]
    assert policy.claim(queue.take, interactive_only=True) == []
    assert queue.asked == [Source.INTERACTIVE, Source.INTERACTIVE]
    queue = Queue({Source.INTERACTIVE: 1, Source.UPLOADS: 1, Source.CHUNKS: 1})
    assert policy.claim(queue.take, interactive_only=False) == ["interactive"]
    assert queue.asked == [Source.INTERACTIVE]  # the batch lane is not looked at


def test_uploads_and_chunks_take_turns_by_the_chunks_time() -> None:
    """A chunk, then uploads' rounds for as long as it took (at most BATCH_CHUNK_SECONDS), then the next chunk."""
    chunks, clock = Chunks(), Clock()
    policy, queue = turns(chunks, clock=clock), Queue({Source.UPLOADS: 100, Source.CHUNKS: 100})
    assert policy.claim(queue.take, False) == ["chunks"]  # a chunk is due at first
    clock.now += 1
    assert policy.claim(queue.take, False) == ["uploads"]  # beside the running chunk: no turn starts yet
    clock.now += 3
    chunks.last_chunk_seconds, chunks.last_chunk_done_at = 4.0, clock.now  # the chunk took 4 s
    assert policy.claim(queue.take, False) == ["uploads"]  # the uploads' turn begins: 4 s
    clock.now += 3.9
    assert policy.claim(queue.take, False) == ["uploads"]
    clock.now += 0.2
    assert policy.claim(queue.take, False) == ["chunks"]  # the turn is over
    # A long chunk gives the uploads BATCH_CHUNK_SECONDS at most.
    chunks.last_chunk_seconds, chunks.last_chunk_done_at = 50.0, clock.now
    assert policy.uploads_turn() == 10.0


def test_either_kind_alone_runs_without_waiting() -> None:
    chunks, clock = Chunks(), Clock()
    policy, queue = turns(chunks, clock=clock), Queue({Source.CHUNKS: 3})
    assert [policy.claim(queue.take, False) for _ in range(4)] == [["chunks"]] * 3 + [[]]
    policy, queue = turns(None, clock=clock), Queue({Source.UPLOADS: 2, Source.CHUNKS: 5})
    assert [policy.claim(queue.take, False) for _ in range(3)] == [["uploads"], ["uploads"], []]
    assert Source.CHUNKS not in queue.asked  # no chunk source: never asked
    # A chunk due but not there stays due: once one is read, the next claim takes it before the uploads.
    policy, queue = turns(Chunks(), clock=clock), Queue({Source.UPLOADS: 5})
    assert policy.claim(queue.take, False) == ["uploads"]
    queue.waiting[Source.CHUNKS] = 1
    assert policy.claim(queue.take, False) == ["chunks"]


def test_the_lane_is_interactive_first_then_batch() -> None:
    policy = turns()
    batch, job, call, later_call = Held(PRIORITY_BATCH, 0), Held(PRIORITY_JOB, 1), Held(PRIORITY_SYNC, 2), \
        Held(PRIORITY_SYNC, 3)
    assert policy.lane([batch, job, later_call, call]) == ([call, later_call, job], False)
    assert policy.lane([batch, Held(PRIORITY_BATCH, 5)]) == ([batch, Held(PRIORITY_BATCH, 5)], True)
    assert policy.lane([]) == ([], False)
    assert policy.interactive_above == PRIORITY_BATCH and policy.interactive(PRIORITY_JOB)
    assert not policy.interactive(PRIORITY_BATCH)


def test_shares_of_a_pass() -> None:
    policy = turns()
    assert policy.share(1000, 100, batch=False) == 900  # what the others would leave
    assert policy.share(1000, 800, batch=False) == 500  # but at least half the pass
    assert policy.share(1000, 800, batch=True) == 1000  # batch requests fill the pass in order


def test_pass_lengths() -> None:
    clock = Clock()
    accelerator = turns(clock=clock)
    assert accelerator.pass_tokens(True, 0, float("-inf")) == 4096  # a full batch pass
    assert accelerator.pass_tokens(False, 0, clock.now) == 4096
    assert accelerator.pass_tokens(False, 100, clock.now) == 128  # the shortest that holds the fresh call
    assert accelerator.pass_tokens(False, 10_000, clock.now) == 4096
    assert turns(clock=clock, batch_round_tokens=256).pass_tokens(True, 0, clock.now) == 256
    cpu = turns(engine=Shapes(launches_ahead=False), clock=clock)
    assert cpu.pass_tokens(True, 0, float("-inf")) == 2 * policy_module.CPU_BATCH_PASS_TOKENS
    assert cpu.pass_tokens(True, 0, clock.now - 1) == policy_module.CPU_BATCH_PASS_TOKENS  # interactive came
    assert cpu.pass_tokens(False, 0, clock.now) == 512  # until a pass was timed
    cpu.pace.seconds_per_token = 0.7 / 1024
    assert cpu.pass_tokens(False, 0, clock.now) == 1024
    cpu.pace.seconds_per_token = 2.3 / 1024  # a slow host: cut to about CPU_WAIT_SECONDS
    assert cpu.pass_tokens(False, 0, clock.now) == 256
    assert cpu.pass_tokens(True, 0, clock.now - 1) == 256


def test_claims_run_ahead_by_batch_passes() -> None:
    accelerator = turns()
    assert accelerator.claim_tokens() == policy_module.CLAIM_AHEAD_PASSES * 4096
    assert accelerator.short_of_work(0) and not accelerator.short_of_work(policy_module.CLAIM_AHEAD_PASSES * 4096)
    assert accelerator.claims_batch(0, runs_interactive=False) and not accelerator.claims_batch(0, True)
    cpu = turns(engine=Shapes(launches_ahead=False))
    assert cpu.claim_tokens() == 4096  # at most a pass of tokens on CPU
    assert turns(engine=Shapes(pass_tokens=512, launches_ahead=False)).claim_tokens() == 512
    assert cpu.short_of_work(4 * 1024 - 1) and not cpu.short_of_work(4 * 1024)


def test_chunk_pieces() -> None:
    pace = Pace()
    assert chunk_piece_tokens(Shapes(), settings(), pace) is None  # an accelerator runs chunks whole
    cpu = Shapes(launches_ahead=False)
    assert chunk_piece_tokens(cpu, settings(), pace) == (policy_module.FIRST_PIECE_PASSES * 1024, False)
    pace.seconds_per_token = 1 / 500
    assert chunk_piece_tokens(cpu, settings(), pace) == pytest.approx((5000, True))


def test_pace_counts_passes_that_compiled_nothing() -> None:
    pace = Pace()
    assert pace.tokens_per_second() is None
    for tokens, compiled, expected in ((512, True, None), (512, False, 1 / 512), (100, False, 1 / 512)):
        pace.record(SimpleNamespace(tokens=tokens, seconds=1.0, compiled=compiled))  # type: ignore[arg-type]
        assert pace.seconds_per_token == expected
    assert pace.tokens_per_second() == pytest.approx(512)
