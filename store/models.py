"""Tables. Created only by the Alembic migrations in migrations/ (tests included)."""

import secrets
import threading
import time
from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from store.location import Location, LocationColumn


def utcnow() -> datetime:
    # Naive UTC everywhere: SQLite has no time zones, and mixing aware and naive values breaks comparisons.
    return datetime.now(UTC).replace(tzinfo=None)


_id_lock = threading.Lock()
_last_id = 0


def new_id(prefix: str) -> str:
    """Millisecond time, then 80 random bits, in hex: ids sort by creation (cursor pagination, and a batch's
    results in the order of its lines, order by id). Within one millisecond a process's ids still increase
    (as ULID's monotonic mode): a batch upload makes many in the same millisecond."""
    global _last_id
    with _id_lock:
        value = max((time.time_ns() // 1_000_000) << 80 | secrets.randbits(80), _last_id + 1)
        _last_id = value
    return f"{prefix}_{value:032x}"


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    webhook_secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # Storage URI prefixes this key's reference batches may read and write (besides BATCH_STORAGE_PREFIXES).
    storage_prefixes: Mapped[list | None] = mapped_column(JSON, nullable=True)


_LIVE = "status IN ('queued', 'running')"
_FINISHED_INTERACTIVE = "finished_at IS NOT NULL AND batch_id IS NULL"


def _partial_index(name: str, columns: tuple[str, ...], condition: str) -> Index:
    return Index(name, *columns, postgresql_where=text(condition), sqlite_where=text(condition))


class Leased:
    """A row a worker claims under a lease and may lose (a job, a chunk): what becomes of it when an attempt
    ends without its result (the worker failed, stopped or died). Its table has the columns status,
    lease_owner, lease_expires_at, attempts, error_code, error_message and finished_at."""

    def requeue_or_fail(self, max_attempts: int, code: str, message: str, cancelled: bool, now: datetime) -> str:
        """Cancelled if it was to be; failed with (code, message) once it had `max_attempts` attempts; else queued
        again. The lease is given up either way. Returns the new status."""
        if cancelled:
            self.status = "cancelled"
        elif self.attempts >= max_attempts:
            self.status, self.error_code, self.error_message = "failed", code, message
        else:
            self.status = "queued"
        self.lease_owner = self.lease_expires_at = None
        if self.status != "queued":
            self.finished_at = now
        return self.status


class Job(Base, Leased):
    """One scoring request. The table is the queue of record; the broker only wakes workers up."""

    __tablename__ = "jobs"
    __table_args__ = (
        # Unique among the jobs that have one (Postgres; SQLite keeps a table constraint: migration 0010).
        Index("uq_jobs_idempotency", "api_key_id", "idempotency_key", unique=True,
              postgresql_where=text("idempotency_key IS NOT NULL")),
        # Partial (migration 0010): a row is written three times, each version into every index it qualifies
        # for, so each index holds only the rows its queries read.
        # By model first (migration 0012): a worker claims its own model's queue only.
        _partial_index("ix_jobs_ready", ("model", "status", "priority", "created_at"), _LIVE),
        _partial_index("ix_jobs_tenant_list", ("api_key_id", "id"), "batch_id IS NULL"),
        # The batch lane claims a batch's queued requests grouped by query (prefix reuse in the engine).
        _partial_index("ix_jobs_batch_claim", ("batch_id", "status", "query_key", "id"),
                       f"batch_id IS NOT NULL AND {_LIVE}"),
        # Batch results are streamed in pages by id.
        _partial_index("ix_jobs_batch_results", ("batch_id", "id"), "batch_id IS NOT NULL"),
        # Retention's look for interactive jobs (a batch's requests go with their batch): without batch_id in
        # its condition it would go through the finished requests of every batch not yet expired.
        _partial_index("ix_jobs_finished", ("finished_at",), _FINISHED_INTERACTIVE),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    # queued, running, succeeded, failed, cancelled
    status: Mapped[str] = mapped_column(String(16), default="queued")
    # Higher runs first: the values are store/priorities.py's.
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # The name of the model it runs on (a name of MODELS, or MODEL): only that model's workers claim it.
    model: Mapped[str] = mapped_column(String(100))
    request: Mapped[dict] = mapped_column(JSON)
    # The request in token space (core's TokenizedRequest.to_bytes), written at submission; NULL for jobs queued
    # before it existed, whose workers tokenize `request`.
    tokens: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    return_logprobs: Mapped[bool] = mapped_column(Boolean, default=False)
    # The dtype its scores were computed in (the finishing worker's: store.finishing.finish_succeeded).
    dtype: Mapped[str | None] = mapped_column(String(16), nullable=True)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64))

    items_total: Mapped[int] = mapped_column(Integer)
    items_done: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer)

    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)

    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)

    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # When its current attempt was claimed, and its items done then (kept from earlier attempts, store/claims.py):
    # its eta is counted from the pace since then (migration 0020).
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    items_at_claim: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    # A request of a batch (one JSONL line) is a job in the batch lane; the columns are NULL for other jobs.
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), nullable=True)
    custom_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # Hash of the query: requests sharing it are claimed together so the engine reuses the prefix.
    query_key: Mapped[str | None] = mapped_column(String(32), nullable=True)


TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")


class Batch(Base):
    """An offline backfill: many requests (jobs with batch_id) uploaded as JSONL, run in the batch lane."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_list", "api_key_id", "id"),
        Index("ix_batches_status", "status", "last_claimed_at"),
        # One batch of a key owns an output prefix (migration 0015): a re-run finds it, another input is refused.
        Index("uq_batches_output", "api_key_id", "output_key", unique=True,
              postgresql_where=text("output_key IS NOT NULL"), sqlite_where=text("output_key IS NOT NULL")),
        _partial_index("ix_batches_finished", ("finished_at",), "finished_at IS NOT NULL"),  # retention
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    # validating, in_progress, cancelling, completed, cancelled, failed
    status: Mapped[str] = mapped_column(String(16), default="validating")
    model: Mapped[str] = mapped_column(String(100))
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set once validation ends.
    total: Mapped[int] = mapped_column(Integer, default=0)
    # An uploaded batch's requests ended by status, the items of its requests and the items scored of its ended
    # requests, kept as they end (store/batch_counts.py): what GET /batches shows without reading the requests.
    succeeded: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cancelled: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    items_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    items_ended: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    # A reference batch (its data in storage, run as chunks): the options (store.lake.tables.Options), the
    # output prefix, and its size as planned. NULL for an uploaded batch.
    source: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    output: Mapped[Location | None] = mapped_column("output_uri", LocationColumn, nullable=True)
    chunks_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A reference batch's output prefix and what it scores into it (input, options, model), as sha256 digests
    # (store.lake.chunks): set while the batch owns the prefix (running or completed); NULL once cancelled or
    # replaced by an overwrite, and for uploads.
    output_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    source_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # When a worker last claimed from this batch: the batch lane serves the tenant waiting longest.
    last_claimed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


BATCH_TERMINAL_STATUSES = ("completed", "cancelled", "failed")


class Chunk(Base, Leased):
    """A part of a reference batch's input (store/lake/): the unit a worker claims, with a lease, attempts and
    the sweeper as jobs have. Done, it names the one object holding its results: the chunk rows are the
    batch's manifest."""

    __tablename__ = "chunks"
    __table_args__ = (
        _partial_index("ix_chunks_ready", ("status", "not_before"), _LIVE),
    )

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    input: Mapped[Location] = mapped_column(LocationColumn)  # vetted (store.lake.access)
    part: Mapped[int] = mapped_column(Integer)  # Parquet row group; -1 for byte ranges
    start: Mapped[int] = mapped_column(BigInteger)
    stop: Mapped[int] = mapped_column(BigInteger)
    rows_total: Mapped[int | None] = mapped_column(Integer, nullable=True)  # known for Parquet
    # The input object's size and version when planned (tables.object_version); NULL before migration 0016.
    input_version: Mapped[str | None] = mapped_column(String(300), nullable=True)
    # queued, running, succeeded, failed, cancelled
    status: Mapped[str] = mapped_column(String(16), default="queued")
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # A chunk that failed for a reason that may pass (the store unreachable) waits until then.
    not_before: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    rows_done: Mapped[int] = mapped_column(Integer, default=0)
    rows_failed: Mapped[int] = mapped_column(Integer, default=0)
    items_done: Mapped[int] = mapped_column(Integer, default=0)
    output: Mapped[str | None] = mapped_column(Text, nullable=True)  # the committed object's name
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class JobResult(Base):
    """Per-job log-probabilities as one float32 [items_total, n_labels] blob; scores are derived on read."""

    __tablename__ = "job_results"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    n_labels: Mapped[int] = mapped_column(Integer)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class JobPart(Base):
    """The items of a running job that one pass scored, kept as they are written (store/finishing.py): a job handed
    back or whose worker died resumes from them (store/claims.py) and scores only the items they lack. `items`:
    int32 item indices; `logprobs`: float32 [len(items), n_labels]. A job's parts go once it ends."""

    __tablename__ = "job_parts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    first_item: Mapped[int] = mapped_column(Integer, primary_key=True)  # an item is scored once: one part holds it
    n_labels: Mapped[int] = mapped_column(Integer)
    items: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)


