"""The errors a service operation refuses with: an HTTP status, a stable code and a message. The API answers
them as JSON {"error": {"code", "message"}}; the data layer raises them (an idempotency conflict, a missing job,
a batch too large) and an OpenAI Batch output line carries the status its route would have answered."""

from core import ERROR_CODES
from store.settings import get_settings

HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    503: "unavailable",
}


class ServiceError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: object):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra


def retry_after() -> dict[str, str]:
    return {"Retry-After": str(get_settings().retry_after_seconds)}


def job_error(job_id: str, code: str, message: str) -> ServiceError:
    """The HTTP error for a job that ended in error, as README's error table lists it: the engine's input
    errors are the client's (400); workers dying on the job is retryable (503); anything else is a bug (500)."""
    if code in ERROR_CODES:
        return ServiceError(400, code, message, job_id=job_id)
    if code == "worker_lost":
        return ServiceError(503, code, message, retry_after(), job_id=job_id)
    return ServiceError(500, code, message, job_id=job_id)


# The HTTP layer's codes by status, turned round: the status the API's handlers (api/errors.py) answer with each code.
HTTP_STATUS = {code: status for status, code in HTTP_CODES.items()}


def error_status(code: str) -> int:
    """The status a route answers with error `code`, for an answer given outside a route (an OpenAI Batch output
    line is what the synchronous route would have answered): the HTTP layer's codes as the API's handlers answer
    them (`invalid_input` 422, a body that does not fit the route's schema or is not JSON; `not_found` 404,
    `method_not_allowed` 405, `body_too_large` 413, ...), else a failed job's error as `job_error` answers it
    (the engine's codes 400, `worker_lost` 503, anything else 500). (The engine's `invalid_input`, 400 from a
    route, is only raised for input that the schemas already refuse.)"""
    return HTTP_STATUS.get(code) or job_error("", code, "").status
