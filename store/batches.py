"""Batch rows: validating an upload line by line into batch-lane jobs, reads and counts, cancel, streamed
results, and settling a batch once none of its requests is left to run (the API and the workers share this).

A batch's requests are jobs (`batch_id` set, priority PRIORITY_BATCH), so the worker's leases, sweeper and
exactly-once result writes cover them as they cover interactive jobs. A bad line becomes a job that failed
at upload, so its error is a result line like any other.

A line is either a job's fields with a `custom_id` or an OpenAI Batch API line (`custom_id`, `method`, `url`,
`body`: a POST to /v1/score or /v1/rerank); each line says which it is, so one file may mix them.
"""

import hashlib
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from sqlalchemy import Row, case, exists, func, insert, select, update
from sqlalchemy.orm import Session

from core import ScoringError
from store.batch_counts import add_ended
from store.catalog import ModelCatalog, ServedModel
from store.counters import count
from store.db import newest_first, session_factory
from store.errors import ServiceError, error_status
from store.jobs import job_request
from store.models import BATCH_TERMINAL_STATUSES, TERMINAL_STATUSES, ApiKey, Batch, Job, JobResult, new_id, utcnow
from store.outbox import enqueue_webhook, latest_delivery, vet_webhook_url
from store.priorities import PRIORITY_BATCH
from store.schemas import (BatchCounts, BatchCreate, BatchLine, BatchOut, BatchSource, OpenAIBatchLine, Progress,
                           RerankRequest, ScoreInput, ScoreRequest, batch_out, describe_errors, rerank_results,
                           route_body, score_lists)
from store.settings import Settings

ModelT = TypeVar("ModelT", bound=BaseModel)
# With this many lines read and none of them a JSON object, the upload is not JSONL: stop reading it.
NOT_JSONL_AFTER_LINES = 1000
# The routes an OpenAI Batch line may POST to, and the body each takes.
OPENAI_URLS = {"/v1/score": ScoreRequest, "/score": ScoreRequest, "/v1/rerank": RerankRequest,
               "/rerank": RerankRequest}


def upload_timeout() -> ServiceError:
    return ServiceError(408, "upload_timeout", "the upload did not finish within BATCH_UPLOAD_TIMEOUT_SECONDS")


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _storable(text: str) -> str:
    # A bad line's custom_id or message may hold NUL or lone surrogates, which a text column cannot take.
    return text.replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode()


def start_batch(session: Session, key: ApiKey, model: str, settings: Settings, webhook_url: str | None,
                metadata: dict | None) -> Batch:
    """Commits the batch row (status validating), so it is visible while its upload comes in."""
    vet_webhook_url(webhook_url, settings.webhook_allowlist)
    batch = Batch(api_key_id=key.id, model=model, webhook_url=webhook_url, metadata_=metadata)
    session.add(batch)
    session.commit()
    return batch


