from fastapi import APIRouter

from api.deps import CurrentKey, SessionDep, SettingsDep
from store.schemas import WorkerList
from store.workers import worker_list

router = APIRouter(tags=["workers"])


@router.get("/workers", response_model=WorkerList)
def list_workers(_: CurrentKey, session: SessionDep, settings: SettingsDep) -> WorkerList:
    """The live workers, each with its model, host, chips, device kind, attention path, dtype, warm-up state,
    and passes/s, items/s and busy share over the last minute; and the deployment's items/s per minute over the
    last hour. From the passes table, which records passes that ran jobs (not those of reference-batch chunks).
    Any key reads it: workers are the deployment's, and it names no job, batch or key."""
    workers = worker_list(session, settings)
    session.commit()  # the connection goes back to the pool before the answer is serialized
    return workers
