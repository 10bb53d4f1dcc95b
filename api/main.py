"""The FastAPI app: `uvicorn --factory api.main:create_app` (what `packscore serve` runs)."""

import functools
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

import anyio.to_thread
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool

from api.deps import get_models
from api.errors import ERROR_RESPONSES, install_error_handlers
from api.limits import BodySizeLimitMiddleware
from api.metrics import Metrics, MetricsMiddleware
from api.routes import batches, health, jobs, models, score, workers
from api.waiter import JobWaiter
from store.lake.access import check_storage_prefixes
from store.settings import get_settings


# Polled every second by `packscore wait-ready`, load balancers and orchestrators: a line per poll buried the
# lines about the requests a user sends.
HEALTH_PATHS = ("/healthz", "/readyz")
UI_DIR = Path(__file__).parent / "ui"


class HealthPollFilter(logging.Filter):
    """Drops uvicorn's access-log lines of GET /healthz and /readyz; every other request keeps its line."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: args = (client, method, path with its query, HTTP version, status).
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[1] == "GET" and str(args[2]).split("?")[0] in HEALTH_PATHS)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Threads for the routes' blocking work. More than a few only fight over the GIL (the work is Python and
    # short database calls), which starves the event loop: /healthz and waiting calls answer late.
    anyio.to_thread.current_default_thread_limiter().total_tokens = get_settings().api_threads
    check_storage_prefixes(get_settings())
    # Load the models' tokenizers before taking traffic, so the first request is not slow; and their rerank
    # templates, so a RERANK_TEMPLATE that does not fit a model stops the start instead of failing requests.
    await run_in_threadpool(get_models)
    _answer_waiting_calls_on_stop(app.state.job_waiter)
    yield
    await app.state.job_waiter.stop()


def _answer_waiting_calls_on_stop(waiter: JobWaiter) -> None:
    """On SIGINT or SIGTERM, /v1/score calls still waiting answer 503 `stopping` with their job id at once, then
    the server's own handler stops it: it cuts the connections left after its graceful timeout, a 500 each.
    Only where the server runs in the main thread (uvicorn, `packscore serve`), whose handlers are chained."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        server_handler = signal.getsignal(signum)
        if callable(server_handler):
            signal.signal(signum, functools.partial(_stop_waiting_then, waiter, server_handler))


def _stop_waiting_then(waiter: JobWaiter, server_handler: Callable[[int, FrameType | None], object], signum: int,
                       frame: FrameType | None) -> None:
    waiter.stop_waiting()
    server_handler(signum, frame)


def create_app() -> FastAPI:
    settings = get_settings()
    # The tokenizer's own thread pool spins after each request's texts, taking CPU the API's request threads
    # need (with it a small request's tokenizing takes about 1.4x the CPU). Set before the tokenizer first runs;
    # an operator's own setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    access_log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HealthPollFilter) for f in access_log.filters):  # once per process, not per app
        access_log.addFilter(HealthPollFilter())
    # /docs and /redoc with their JavaScript and CSS served from the package: they work where no CDN is reachable.
    app = FastAPIOffline(title="packscore", version="0.1.0", lifespan=lifespan,
                  description="Batch scoring of (query, items, label_token_ids) with packed multi-item passes.")
    install_error_handlers(app)
    app.state.metrics = Metrics()
    app.state.job_waiter = JobWaiter(settings.database_url, settings.score_poll_seconds)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes, exempt_paths=("/batches",))
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    for router in (jobs.router, batches.router, score.router, models.router, workers.router):
        app.include_router(router, responses=ERROR_RESPONSES)
    app.include_router(health.router)
    # The page to watch the service: static files whose requests are the public routes above, with the user's key.
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
    return app

