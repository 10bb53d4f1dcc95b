"""Reference batches in the database: one batch row and one row per chunk, never a row per line.

Creating one (the API): access is checked, the input is planned from metadata (store.lake.tables.plan) and
the chunk rows inserted with the batch, in one transaction. Running one (the workers): a chunk is claimed
under a lease (SKIP LOCKED), its lease extended (and its progress written) by the worker's keeper, and it
ends in one conditional UPDATE that names its result object: a worker that lost the lease commits nothing, and
the chunk rows are the manifest. A worker may cut a chunk it holds into pieces (`split_chunk`): the pieces
are new chunk rows, and results and manifest list chunks in input order, not by index. An expired lease is
swept like a job's (the attempt counts; the chunk fails after MAX_ATTEMPTS); a chunk of a cancelled batch
that goes back (its lease expired, or its worker stopped) is cancelled instead. A chunk whose store was
unreachable waits a little longer each attempt (`not_before`). Once no chunk is live, the batch is settled:
`_manifest.json` (then `_SUCCESS` if completed) is written, the status changes in a conditional UPDATE (so the
webhook is queued once), and objects of lost attempts are removed.

Outputs: a key's batch holds its output prefix while it runs and once completed (`batches.output_key`, unique
per key), with a digest of what it scores (`source_key`: the input's URIs, the options, the model). The same
request again is answered with that batch and plans nothing; another input to the prefix is refused naming it.
A cancelled batch, or a failed one (its output refused writes), gives the prefix to a new batch of the same
request, which resumes from its committed chunks (`_resume`); a completed one replaced by an `overwrite`, or a
cancelled or failed one met by another input, gives the prefix up.

Turns: reference batches take turns a chunk at a time, the batch whose chunk started least recently first
(`last_claimed_at`, set when a worker starts a chunk: `take_turn`).
"""

import hashlib
import json
import logging
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import RequestTokenizer, ScoringError
from store import storage
from store.counters import count
from store.db import session_factory, session_scope
from store.errors import ServiceError
from store.lake.access import Access, store_error
from store.lake.tables import (Columns, Options, PlannedChunk, json_line, object_name, plan, read_table,
                               write_manifest)
from store.location import Location
from store.models import ApiKey, Batch, Chunk, utcnow
from store.outbox import enqueue_webhook, latest_delivery, vet_webhook_url
from store.schemas import (BatchCounts, BatchOut, BatchPlan, BatchSource, ChunkCounts, DocsRate, EarlierBatch, Progress,
                           Rate, RowCounts, batch_out, eta_seconds)
from store.settings import Settings
from store.storage import Failure

log = logging.getLogger(__name__)

LIVE = ("queued", "running")
# A chunk whose store failed waits this long times 2**(attempt - 1) before it is claimed again (capped).
RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0
INSERT_PAGE = 1000
# A chunk whose object the output refuses for good fails with one of these codes, and its batch fails with it
# (settle): a full disk is not freed by waiting, nor are denied writes, as an unreachable store may come back.
OUTPUT_FULL = "output_full"
OUTPUT_DENIED = "output_denied"

_CHUNKS = Chunk.__table__.c


def access_for(key: ApiKey, settings: Settings) -> Access:
    return Access(settings.batch_local_root, [*settings.batch_storage_prefixes, *(key.storage_prefixes or [])])


@dataclass(frozen=True)
class _Vetted:
    """A reference batch's request as checked: where it reads and writes, its options, and the digests that
    find an earlier batch of the same request."""

    access: Access
    output: Location
    options: Options
    output_key: str  # the output prefix's digest
    source_key: str  # what it scores: the input's URIs as vetted, the options, the model


def _vet(key: ApiKey, body: BatchSource, tokenizer: RequestTokenizer, settings: Settings) -> _Vetted:
    vet_webhook_url(body.webhook_url, settings.webhook_allowlist)
    access = access_for(key, settings)
    output = access.location(body.output, "output")
    if any(c in output.path for c in "*?["):
        raise ServiceError(400, "invalid_uri", "output is a prefix, not a glob")
    columns = Columns(body.columns.query, body.columns.item, tuple(body.columns.ids), body.columns.label) \
        if body.columns else None
    if columns is not None and columns.label is None and not body.label_token_ids:
        raise ServiceError(400, "empty_label_token_ids", "a pair table needs label_token_ids (or columns.label)")
    if body.label_token_ids:
        try:  # the engine's own checks of the labels (range, non-empty), on a stand-in request
            tokenizer.tokenize([0], [], body.label_token_ids)
        except ScoringError as exc:
            if exc.code.startswith(("label", "empty_label", "too_many_labels")):
                raise ServiceError(400, exc.code, exc.message) from None
    options = Options(body.format or "", columns, tuple(body.label_token_ids) if body.label_token_ids else None,
                      body.apply_softmax, body.item_first, body.return_logprobs, body.output_format)
    inputs = [access.location(uri).uri for uri in ([body.input] if isinstance(body.input, str) else body.input)]
    return _Vetted(access, output, options, _digest(output.uri.rstrip("/")),
                   _digest(json.dumps([inputs, options.to_json(), tokenizer.model_name], sort_keys=True)))


