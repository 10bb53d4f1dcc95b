from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from api import crud
from api.deps import CurrentKey, RequestTokenizerDep, SessionDep, SettingsDep
from api.schemas import JobCreate, JobList, JobOut, JobStatus
from worker.celery_app import kick_drain

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post("", status_code=202, response_model=JobOut)
def create_job(body: JobCreate, key: CurrentKey, session: SessionDep, request_tokenizer: RequestTokenizerDep, settings: SettingsDep,
               response: Response,
               idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> JobOut:
    """Queue a scoring job. The same Idempotency-Key with the same body returns the same job; with another body, 409."""
    job, created = crud.create_job(session, key, body, request_tokenizer, settings, idempotency_key=idempotency_key)
    if created:
        kick_drain()
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/jobs/{job.id}"
    return crud.read_job(session, job)


@router.get("", response_model=JobList)
def list_jobs(key: CurrentKey, session: SessionDep, status: JobStatus | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20, cursor: str | None = None) -> JobList:
    """This key's jobs, newest first, without scores (fetch a job for those). Pass `next_cursor` as `cursor`."""
    jobs, next_cursor = crud.list_jobs(session, key, status, limit, cursor)
    return JobList(data=[crud.read_job(session, job, with_scores=False) for job in jobs], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: str, key: CurrentKey, session: SessionDep) -> JobOut:
    return crud.read_job(session, crud.get_job(session, key, job_id))


@router.post("/{job_id}/cancel", response_model=JobOut, responses={202: {"model": JobOut}})
def cancel_job(job_id: str, key: CurrentKey, session: SessionDep, response: Response) -> JobOut:
    """Queued: cancelled now (200). Running: cancelled at the next pass boundary (202). Finished: 409."""
    job = crud.cancel_job(session, crud.get_job(session, key, job_id))
    if job.status != "cancelled":
        response.status_code = 202
    return crud.read_job(session, job)
