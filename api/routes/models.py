from fastapi import APIRouter

from api.deps import CurrentKey, ModelsDep, SessionDep, SettingsDep
from api.schemas import ModelCard, ModelList, ModelWorkers
from store.workers import live_workers, model_dtypes

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
def list_models(_: CurrentKey, session: SessionDep, models: ModelsDep, settings: SettingsDep) -> ModelList:
    """The deployment's models (MODELS), as OpenAI's /v1/models lists them, each with its live workers. A
    request names one with `model` (none: the default, the first); a model with no live worker keeps its
    jobs queued until one starts. `dtype`: what its workers compute in (one per model: store.workers.register)."""
    workers = live_workers(session, settings)
    dtypes = model_dtypes(session, settings)
    session.commit()  # the connection goes back to the pool before the answer is serialized
    return ModelList(data=[
        ModelCard(id=name, created=models.created, default=name == models.default,
                  workers=ModelWorkers(ready=workers.get(name, {}).get("ready", 0),
                                       warming=workers.get(name, {}).get("warming", 0)),
                  dtype=dtypes.get(name))
        for name in models.names])