def create_reference_batch(session: Session, key: ApiKey, body: BatchSource, tokenizer: RequestTokenizer,
                           settings: Settings) -> tuple[Batch, bool]:
    """Checks access, plans the chunks from metadata and commits the batch with its chunk rows (status
    in_progress); any refusal is a ServiceError and leaves nothing behind. Returns (batch, created): the same
    input sent again to an output this key's batch holds gets that batch (running or completed) and nothing is
    planned; after a cancelled or failed one, a new batch resumes from its committed chunks (`overwrite`: from
    row 0);
    another input, or `overwrite` while it runs, is a 409 `output_in_use`."""
    vetted = _vet(key, body, tokenizer, settings)
    output = vetted.output
    held, earlier = _output_holder(session, key, vetted.output_key, vetted.source_key, body.overwrite, output.uri)
    if held is not None:
        return held, False
    objects = [] if earlier is not None else vetted.access.expand(body.input, output)
    batch = Batch(api_key_id=key.id, model=tokenizer.model_name, webhook_url=body.webhook_url,
                  metadata_=body.metadata, status="in_progress", in_progress_at=utcnow(),
                  output_key=vetted.output_key, source_key=vetted.source_key)
    session.add(batch)
    try:
        session.flush()
    except IntegrityError:  # a concurrent request took the output first: answer as if it had come before
        session.rollback()
        held, _ = _output_holder(session, key, vetted.output_key, vetted.source_key, False, output.uri)
        if held is None:
            raise ServiceError(409, "output_in_use", f"another batch was being created for {output.uri}; "
                                                     "send it again") from None
        return held, False
    # Each object's format is checked as it is planned (format_of); the batch keeps the one given, if any.
    batch.source = {**vetted.options.to_json(), "input": body.input}
    if earlier is not None:
        queued = _resume(session, batch, earlier)
        session.commit()
        if queued:
            session.refresh(batch)
        else:  # every chunk was committed (only the manifest was refused): it ends now
            _settle_now(session, batch)
        return batch, True
    batch.output = output.child(batch.id)
    n = rows = 0
    known = True
    page: list[dict] = []
    for chunk in plan(objects, vetted.options, settings):
        if n >= settings.batch_max_chunks:
            raise ServiceError(413, "batch_too_large", f"the input is over BATCH_MAX_CHUNKS "
                                                       f"({settings.batch_max_chunks}) chunks: split it into batches")
        page.append(_chunk_row(batch.id, n, chunk))
        n += 1
        rows += chunk.rows or 0
        known = known and chunk.rows is not None
        if len(page) >= INSERT_PAGE:
            session.execute(insert(Chunk), page)
            page = []
    if page:
        session.execute(insert(Chunk), page)
    if n == 0:
        names = ", ".join(location.name for location in objects[:5]) + (", ..." if len(objects) > 5 else "")
        raise ServiceError(400, "empty_batch", f"the input has no rows ({names})")
    batch.chunks_total = n
    batch.total = rows if known else 0
    session.commit()
    session.refresh(batch)
    return batch, True


def _resume(session: Session, batch: Batch, earlier: Batch) -> int:
    """`batch` takes over the earlier (cancelled or failed) batch's plan and folder: its committed chunks as they
    are, their objects read where they lie (so nothing is scored twice), the others queued again. Attempts go on
    from the earlier batch's, so that an attempt's object never has the name of an earlier attempt's (one a
    worker of the earlier batch may still be writing, and removes when its commit is refused). A committed
    chunk whose object is no longer in the folder is queued again too: the output stays whole. Returns the
    number of chunks queued."""
    batch.output = earlier.output
    batch.chunks_total, batch.total = earlier.chunks_total, earlier.total
    batch.source = {**batch.source, "resumed_from": earlier.id}
    present = _object_names(earlier.output)
    page: list[dict] = []
    queued = 0
    for row in session.execute(select(Chunk.__table__).where(_CHUNKS.batch_id == earlier.id)).mappings():
        values = {**row, "batch_id": batch.id}
        if row["status"] != "succeeded" or row["output"] not in present:
            queued += 1
            values.update(status="queued", lease_owner=None, lease_expires_at=None, not_before=None, output=None,
                          error_code=None, error_message=None, started_at=None, finished_at=None, **_NO_PROGRESS)
        page.append(values)
        if len(page) >= INSERT_PAGE:
            session.execute(insert(Chunk), page)
            page = []
    if page:
        session.execute(insert(Chunk), page)
    return queued


def _object_names(output: Location) -> set[str]:
    """The names of the objects in a batch's folder now (listed afresh: this process may have listed it before)."""
    try:
        output.fs.invalidate_cache(output.path)
        return {posixpath.basename(p) for p in output.fs.find(output.path)}
    except FileNotFoundError:
        return set()
    except Exception as exc:  # noqa: BLE001  (see store_error)
        raise store_error(output, exc) from None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _then(holder: Batch, source_key: str, overwrite: bool) -> str:
    """What a request does with the key's batch holding its output (EarlierBatch.then), or "refuse"."""
    same = holder.source_key == source_key and not overwrite
    # A failed holder broke off (its output refused writes) and kept its committed objects, as a cancelled one
    # does. Either, met by another input or options, gives its output up as a batch never run.
    if holder.status in ("failed", "cancelled") and same:
        return "resume"
    if holder.status in ("failed", "cancelled") or (overwrite and holder.status == "completed"):
        return "replace"
    if same:
        return "report" if holder.status == "completed" else "follow"
    return "refuse"


