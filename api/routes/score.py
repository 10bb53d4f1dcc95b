import time

from fastapi import APIRouter

from api import crud
from api.deps import CurrentKey, RequestTokenizerDep, SessionDep, SettingsDep
from api.errors import APIError
from api.schemas import ErrorBody, ScoreRequest, ScoreResponse, Usage
from core import ERROR_CODES
from worker.celery_app import kick_drain

router = APIRouter(tags=["score"])


@router.post("/v1/score", response_model=ScoreResponse,
             responses={504: {"model": ErrorBody, "description": "`timeout`: still running; poll GET /jobs/{job_id}"}})
def score(body: ScoreRequest, key: CurrentKey, session: SessionDep, request_tokenizer: RequestTokenizerDep,
          settings: SettingsDep) -> ScoreResponse:
    """Synchronous scoring with the request and response of vLLM's and SGLang's /v1/score. It runs as a
    high-priority job through the same queue and workers; past SCORE_TIMEOUT_SECONDS it answers 504 with the
    job id (poll GET /jobs/{id})."""
    job, _ = crud.create_job(session, key, body, request_tokenizer, settings, priority=crud.PRIORITY_SYNC)
    kick_drain()
    deadline = time.monotonic() + settings.score_timeout_seconds
    while job.status in ("queued", "running"):
        if time.monotonic() > deadline:
            raise APIError(504, "timeout", f"job {job.id} is still {job.status}; poll GET /jobs/{job.id}",
                           job_id=job.id)
        time.sleep(settings.score_poll_seconds)
        session.refresh(job)
        session.commit()  # end the read transaction so the next poll sees the worker's commits
    out = crud.read_job(session, job)
    if out.status == "cancelled":
        raise APIError(409, "cancelled", f"job {job.id} was cancelled", job_id=job.id)
    if out.error is not None:
        status = 400 if out.error.code in ERROR_CODES else 500
        raise APIError(status, out.error.code, out.error.message, job_id=job.id)
    return ScoreResponse(id=job.id, created=int(job.created_at.timestamp()), model=job.model,
                         scores=out.scores or [], usage=Usage(prompt_tokens=job.prompt_tokens,
                                                              total_tokens=job.prompt_tokens))
