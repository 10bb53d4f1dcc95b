"""Every error leaves the API as JSON {"error": {"code", "message"}} with a 4xx/5xx status."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorBody
from api.settings import get_settings
from core import ERROR_CODES, ScoringError

log = logging.getLogger(__name__)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "rate_limited",
    503: "unavailable",
}


# Documented on every authenticated route, so the OpenAPI schema lists the statuses and body clients will see.
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "Invalid request: the engine's error codes (score-semantics.md) or `invalid_webhook_url`"),
        (401, "Missing or wrong API key"),
        (404, "No such resource for this key"),
        (409, "Conflict: `idempotency_conflict`, `job_finished`..."),
        (413, "`body_too_large`"),
        (422, "`invalid_input`: malformed JSON, wrong types, unknown fields"),
        (500, "`internal_error`: a bug (the engine failed on the job at every attempt); the body names the job"),
        (503, "`unavailable`: the database is down or busy, or `worker_lost`: workers kept dying on the job; "
              "retry after `Retry-After` seconds"),
    )
}


class APIError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: object):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **extra: object) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(get_settings().retry_after_seconds)}


def _unavailable(message: str = "the database is unavailable; retry later") -> JSONResponse:
    return error_response(503, "unavailable", message, headers=_retry_after())


def job_error(job_id: str, code: str, message: str) -> APIError:
    """The HTTP error for a job that ended in error, as README's error table lists it: the engine's input
    errors are the client's (400); workers dying on the job is retryable (503); anything else is a bug (500)."""
    if code in ERROR_CODES:
        return APIError(400, code, message, job_id=job_id)
    if code == "worker_lost":
        return APIError(503, code, message, _retry_after(), job_id=job_id)
    return APIError(500, code, message, job_id=job_id)


# The HTTP layer's codes by status, turned round: the status the handlers below answer with each code.
_HTTP_STATUS = {code: status for status, code in _HTTP_CODES.items()}


def error_status(code: str) -> int:
    """The status a route answers with error `code`, for an answer given outside a route (an OpenAI Batch output
    line is what the synchronous route would have answered): the HTTP layer's codes as the handlers below answer
    them (`invalid_input` 422, a body that does not fit the route's schema or is not JSON; `not_found` 404,
    `method_not_allowed` 405, `body_too_large` 413, ...), else a failed job's error as `job_error` answers it
    (the engine's codes 400, `worker_lost` 503, anything else 500). (The engine's `invalid_input`, 400 from a
    route, is only raised for input that the schemas already refuse.)"""
    return _HTTP_STATUS.get(code) or job_error("", code, "").status


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, **exc.extra)

    @app.exception_handler(ScoringError)
    async def _scoring_error(_: Request, exc: ScoringError) -> JSONResponse:
        return error_response(400, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_input", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    # Postgres stopped or unreachable: a retryable 503, not a 500 (issue 5's chaos test).
    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return _unavailable()

    # Every pooled connection is in use (a burst of requests): retryable, like an unavailable database.
    @app.exception_handler(PoolTimeout)
    async def _pool_exhausted(_: Request, exc: PoolTimeout) -> JSONResponse:
        log.warning("database connection pool exhausted: %s", exc)
        return _unavailable("the database is busy; retry later")

    # A value the database cannot hold (e.g. a NUL byte in an id or cursor) is the client's mistake.
    @app.exception_handler(DataError)
    async def _bad_value(_: Request, exc: DataError) -> JSONResponse:
        return error_response(422, "invalid_input", f"a value in the request is not acceptable: {exc.orig}")

    @app.exception_handler(DBAPIError)
    async def _db_error(_: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return _unavailable()
        log.exception("database error")
        return error_response(500, "internal_error", "internal error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal error")