def _output_holder(session: Session, key: ApiKey, output_key: str, source_key: str, overwrite: bool,
                   uri: str) -> tuple[Batch | None, Batch | None]:
    """(the key's batch holding this output if the request is its re-run, else None; a cancelled or failed
    batch of the same request that a new batch resumes from). A batch replaced or resumed gives the output up,
    in the caller's transaction. Another input, or an overwrite of a running batch, is refused naming the holder."""
    holder = session.scalar(select(Batch).where(Batch.api_key_id == key.id, Batch.output_key == output_key))
    if holder is None:
        return None, None
    then = _then(holder, source_key, overwrite)
    if then in ("resume", "replace"):
        holder.output_key = None
        session.flush()  # before the new batch takes it
        return None, holder if then == "resume" else None
    if then != "refuse":
        return holder, None
    running = holder.status == "in_progress"
    message = f"batch {holder.id} is still {'running' if running else holder.status} into {uri}: " \
              f"{'cancel it first' if running else 'send it again once it has ended'}" if overwrite else \
        f"{uri} is the output of batch {holder.id}, which has another input or options: choose another output, " \
        "or overwrite it (`overwrite`, the CLI's --overwrite) once that batch has ended"
    raise ServiceError(409, "output_in_use", message, batch_id=holder.id)


# Before a deployment has run a reference batch of a model, the only rates there are: docs/performance.md's
# (a pair table's rows per second).
DOCS_RATES = (DocsRate(where="the bundled model on a 2-core CPU (docs/performance.md: backfill alone)", low=20.0,
                       high=49.0),
              DocsRate(where="Qwen3-0.6B's shape on one H200 (docs/performance.md: contract speed)", low=6530.0,
                       high=7014.0))
# The measured rate: over a model's chunks committed in this window, at most this many, the latest.
RATE_WINDOW = timedelta(days=1)
RATE_CHUNKS = 200


def plan_reference(session: Session, key: ApiKey, body: BatchSource, tokenizer: RequestTokenizer,
                   settings: Settings) -> BatchPlan:
    """What `create_reference_batch` would run for this body, planned the same way (the same refusals), with
    nothing written: the plan, the earlier batch the request would find, and an estimate of the time at the
    rate this deployment ran the model's reference batches lately."""
    vetted = _vet(key, body, tokenizer, settings)
    objects = vetted.access.expand(body.input, vetted.output)
    n = rows = spanned = 0
    known = True
    for chunk in plan(objects, vetted.options, settings):
        n += 1
        rows += chunk.rows or 0
        known = known and chunk.rows is not None
        spanned += chunk.stop - chunk.start if chunk.part == -1 else 0
    if n == 0:
        raise ServiceError(400, "empty_batch", f"the input has no rows ({', '.join(o.name for o in objects[:5])})")
    if n > settings.batch_max_chunks:
        raise ServiceError(413, "batch_too_large", f"the input is over BATCH_MAX_CHUNKS "
                                                   f"({settings.batch_max_chunks}) chunks: split it into batches")
    earlier = None
    holder = session.scalar(select(Batch).where(Batch.api_key_id == key.id, Batch.output_key == vetted.output_key))
    if holder is not None:
        then = _then(holder, vetted.source_key, body.overwrite)
        if then == "refuse":
            _output_holder(session, key, vetted.output_key, vetted.source_key, body.overwrite, vetted.output.uri)
        committed = session.scalar(select(func.coalesce(func.sum(Chunk.rows_done), 0)).where(
            Chunk.batch_id == holder.id, Chunk.status == "succeeded"))
        earlier = EarlierBatch(id=holder.id, status=holder.status, then=then, rows_committed=int(committed))
    rate = measured_rate(session, tokenizer.model_name)
    left = rows - (earlier.rows_committed if earlier and earlier.then == "resume" else 0)
    estimate = None
    if known and rate.rows_per_second:
        estimate = round(left / rate.rows_per_second, 1)
    elif not known and spanned and rate.bytes_per_second:
        estimate = round(spanned / rate.bytes_per_second, 1)
    session.rollback()  # nothing of a plan is kept
    return BatchPlan(model=tokenizer.model_name, input=[o.uri for o in objects], objects=len(objects),
                     columns=vetted.options.columns.names() if vetted.options.columns else None,
                     rows=rows if known else None, bytes=spanned or None, chunks=n, output=vetted.output.uri,
                     earlier=earlier, rate=rate, estimate_seconds=estimate)


def measured_rate(session: Session, model: str) -> Rate:
    """Rows and input bytes per second of the model's reference batches over their chunks committed lately
    (RATE_WINDOW, RATE_CHUNKS), per second of the time any of them ran (parallel workers count once, idle gaps
    not at all); chunks a resumed batch took over from the batch before are not counted twice."""
    found = session.execute(
        select(Chunk.started_at, Chunk.finished_at, Chunk.rows_done, Chunk.part, Chunk.start, Chunk.stop)
        .join(Batch, Batch.id == Chunk.batch_id)
        .where(Batch.model == model, Chunk.status == "succeeded", Chunk.started_at >= Batch.in_progress_at,
               Chunk.finished_at >= utcnow() - RATE_WINDOW)
        .order_by(Chunk.finished_at.desc()).limit(RATE_CHUNKS)).all()
    spans = [c for c in found if c.part == -1]
    busy, busy_spans = _busy_seconds(found), _busy_seconds(spans)
    if not found or busy <= 0:
        return Rate(rows_per_second=None, bytes_per_second=None, measured=False, docs=list(DOCS_RATES),
                    basis=f"no reference batch of {model} ran on this deployment in the last "
                          f"{RATE_WINDOW.days * 24} hours")
    rows = sum(c.rows_done for c in found)
    return Rate(rows_per_second=round(rows / busy, 2),
                bytes_per_second=round(sum(c.stop - c.start for c in spans) / busy_spans, 1) if busy_spans else None,
                measured=True, docs=list(DOCS_RATES),
                basis=f"{rows} rows in the {len(found)} chunks of {model} committed last, {busy:.1f} s of running")


