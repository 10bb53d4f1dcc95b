from datetime import timedelta

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select, text

from api.deps import SessionDep, SettingsDep
from store.broker import broker_reachable
from store.models import Worker, utcnow

router = APIRouter(tags=["health"])


# async: it answers on the event loop, even while every worker thread is busy.
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready: the body says which check failed"}})
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready to serve: the database and the broker answer and at least one ready worker was seen recently.
    "warming" (503) while the only live workers still compile their programs (WARMUP=ladder)."""
    checks: dict[str, bool | int] = {}
    try:
        session.execute(text("SELECT 1"))
        cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
        states = dict(session.execute(select(Worker.state, func.count()).where(Worker.last_seen_at >= cutoff)
                                      .group_by(Worker.state)).all())
        checks["database"] = True
    except Exception:  # readiness reports, it does not fail
        states = {}
        checks["database"] = False
    checks["broker"] = broker_reachable()
    checks["workers"] = states.get("ready", 0)
    checks["warming"] = states.get("warming", 0)
    ready = bool(checks["database"] and checks["broker"] and checks["workers"] > 0)
    status = "ready" if ready else "warming" if checks["warming"] and checks["database"] and checks["broker"] \
        else "not_ready"
    return JSONResponse({"status": status, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus exposition: requests, jobs by state, queue depth, passes, items per pass, pass latency,
    webhook deliveries, live workers."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
