"""The wire format shared by the API, the batch files and the webhooks: scoring and rerank requests as the API
validates them and batch lines carry them, and jobs and batches as responses, result lines and webhook payloads
show them (the OpenAPI schema at /docs comes from these and api/schemas.py)."""

import difflib
import json
import typing
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError
from sqlalchemy import Row

from core import scores_from_logprobs
from store.models import Batch, Job, WebhookDelivery, utcnow

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


def check_storable(data: object, allow_nan: bool = True) -> None:
    """Raises ValueError where a parsed JSON value cannot be stored or tokenized: JSON allows lone surrogates
    ("\ud800"), which neither the tokenizer nor the database can take, and nesting deeper than Python's
    recursion limit, which no encoder gets through; without `allow_nan`, NaN and Infinity (not JSON)."""
    try:
        json.dumps(data, ensure_ascii=False, allow_nan=allow_nan).encode()
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    except RecursionError:
        raise ValueError("the value is nested too deeply") from None
    except ValueError as exc:
        if "Out of range float" in str(exc):
            raise ValueError("NaN and Infinity are not JSON numbers") from None
    except TypeError:
        pass  # not JSON-shaped: the field validators say what is wrong


MAX_METADATA_DEPTH = 32
MAX_INSTRUCTION_CHARS = 4096


def check_metadata(value: object) -> object:
    """Raises ValueError where `metadata` cannot be stored (`check_storable`) or nests deeper than
    MAX_METADATA_DEPTH: it is stored and echoed back as sent, and pydantic's serializer, which echoes it, stops
    at about 255 levels (a 500 after the job was taken)."""
    check_storable(value, allow_nan=False)  # Python's parser takes NaN and Infinity: stored, they come back null
    level, depth = [value], 0
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        if depth > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata nests deeper than {MAX_METADATA_DEPTH} levels")
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return value


Metadata = Annotated[dict[str, Any] | None, AfterValidator(check_metadata)]