def _busy_seconds(chunks: list) -> float:
    """The time any of these chunks ran (the union of their [started_at, finished_at])."""
    total, end = 0.0, None
    for chunk in sorted(chunks, key=lambda c: c.started_at):
        if end is None or chunk.started_at > end:
            total += (chunk.finished_at - chunk.started_at).total_seconds()
            end = chunk.finished_at
        elif chunk.finished_at > end:
            total += (chunk.finished_at - end).total_seconds()
            end = chunk.finished_at
    return total


def _chunk_row(batch_id: str, index: int, chunk: PlannedChunk) -> dict:
    return {"batch_id": batch_id, "index": index, "input": chunk.input, "part": chunk.part, "start": chunk.start,
            "stop": chunk.stop, "rows_total": chunk.rows, "input_version": chunk.version, "status": "queued",
            "attempts": 0, "rows_done": 0, "rows_failed": 0, "items_done": 0}


# ---- the workers' side -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimedChunk:
    batch_id: str
    index: int
    attempt: int
    input: Location
    part: int
    start: int
    stop: int
    options: Options
    output: Location  # the batch's output folder
    input_version: str | None  # the object's when planned (tables.object_version)

    @property
    def key(self) -> tuple[str, int]:
        return (self.batch_id, self.index)

    @property
    def object(self) -> Location:
        return self.output.child(object_name(self.index, self.attempt, self.options.output_format))


@dataclass(frozen=True)
class ChunkProgress:
    """A running chunk's rows and items scored so far (written by the keeper; a commit writes the final ones)."""

    rows_done: int
    rows_failed: int
    items_done: int
    rows_total: int  # known once the chunk is read (a JSONL chunk's lines)


_NO_PROGRESS = dict(rows_done=0, rows_failed=0, items_done=0)


def claim_chunk(owner: str, settings: Settings) -> ClaimedChunk | None:
    """Leases the next ready chunk of a batch of the worker's model (the batch whose chunk started least
    recently first, then oldest batch, then chunk order), or None."""
    now = utcnow()
    with session_scope() as session:
        candidate = session.execute(
            select(_CHUNKS.batch_id, _CHUNKS.index)
            .select_from(Chunk.__table__.join(Batch, Batch.id == _CHUNKS.batch_id))
            .where(_CHUNKS.status == "queued", Batch.status == "in_progress", Batch.model == settings.worker_model,
                   (_CHUNKS.not_before.is_(None)) | (_CHUNKS.not_before <= now))
            .order_by(Batch.last_claimed_at.asc().nulls_first(), _CHUNKS.batch_id, _CHUNKS.index).limit(1)
            .with_for_update(of=Chunk.__table__, skip_locked=True)).first()
        if candidate is None:
            return None
        row = session.execute(
            update(Chunk.__table__).where(_CHUNKS.batch_id == candidate.batch_id, _CHUNKS.index == candidate.index,
                                          _CHUNKS.status == "queued")
            .values(status="running", lease_owner=owner, attempts=_CHUNKS.attempts + 1,
                    lease_expires_at=now + timedelta(seconds=settings.lease_seconds),
                    started_at=func.coalesce(_CHUNKS.started_at, now), **_NO_PROGRESS)
            .returning(_CHUNKS.batch_id, _CHUNKS.index, _CHUNKS.attempts, _CHUNKS.input, _CHUNKS.part,
                       _CHUNKS.start, _CHUNKS.stop, _CHUNKS.input_version)).first()
        if row is None:
            return None
        source, output = session.execute(select(Batch.source, Batch.output).where(Batch.id == row.batch_id)).one()
    return ClaimedChunk(row.batch_id, row.index, row.attempts, row.input, row.part, row.start, row.stop,
                        Options.from_json(source), output, row.input_version)


def take_turn(chunk: ClaimedChunk, settings: Settings) -> bool:
    """Whether the worker may start this chunk (read ahead) now: its batch is still in progress and no other
    batch of the model with a ready chunk is ahead of it in turn. If so, the batch's turn is recorded."""
    now = utcnow()
    with session_scope() as session:
        ready = select(Chunk.index).where(Chunk.batch_id == Batch.id, Chunk.status == "queued",
                                          (Chunk.not_before.is_(None)) | (Chunk.not_before <= now)).exists()
        first = session.scalar(select(Batch.id).where(
            Batch.status == "in_progress", Batch.model == settings.worker_model, ready | (Batch.id == chunk.batch_id))
            .order_by(Batch.last_claimed_at.asc().nulls_first(), Batch.id).limit(1))
        if first != chunk.batch_id:
            return False
        session.execute(update(Batch).where(Batch.id == chunk.batch_id).values(last_claimed_at=now))
    return True


def extend_leases(owner: str, settings: Settings,
                  held: dict[tuple[str, int], ChunkProgress | None]) -> set[tuple[str, int]]:
    """Extends the leases of the chunks held, and writes the progress of those running. Returns the chunks no
    longer this worker's (their batch was cancelled, or the lease lapsed and the sweeper took them back): the
    worker stops scoring them."""
    lost: set[tuple[str, int]] = set()
    if not held:
        return lost
    now = utcnow()
    with session_scope() as session:
        for (batch_id, index), progress in held.items():
            values = {"lease_expires_at": now + timedelta(seconds=settings.lease_seconds)}
            if progress is not None:
                values.update(progress.__dict__)
            if not session.execute(update(Chunk.__table__).where(
                    _CHUNKS.batch_id == batch_id, _CHUNKS.index == index, _CHUNKS.lease_owner == owner,
                    _CHUNKS.status == "running").values(**values)).rowcount:
                lost.add((batch_id, index))
    return lost


