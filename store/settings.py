"""All configuration, from environment variables (one place, pydantic-settings)."""

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class SettingsError(ValueError):
    """A setting the service cannot run with, found after the settings were read (the CLI reports it as one line)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/packscore"
    # Threads that run the API's blocking work (validation, tokenization, database calls).
    api_threads: int = Field(8, gt=0)
    # Connections per process. Above API_THREADS plus a worker's threads, so a burst of requests waits for
    # threads, not for connections; an exhausted pool answers 503 after DB_POOL_TIMEOUT_SECONDS.
    db_pool_size: int = Field(20, ge=0)  # 0: no limit (SQLAlchemy's)
    db_max_overflow: int = Field(30, ge=-1)  # -1: no limit (SQLAlchemy's)
    db_pool_timeout_seconds: float = Field(10.0, ge=0)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Celery broker; defaults to REDIS_URL. Embedded mode uses "filesystem://".
    broker_url: str | None = None
    # Folder for the filesystem broker (embedded mode only).
    broker_dir: str = ".packscore/broker"
    # Prefix on every broker key, so several deployments (or test runs) can share one Redis.
    broker_key_prefix: str = ""
    queue_name: str = "packscore"

    # The models this deployment serves, name to source (a source is what MODEL takes: a bundled name, a .gguf
    # file or a Hugging Face directory): `small=smollm2-135m,judge=/models/qwen3-reranker`, or a JSON object. A
    # bare source names itself. The first is the model of a request that names none. Unset: MODEL alone.
    models: Annotated[dict[str, str], NoDecode] = {}
    # Without MODELS: the one model, named as its source. With MODELS: the one a worker serves (a name of
    # MODELS; unset, the first); the API reads MODELS only.
    model: str | None = None
    max_items: int = Field(100_000, gt=0)
    max_tokens: int = Field(4_000_000, gt=0)
    max_labels: int = Field(4096, gt=0)
    max_scores: int = Field(1_000_000, gt=0)  # items x labels of one request: the size of its results
    # Tokens per packed pass (None: the engine's default for the backend).
    pass_tokens: int | None = Field(None, gt=0)
    # bfloat16 on accelerators (no further from float32 than transformers' own bfloat16: docs/score-semantics.md);
    # float32 on CPU, where bfloat16 gains little without AMX. auto: bfloat16 on accelerators and on CPUs with AMX,
    # float32 on other CPUs (core.dtype). Not the default: a default that differs by host would split a mixed
    # fleet's workers of one model between dtypes, and a worker of another dtype than its model's is refused.
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    # auto: Pallas kernels on TPU and GPU (the XLA path where a kernel does not compile), XLA on CPU.
    attention: Literal["auto", "xla", "pallas"] = "auto"
    # Compiled pass programs a worker keeps in memory (least recently used go first; each holds tens of MB).
    # Above the warm-up's (21 on CPU), so that programs met later do not evict warmed ones.
    max_programs: int = Field(24, gt=0)
    # Device memory for recent queries' keys/values (a query shared by requests, or whose items span passes,
    # is computed once). A job whose items span passes starts when its query fits beside those under way.
    # Unset: 256 MiB on CPU; on accelerators a share of the device memory left after the weights and the
    # largest pass (core.scorer.device_prefix_cache_bytes).
    prefix_cache_bytes: int | None = Field(None, ge=0)
    # How often a ready worker hands glibc's freed memory back (malloc_trim) and logs its RSS beside the bounded
    # parts (prefix cache, resident programs, Arrow's pool), so that a cache filling up is told from a leak; with
    # trace_python_memory (tracemalloc: slows the worker; for hunting a leak) also the lines whose Python
    # allocations grew most since the last log.
    memory_log_seconds: float = Field(300.0, gt=0)
    trace_python_memory: bool = False
    # The C allocator of the worker processes that `packscore worker` and `serve --embedded` start. jemalloc
    # (preloaded where the system has it: Debian's and Ubuntu's libjemalloc2, which the image installs; glibc's
    # otherwise): the workers' RSS grows from fragmentation far more slowly than under glibc's (docs/soak.md).
    # system: glibc's (or whatever LD_PRELOAD already names).
    worker_allocator: Literal["jemalloc", "system"] = "jemalloc"
    # JAX's persistent compilation cache: a restarted worker, or an evicted program, loads instead of compiling.
    # One folder per host by default, which that host's workers share (a program compiled by one is loaded by the
    # others); empty: no cache.
    compile_cache_dir: str = Field(default_factory=lambda: str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packscore" / "compile"))
    # ladder: a starting worker compiles (or loads from COMPILE_CACHE_DIR) every program of the pass-shape
    # ladder before it takes work, and /readyz says "warming" meanwhile; none: programs compile when first met.
    warmup: Literal["ladder", "none"] = "ladder"
    # Devices the engine shards the model over (tensor parallelism): a worker holds this many JAX devices (chips;
    # on TPU v7x, two per chip), and `packscore worker --devices` starts one worker per group of them.
    tensor_parallel: int = Field(1, ge=1)
    # Set by `packscore worker --devices` for each worker it starts: the chips it was given ("tpu:0,1,2,3"),
    # for /readyz and /metrics. Unset: the process's own devices.
    device_group: str | None = None
    # A GGUF model's converted tokenizer and dequantized weights, kept so that restarts skip the conversion.
    model_cache_dir: str | None = None
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    api_key_prefix: str = "psk_"

    # Work claimed by one drain round: jobs are coalesced into packed passes up to these bounds.
    drain_max_jobs: int = Field(256, gt=0)
    drain_max_items: int = Field(20_000, gt=0)
    lease_seconds: float = Field(60.0, gt=0)
    # How often a worker heartbeats its leases and itself, sweeps expired leases and re-kicks idle queued jobs.
    sweep_interval_seconds: float = Field(2.0, gt=0)
    max_attempts: int = Field(5, gt=0)
    # A worker not seen for this long is not counted by /readyz.
    worker_stale_seconds: float = Field(30.0, gt=0)

    # Offline batches (POST /batches): limits per upload (lines, bytes of the JSONL file).
    batch_max_requests: int = Field(100_000, gt=0)
    batch_max_bytes: int = Field(200 * 1024 * 1024, gt=0)
    # Tokens of batch requests a worker claims per drain round (unset: one packed pass). Queued interactive
    # jobs run before the next round, so smaller rounds mean lower interactive latency during a backfill.
    batch_round_tokens: int | None = Field(None, gt=0)
    # An upload still running this long after it began is failed (`upload_timeout`): by the API, or by a
    # worker's sweeper if the API died with it.
    batch_upload_timeout_seconds: float = Field(3600.0, gt=0)

    # Reference batches (POST /batches naming its data; store/lake/): local paths are served only under this
    # folder (unset: none are; `serve --embedded` sets the folder it was started in), and remote URIs only under
    # these prefixes (every key), or those of the key's own `storage_prefixes` column. None by default.
    batch_local_root: str | None = None
    batch_storage_prefixes: Annotated[list[str], NoDecode] = []
    # A reference batch is planned into chunks of about this many Parquet rows, or JSONL/CSV bytes; at most
    # this many chunks per batch (not BATCH_MAX_REQUESTS).
    batch_chunk_rows_target: int = Field(5000, gt=0)
    batch_chunk_bytes: int = Field(8 << 20, gt=0)
    # A worker whose passes run on the CPU cuts a chunk it reads into pieces of about this many seconds of its
    # own passes (accelerators keep the planned chunks). A piece is also a batch's turn: uploaded batches run
    # for as long between two chunks, and other reference batches take turns chunk by chunk.
    batch_chunk_seconds: float = Field(60.0, gt=0)
    batch_max_chunks: int = Field(200_000, gt=0)
    # A compressed JSONL file cannot be split into chunks: it is one, so at most this large.
    batch_compressed_max_bytes: int = Field(64 << 20, gt=0)

    # Retention (store/retention.py): finished jobs, their results and webhook deliveries, and finished batches
    # are deleted this long after they finished (as the OpenAI Batch API keeps files); passes after their own.
    result_ttl_days: float = Field(30.0, gt=0)
    pass_history_days: float = Field(7.0, gt=0)
    retention_chunk_rows: int = Field(1000, gt=0)
    retention_interval_seconds: float = Field(60.0, gt=0)
    # Rows per database round trip while an upload streams in, and per page of streamed results.
    batch_chunk_rows: int = Field(1000, gt=0)

    # How /v1/rerank turns a query and documents into a scoring request (store/rerank.py): "auto" (Qwen3-Reranker's
    # template for Qwen3 models, "smollm2" for others), a built-in name ("qwen3-reranker", "smollm2"), or a JSON
    # object {"prefix", "suffix", "instruction", "labels": [yes, no]} whose prefix holds {instruction} and {query}.
    rerank_template: str = "auto"

    score_timeout_seconds: float = Field(60.0, gt=0)
    # How often the API looks for finished /v1/score jobs on SQLite (one query for all waiting calls);
    # Postgres notifies instead.
    score_poll_seconds: float = Field(0.05, gt=0)
    retry_after_seconds: int = Field(5, ge=0)

    # Seconds to wait before attempt n+1 of a webhook delivery; its length bounds the attempts.
    webhook_retry_schedule: Annotated[list[Annotated[float, Field(ge=0)]], NoDecode] = [1, 5, 30, 120, 600, 1800, 3600]
    webhook_timeout_seconds: float = Field(10.0, gt=0)
    webhook_poll_seconds: float = Field(1.0, gt=0)
    # Delivery attempts in flight at once per worker, at most this many of them to one host, and at most this
    # many for one API key (a key's slow receivers, on however many host names, leave the other keys slots).
    webhook_concurrency: int = Field(16, gt=0)
    webhook_per_host: int = Field(4, gt=0)
    webhook_per_key: int = Field(8, gt=0)
    # Hosts, IPs or CIDR networks that webhooks may reach even though they are private/loopback.
    webhook_allowlist: Annotated[list[str], NoDecode] = []
    # A webhook message larger than this (bytes of JSON) carries a link to its results instead of the results.
    webhook_max_payload_bytes: int = Field(1_000_000, gt=0)

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, url: str) -> str:
        # Else SQLAlchemy fails at the first query, deep in a traceback: postgres:// (libpq's and Heroku's spelling)
        # is no dialect of its, and other databases' drivers are not installed. Not shown: it may hold a password.
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            backend = make_url(url).get_backend_name()
        except (ArgumentError, ValueError):  # ValueError: a port that is no number
            backend = None
        if backend not in ("postgresql", "sqlite"):
            raise ValueError("not a PostgreSQL or SQLite URL (postgresql+psycopg://... or sqlite:///...)")
        return url

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("{"):
            return json.loads(value)
        models: dict[str, str] = {}
        for entry in (part.strip() for part in value.split(",")):
            if entry:
                name, _, source = entry.partition("=") if "=" in entry else (entry, "", entry)
                if name.strip() in models:
                    raise ValueError(f"MODELS names {name.strip()!r} twice")
                models[name.strip()] = source.strip()
        return models

    @field_validator("models")
    @classmethod
    def _check_models(cls, models: dict[str, str]) -> dict[str, str]:
        for name, source in models.items():
            # A job row keeps the name (jobs.model is 100 characters).
            if not name or not source or len(name) > 100:
                raise ValueError(f"MODELS entry {name!r}={source!r}: a name of 1 to 100 characters and a source")
        return models

    @property
    def served_models(self) -> dict[str, str]:
        """The deployment's models, name to source, the default first."""
        if self.models:
            return dict(self.models)
        model = self.model or "smollm2-135m"
        return {model: model}

    @property
    def default_model(self) -> str:
        """The model of a request that names none."""
        return next(iter(self.served_models))

    @property
    def worker_model(self) -> str:
        """The name of the one model a worker serves (MODEL, a name of MODELS; unset, the default)."""
        if self.model is None or not self.models:
            return self.default_model
        if self.model not in self.models:
            raise SettingsError(f"MODEL={self.model!r} is not a name of MODELS ({', '.join(self.models)})")
        return self.model

    @field_validator("webhook_allowlist", "webhook_retry_schedule", "batch_storage_prefixes", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        # Environment lists are comma-separated ("127.0.0.1,10.0.0.0/8") or JSON.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def request_limits(self) -> dict[str, int]:
        """The engine's request limits: the API validates with the same ones the workers score with."""
        return {"max_items": self.max_items, "max_tokens": self.max_tokens, "max_labels": self.max_labels,
                "max_scores": self.max_scores}

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or self.redis_url


@lru_cache
def get_settings() -> Settings:
    return Settings()
