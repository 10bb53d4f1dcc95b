"""The bodies only HTTP uses: POST /jobs's two kinds, list pages and the error body (the rest of the wire format
is store/schemas.py, shared with batch files and webhooks)."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from store.schemas import BatchOut, ErrorInfo, JobCreate, JobOut, Metadata, RerankInput


class RerankJobCreate(RerankInput):
    """POST /jobs with `"kind": "rerank"`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["rerank"]
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: Metadata = None


def _job_kind(value: object) -> str:
    kind = value.get("kind", "score") if isinstance(value, dict) else getattr(value, "kind", "score")
    return kind if kind in ("score", "rerank") else "score"  # an unknown kind fails JobCreate's Literal


# The body of POST /jobs: a scoring request, or a rerank request with "kind": "rerank".
JobBody = Annotated[Annotated[JobCreate, Tag("score")] | Annotated[RerankJobCreate, Tag("rerank")],
                    Discriminator(_job_kind)]


class ErrorBody(BaseModel):
    """Every error response: `{"error": {"code", "message"}}` (some errors add fields, e.g. `job_id`)."""

    error: ErrorInfo


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobOut]
    next_cursor: str | None


class ModelWorkers(BaseModel):
    """A model's workers seen within WORKER_STALE_SECONDS: ready, and still compiling their programs."""

    ready: int
    warming: int


class ModelCard(BaseModel):
    """One model of GET /v1/models, as OpenAI's, with its live workers (none: its jobs wait in the queue)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "packscore"
    default: bool  # the model of a request that names none
    workers: ModelWorkers
    # The dtype its live workers compute in (one per model); left out while none has registered one.
    dtype: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut]
    next_cursor: str | None