def split_chunk(owner: str, chunk: ClaimedChunk, cuts: list[tuple[int, int | None]],
                rows_first: int | None) -> ClaimedChunk | None:
    """Cuts a chunk the worker holds at these positions (row offsets of a Parquet row group, or byte offsets of
    line starts; each with the rows of the piece that starts there, if known): it keeps the first piece, and
    the others become queued chunks of the batch. None if the chunk is no longer ours or the batch not in
    progress (then nothing changed)."""
    if not cuts:
        return chunk
    with session_scope() as session:
        # The batch row first, as cancel takes it.
        batch = session.scalar(select(Batch).where(Batch.id == chunk.batch_id).with_for_update())
        if batch is None or batch.status != "in_progress":
            return None
        changed = session.execute(update(Chunk.__table__).where(
            _CHUNKS.batch_id == chunk.batch_id, _CHUNKS.index == chunk.index, _CHUNKS.lease_owner == owner,
            _CHUNKS.status == "running", _CHUNKS.attempts == chunk.attempt)
            .values(stop=cuts[0][0], rows_total=rows_first)).rowcount
        if not changed:
            return None
        bounds = [cut for cut, _ in cuts] + [chunk.stop]
        session.execute(insert(Chunk), [
            _chunk_row(batch.id, batch.chunks_total + k, PlannedChunk(chunk.input.uri, chunk.part, start, stop, rows,
                                                                  chunk.input_version))
            for k, ((start, rows), stop) in enumerate(zip(cuts, bounds[1:]))])
        batch.chunks_total += len(cuts)
    return replace(chunk, stop=cuts[0][0])


def commit_chunk(owner: str, chunk: ClaimedChunk, rows: int, rows_failed: int, items: int,
                 error: tuple[str, str] | None = None) -> bool:
    """The chunk is done: its object (`chunk.object`, already written) becomes its result, under the lease
    condition, in one transaction. With `error` (the input is missing or corrupt) it fails, with no object.
    Returns whether it was still ours; if not, the caller removes what it wrote."""
    values = dict(status="failed" if error else "succeeded", lease_owner=None, lease_expires_at=None,
                  finished_at=utcnow(), rows_done=rows, rows_failed=rows_failed, items_done=items,
                  output=None if error else chunk.object.name)
    if error:
        values.update(error_code=error[0], error_message=error[1][:2000])
    with session_scope() as session:
        changed = session.execute(update(Chunk.__table__).where(
            _CHUNKS.batch_id == chunk.batch_id, _CHUNKS.index == chunk.index, _CHUNKS.lease_owner == owner,
            _CHUNKS.status == "running", _CHUNKS.attempts == chunk.attempt).values(**values)).rowcount
        if changed:
            count(session, "chunks_finished", label=values["status"])
            count(session, "batch_rows", rows)
    return bool(changed)


def release_chunk(owner: str, settings: Settings, chunk: ClaimedChunk, error: str | None) -> None:
    """Hands a chunk back: after a failure (`error`) the attempt counts and it waits before it runs again,
    failing after MAX_ATTEMPTS; when the worker stops or gives the turn (None) it does not count. A chunk of
    a batch no longer in progress (cancelled) is cancelled; the caller settles the batch."""
    now = utcnow()
    with session_scope() as session:
        live = session.scalar(select(Batch.status).where(Batch.id == chunk.batch_id)) == "in_progress"
        row = session.execute(select(Chunk).where(
            Chunk.batch_id == chunk.batch_id, Chunk.index == chunk.index, Chunk.lease_owner == owner,
            Chunk.status == "running").with_for_update()).scalar_one_or_none()
        if row is None:
            return
        if error is None:
            row.attempts -= 1
        _end_attempt(session, row, settings, "input_unavailable", error or "", now, cancelled=not live)


def _end_attempt(session: Session, row: Chunk, settings: Settings, code: str, message: str,
                 now: datetime, cancelled: bool = False) -> None:
    row.rows_done = row.rows_failed = row.items_done = 0  # what a lost attempt scored is not in any object
    if row.requeue_or_fail(settings.max_attempts, code, message[:2000], cancelled, now) == "queued":
        wait = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2 ** max(row.attempts - 1, 0)) if message else 0
        row.not_before = now + timedelta(seconds=wait)
    else:
        count(session, "chunks_finished", label=row.status)


def sweep_chunks(settings: Settings) -> set[str]:
    """Re-queues chunks whose lease expired (their worker died), or cancels them if their batch was
    cancelled; returns the batches that may be over (none of their chunks live), which the caller settles."""
    now = utcnow()
    with session_scope() as session:
        stopped = set(session.scalars(select(Batch.id).where(Batch.source.is_not(None),
                                                             Batch.status == "cancelling")))
        expired = session.scalars(select(Chunk).where(Chunk.status == "running", Chunk.lease_expires_at < now)
                                  .with_for_update(skip_locked=True)).all()
        for row in expired:
            cancelled = row.batch_id in stopped
            log.warning("lease of chunk %s/%s held by %s expired; %s", row.batch_id, row.index, row.lease_owner,
                        "cancelling it (its batch was cancelled)" if cancelled else "re-queueing")
            _end_attempt(session, row, settings, "worker_lost", "the worker running this chunk stopped", now,
                         cancelled)
        if stopped:  # queued chunks of a cancelled batch (handed back as the cancel came) never run
            session.execute(update(Chunk.__table__).where(_CHUNKS.batch_id.in_(stopped), _CHUNKS.status == "queued")
                            .values(status="cancelled", finished_at=now))
        live = select(Chunk.batch_id).where(Chunk.batch_id == Batch.id, Chunk.status.in_(LIVE)).exists()
        over = set(session.scalars(select(Batch.id).where(Batch.source.is_not(None),
                                                          Batch.status.in_(("in_progress", "cancelling")), ~live)))
    return over