class WebhookDelivery(Base):
    """One webhook message (its id is the webhook-id header, the same for every retry) and its attempts."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("msg"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True, index=True)
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), nullable=True,
                                                 index=True)
    url: Mapped[str] = mapped_column(Text)
    # Deferred: a job's whole results; the views that show a delivery's state need none of it.
    payload: Mapped[str] = mapped_column(Text, deferred=True)
    # pending, delivered, failed
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class Pass(Base):
    """One packed forward pass run by a worker; /metrics aggregates these across all workers."""

    __tablename__ = "passes"
    __table_args__ = (Index("ix_passes_created", "created_at"),)  # retention

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker: Mapped[str] = mapped_column(String(200))
    n_jobs: Mapped[int] = mapped_column(Integer)
    n_items: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(Integer)
    padded_tokens: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Worker(Base):
    """Live workers, heartbeated by each worker process (for /readyz)."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(100))
    started_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # The attention path its engine runs (core.scorer.Scorer.attention_path), e.g. "pallas-tpu" or "xla".
    attention: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # "warming" while it compiles its programs (WARMUP=ladder), then "ready"; /readyz counts the ready ones.
    state: Mapped[str] = mapped_column(String(16), default="ready", server_default="ready")
    # Where it runs: its host, and the chips `packscore worker --devices` gave it ("tpu:0,1"; None: a worker
    # started alone, on its process's own devices).
    host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    device_group: Mapped[str | None] = mapped_column(String(100), nullable=True)
    # While warming: the programs compiled (or loaded from the cache) so far, of how many.
    warmup_done: Mapped[int | None] = mapped_column(Integer, nullable=True)
    warmup_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The dtype its engine computes in ("float32", "bfloat16"): one per model across the live workers
    # (store.workers.register), so that a score does not depend on which worker ran it.
    dtype: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # The platform its devices are ("cpu", "tpu", "gpu"), as JAX names it: the device kind GET /workers shows.
    platform: Mapped[str | None] = mapped_column(String(16), nullable=True)


class CounterRow(Base):
    """A running total kept as events happen (see store.counters.count). A total is the sum over its shards: each
    transaction adds to one shard chosen at random, so concurrent workers seldom wait on the same row."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(String(64), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