class Ingest:
    """Turns the lines of one upload into job rows, inserted a chunk at a time in one transaction (committed
    by `finish`), so the API holds one chunk, never the batch.

    A batch runs one model (its workers claim it whole, and tenants take turns within each model's queue):
    the `model` of POST /batches (`fixed`), else the model of its first request (the default if that names
    none). A request naming another model fails with `unknown_model`."""

    def __init__(self, session: Session, batch: Batch, models: ModelCatalog, settings: Settings,
                 fixed: bool = False) -> None:
        self.session = session
        self.batch = batch
        self.models = models
        self.model: ServedModel | None = models.get(batch.model) if fixed else None
        self.settings = settings
        self.lines = 0  # every line, blank ones included (line numbers in error messages)
        self.total = 0  # requests: non-blank lines
        self.objects = 0  # lines that are JSON objects
        self.queued = 0
        self.failed = 0  # lines that failed at upload
        self.items_total = 0  # the items of its requests
        # 16-byte digests, not the ids: duplicate detection in bounded memory (about 10 MB per 100k lines), with
        # the line each id was first used on.
        self._seen: dict[bytes, int] = {}
        self._rows: list[dict] = []

    def add_lines(self, lines: Iterable[bytes | None]) -> None:
        """Raw JSONL lines; None stands for a line over the length limit."""
        for raw in lines:
            self.lines += 1
            if raw is None:
                self._add(None, LineError("line_too_long", f"the line is over {self.settings.max_body_bytes} bytes"))
                continue
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested too deeply
                self._add(None, LineError("invalid_json", f"not a JSON value: {exc}"))
                continue
            self._add(value)
        self._flush()

    def add_values(self, values: Iterable[Any]) -> None:
        """Already parsed requests (the JSON body form)."""
        for value in values:
            self.lines += 1
            self._add(value)
        self._flush()

    def _add(self, value: Any, error: LineError | None = None) -> None:
        self.total += 1
        if self.total > self.settings.batch_max_requests:
            raise ServiceError(413, "batch_too_large",
                               f"a batch holds at most {self.settings.batch_max_requests} requests")
        if isinstance(value, dict):
            self.objects += 1
        elif self.objects == 0 and self.lines >= NOT_JSONL_AFTER_LINES:
            raise ServiceError(400, "invalid_jsonl", f"none of the first {self.lines} lines is a JSON object")
        custom_id = value.get("custom_id") if isinstance(value, dict) else None
        now = utcnow()
        # Every row has every key: the chunk is one multi-row INSERT.
        row = {"id": new_id("job"), "api_key_id": self.batch.api_key_id, "batch_id": self.batch.id,
               "priority": PRIORITY_BATCH, "model": self.model.name if self.model else self.batch.model,
               "request": {}, "tokens": None,
               "return_logprobs": False,
               "request_hash": "", "items_total": 0, "items_done": 0, "prompt_tokens": 0, "attempts": 0,
               "cancel_requested": False, "created_at": now, "custom_id": None, "query_key": None,
               "error_code": None, "error_message": None, "finished_at": None}
        try:
            if error is not None:
                raise error
            row.update(self._validate(value))
        except LineError as exc:
            # A repeated custom_id's error line keeps it, and its message the line numbers: the client can tell the
            # line refused from the first line's result.
            if not (isinstance(custom_id, str) and custom_id):
                custom_id = None
            row.update(status="failed", error_code=exc.code, finished_at=now,
                       error_message=_storable(f"line {self.lines}: {exc.message}")[:2000],
                       custom_id=_storable(custom_id)[:256] if custom_id else None)
        self._rows.append(row)
        if len(self._rows) >= self.settings.batch_chunk_rows:
            self._flush()

    def _validate(self, value: Any) -> dict:
        body, custom_id, return_logprobs = parse_line(value)
        model = self._model_of(body.model)
        rerank = None
        if isinstance(body, RerankRequest):
            try:
                body, rerank = model.rerank.score_input(body)
            except ScoringError as exc:
                raise LineError(exc.code, exc.message) from None
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        if digest in self._seen:
            raise LineError("duplicate_custom_id",
                             f"custom_id {custom_id!r} was already used on line {self._seen[digest]}")
        self._seen[digest] = self.lines
        return self._request(body, model, custom_id, return_logprobs, rerank)

    def _model_of(self, name: str | None) -> ServedModel:
        if self.model is None:  # the first request decides the batch's model
            try:
                self.model = self.models.get(name)
            except ScoringError as exc:
                raise LineError(exc.code, exc.message) from None
        elif name is not None and name != self.model.name:
            raise LineError("unknown_model", f"model {name!r}: this batch runs {self.model.name!r} (a batch runs one "
                                             "model: the `model` of POST /batches, else its first request's)")
        return self.model

    def _request(self, body: ScoreInput, model: ServedModel, custom_id: str, return_logprobs: bool,
                 rerank: dict | None) -> dict:
        try:
            tokenized = model.tokenizer.tokenize(body.query, body.items, body.label_token_ids, body.item_first)
        except ScoringError as exc:
            raise LineError(exc.code, exc.message) from None
        self.queued += 1
        query_key = hashlib.blake2b(json.dumps(body.query).encode(), digest_size=16).hexdigest()
        return {"status": "queued", "model": model.name, "custom_id": custom_id, "request": job_request(body, rerank),
                "tokens": tokenized.to_bytes(),
                "return_logprobs": return_logprobs, "items_total": tokenized.n_items,
                "prompt_tokens": tokenized.prompt_tokens, "query_key": query_key}

    def _flush(self) -> None:
        if self._rows:
            self.session.execute(insert(Job), self._rows)
            failed = sum(row["status"] == "failed" for row in self._rows)
            count(self.session, "jobs_finished", failed, label="failed")
            self.failed += failed
            self.items_total += sum(row["items_total"] for row in self._rows)
            self._rows = []

    def finish(self) -> Batch:
        """Commits the requests; the batch is then in progress (or already completed if no line was valid)."""
        self._flush()
        if self.total == 0:
            raise ServiceError(400, "empty_batch", "the batch has no requests")
        if self.objects == 0:
            raise ServiceError(400, "invalid_jsonl", "no line of the upload is a JSON object")
        now = utcnow()
        model = self.model.name if self.model else self.batch.model
        if not self.session.execute(update(Batch).where(Batch.id == self.batch.id, Batch.status == "validating")
                                    .values(status="in_progress", total=self.total, in_progress_at=now,
                                            model=model, failed=self.failed,
                                            items_total=self.items_total)).rowcount:
            raise upload_timeout()  # the sweeper gave up on this upload already
        if model != self.batch.model:  # lines that failed before the first request set the batch's model
            self.session.execute(update(Job).where(Job.batch_id == self.batch.id, Job.model != model)
                                 .values(model=model))
        settle_batch(self.session, self.batch.id)
        self.session.commit()
        self.session.refresh(self.batch)
        return self.batch


