"""The pass loop's entry points that only the tests use: a claim of either job lane, a loop over given jobs or
claims, and a worker's claim over given sources."""

import threading
from collections.abc import Callable

from core import Scorer
from store import claims
from store.claims import ClaimedJob
from store.priorities import PRIORITY_BATCH
from store.settings import Settings, get_settings
from worker import drain
from worker.jobs import JobBook, JobSource
from worker.lake import ChunkFeed
from worker.policy import Source, policy_for


def claim_jobs(owner: str, settings: Settings, batch_round_tokens: int | None = None) -> list[ClaimedJob]:
    """Both lanes of the worker's model in turn: the ready interactive jobs if any, else one batch round."""
    return claims.claim_interactive(owner, settings, PRIORITY_BATCH) or \
        claims.claim_batch_round(owner, settings, batch_round_tokens)


def run_claims(scorer: Scorer, owner: str, settings: Settings, claim: Callable[[bool], list[ClaimedJob]],
               wake: threading.Event | None = None) -> int:
    """Runs a pass loop whose claims are `claim(interactive_only)`'s jobs."""
    policy = policy_for(scorer, settings, drain.pace_for(scorer))

    def claim_for(book: JobBook) -> drain.Claim:
        source = JobSource(owner, settings, book, policy.interactive_above)
        return lambda interactive_only: source.sinks(claim(interactive_only))  # type: ignore[return-value]

    return drain.run_loop(scorer, owner, settings, policy, claim_for, lambda: False, wake or threading.Event())


def run_jobs(scorer: Scorer, owner: str, jobs: list[ClaimedJob]) -> None:
    """Runs these claimed jobs (and claims nothing else)."""
    given = [jobs]
    run_claims(scorer, owner, get_settings(), lambda _: given.pop() if given else [])


def claimer(owner: str, settings: Settings, round_tokens: int, feed: ChunkFeed, scorer: Scorer) -> drain.Claimer:
    """A worker's claim over its job lanes and `feed`, as drain makes it; the jobs it claims are for looking at
    (their book writes nothing)."""
    policy = policy_for(scorer, settings, feed.pace, feed)
    jobs = JobSource(owner, settings, JobBook(None, owner, settings), policy.interactive_above,  # type: ignore[arg-type]
                     round_tokens)
    return drain.Claimer({Source.INTERACTIVE: jobs.claim_interactive, Source.UPLOADS: jobs.claim_round,
                          Source.CHUNKS: feed.take}, policy, settings.worker_model)
