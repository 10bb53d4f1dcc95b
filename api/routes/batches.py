import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from typing import IO, Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api.deps import CurrentKey, ModelsDep, SessionDep, SettingsDep
from api.schemas import BatchList
from store import batches
from store.broker import kick_drain
from store.catalog import ModelCatalog
from store.errors import ServiceError
from store.lake import chunks
from store.models import ApiKey, Batch
from store.schemas import BatchCreate, BatchOut, BatchPlan, BatchSource, check_metadata
from store.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/batches", tags=["batches"])

def _inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its definitions inlined: a request body documented by hand cannot point
    into the model's own `$defs` (OpenAPI clients resolve `#/$defs/...` against the whole document, and
    schemathesis could then generate no JSON body at all)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):  # type: ignore[no-untyped-def]
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    return resolve(schema)


_UPLOAD_DOC = {
    "requestBody": {"content": {
        "application/jsonl": {"schema": {"type": "string", "format": "binary"}},
        "application/json": {"schema": {"oneOf": [_inline_schema(BatchCreate), _inline_schema(BatchSource)]}},
    }},
}


async def _json_body(request: Request, limit: int) -> BatchCreate | BatchSource:
    body = bytearray()
    async for data in request.stream():
        body += data
        if len(body) > limit:
            raise ServiceError(413, "body_too_large",
                               f"a JSON batch body is at most {limit} bytes; upload JSONL instead")
    return await run_in_threadpool(batches.parse_batch_body, bytes(body))


@router.post("", status_code=201, response_model=BatchOut, openapi_extra=_UPLOAD_DOC,
             responses={200: {"model": BatchOut, "description": "A reference batch sent again: the one there"}})
async def create_batch(request: Request, key: CurrentKey, session: SessionDep, models: ModelsDep,
                       settings: SettingsDep, response: Response,
                       webhook_url: Annotated[str | None, Query(max_length=2048)] = None,
                       metadata: Annotated[str | None, Query(description="a JSON object, echoed back")] = None,
                       model: Annotated[str | None, Query(max_length=100, description="the batch's model (default: "
                                                          "its first request's)")] = None,
                       ) -> BatchOut:
    """Create a batch from a JSONL file sent as the raw body (one request per line, each with a `custom_id`;
    `webhook_url` and `metadata` as query parameters), or from a JSON body `{"requests": [...],
    "webhook_url", "metadata", "model"}` (query parameters beside a JSON body are a 422). A line is a job's
    fields, or an OpenAI Batch API line (`method`, `url`: /v1/score or /v1/rerank, `body`). The upload is
    received whole, then validated line by line: a bad line becomes an error result of its own. An upload with
    no JSON object line is a 400. A batch runs one model: `model` (a query parameter, or a field of the JSON
    body), else its first request's.

    A JSON body naming `input` and `output` instead is a reference batch: the data stays in storage (s3://,
    gs://, az://, or a local path under BATCH_LOCAL_ROOT) and is run in chunks; see README "Backfills from
    object storage". Sent again with the same input and options to the same output, it answers 200 with the
    batch already there (running, or ended with its `manifest`); another input to that output is a 409
    `output_in_use`; `"overwrite": true` runs a completed one again as a new batch."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > settings.batch_max_bytes:
        raise ServiceError(413, "batch_too_large", f"a batch file is at most {settings.batch_max_bytes} bytes")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        raise ServiceError(415, "unsupported_media_type", "send the JSONL file as the raw request body")
    body = None
    if content_type == "application/json":
        body = await _json_body(request, settings.max_body_bytes)
        given = [name for name, value in (("model", model), ("webhook_url", webhook_url), ("metadata", metadata))
                 if value is not None]
        if given:  # read from the body only: a query parameter beside a JSON body would be ignored silently
            raise ServiceError(422, "invalid_input", f"with a JSON body, give {', '.join(given)} in the body, not "
                                                     "as query parameters")
        if isinstance(body, BatchSource):
            batch, created = await run_in_threadpool(_create_reference, session, key, body, models, settings)
            if created:
                kick_drain(batch.model)
            else:  # the same input and output again: its batch, running or ended
                response.status_code = 200
            response.headers["Location"] = f"/batches/{batch.id}"
            return await run_in_threadpool(read, session, batch)
        webhook_url, meta, model = body.webhook_url, body.metadata, body.model
    else:
        try:
            meta = json.loads(metadata) if metadata is not None else None
            check_metadata(meta)
        except (ValueError, RecursionError) as exc:
            raise ServiceError(422, "invalid_input", f"metadata must be a JSON object ({exc})") from None
        if metadata is not None and not isinstance(meta, dict):
            raise ServiceError(422, "invalid_input", "metadata must be a JSON object")
    chosen = models.get(model).name  # an unknown model is refused before anything is stored
    batch = await run_in_threadpool(batches.start_batch, session, key, chosen, settings, webhook_url, meta)
    ingest = batches.Ingest(session, batch, models, settings, fixed=model is not None)
    deadline = time.monotonic() + settings.batch_upload_timeout_seconds
    try:
        if body is not None:
            await run_in_threadpool(ingest.add_values, body.requests)
        else:
            with await _spool(request.stream(), deadline, settings) as spooled:
                async for lines in batches.jsonl_lines(_read_back(spooled), settings):
                    await run_in_threadpool(ingest.add_lines, lines)
        batch = await run_in_threadpool(ingest.finish)
    except ClientDisconnect:
        await _fail_upload(session, batch, "upload_interrupted", "the client went away during the upload")
        raise
    except ServiceError as exc:
        await _fail_upload(session, batch, exc.code, exc.message)
        exc.extra["batch_id"] = batch.id
        raise
    except Exception as exc:  # the database went away, or a bug: the batch must not stay `validating`
        await _fail_upload(session, batch, "upload_failed",
                           f"the upload failed on the server ({type(exc).__name__}); send it again")
        raise
    if ingest.queued:
        kick_drain(batch.model)
    response.headers["Location"] = f"/batches/{batch.id}"
    return await run_in_threadpool(batches.read_batch, session, batch)


@router.post("/plan", response_model=BatchPlan)
def plan_batch(body: BatchSource, key: CurrentKey, session: SessionDep, models: ModelsDep,
               settings: SettingsDep) -> BatchPlan:
    """A reference batch's body, planned as POST /batches would plan it (the same refusals), with no batch
    created: its objects, rows, chunks, the columns read, the output, the batch of this key it would find there,
    and an estimate of the time at the rate this deployment ran the model's reference batches lately (`rate`;
    before any ran, the figures from the docs, and no estimate)."""
    try:
        return chunks.plan_reference(session, key, body, models.get(body.model).tokenizer, settings)
    finally:
        session.rollback()


def _create_reference(session: Session, key: ApiKey, body: BatchSource, models: ModelCatalog,
                      settings: Settings) -> tuple[Batch, bool]:
    try:
        return chunks.create_reference_batch(session, key, body, models.get(body.model).tokenizer, settings)
    except Exception:
        session.rollback()  # nothing of a refused batch is kept
        raise


def read(session: Session, batch: Batch) -> BatchOut:
    """An uploaded batch's counts come from its jobs, a reference batch's from its chunks."""
    return chunks.read_reference(session, batch) if batch.source is not None else batches.read_batch(session, batch)


# An upload is received whole before its requests are written in one transaction (an upload that breaks off
# keeps none), so a client that stalls mid-upload holds no transaction: on SQLite that would be the database's one
# write lock (every other write waiting), on PostgreSQL a pooled connection.
_SPOOL_IN_MEMORY_BYTES = 1 << 20


async def _spool(stream: AsyncIterator[bytes], deadline: float, settings: Settings) -> IO[bytes]:
    """The body in a temporary file (in memory up to _SPOOL_IN_MEMORY_BYTES), at most BATCH_MAX_BYTES, by
    the upload's deadline."""
    spooled = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY_BYTES)
    try:
        async for data in stream:
            if time.monotonic() > deadline:
                raise batches.upload_timeout()
            if spooled.tell() + len(data) > settings.batch_max_bytes:
                raise ServiceError(413, "batch_too_large",
                                   f"a batch file is at most {settings.batch_max_bytes} bytes")
            spooled.write(data)
    except BaseException:
        spooled.close()
        raise
    spooled.seek(0)
    return spooled


