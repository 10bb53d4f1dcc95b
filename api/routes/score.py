from fastapi import APIRouter
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentKey, JobWaiterDep, ModelsDep, SessionDep, SettingsDep
from api.schemas import ErrorBody
from api.waiter import JobProgress, JobWaiter
from core import RequestTokenizer
from store import jobs as job_store
from store.broker import kick_drain
from store.errors import ServiceError, job_error, retry_after
from store.models import ApiKey, Job
from store.priorities import PRIORITY_SYNC
from store.schemas import (RerankRequest, RerankResponse, ScoreInput, ScoreRequest, ScoreResponse, eta_seconds,
                           route_body)
from store.settings import Settings

router = APIRouter(tags=["score"])

_TIMEOUT = {504: {"model": ErrorBody, "description": "`timeout`: still running; poll GET /jobs/{job_id} (the error has "
                                                     "`job_id`, `items_done`, `items_total`, `eta_seconds`)"},
            503: {"model": ErrorBody, "description": "`stopping`: the API process is stopping while the job runs; "
                                                     "poll GET /jobs/{job_id} (the error has `job_id`), or "
                                                     "`unavailable`, `worker_lost`"}}


@router.post("/v1/score", response_model=ScoreResponse, responses=_TIMEOUT)
@router.post("/score", response_model=ScoreResponse, responses=_TIMEOUT, include_in_schema=False)
async def score(body: ScoreRequest, key: CurrentKey, session: SessionDep, models: ModelsDep,
                settings: SettingsDep, waiter: JobWaiterDep) -> ScoreResponse:
    """Synchronous scoring with the request and response of SGLang's /v1/score (label token ids required; vLLM's
    field names `text_1`/`text_2` are taken too, not its label-free answer shape). It runs as a
    high-priority job through the same queue and workers; past SCORE_TIMEOUT_SECONDS it answers 504 with the
    job id (poll GET /jobs/{id}). While it waits it holds neither a thread nor a database connection."""
    return await _run(body, None, key, session, models.get(body.model).tokenizer, settings, waiter)


@router.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=_TIMEOUT)
@router.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=_TIMEOUT,
             include_in_schema=False)
async def rerank(body: RerankRequest, key: CurrentKey, session: SessionDep, models: ModelsDep,
                 settings: SettingsDep, waiter: JobWaiterDep) -> RerankResponse:
    """Rerank as Cohere, Jina and vLLM define it: documents sorted by relevance to the query, P(yes) of the
    RERANK_TEMPLATE prompt against P(no). Runs like /v1/score (same queue, same timeout)."""
    model = models.get(body.model)
    score_input, rerank_spec = model.rerank.score_input(body)
    return await _run(score_input, rerank_spec, key, session, model.tokenizer, settings, waiter)


async def _run(body: ScoreInput, rerank: dict | None, key: ApiKey, session: Session,
               request_tokenizer: RequestTokenizer, settings: Settings,
               waiter: JobWaiter) -> ScoreResponse | RerankResponse:
    job = await run_in_threadpool(_submit, body, rerank, key, session, request_tokenizer, settings)
    if not await waiter.wait(job.id, settings.score_timeout_seconds):
        if waiter.stopping:
            raise ServiceError(503, "stopping", f"this API process is stopping; job {job.id} goes on: poll GET "
                               f"/jobs/{job.id} for its result", retry_after(), job_id=job.id)
        raise _timed_out(job, waiter.progress(job.id), settings.score_timeout_seconds)
    return await run_in_threadpool(_response, session, job)


def _timed_out(job: Job, seen: JobProgress | None, waited: float) -> ServiceError:
    """The 504 of a call its job outlasted: the job goes on; how far it got, about how long the rest takes at its
    pace so far (as the waiter's last poll saw it: no query of its own), and where requests this large belong."""
    done, total = (seen.items_done, seen.items_total) if seen else (0, job.items_total)
    eta = eta_seconds(done, total, seen.claimed_at or seen.started_at, seen.items_at_claim) if seen else None
    if seen is None or seen.started_at is None:
        where = f"not started yet: {total} items"
    else:
        where = f"{done} of {total} items scored" + (f", about {eta:.0f} s to go" if eta is not None else "")
    return ServiceError(
        504, "timeout", f"job {job.id} did not finish within {waited:g} s ({where}). It goes on: poll GET "
        f"/jobs/{job.id} for its result. Requests this large belong in POST /jobs, which answers at once (then "
        "poll it, or give a webhook_url); SCORE_TIMEOUT_SECONDS sets how long /v1/score waits.",
        job_id=job.id, items_done=done, items_total=total, eta_seconds=eta)


def _submit(body: ScoreInput, rerank: dict | None, key: ApiKey, session: Session, request_tokenizer: RequestTokenizer,
            settings: Settings) -> Job:
    # The insert and the kick in one trip to a thread, not two.
    job, _ = job_store.create_job(session, key, body, request_tokenizer, settings, priority=PRIORITY_SYNC,
                                  rerank=rerank)
    kick_drain(job.model)
    return job


def _response(session: Session, job: Job) -> ScoreResponse | RerankResponse:
    job = session.get(Job, job.id)  # the row as it is now (create_job's job is the row as written)
    logprobs = job_store.read_logprobs(session, job)
    session.commit()  # the connection goes back to the pool now, not when the response has been sent
    if job.status == "cancelled":
        raise ServiceError(409, "cancelled", f"job {job.id} was cancelled", job_id=job.id)
    if job.error_code is not None or logprobs is None:
        raise job_error(job.id, job.error_code or "internal_error", job.error_message or "")
    return route_body(job, logprobs)