class _ValidUnicode(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        check_storable(data)
        return data


class ScoreInput(_ValidUnicode):
    """The scoring request of docs/score-semantics.md. Types are loose on purpose where the engine gives the
    precise error code (mixed text/ids, empty lists, out-of-range ids)."""

    query: str | list[StrictInt]
    items: list[str | list[StrictInt]]
    label_token_ids: list[StrictInt]
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: str | None = None


class JobCreate(ScoreInput):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["score"] = "score"

    return_logprobs: StrictBool = False
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: Metadata = None


# What vLLM's and OpenAI's clients send to /v1/score and /v1/rerank beside the request, none of which changes a
# score here: accepted and dropped, so those clients work unchanged. Every other unknown field is refused (422,
# naming it): a typo of one of ours (`apply_sofmax`) must never silently change the answer, so no near miss of
# our fields may join this list (tests/test_api_jobs.py checks). `truncate_prompt_tokens` only as null: a number
# asks for truncation, which packscore never does.
OTHER_ENGINES_FIELDS = ("user", "priority", "request_id", "mm_processor_kwargs", "truncate_prompt_tokens")


class _DropInBody(BaseModel):
    """A body of the routes other engines' clients call (/v1/score, /v1/rerank, and OpenAI Batch lines' bodies)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_other_engines_fields(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        if data.get("truncate_prompt_tokens") is not None:
            raise PydanticCustomError(
                "unsupported", "truncate_prompt_tokens: packscore never truncates (send it as null, or leave it out); "
                "a request over the model's limits is refused with `too_many_tokens`")
        return {k: v for k, v in data.items() if k not in OTHER_ENGINES_FIELDS}


class ScoreRequest(ScoreInput, _DropInBody):
    """/v1/score as in vLLM and SGLang: `text_1` and `text_2` are accepted for `query` and `items`, and a single
    item may be a string."""

    query: str | list[StrictInt] = Field(validation_alias=AliasChoices("query", "text_1"))
    items: list[str | list[StrictInt]] = Field(validation_alias=AliasChoices("items", "text_2"))

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
    dtype: str | None = None  # what the scores were computed in (one per model across a deployment)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")  # Cohere's `title`, say, is not read: refused, not dropped

    text: str


class RerankInput(_ValidUnicode):
    """/v1/rerank as Cohere, Jina and vLLM define it (store/rerank.py says how it is scored)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    # None or 0 (vLLM's default): every document.
    top_n: StrictInt | None = Field(default=None, ge=0)
    return_documents: StrictBool = True
    # The task, in Qwen3-Reranker's words; the template's default when unset. Bounded: some templates repeat
    # it after every document.
    instruction: str | None = Field(default=None, max_length=MAX_INSTRUCTION_CHARS)


class RerankRequest(RerankInput, _DropInBody):
    pass


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    object: Literal["rerank"] = "rerank"
    created: int
    model: str
    results: list[RerankResult]
    usage: Usage


class Progress(BaseModel):
    items_done: int
    items_total: int


class ErrorInfo(BaseModel):
    code: str
    message: str


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
    kind: Literal["score", "rerank"] = "score"
    status: JobStatus
    model: str
    progress: Progress
    # A running job's seconds left at its pace since its current attempt was claimed (null before that attempt's
    # first items, and once it has ended).
    eta_seconds: float | None = None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    usage: Usage
    # The dtype its scores were computed in, once it has succeeded (one per model across a deployment).
    dtype: str | None = None
    scores: list[list[float]] | None = None
    logprobs: list[list[float]] | None = None
    # A rerank job's answer, as /v1/rerank gives it (its scores are [P(yes), P(no)] per document, in order).
    results: list[RerankResult] | None = None
    error: ErrorInfo | None = None
    webhook_url: str | None
    webhook: WebhookState | None = None
    metadata: dict[str, Any] | None


def eta_seconds(done: float, total: float, started_at: datetime | None, done_at_start: float = 0) -> float | None:
    """Seconds left for work started at `started_at` (naive UTC) at its pace since: `done - done_at_start` in the
    time since then (a resumed job's items kept from earlier attempts are not its pace); None before anything is
    done since."""
    if started_at is None or done - done_at_start <= 0 or total <= 0:
        return None
    elapsed = (utcnow() - started_at).total_seconds()
    return round(max(0.0, elapsed * (total - done) / (done - done_at_start)), 1)


def _utc(value: datetime | None) -> datetime | None:
    # Stored naive in UTC; shown with an explicit offset.
    return value.replace(tzinfo=UTC) if value else None


def _error(row: "Job | Batch") -> "ErrorInfo | None":
    return ErrorInfo(code=row.error_code, message=row.error_message or "") if row.error_code else None


def _webhook(delivery: WebhookDelivery | None) -> "WebhookState | None":
    return WebhookState.model_validate(delivery, from_attributes=True) if delivery else None


def rerank_results(request: dict, logprobs: np.ndarray) -> list[RerankResult]:
    """A rerank job's results from its [documents, (yes, no)] log-probabilities (or [documents, (yes,)]: the
    label's probability): most relevant first."""
    rerank = request["rerank"]
    logprobs = np.asarray(logprobs, np.float64)
    relevance = scores_from_logprobs(logprobs, logprobs.shape[-1] > 1)[:, 0] if len(logprobs) else np.zeros(0)
    order = np.argsort(-relevance, kind="stable")[: rerank["top_n"] or None]
    # The stored items are the documents between the template's separator and suffix; they are not stored twice.
    # (Jobs stored before the separator existed have none.)
    start, end = len(rerank.get("separator", "")), len(rerank["suffix"])
    return [RerankResult(index=int(i), relevance_score=float(relevance[i]),
                         document=RerankDocument(text=request["items"][i][start:len(request["items"][i]) - end])
                         if rerank["return_documents"] else None) for i in order]


def score_lists(logprobs: np.ndarray, apply_softmax: bool,
                return_logprobs: bool) -> tuple[list[list[float]], list[list[float]] | None]:
    """A succeeded request's `scores` (docs/score-semantics.md: its labels' probabilities, or their softmax) and,
    where asked for, its `logprobs` (float64), as answers and result files give them, from its [items, labels]
    log-probabilities."""
    scores = scores_from_logprobs(logprobs, apply_softmax).tolist()
    return scores, np.asarray(logprobs, np.float64).tolist() if return_logprobs else None


def route_body(job: "Job | Row", logprobs: np.ndarray) -> "ScoreResponse | RerankResponse":
    """What the synchronous route (/v1/score or /v1/rerank) answers for a succeeded job. `job` is a Job or a
    row of its columns id, created_at, model, request, prompt_tokens and dtype."""
    usage = Usage(prompt_tokens=job.prompt_tokens, total_tokens=job.prompt_tokens)
    created = int(job.created_at.replace(tzinfo=UTC).timestamp())
    if "rerank" in job.request:
        return RerankResponse(id=job.id, created=created, model=job.model,
                              results=rerank_results(job.request, logprobs), usage=usage)
    scores, _ = score_lists(logprobs, job.request.get("apply_softmax", False), False)
    return ScoreResponse(id=job.id, created=created, model=job.model, usage=usage, scores=scores, dtype=job.dtype)


def job_out(job: Job, logprobs: np.ndarray | None = None, delivery: WebhookDelivery | None = None) -> JobOut:
    """The public view of a job; `logprobs` ([items, labels]) only for a succeeded job whose scores are shown."""
    scores = raw = results = None
    if logprobs is not None:
        scores, raw = score_lists(logprobs, job.request.get("apply_softmax", False), job.return_logprobs)
        results = rerank_results(job.request, logprobs) if "rerank" in job.request else None
    return JobOut(
        id=job.id,
        kind="rerank" if "rerank" in job.request else "score",
        status=job.status,
        model=job.model,
        progress=Progress(items_done=job.items_done, items_total=job.items_total),
        eta_seconds=eta_seconds(job.items_done, job.items_total, job.claimed_at or job.started_at,
                                job.items_at_claim or 0) if job.status == "running" else None,
        created_at=_utc(job.created_at),
        started_at=_utc(job.started_at),
        finished_at=_utc(job.finished_at),
        attempts=job.attempts,
        usage=Usage(prompt_tokens=job.prompt_tokens, total_tokens=job.prompt_tokens),
        dtype=job.dtype if logprobs is not None else None,
        scores=scores,
        logprobs=raw,
        results=results,
        error=_error(job),
        webhook_url=job.webhook_url,
        webhook=_webhook(delivery),
        metadata=job.metadata_,
    )


BatchStatus = Literal["validating", "in_progress", "cancelling", "completed", "cancelled", "failed"]


def _no_nul(value: str) -> str:
    # The database cannot store NUL in a text column; one such line must not fail the whole upload.
    if "\x00" in value:
        raise ValueError("custom_id must not contain NUL characters")
    return value


CustomId = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_no_nul)]