def parse_line(value: Any) -> tuple[ScoreInput | RerankRequest, str, bool]:
    """One line of a batch (either format) as (its body, custom_id, return_logprobs), or a LineError."""
    if not isinstance(value, dict):
        raise LineError("invalid_input", "the line is not a JSON object")
    if {"method", "url", "body"} & value.keys():
        line = _parse(OpenAIBatchLine, value)
        if line.method.upper() != "POST":
            raise LineError("method_not_allowed", f"method {line.method!r}: only POST is served")
        if line.url not in OPENAI_URLS:
            raise LineError("unknown_url", f"url {line.url!r} is not one of {', '.join(OPENAI_URLS)}")
        return _parse(OPENAI_URLS[line.url], line.body, "body"), line.custom_id, False
    body = _parse(BatchLine, value)
    return body, body.custom_id, body.return_logprobs


def _parse(schema: type[ModelT], value: Any, where: str = "") -> ModelT:
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        raise LineError("invalid_input", describe_errors(schema, exc.errors(), value, where)) from None


def fail_upload(session: Session, batch: Batch, code: str, message: str) -> None:
    """The upload was refused or broke off: none of its requests is kept; the batch is failed with the error
    (unless the sweeper failed it first, past BATCH_UPLOAD_TIMEOUT_SECONDS)."""
    session.rollback()
    _fail(session, batch, code, message)
    session.commit()


def _fail(session: Session, batch: Batch, code: str, message: str) -> None:
    if session.execute(update(Batch).where(Batch.id == batch.id, Batch.status == "validating").values(
            status="failed", error_code=code, error_message=message, finished_at=utcnow())).rowcount:
        session.refresh(batch)
        _enqueue_batch_webhook(session, batch)


