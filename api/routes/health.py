from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.deps import SessionDep, SettingsDep
from store.broker import broker_reachable
from store.workers import live_device_groups, live_workers, waiting_models

router = APIRouter(tags=["health"])


# async: it answers on the event loop, even while every worker thread is busy.
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready: the body says which check failed"}})
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready to serve: the database and the broker answer, a ready worker was seen recently, and no model's live
    workers are all still warming. "warming" (503) while some model's only live workers still compile their
    programs (WARMUP=ladder). `models`: each configured model's ready and warming workers, and whether jobs of it
    wait; a model with no live worker keeps its jobs queued until one starts (`packscore wait-ready` waits for
    it). `device_groups`: each live worker's host, chips (`packscore worker --devices`; null for a worker
    started alone), model and state."""
    checks: dict[str, bool | int] = {}
    models = list(settings.served_models)
    try:
        session.execute(text("SELECT 1"))
        workers = live_workers(session, settings)
        waiting = waiting_models(session, models)
        groups = live_device_groups(session, settings)
        checks["database"] = True
    except Exception:  # readiness reports, it does not fail
        workers, waiting, groups = {}, set(), []
        checks["database"] = False
    checks["broker"] = broker_reachable()
    checks["workers"] = sum(states.get("ready", 0) for states in workers.values())
    checks["warming"] = sum(states.get("warming", 0) for states in workers.values())
    warming_only = [model for model in models if workers.get(model, {}).get("warming", 0)
                    and not workers.get(model, {}).get("ready", 0)]
    ready = bool(checks["database"] and checks["broker"] and checks["workers"] > 0 and not warming_only)
    status = "ready" if ready else "warming" if checks["warming"] and checks["database"] and checks["broker"] \
        else "not_ready"
    per_model = {model: {"workers": workers.get(model, {}).get("ready", 0),
                         "warming": workers.get(model, {}).get("warming", 0), "jobs_waiting": model in waiting}
                 for model in models}
    return JSONResponse({"status": status, "checks": checks, "models": per_model, "device_groups": groups},
                        status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus exposition: requests, jobs by state, queue depth, passes, items per pass, pass latency,
    webhook deliveries, live workers."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
