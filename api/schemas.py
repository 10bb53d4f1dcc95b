"""Request and response bodies (the OpenAPI schema at /docs comes from these)."""

import json
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from api.models import Job, WebhookDelivery
from core import scores_from_logprobs

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class ScoreInput(BaseModel):
    """The scoring request of score-semantics.md. Types are loose on purpose where the engine gives the
    precise error code (mixed text/ids, empty lists, out-of-range ids)."""

    query: str | list[StrictInt]
    items: list[str | list[StrictInt]]
    label_token_ids: list[StrictInt]
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        # JSON allows lone surrogates ("\ud800"); neither the tokenizer nor the database can take them.
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
        except (TypeError, ValueError):
            pass  # not JSON-shaped: the field validators say what is wrong
        return data


class JobCreate(ScoreInput):
    model_config = ConfigDict(extra="forbid")

    return_logprobs: StrictBool = False
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: dict[str, Any] | None = None


class ScoreRequest(ScoreInput):
    """/v1/score as in vLLM and SGLang: `text_1` is accepted for `query`, and a single item may be a string."""

    model_config = ConfigDict(extra="ignore")

    query: str | list[StrictInt] = Field(validation_alias=AliasChoices("query", "text_1"))

    @field_validator("items", mode="before")
    @classmethod
    def _single_item(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["scoring"] = "scoring"
    created: int
    model: str
    scores: list[list[float]]
    usage: Usage


class Progress(BaseModel):
    items_done: int
    items_total: int


class ErrorInfo(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error response: `{"error": {"code", "message"}}` (some errors add fields, e.g. `job_id`)."""

    error: ErrorInfo


class WebhookState(BaseModel):
    id: str
    url: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    delivered_at: datetime | None


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    progress: Progress
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    usage: Usage
    scores: list[list[float]] | None = None
    logprobs: list[list[float]] | None = None
    error: ErrorInfo | None = None
    webhook_url: str | None
    webhook: WebhookState | None = None
    metadata: dict[str, Any] | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobOut]
    next_cursor: str | None


def _utc(value: datetime | None) -> datetime | None:
    # Stored naive in UTC; shown with an explicit offset.
    return value.replace(tzinfo=UTC) if value else None


def job_out(job: Job, logprobs: np.ndarray | None = None, delivery: WebhookDelivery | None = None) -> JobOut:
    """The public view of a job; `logprobs` ([items, labels]) only for a succeeded job whose scores are shown."""
    scores = raw = None
    if logprobs is not None:
        scores = scores_from_logprobs(logprobs, job.request.get("apply_softmax", False)).tolist()
        raw = np.asarray(logprobs, np.float64).tolist() if job.return_logprobs else None
    return JobOut(
        id=job.id,
        status=job.status,
        model=job.model,
        progress=Progress(items_done=job.items_done, items_total=job.items_total),
        created_at=_utc(job.created_at),
        started_at=_utc(job.started_at),
        finished_at=_utc(job.finished_at),
        attempts=job.attempts,
        usage=Usage(prompt_tokens=job.prompt_tokens, total_tokens=job.prompt_tokens),
        scores=scores,
        logprobs=raw,
        error=ErrorInfo(code=job.error_code, message=job.error_message or "") if job.error_code else None,
        webhook_url=job.webhook_url,
        webhook=WebhookState.model_validate(delivery, from_attributes=True) if delivery else None,
        metadata=job.metadata_,
    )


BatchStatus = Literal["validating", "in_progress", "cancelling", "completed", "cancelled", "failed"]


class BatchLine(ScoreInput):
    """One line of a batch file: a scoring request (as for POST /jobs) with the caller's `custom_id`."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=256)
    return_logprobs: StrictBool = False

    @field_validator("custom_id")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        # The database cannot store NUL in a text column; one such line must not fail the whole upload.
        if "\x00" in value:
            raise ValueError("custom_id must not contain NUL characters")
        return value


class BatchCreate(BaseModel):
    """The JSON body form of POST /batches (small batches; large ones upload a JSONL file)."""

    model_config = ConfigDict(extra="forbid")

    requests: list[Any]
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: dict[str, Any] | None = None


class BatchCounts(BaseModel):
    total: int
    succeeded: int
    failed: int
    cancelled: int


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus
    model: str
    counts: BatchCounts
    progress: Progress
    created_at: datetime
    in_progress_at: datetime | None
    finished_at: datetime | None
    error: ErrorInfo | None = None
    webhook_url: str | None
    webhook: WebhookState | None = None
    metadata: dict[str, Any] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut]
    next_cursor: str | None