async def jsonl_lines(stream: AsyncIterator[bytes], settings: Settings) -> AsyncIterator[list[bytes | None]]:
    """Splits a streamed body into lines, a chunk of lines at a time. A line longer than MAX_BODY_BYTES is
    skipped (reported as None); more than BATCH_MAX_BYTES in all is a 413. Linear in the body's size (each
    byte is scanned once and joined once), so it can run on the event loop."""
    limit = settings.max_body_bytes
    pieces: list[bytes] = []  # the line not yet ended
    pending = received = 0
    overlong = False
    lines: list[bytes | None] = []
    async for data in stream:
        received += len(data)
        if received > settings.batch_max_bytes:
            raise ServiceError(413, "batch_too_large", f"a batch file is at most {settings.batch_max_bytes} bytes")
        start = 0
        while (cut := data.find(b"\n", start)) >= 0:
            if not overlong:
                pending += cut - start
                overlong = pending > limit
            if not overlong:
                lines.append(b"".join((*pieces, data[start:cut])) if pieces else data[start:cut])
            else:
                lines.append(None)
            pieces, pending, overlong, start = [], 0, False, cut + 1
        if start < len(data) and not overlong:
            pieces.append(data[start:])
            pending += len(data) - start
            if pending > limit:
                pieces, overlong = [], True
        if len(lines) >= settings.batch_chunk_rows:
            yield lines
            lines = []
    if overlong:
        lines.append(None)
    elif pieces:
        lines.append(b"".join(pieces))
    yield lines


def parse_batch_body(body: bytes) -> BatchCreate | BatchSource:
    """The JSON body form of an upload, or of a reference batch (one that names `input`; run it in a thread:
    a large body takes a while to parse)."""
    try:
        value = json.loads(body)
        schema = BatchSource if isinstance(value, dict) and "input" in value else BatchCreate
        return schema.model_validate(value)
    except RecursionError:
        raise ServiceError(422, "invalid_input", "invalid JSON batch body: nested too deeply") from None
    except ValueError as exc:  # ValidationError is a ValueError too
        message = describe_errors(schema, exc.errors(), value) if isinstance(exc, ValidationError) else str(exc)
        raise ServiceError(422, "invalid_input", f"invalid JSON batch body: {message}") from None


def expire_uploads(session: Session, settings: Settings) -> list[str]:
    """Fails the batches still `validating` BATCH_UPLOAD_TIMEOUT_SECONDS after they were created: their upload
    died with its API process (the API fails the batch itself on any error it lives through)."""
    cutoff = utcnow() - timedelta(seconds=settings.batch_upload_timeout_seconds)
    expired = list(session.scalars(select(Batch).where(Batch.status == "validating", Batch.created_at < cutoff)
                                   .with_for_update(skip_locked=True)))
    for batch in expired:
        timeout = upload_timeout()
        _fail(session, batch, timeout.code, timeout.message)
    return [batch.id for batch in expired]


def unsettled_batches(session: Session) -> set[str]:
    """The uploaded batches that are over but were not settled (the sweeper settles them): those running or
    cancelling with no queued or running request left (a worker died between its last result and settling the
    batch). First, the queued requests of a cancelling batch are cancelled: a running one handed back after the
    cancel (its worker stopped) went back to the queue, which no claim reads for that batch."""
    cancelling = select(Batch.id).where(Batch.status == "cancelling", Batch.source.is_(None))
    stranded = session.execute(update(Job).where(Job.batch_id.in_(cancelling), Job.status == "queued")
                               .values(status="cancelled", finished_at=utcnow())
                               .returning(Job.batch_id, Job.items_done)).all()
    if stranded:
        count(session, "jobs_finished", len(stranded), label="cancelled")
        add_ended(session, [(batch_id, "cancelled", done) for batch_id, done in stranded])
    live = exists().where(Job.batch_id == Batch.id, Job.status.in_(("queued", "running")))
    return set(session.scalars(select(Batch.id).where(Batch.status.in_(("in_progress", "cancelling")),
                                                      Batch.source.is_(None), ~live)))


def settle_batch(session: Session, batch_id: str) -> bool:
    """Ends a running or cancelling batch that has no queued or running request left (completed or cancelled)
    and queues its webhook. Conditional, so of concurrent callers exactly one settles it."""
    busy = exists().where(Job.batch_id == batch_id, Job.status.in_(("queued", "running")))
    changed = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.status.in_(("in_progress", "cancelling")), ~busy)
        .values(status=case((Batch.status == "cancelling", "cancelled"), else_="completed"), finished_at=utcnow())
    ).rowcount
    if changed:
        batch = session.get(Batch, batch_id)
        session.refresh(batch)
        _enqueue_batch_webhook(session, batch)
    return bool(changed)