def live_chunks(settings: Settings) -> bool:
    """Whether any chunk of the worker's model waits to be claimed now (the sweeper's wake-up)."""
    with session_scope() as session:
        return session.scalar(select(Chunk.index).join(Batch, Batch.id == Chunk.batch_id).where(
            Chunk.status == "queued", Batch.status == "in_progress", Batch.model == settings.worker_model,
            (Chunk.not_before.is_(None)) | (Chunk.not_before <= utcnow())).limit(1)) is not None


def settle(batch_id: str) -> bool:
    """Ends the batch if none of its chunks is live: writes the manifest (then `_SUCCESS`), changes its status
    in a conditional UPDATE (so of concurrent callers exactly one queues the webhook) and removes objects of
    lost attempts. A batch whose output refused a write for good fails (`output_full`, `output_denied`), keeping
    its committed objects (the same request resumes from them), with no `_SUCCESS`. Returns whether this call
    ended it; raises where the store is unreachable (the sweep settles it again)."""
    with session_scope() as session:
        # The status and the live chunks in one statement, so of one moment: read apart, a cancel committed
        # between them made a cancelled batch look completed (no chunk live, the status still in progress).
        live = select(Chunk.index).where(Chunk.batch_id == Batch.id, Chunk.status.in_(LIVE)).exists()
        found = session.execute(select(Batch, live).where(Batch.id == batch_id)).first()
        if found is None or found[1] or found[0].status not in ("in_progress", "cancelling"):
            return False
        batch = found[0]
        was = batch.status
        refused = session.execute(select(Chunk.error_code, Chunk.error_message).where(
            Chunk.batch_id == batch_id, Chunk.error_code.in_((OUTPUT_FULL, OUTPUT_DENIED))).limit(1)).first()
        status = "failed" if refused else "cancelled" if batch.status == "cancelling" else "completed"
        output = batch.output
        manifest = _manifest(session, batch, status)
    # Before the status changes: a reader that sees the batch over finds the manifest. A worker dying here
    # leaves the batch live, and the sweeper settles it again (the manifest is the same).
    if status != "failed":
        try:
            write_manifest(output, manifest, status == "completed")
        except Exception as exc:
            refused = write_refused(output.child("_manifest.json"), exc)
            if refused is None:
                raise
            status, manifest = "failed", {**manifest, "status": "failed"}
    if status == "failed":
        _fail_output(output, manifest)
    _remove_uncommitted(output, {entry["name"] for entry in manifest["objects"]})
    failure = dict(error_code=refused[0], error_message=refused[1][:2000]) if refused else {}
    with session_scope() as session:
        changed = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == was)
                                  .values(status=status, finished_at=utcnow(), **failure)).rowcount
        if changed:
            batch = session.get(Batch, batch_id)
            session.refresh(batch)
            if batch.webhook_url:
                enqueue_webhook(session, batch.api_key_id, batch.webhook_url, f"batch.{batch.status}",
                                read_reference(session, batch).model_dump(mode="json", exclude={"webhook"}),
                                batch_id=batch.id)
    return bool(changed)


def write_refused(location: Location, exc: BaseException) -> tuple[str, str] | None:
    """Why the output refuses writing `location` for good, as (code, message): its disk or quota full, or the
    write denied (what each store's refusals look like is its own: storage.refused_write). None where trying
    again may work."""
    refused = storage.refused_write(exc)
    if refused is Failure.FULL:
        return OUTPUT_FULL, f"the output's disk is full: {location.uri} could not be written ({exc})"
    if refused is Failure.DENIED:
        return OUTPUT_DENIED, f"the output refused {location.uri} ({type(exc).__name__}: {exc})"
    return None


def remove_object(location: Location) -> None:
    """Removes what a failed write may have left of an object (nothing there is fine)."""
    try:
        if location.fs.exists(location.path):
            location.fs.rm(location.path)
    except OSError as exc:
        log.warning("could not remove %s: %s", location.uri, exc)


def _fail_output(output: Location, manifest: dict) -> None:
    """A failed batch leaves nothing half-committed: no `_SUCCESS` (the output is not whole; a completed
    manifest refused may have left one) and, if it fits, a `_manifest.json` saying `failed` that lists its
    committed objects, as a cancelled batch's does."""
    try:
        if output.fs.exists(output.child("_SUCCESS").path):
            output.fs.rm(output.child("_SUCCESS").path)
        write_manifest(output, manifest, success=False)
    except Exception as exc:  # noqa: BLE001  (the batch fails all the same: its output refused it)
        log.warning("the failed batch's manifest could not be written under %s: %s", output.uri, exc)


def in_input_order(chunks: list) -> list:
    """Chunk rows (with index, input, part and start) in the order of the input's rows: a piece cut from a
    chunk has a later index than the chunks planned after it."""
    first: dict[str, int] = {}
    for chunk in sorted(chunks, key=lambda c: c.index):
        first.setdefault(chunk.input, chunk.index)
    return sorted(chunks, key=lambda c: (first[c.input], c.part, c.start))


