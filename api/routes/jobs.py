from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentKey, ModelsDep, SessionDep, SettingsDep
from api.schemas import JobBody, JobList
from store import jobs as job_store
from store.broker import kick_drain
from store.models import ApiKey
from store.catalog import ModelCatalog
from store.schemas import JobCreate, JobOut, JobStatus, job_out
from store.settings import Settings

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post("", status_code=202, response_model=JobOut)
async def create_job(body: JobBody, key: CurrentKey, session: SessionDep, models: ModelsDep,
                     settings: SettingsDep, response: Response,
                     idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> JobOut:
    """Queue a scoring job, or with `"kind": "rerank"` a rerank job (the body of /v1/rerank; its `results` are
    what /v1/rerank answers). The same Idempotency-Key with the same body returns the same job; with another
    body, 409."""
    # One trip to a thread for the blocking work; the answer is then serialized on the event loop (a sync route
    # costs a second trip for that).
    return await run_in_threadpool(_create_job, body, key, session, models, settings, response, idempotency_key)


def _create_job(body: JobBody, key: ApiKey, session: Session, models: ModelCatalog, settings: Settings,
                response: Response, idempotency_key: str | None) -> JobOut:
    rerank = None
    model = models.get(body.model)
    if body.kind == "rerank":
        score_input, rerank = model.rerank.score_input(body)
        body = JobCreate(**score_input.model_dump(), webhook_url=body.webhook_url, metadata=body.metadata)
    job, created = job_store.create_job(session, key, body, model.tokenizer, settings,
                                        idempotency_key=idempotency_key, rerank=rerank)
    response.headers["Location"] = f"/jobs/{job.id}"
    if created:
        kick_drain(job.model)
        # Just inserted: no result and no webhook delivery yet, so the row as written is the whole answer.
        return job_out(job)
    response.headers["Idempotent-Replayed"] = "true"
    return job_store.read_job(session, job)


@router.get("", response_model=JobList)
def list_jobs(key: CurrentKey, session: SessionDep, status: JobStatus | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20, cursor: str | None = None) -> JobList:
    """This key's jobs, newest first, without scores (fetch a job for those). Pass `next_cursor` as `cursor`."""
    jobs, next_cursor = job_store.list_jobs(session, key, status, limit, cursor)
    return JobList(data=[job_store.read_job(session, job, with_scores=False) for job in jobs], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: str, key: CurrentKey, session: SessionDep) -> JobOut:
    return job_store.read_job(session, job_store.get_job(session, key, job_id))


@router.post("/{job_id}/cancel", response_model=JobOut, responses={202: {"model": JobOut}})
def cancel_job(job_id: str, key: CurrentKey, session: SessionDep, response: Response) -> JobOut:
    """Queued: cancelled now (200). Running: cancelled at the next pass boundary (202). Finished: 409."""
    job = job_store.cancel_job(session, job_store.get_job(session, key, job_id))
    if job.status != "cancelled":
        response.status_code = 202
    return job_store.read_job(session, job)
