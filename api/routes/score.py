from fastapi import APIRouter
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import crud
from api.deps import CurrentKey, JobWaiterDep, RequestTokenizerDep, SessionDep, SettingsDep
from api.errors import APIError, job_error
from api.models import Job
from api.schemas import ErrorBody, ScoreRequest, ScoreResponse, Usage
from worker.celery_app import kick_drain

router = APIRouter(tags=["score"])


@router.post("/v1/score", response_model=ScoreResponse,
             responses={504: {"model": ErrorBody, "description": "`timeout`: still running; poll GET /jobs/{job_id}"}})
async def score(body: ScoreRequest, key: CurrentKey, session: SessionDep, request_tokenizer: RequestTokenizerDep,
                settings: SettingsDep, waiter: JobWaiterDep) -> ScoreResponse:
    """Synchronous scoring with the request and response of vLLM's and SGLang's /v1/score. It runs as a
    high-priority job through the same queue and workers; past SCORE_TIMEOUT_SECONDS it answers 504 with the
    job id (poll GET /jobs/{id}). While it waits it holds neither a thread nor a database connection."""
    job, _ = await run_in_threadpool(crud.create_job, session, key, body, request_tokenizer, settings,
                                     priority=crud.PRIORITY_SYNC)
    await run_in_threadpool(kick_drain)
    if not await waiter.wait(job.id, settings.score_timeout_seconds):
        raise APIError(504, "timeout", f"job {job.id} is not finished yet; poll GET /jobs/{job.id}", job_id=job.id)
    return await run_in_threadpool(_response, session, job)


def _response(session: Session, job: Job) -> ScoreResponse:
    session.refresh(job)
    out = crud.read_job(session, job)
    session.commit()  # the connection goes back to the pool now, not when the response has been sent
    if out.status == "cancelled":
        raise APIError(409, "cancelled", f"job {job.id} was cancelled", job_id=job.id)
    if out.error is not None:
        raise job_error(job.id, out.error.code, out.error.message)
    return ScoreResponse(id=job.id, created=int(job.created_at.timestamp()), model=job.model,
                         scores=out.scores or [], usage=Usage(prompt_tokens=job.prompt_tokens,
                                                              total_tokens=job.prompt_tokens))
