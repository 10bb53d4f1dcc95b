from datetime import timedelta

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select, text

from api.deps import SessionDep, SettingsDep
from api.models import Worker, utcnow
from worker.celery_app import broker_reachable

router = APIRouter(tags=["health"])


# async: it answers on the event loop, even while every worker thread is busy.
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready: the body says which check failed"}})
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready to serve: the database and the broker answer and at least one worker was seen recently."""
    checks: dict[str, bool | int] = {}
    try:
        session.execute(text("SELECT 1"))
        cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
        workers = session.scalar(select(func.count()).select_from(Worker).where(Worker.last_seen_at >= cutoff)) or 0
        checks["database"] = True
    except Exception:  # readiness reports, it does not fail
        workers = 0
        checks["database"] = False
    checks["broker"] = broker_reachable()
    checks["workers"] = workers
    ready = bool(checks["database"] and checks["broker"] and workers > 0)
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus exposition: requests, jobs by state, queue depth, passes, items per pass, pass latency,
    webhook deliveries, live workers."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