async def _read_back(spooled: IO[bytes], size: int = 1 << 20) -> AsyncIterator[bytes]:
    while data := spooled.read(size):
        yield data


async def _fail_upload(session: Session, batch: Batch, code: str, message: str) -> None:
    try:
        await run_in_threadpool(batches.fail_upload, session, batch, code, message)
    except Exception as exc:  # the database is down: a worker's sweeper fails the batch after the timeout
        log.warning("could not mark batch %s failed (%s): %s", batch.id, code, exc)


@router.get("", response_model=BatchList)
def list_batches(key: CurrentKey, session: SessionDep, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                 cursor: str | None = None) -> BatchList:
    """This key's batches, newest first. Pass `next_cursor` back as `cursor`."""
    rows, next_cursor = batches.list_batches(session, key, limit, cursor)
    uploaded = batches.read_uploaded(session, [batch for batch in rows if batch.source is None])
    return BatchList(data=[uploaded.get(batch.id) or chunks.read_reference(session, batch) for batch in rows],
                     next_cursor=next_cursor)


@router.get("/{batch_id}", response_model=BatchOut)
def get_batch(batch_id: str, key: CurrentKey, session: SessionDep) -> BatchOut:
    return read(session, batches.get_batch(session, key, batch_id))


@router.get("/{batch_id}/results", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}}})
def batch_results(batch_id: str, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                  format: Literal["packscore", "openai"] = "packscore") -> StreamingResponse:
    """JSONL, one line per finished request: `{"custom_id", "scores", "logprobs"?, "results"?, "error"?}`, or
    with `format=openai` the OpenAI Batch API's `{"id", "custom_id", "response": {"status_code", "request_id",
    "body"}, "error"}`. While the batch runs, the requests finished so far (call again for more); complete
    once the batch has ended."""
    batch = batches.get_batch(session, key, batch_id)
    lines = chunks.iter_results(batch.id, format == "openai") if batch.source is not None else \
        batches.iter_results(batch.id, settings.batch_chunk_rows, format == "openai")
    return StreamingResponse(lines,
                             media_type="application/jsonl", headers={"Batch-Status": batch.status})


@router.post("/{batch_id}/cancel", response_model=BatchOut, responses={202: {"model": BatchOut}})
def cancel_batch(batch_id: str, key: CurrentKey, session: SessionDep, response: Response) -> BatchOut:
    """Requests not started are cancelled (200 once none is running; 202 `cancelling` while the running ones
    finish). Finished requests stay in the results. A reference batch's running chunks are stopped too: it is
    `cancelled` at once (202 `cancelling` only while its manifest cannot be written). A batch that has ended, or a
    reference batch whose chunks have all run: 409."""
    batch = batches.get_batch(session, key, batch_id)
    batch = (chunks.cancel_reference(session, batch) if batch.source is not None
             else batches.cancel_batch(session, batch))
    if batch.status != "cancelled":
        response.status_code = 202
    return read(session, batch)