def _manifest(session: Session, batch: Batch, status: str) -> dict:
    objects, failed, cancelled = [], [], []
    rows = rows_failed = items = 0
    for chunk in in_input_order(session.execute(
            select(Chunk.index, Chunk.input, Chunk.part, Chunk.start, Chunk.stop, Chunk.status, Chunk.output,
                   Chunk.rows_done, Chunk.rows_failed, Chunk.items_done, Chunk.error_code, Chunk.error_message,
                   Chunk.rows_total).where(Chunk.batch_id == batch.id)).all()):
        where = {"chunk": chunk.index, "input": chunk.input.uri, "part": chunk.part, "start": chunk.start,
                 "stop": chunk.stop}
        if chunk.status == "succeeded":
            objects.append({"name": chunk.output, **where, "rows": chunk.rows_done, "rows_failed": chunk.rows_failed,
                            "items": chunk.items_done})
            rows += chunk.rows_done
            rows_failed += chunk.rows_failed
            items += chunk.items_done
        elif chunk.status == "failed":
            failed.append({**where, "rows": chunk.rows_total, "error": {"code": chunk.error_code,
                                                                        "message": chunk.error_message}})
        else:
            cancelled.append({**where, "rows": chunk.rows_total})
    return {"batch_id": batch.id, "status": status, "output_format": (batch.source or {}).get("output_format"),
            "rows": rows, "rows_failed": rows_failed, "items": items, "objects": objects, "failed_chunks": failed,
            "cancelled_chunks": cancelled}


def _remove_uncommitted(output: Location, committed: set[str]) -> None:
    """Objects of attempts that lost their lease (or died while writing): never in the manifest, removed."""
    try:
        names = [posixpath.basename(p) for p in output.fs.find(output.path)]
        stale = [output.child(n).path for n in names if n.startswith("part-") and n not in committed]
        if stale:
            output.fs.rm(stale)
    except Exception as exc:  # noqa: BLE001  (a store's own errors too: the batch ends all the same)
        log.warning("could not remove the objects of lost attempts under %s: %s", output.uri, exc)


def remove_lost_attempts(chunk: ClaimedChunk) -> None:
    """After a chunk's commit: earlier attempts' objects of the same chunk (a killed worker's)."""
    try:
        pattern = chunk.output.child(f"part-{chunk.index:06d}-attempt-*").path
        stale = [p for p in chunk.output.fs.glob(pattern) if posixpath.basename(p) != chunk.object.name]
        if stale:
            chunk.output.fs.rm(stale)
    except OSError as exc:
        log.warning("could not remove earlier attempts of chunk %s/%s: %s", chunk.batch_id, chunk.index, exc)


# ---- the API's side ----------------------------------------------------------------------------------------


def read_reference(session: Session, batch: Batch) -> BatchOut:
    """The batch with its chunks' progress: rows and items done (running chunks' so far, as their workers last
    wrote it), chunks done and in flight, an ETA."""
    by_status = {row.status: row for row in session.execute(
        select(Chunk.status, func.count().label("n"), func.coalesce(func.sum(Chunk.rows_done), 0).label("rows"),
               func.coalesce(func.sum(Chunk.rows_failed), 0).label("failed"),
               func.coalesce(func.sum(Chunk.items_done), 0).label("items"),
               func.coalesce(func.sum(Chunk.rows_total), 0).label("rows_total"),
               func.count(Chunk.rows_total).label("read"),
               func.coalesce(func.sum(Chunk.stop - Chunk.start), 0).label("span"))
        .where(Chunk.batch_id == batch.id).group_by(Chunk.status))}

    def summed(field: str, *statuses: str) -> int:  # over these statuses, or all; int(): Postgres sums as numeric
        return sum(int(getattr(row, field)) for status, row in by_status.items() if status in (statuses or by_status))

    rows_done, rows_failed, items_done = summed("rows"), summed("failed"), summed("items")
    cancelled_rows = summed("rows_total", "cancelled")
    live = batch.status in ("in_progress", "cancelling")
    # Only a batch in progress has chunks cut into pieces (split_chunk).
    chunks = ChunkCounts(total=batch.chunks_total, total_final=batch.status != "in_progress",
                         done=summed("n", "succeeded", "failed"), in_flight=summed("n", "running"),
                         failed=summed("n", "failed"), cancelled=summed("n", "cancelled"))
    if not live:  # what ran, and what a cancel left (one item a row, known for a pair table): as an upload's
        items_total = items_done + cancelled_rows
    elif batch.total:  # known rows (Parquet) are a pair table's, one item each: those not failed nor cancelled
        items_total = batch.total - rows_failed - summed("rows_total", "failed", "cancelled")
    else:
        items_total = 0  # unknown until every chunk has been read
    eta = _eta(session, batch, rows_done, cancelled_rows, summed("span", "succeeded", "failed"),
               summed("span") - summed("span", "cancelled")) if live else None
    output = batch.output
    # The input's rows: known from planning (Parquet's metadata), else once every chunk has been read (a
    # committed chunk's rows are its rows done, errors included; another's, its rows_total once read).
    others = [row for status, row in by_status.items() if status != "succeeded"]
    if batch.total:
        rows_total: int | None = batch.total
    elif all(row.read == row.n for row in others):
        rows_total = summed("rows", "succeeded") + sum(int(row.rows_total) for row in others)
    else:
        rows_total = None
    counts = BatchCounts(total=rows_total, succeeded=rows_done - rows_failed, failed=rows_failed,
                         cancelled=cancelled_rows)
    return batch_out(batch, counts, Progress(items_done=items_done, items_total=items_total),
                     latest_delivery(session, batch.id), chunks=chunks, output=output.uri, eta_seconds=eta,
                     manifest=None if live else output.child("_manifest.json").uri,
                     input=batch.source["input"], resumed_from=batch.source.get("resumed_from"),
                     rows=RowCounts(done=rows_done, failed=rows_failed, total=rows_total))