def _enqueue_batch_webhook(session: Session, batch: Batch) -> None:
    if batch.webhook_url:
        enqueue_webhook(session, batch.api_key_id, batch.webhook_url, f"batch.{batch.status}",
                        read_batch(session, batch).model_dump(mode="json", exclude={"webhook"}), batch_id=batch.id)


def get_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    batch = session.scalar(select(Batch).where(Batch.id == batch_id, Batch.api_key_id == key.id))
    if batch is None:  # another tenant's batch is indistinguishable from a missing one
        raise ServiceError(404, "not_found", f"no batch {batch_id!r}")
    return batch


def read_batch(session: Session, batch: Batch) -> BatchOut:
    counts = {"succeeded": 0, "failed": 0, "cancelled": 0}
    items_total = items_done = 0
    for status, n, total, done in session.execute(
            select(Job.status, func.count(), func.coalesce(func.sum(Job.items_total), 0),
                   func.coalesce(func.sum(Job.items_done), 0)).where(Job.batch_id == batch.id).group_by(Job.status)):
        if status in counts:
            counts[status] = n
        items_total += total
        items_done += done
    return batch_out(batch, BatchCounts(total=batch.total, **counts),
                     Progress(items_done=items_done, items_total=items_total), latest_delivery(session, batch.id))


def read_uploaded(session: Session, batches: list[Batch]) -> dict[str, BatchOut]:
    """Uploaded batches as read_batch shows them, by id, from the counts on their rows (store/batch_counts.py)
    and their running requests' items done, in one query for them all: a listing reads no batch's requests
    but those running. A request handed back keeps its items done, shown here again once it runs (a batch's
    requests are short: few span passes, the only ones that keep items)."""
    running = dict(session.execute(
        select(Job.batch_id, func.sum(Job.items_done)).where(Job.batch_id.in_([batch.id for batch in batches]),
                                                             Job.status == "running").group_by(Job.batch_id)).all())
    return {batch.id: batch_out(batch, BatchCounts(total=batch.total, succeeded=batch.succeeded, failed=batch.failed,
                                                   cancelled=batch.cancelled),
                                Progress(items_done=batch.items_ended + int(running.get(batch.id) or 0),
                                         items_total=batch.items_total), latest_delivery(session, batch.id))
            for batch in batches}


def list_batches(session: Session, key: ApiKey, limit: int, cursor: str | None) -> tuple[list[Batch], str | None]:
    """A page of the key's batches, newest first (`newest_first`)."""
    return newest_first(session, select(Batch).where(Batch.api_key_id == key.id), Batch.id, limit, cursor)


def cancel_batch(session: Session, batch: Batch) -> Batch:
    """Queued requests are cancelled now; running ones finish (the batch is cancelling until they have)."""
    if batch.status in BATCH_TERMINAL_STATUSES:
        raise ServiceError(409, "batch_finished", f"batch {batch.id} is already {batch.status}")
    if batch.status == "validating":
        raise ServiceError(409, "batch_validating", f"batch {batch.id} is still being uploaded")
    now = utcnow()
    session.execute(update(Batch).where(Batch.id == batch.id, Batch.status == "in_progress")
                    .values(status="cancelling"))
    cancelled = session.execute(update(Job).where(Job.batch_id == batch.id, Job.status == "queued")
                                .values(status="cancelled", finished_at=now).returning(Job.items_done)).scalars().all()
    count(session, "jobs_finished", len(cancelled), label="cancelled")
    add_ended(session, [(batch.id, "cancelled", done) for done in cancelled])
    settle_batch(session, batch.id)
    session.commit()
    session.refresh(batch)
    return batch