class BatchLine(ScoreInput):
    """One line of a batch file: a scoring request (as for POST /jobs) with the caller's `custom_id`."""

    model_config = ConfigDict(extra="forbid")

    custom_id: CustomId
    return_logprobs: StrictBool = False


class OpenAIBatchLine(BaseModel):
    """One line of an OpenAI Batch API input file (vLLM's run-batch reads the same): the body of a POST to one
    of the synchronous routes."""

    model_config = ConfigDict(extra="forbid")

    custom_id: CustomId
    method: str
    url: str
    body: dict[str, Any]


class BatchCreate(BaseModel):
    """The JSON body form of POST /batches (small batches; large ones upload a JSONL file)."""

    model_config = ConfigDict(extra="forbid")

    requests: list[Any]
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: Metadata = None
    # The batch's one model (default: its first request's).
    model: str | None = Field(default=None, max_length=100)


class ColumnsSpec(BaseModel):
    """A pair table's columns: the query, the item (document), id columns passed through to the output, and
    optionally a column holding each row's label token ids."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=256)
    item: str = Field(min_length=1, max_length=256)
    ids: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=32)
    label: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("ids")
    @classmethod
    def _not_a_result_column(cls, ids: list[str]) -> list[str]:
        # An output row holds its ids beside these: an id of the same name would be overwritten, silently.
        taken = [name for name in ids if name in ("scores", "logprobs", "error_code", "error_message", "error")]
        if taken:
            raise ValueError(f"{taken[0]!r} names a column of the results (scores, logprobs, error_code, "
                             "error_message, error): rename it in the input")
        return ids


class BatchSource(_ValidUnicode):
    """The JSON body form of POST /batches that names its data instead of carrying it (a reference batch):
    `input` (a URI, a list of URIs, or a glob; s3://, gs://, az:// or a local path), `output` (a URI prefix),
    `format` (jsonl, parquet, csv; default from the extension), and for pair tables `columns` and
    `label_token_ids`. The same body sent again finds its batch (see store.lake.chunks); `overwrite` runs it
    again instead."""

    model_config = ConfigDict(extra="forbid")

    input: Annotated[str, Field(min_length=1, max_length=4096)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(min_length=1, max_length=10_000)]
    output: str = Field(min_length=1, max_length=4096)
    format: Literal["jsonl", "parquet", "csv"] | None = None
    output_format: Literal["parquet", "jsonl"] = "parquet"
    columns: ColumnsSpec | None = None
    label_token_ids: list[StrictInt] | None = None
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    return_logprobs: StrictBool = False
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: Metadata = None
    # The model every row is scored with (default: the deployment's first).
    model: str | None = Field(default=None, max_length=100)
    overwrite: StrictBool = False


class DocsRate(BaseModel):
    """A rate docs/performance.md measured (rows of a pair table per second, low to high), and where."""

    where: str
    low: float
    high: float


class Rate(BaseModel):
    """Rows (a pair table's row: one item) and input bytes per second of a model's reference batches as this
    deployment ran them lately (`measured`; `basis` says over what), else None, and the figures from the docs
    (`docs`) as the only estimate there is."""

    rows_per_second: float | None
    bytes_per_second: float | None
    measured: bool
    basis: str
    docs: list[DocsRate]


class EarlierBatch(BaseModel):
    """The key's batch that already holds the output, and what the same request does with it: `follow` (it is
    running: the request answers it), `report` (it completed), `resume` (cancelled, or failed as its output
    refused writes: a new batch takes its committed rows), `replace` (a new batch from row 0)."""

    id: str
    status: str
    then: Literal["follow", "report", "resume", "replace"]
    rows_committed: int


class BatchPlan(BaseModel):
    """POST /batches/plan: what POST /batches would run for the same body, planned the same way, with no batch
    created. `columns`: those read (None: JSONL lines as requests); `rows` None where unknown until read (CSV,
    JSONL); `bytes`: the byte ranges' (CSV, JSONL); `estimate_seconds` from a measured `rate` (None before this
    deployment has run a reference batch of the model, or where nothing it measured applies)."""

    model: str
    input: list[str]
    objects: int
    columns: list[str] | None
    rows: int | None
    bytes: int | None
    chunks: int
    output: str
    earlier: EarlierBatch | None
    rate: Rate
    estimate_seconds: float | None


class RowCounts(BaseModel):
    """A reference batch's input rows: done (each has one result row, an error row included), of which failed,
    and all of them (None while unknown: JSONL and CSV are planned by size)."""

    done: int
    failed: int
    total: int | None


class ChunkCounts(BaseModel):
    """`total` may grow while the batch runs (a worker on CPU cuts a chunk into pieces: more chunks, the same
    rows); `total_final` says it no longer can."""

    total: int
    total_final: bool
    done: int
    in_flight: int
    failed: int
    cancelled: int


class BatchCounts(BaseModel):
    # The batch's requests (an upload's lines, a reference batch's rows) as planned; null for a reference batch
    # of CSV or JSONL until every chunk has been read (docs/batches.md).
    total: int | None
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
    # Reference batches only: the chunks, the rows done so far (counts are rows there), the output prefix of
    # the batch's objects, and an estimate of the seconds left.
    chunks: ChunkCounts | None = None
    rows: RowCounts | None = None
    input: str | list[str] | None = None  # as the user gave it: a URI, a list of URIs or a glob
    output: str | None = None
    manifest: str | None = None  # once the batch has ended: `_manifest.json` under `output`
    eta_seconds: float | None = None
    resumed_from: str | None = None  # the cancelled or failed batch whose committed chunks and folder this took over


def batch_out(batch: Batch, counts: BatchCounts, progress: Progress, delivery: WebhookDelivery | None,
              **reference: Any) -> BatchOut:
    """The public view of a batch, with the counts and progress of its requests (an uploaded batch) or its
    chunks (a reference batch; `reference`: its chunks, rows, input, output, manifest and eta_seconds)."""
    return BatchOut(id=batch.id, status=batch.status, model=batch.model, counts=counts, progress=progress,
                    created_at=_utc(batch.created_at), in_progress_at=_utc(batch.in_progress_at),
                    finished_at=_utc(batch.finished_at), error=_error(batch), webhook_url=batch.webhook_url,
                    webhook=_webhook(delivery), metadata=batch.metadata_, **reference)


# Stored naive in UTC; shown with an explicit offset.
UtcDatetime = Annotated[datetime, AfterValidator(lambda value: value.replace(tzinfo=value.tzinfo or UTC))]


class WarmupPrograms(BaseModel):
    done: int
    total: int


class WorkerOut(BaseModel):
    """A live worker, with its passes over the last minute (`passes_per_second`, `items_per_second`, `busy`: the
    share of the minute its passes ran)."""

    id: str
    model: str
    host: str | None
    device_group: str | None  # its chips as `packscore worker --devices` gave them ("tpu:0,1"); None: the host's own
    device_kind: str | None  # tpu, gpu or cpu as its device group or attention path tells; None where neither does
    attention: str | None
    dtype: str
    state: str  # "warming" or "ready"
    programs: WarmupPrograms | None  # while it warms
    started_at: UtcDatetime
    last_seen_at: UtcDatetime
    passes_per_second: float
    items_per_second: float
    busy: float


class ThroughputPoint(BaseModel):
    minute: UtcDatetime
    items_per_second: float


class WorkerList(BaseModel):
    """GET /workers: the live workers and the deployment's items/s per minute over the last hour (at most 60
    points, oldest first; `history_seconds`: how far back the passes kept reach, at most an hour)."""

    object: Literal["list"] = "list"
    data: list[WorkerOut]
    throughput: list[ThroughputPoint]
    history_seconds: float


def _field_names(schema: object) -> set[str]:
    """The names a body of `schema` (a model, or a union of them) may use, its nested models' and its aliases
    (`text_1`) included."""
    names: set[str] = set()
    types, seen = [schema], set()
    while types:
        t = types.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            if t in seen:
                continue
            seen.add(t)
            for name, info in t.model_fields.items():
                names.add(name)
                if isinstance(info.validation_alias, AliasChoices):
                    names.update(a for a in info.validation_alias.choices if isinstance(a, str))
                types.append(info.annotation)
        else:
            types.extend(typing.get_args(t))
    return names


def describe_errors(schema: object, errors: list[dict], value: object, where: str = "") -> str:
    """Pydantic's errors of `value` read as `schema` (a model or a union of them; None if unknown), at most five,
    as `field: what is wrong`. An unknown field is named with the field it is closest to (`labels`: did you mean
    `label_token_ids`?), and a missing field with the unknown one beside it that looks like it."""
    known = _field_names(schema)
    parts = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join([where, *loc] if where else loc)
        message = str(err.get("msg"))
        if err.get("type") == "extra_forbidden" and loc:
            close = difflib.get_close_matches(loc[-1], sorted(known), 1, 0.5)
            message = "unknown field" + (f" (did you mean `{close[0]}`?)" if close else "")
        elif err.get("type") == "missing" and loc:
            beside = _at(value, loc[:-1])
            unknown = ([k for k in beside if isinstance(k, str) and k not in known and k not in OTHER_ENGINES_FIELDS]
                       if isinstance(beside, dict) else [])
            if close := difflib.get_close_matches(loc[-1], unknown, 1, 0.5):
                message += f" (the body has `{close[0]}`: did you mean `{loc[-1]}`?)"
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


def _at(value: object, path: list[str]) -> object:
    """The part of a body at an error's location (a union's tag in it, as `score` in /jobs' errors, is skipped)."""
    for step in path:
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
    return value
