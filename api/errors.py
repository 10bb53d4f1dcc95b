"""Every error leaves the API as JSON {"error": {"code", "message"}} with a 4xx/5xx status."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorBody
from core import ScoringError
from store.errors import HTTP_CODES, ServiceError, retry_after
from store.schemas import describe_errors

log = logging.getLogger(__name__)

# Documented on every authenticated route, so the OpenAPI schema lists the statuses and body clients will see.
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "Invalid request: the engine's error codes (docs/score-semantics.md) or `invalid_webhook_url`"),
        (401, "Missing or wrong API key"),
        (404, "No such resource for this key"),
        (409, "Conflict: `idempotency_conflict`, `job_finished`..."),
        (413, "`body_too_large`"),
        (415, "`unsupported_media_type`: a JSON body sent without `content-type: application/json`"),
        (422, "`invalid_input`: malformed JSON, wrong types, unknown fields"),
        (500, "`internal_error`: a bug (the engine failed on the job at every attempt); the body names the job"),
        (503, "`unavailable`: the database is down or busy, `worker_lost`: workers kept dying on the job, or "
              "`stopping`: the API stopped while /v1/score waited (poll `job_id`); retry after `Retry-After` seconds"),
    )
}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **extra: object) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status_code=status, headers=headers)


def _validation_message(request: Request, exc: RequestValidationError) -> str:
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":  # FastAPI gives the offset into the body; people read lines
            return _json_error_message(str(exc.body), err["loc"][-1], err.get("ctx", {}).get("error", ""))
    # The route's body model names the fields an unknown one may have meant.
    body_field = getattr(request.scope.get("route"), "body_field", None)
    schema = getattr(getattr(body_field, "field_info", None), "annotation", None)
    return describe_errors(schema, list(exc.errors()), exc.body) or "invalid request"


def _json_error_message(document: str, offset: int, reason: str) -> str:
    line = document.count("\n", 0, offset) + 1
    column = offset - (document.rfind("\n", 0, offset) + 1) + 1
    return f"the body is not valid JSON: {reason} at line {line}, column {column} (character {offset})"


def _not_json_body(request: Request, exc: RequestValidationError) -> str | None:
    """Why a JSON route got no JSON object, when the reason is the request's content-type (FastAPI reads the
    body as JSON only under a JSON content-type; any other body fails as "not a valid dictionary")."""
    content_type = request.headers.get("content-type")
    if content_type and content_type.split(";")[0].strip().lower().endswith(("/json", "+json")):
        return None
    # A body that is there but was not read as JSON (no body at all stays FastAPI's "missing").
    if not any(tuple(err.get("loc", ())) == ("body",) and err.get("type") != "missing" for err in exc.errors()):
        return None
    got = f"content-type {content_type!r}" if content_type else "no content-type"
    return f"send the body as JSON with 'content-type: application/json' (this request had {got})"


def _unavailable(message: str = "the database is unavailable; retry later") -> JSONResponse:
    return error_response(503, "unavailable", message, headers=retry_after())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _api_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, **exc.extra)

    @app.exception_handler(ScoringError)
    async def _scoring_error(_: Request, exc: ScoringError) -> JSONResponse:
        return error_response(400, exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if (message := _not_json_body(request, exc)) is not None:
            return error_response(415, "unsupported_media_type", message)
        return error_response(422, "invalid_input", _validation_message(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "error")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    # Postgres stopped or unreachable: a retryable 503, not a 500.
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
