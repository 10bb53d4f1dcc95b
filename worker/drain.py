"""The pass loop: claimed jobs run coalesced in the engine's packed passes, with their progress, results and
cancellations written at each pass boundary (through store/jobqueue.py, whose writes keep the lease condition)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from core import PassResult, Scorer, ScoringError, TokenizedRequest
from store import jobqueue
from store.db import session_scope
from store.models import Job
from store.settings import Settings

log = logging.getLogger(__name__)

# Jobs this process is scoring right now: the only leases its heartbeat extends. A job left "running" by a
# failed drain (say the database went away) must not be kept alive by a heartbeat; its lease expires instead.
active_jobs: set[str] = set()


class Stopping(Exception):
    """The worker is shutting down: a drain releases its jobs at the next pass boundary."""


@dataclass
class RunningJob:
    job_id: str
    request: TokenizedRequest
    logprobs: np.ndarray
    done: int = 0
    closed: bool = field(default=False)  # finished, cancelled or no longer ours


def _pass_boundary(owner: str, result: PassResult, running: list[RunningJob]) -> None:
    """After each pass: record it, write progress and finished results, apply cancellations, drop lost leases."""
    touched = {part.request for part in result.scores}
    with session_scope() as session:
        n_items = sum(len(p.items) for p in result.scores)
        jobqueue.record_pass(session, owner, len(touched), n_items, result.tokens, result.padded_tokens,
                             result.seconds)
        state = jobqueue.leased(session, owner, [r.job_id for r in running if not r.closed])
        for index, run in enumerate(running):
            if run.closed:
                continue
            if run.job_id not in state:
                log.warning("job %s is no longer leased to %s; dropping it", run.job_id, owner)
                run.closed = True
            elif state[run.job_id]:
                jobqueue.finish_job(session, owner, run.job_id, "cancelled")
                run.closed = True
            elif run.done == run.request.n_items:
                jobqueue.finish_job(session, owner, run.job_id, "succeeded", logprobs=run.logprobs)
                run.closed = True
            elif index in touched:
                jobqueue.set_progress(session, owner, run.job_id, run.done)


def _tokenized(scorer: Scorer, job: Job) -> TokenizedRequest:
    """The request as the API tokenized it at submission; a job queued before tokens were stored (or for
    another model) is tokenized from its text here."""
    if job.tokens is not None and job.model == scorer.model_name:
        # Checked again as token ids (no tokenizer involved): this worker's limits may differ from the API's.
        stored = TokenizedRequest.from_bytes(job.tokens)
        return scorer.tokenize(list(stored.query), [list(item) for item in stored.items],
                               list(stored.label_token_ids), stored.item_first)
    r = job.request
    return scorer.tokenize(r["query"], r["items"], r["label_token_ids"], r["item_first"])


def run_jobs(scorer: Scorer, owner: str, jobs: list[Job], before_pass: Callable[[], None] | None = None) -> None:
    """Scores claimed jobs together: the engine coalesces them into packed passes. `before_pass` runs before
    each pass (the batch lane waits there while interactive jobs run)."""
    running: list[RunningJob] = []
    with session_scope() as session:
        for job in jobs:
            try:
                request = _tokenized(scorer, job)
            except ScoringError as exc:  # limits changed since the API accepted it
                jobqueue.finish_job(session, owner, job.id, "failed", error=(exc.code, exc.message))
                continue
            logprobs = np.full((request.n_items, len(request.label_token_ids)), np.nan, np.float32)
            if request.n_items == 0:
                jobqueue.finish_job(session, owner, job.id, "succeeded", logprobs=logprobs)
                continue
            running.append(RunningJob(job.id, request, logprobs))
    if not running:
        return
    active_jobs.update(r.job_id for r in running)
    passes = scorer.iter_passes([r.request for r in running])
    try:
        while True:
            if before_pass is not None:
                before_pass()
            if (result := next(passes, None)) is None:
                break
            for part in result.scores:
                run = running[part.request]
                run.logprobs[part.items] = part.logprobs
                run.done += len(part.items)
            _pass_boundary(owner, result, running)
            if all(r.closed for r in running):
                break  # closing the generator cancels the remaining passes
    finally:
        passes.close()
        active_jobs.difference_update(r.job_id for r in running)
    leftover = [r.job_id for r in running if not r.closed]
    if leftover:  # the engine reported fewer items than promised: a bug, not the user's fault
        with session_scope() as session:
            for job_id in leftover:
                jobqueue.finish_job(session, owner, job_id, "failed",
                        error=("internal_error", "the engine did not score every item"))


def drain(scorer: Scorer, owner: str, settings: Settings, lane: Literal["both", "interactive", "batch"] = "both",
          before_pass: Callable[[], None] | None = None) -> int:
    """Runs the ready jobs of `lane` until none is left; returns how many jobs it claimed. Lanes: "interactive",
    "batch" (one round per claim), or "both" (a batch round only when no interactive job is ready).
    `before_pass` runs before each claim and each pass; it raises Stopping to release the claimed jobs
    (back to the queue) and end the drain."""
    round_tokens = settings.batch_round_tokens or scorer.pass_tokens
    claim = {"both": lambda: jobqueue.claim_jobs(owner, settings, round_tokens),
             "interactive": lambda: jobqueue.claim_interactive(owner, settings),
             "batch": lambda: jobqueue.claim_batch_round(owner, settings, round_tokens)}[lane]
    total = 0
    while True:
        if before_pass is not None:
            before_pass()
        if not (jobs := claim()):
            return total
        total += len(jobs)
        try:
            run_jobs(scorer, owner, jobs, before_pass)
        except Stopping:
            jobqueue.release(owner, settings, [job.id for job in jobs], None)
            raise
        except Exception as exc:
            log.exception("drain failed; releasing its jobs")
            jobqueue.release(owner, settings, [job.id for job in jobs], f"{type(exc).__name__}: {exc}")
        jobqueue.settle_batches({job.batch_id for job in jobs if job.batch_id})


def heartbeat(owner: str, model: str, settings: Settings, attention: str | None = None,
              state: str = "ready") -> None:
    """Extends the leases of the jobs this process is scoring (not of a job left "running" by a failed drain:
    its lease must expire) and marks the worker alive."""
    jobqueue.heartbeat(owner, model, settings, active_jobs, attention, state)