def _eta(session: Session, batch: Batch, rows_done: int, cancelled_rows: int, span_done: int,
         span_total: int) -> float | None:
    """Seconds left at the rate so far, over the time since the batch's first chunk started: by rows where the
    batch's rows are known (Parquet), else by the share of the input's bytes done (a running chunk by its rows
    done of its rows): totals that cutting chunks into pieces leaves as they are. None until some rows are
    done."""
    ours = Chunk.batch_id == batch.id
    carried_rows = carried_span = 0
    if batch.source.get("resumed_from"):
        # The chunks the batch it resumes had committed are neither this run's work nor its pace.
        ours = ours & (Chunk.started_at >= batch.in_progress_at)
        carried = session.execute(select(func.coalesce(func.sum(Chunk.rows_done), 0),
                                         func.coalesce(func.sum(Chunk.stop - Chunk.start), 0)).where(
            Chunk.batch_id == batch.id, Chunk.status == "succeeded", Chunk.started_at < batch.in_progress_at)).one()
        carried_rows, carried_span = int(carried[0]), int(carried[1])
    started = session.scalar(select(func.min(Chunk.started_at)).where(ours))
    if batch.total:
        done, total = float(rows_done - carried_rows), batch.total - cancelled_rows - carried_rows
    else:
        running = session.execute(select(Chunk.start, Chunk.stop, Chunk.rows_done, Chunk.rows_total).where(
            Chunk.batch_id == batch.id, Chunk.status == "running", Chunk.rows_done > 0)).all()
        done = span_done - carried_span + sum((r.stop - r.start) * min(1.0, r.rows_done / r.rows_total)
                                              for r in running if r.rows_total)
        total = span_total - carried_span
    return eta_seconds(done, total, started)


def cancel_reference(session: Session, batch: Batch) -> Batch:
    """No chunk runs after this: queued and running chunks are cancelled at once, and the batch is settled in
    this call (cancelled, with a manifest of the chunks committed before). A running chunk's worker finds its
    lease gone at its next lease extension (a sweep interval) and stops scoring it; its commit, conditional on
    the lease, is refused and what it wrote removed. The batch keeps its output: the same request again resumes
    from its committed chunks (create_reference_batch). Cancelling stays the status only where the manifest could
    not be written now (the sweeper settles it). A batch whose chunks have all ended is completing, not cancelled:
    409 `batch_finished`."""
    if batch.status not in ("in_progress", "cancelling"):
        raise ServiceError(409, "batch_finished", f"batch {batch.id} is already {batch.status}")
    was = batch.status
    session.execute(update(Batch).where(Batch.id == batch.id, Batch.status == "in_progress")
                    .values(status="cancelling"))
    cancelled = session.execute(update(Chunk.__table__).where(_CHUNKS.batch_id == batch.id,
                                                              _CHUNKS.status.in_(LIVE))
                                .values(status="cancelled", lease_owner=None, lease_expires_at=None,
                                        finished_at=utcnow(), **_NO_PROGRESS)).rowcount
    if not cancelled and was == "in_progress":
        # Every chunk has ended: the batch is completing (a settle may be writing its manifest now), and a cancel
        # would end it twice.
        session.rollback()
        _settle_now(session, batch)
        raise ServiceError(409, "batch_finished", f"batch {batch.id} has run every chunk: it is "
                           f"{'completing' if batch.status == 'in_progress' else 'already ' + batch.status}")
    count(session, "chunks_finished", cancelled, label="cancelled")
    session.commit()
    _settle_now(session, batch)
    return batch


def _settle_now(session: Session, batch: Batch) -> None:
    """Settles the batch if it is over, and reads it again; where its store is unreachable now, the sweeper
    settles it later."""
    try:
        settle(batch.id)
    except Exception as exc:  # noqa: BLE001  (the sweeper settles it)
        log.warning("batch %s could not be settled now: %s", batch.id, exc)
    session.refresh(batch)


def iter_results(batch_id: str, openai: bool = False) -> Iterator[bytes]:
    """The committed objects' rows as JSONL, in chunk order (a failed chunk is one error line). Objects of
    uncommitted attempts are never read: only the names in the chunk rows are."""
    with session_factory()() as session:
        folder = session.scalar(select(Batch.output).where(Batch.id == batch_id))
        chunks = [chunk for chunk in in_input_order(session.execute(
            select(Chunk.index, Chunk.status, Chunk.output, Chunk.input, Chunk.part, Chunk.start, Chunk.error_code,
                   Chunk.error_message).where(Chunk.batch_id == batch_id)).all())
            if chunk.status in ("succeeded", "failed")]
    for chunk in chunks:
        if chunk.status == "failed":
            error = {"code": chunk.error_code, "message": chunk.error_message or ""}
            line = {"custom_id": None, "chunk": chunk.index, "input": chunk.input.uri, "scores": None, "error": error}
            yield (json.dumps(line) + "\n").encode()
            continue
        for k, rows in enumerate(read_table(folder.child(chunk.output))):
            yield "".join(json_line(_line(row, batch_id, chunk.index, k * 1000 + i, openai)) + "\n"
                          for i, row in enumerate(rows)).encode()


def _line(row: dict, batch_id: str, chunk: int, i: int, openai: bool) -> dict:
    code, message = row.pop("error_code", None), row.pop("error_message", None)
    error = {"code": code, "message": message or ""} if code else None
    if not openai:
        return {**row, **({"error": error} if error else {})}
    request_id = f"{batch_id}:{chunk}:{i}"
    body = {"error": error} if error else {k: row[k] for k in ("scores", "logprobs") if k in row}
    return {"id": request_id, "custom_id": row.get("custom_id"), "error": None,
            "response": {"status_code": 400 if error else 200, "request_id": request_id, "body": body}}