def iter_results(batch_id: str, page_rows: int, openai: bool = False) -> Iterator[bytes]:
    """The finished requests as JSONL, read from the database a page at a time (each page its own short
    transaction, so a long download neither holds a snapshot nor the batch in memory). `openai`: OpenAI
    Batch API output lines instead of this service's own. An ended batch's download that comes up short of its
    requests raises, so that the response breaks off rather than end as if whole: retention deletes an expired
    batch's requests a thousand at a time, in the order the pages read them."""
    with session_factory()() as session:
        expected = session.scalar(select(Batch.total).where(Batch.id == batch_id,
                                                            Batch.status.in_(BATCH_TERMINAL_STATUSES)))
    after, sent = "", 0
    while True:
        with session_factory()() as session:
            rows = session.execute(
                select(Job.id, Job.custom_id, Job.status, Job.error_code, Job.error_message, Job.items_total,
                       Job.return_logprobs, Job.request, Job.model, Job.created_at, Job.prompt_tokens, Job.dtype,
                       JobResult.n_labels, JobResult.logprobs)
                .outerjoin(JobResult, JobResult.job_id == Job.id)
                .where(Job.batch_id == batch_id, Job.status.in_(TERMINAL_STATUSES), Job.id > after)
                .order_by(Job.id).limit(page_rows)).all()
        if not rows:
            break
        out = []
        for row in rows:
            logprobs = None
            if row.status == "succeeded" and row.logprobs is not None:
                logprobs = np.frombuffer(row.logprobs, np.float32).reshape(row.items_total, row.n_labels)
            if row.status == "cancelled":
                error = {"code": "cancelled", "message": "the batch was cancelled before this request ran"}
            elif logprobs is None:
                error = {"code": row.error_code or "internal_error", "message": row.error_message or ""}
            else:
                error = None
            line = _openai_line(row, logprobs, error) if openai else _line(row, logprobs, error)
            out.append(json.dumps(line, separators=(",", ":")) + "\n")
        yield "".join(out).encode()
        sent += len(rows)
        after = rows[-1].id
        if len(rows) < page_rows:
            break
    if expected is not None and sent < expected:
        raise RuntimeError(f"batch {batch_id}: {expected - sent} of its {expected} results were deleted (retention) "
                           "during the download")


def _line(row: Row, logprobs: np.ndarray | None, error: dict | None) -> dict:
    """This service's result line: `{"custom_id", "scores", "logprobs"?, "results"? (rerank), "dtype"?, "error"?}`."""
    line: dict[str, Any] = {"custom_id": row.custom_id, "scores": None}
    if logprobs is not None:
        line["scores"], raw = score_lists(logprobs, row.request.get("apply_softmax", False), row.return_logprobs)
        if raw is not None:
            line["logprobs"] = raw
        if "rerank" in row.request:
            line["results"] = [r.model_dump(exclude_none=True) for r in rerank_results(row.request, logprobs)]
        if row.dtype is not None:
            line["dtype"] = row.dtype
    else:
        line["error"] = error
    return line


# A line's own error codes, and the route's code each stands for, for the status of its OpenAI output line:
# a POST to a url the app does not serve is 404, a body that is not JSON 422, one over MAX_BODY_BYTES 413; a
# repeated custom_id (no route has one) is the client's mistake, 400. Other codes are the routes' own.
_LINE_ROUTE_CODE = {"unknown_url": "not_found", "invalid_json": "invalid_input", "line_too_long": "body_too_large",
                    "duplicate_custom_id": "bad_request"}


def _openai_line(row: Row, logprobs: np.ndarray | None, error: dict | None) -> dict:
    """The OpenAI Batch API's output line. As there, a request the route answered has `response` (an error
    answer too, with its status and `{"error": ...}` body) and `error` null; one that never ran (cancelled)
    has `response` null and `error` set."""
    line: dict[str, Any] = {"id": row.id, "custom_id": row.custom_id, "response": None, "error": None}
    if logprobs is not None:
        body = route_body(row, logprobs).model_dump(mode="json", exclude_none=True)
        line["response"] = {"status_code": 200, "request_id": row.id, "body": body}
    elif row.status == "cancelled":
        line["error"] = error
    else:
        status = error_status(_LINE_ROUTE_CODE.get(error["code"], error["code"]))
        line["response"] = {"status_code": status, "request_id": row.id, "body": {"error": error}}
    return line
