"""Capacity benchmark: how busy the service keeps an accelerator, with the device simulated.

    python -m benchmarks.capacity [--target tpu-v6e|tpu-v5e|cuda-h100 | --device-tokens-per-s R]
                              [--shapes contract,small,backfill] [--workers 1,2] [--device-seconds 10]
    python -m benchmarks.capacity --runs datalake:1,datalake:2 [--pairs 1000000]
    python -m benchmarks.capacity --runs two-models:2

It starts the real service on a fresh Postgres database (with Redis): one API process and N workers whose
device step is simulated. A simulated pass takes (real tokens of the pass) / R seconds of a device timeline
of its own, which runs beside the worker's Python, as an accelerator does; everything else (the API, the
database, the broker, tokenization, planning, packing, the pass loop) is the real code. R defaults to
`core.aot`'s roofline for Qwen3-0.6B on the target: an estimate, so the duty cycle says how much of such a
device the service would keep busy, not how fast any device is.

For each traffic shape it queues the jobs first (POST /jobs from 16 persistent clients, or one batch upload),
then starts the workers, and reports (a run holds --device-seconds of simulated device time per worker: the
workers start together, and the last one ready starts claiming a second or so after the first, which would
otherwise weigh twice as much on two workers' duty as on one's):
- duty: simulated device seconds / (wall seconds x workers), the wall from the first claim to the last finish
  by the jobs' own timestamps;
- items/s, and the ideal items/s (every device busy all the time);
- API jobs/s while the jobs were submitted;
- CPU milliseconds per job of the API (during submission), the workers (host work only: the device is a
  sleep) and Postgres (all its processes; submission, drain and a batch's results read back, separately;
  the benchmark's own polling connection left out), from /proc;
- each worker's first and last pass and its device time (JSON only);
- an estimate (labelled so): how many such workers one Postgres core could feed at 90% duty.

The `two-models` shape runs two models in one deployment, MODELS=a=smollm2-135m,b=smollm2-135m: two names,
two queues and two workers, of one checkpoint so that both workers load in the same time and claim together
(the device is simulated: what the weights are does not matter). `small` jobs alternate between the two; one
simulated worker per model (MODEL=a, MODEL=b). Each worker's duty is its own: its device seconds / the wall of
its model's jobs (first claim to last finish).

The simulated workers are started by this module only (`python -m benchmarks.capacity simulated-worker`), never by
a setting of a serving deployment; their heartbeat and /metrics say attention="simulated".
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.service_harness import free_port, stop_processes, wait_until

REPO = Path(__file__).resolve().parents[1]
SIMULATED = "simulated"
CLIENTS = 16  # persistent HTTP clients submitting jobs


@dataclass(frozen=True)
class Shape:
    query_tokens: int
    items: int
    item_tokens: int
    batch: bool  # one batch upload of JSONL lines instead of POST /jobs
    models: tuple[str, ...] = ()  # MODELS entries (name=source) the jobs alternate between; () for MODEL alone


SHAPES = {
    "contract": Shape(2000, 500, 20, batch=False),  # the seeds' accelerator contract request
    "small": Shape(50, 10, 10, batch=False),
    "backfill": Shape(200, 20, 15, batch=True),
    "two-models": Shape(50, 10, 10, batch=False, models=("a=smollm2-135m", "b=smollm2-135m")),
}
# Words the bundled tokenizer reads as one token each after a space: a text of n words is about n tokens.
WORDS = ("the cat dog house tree river city water light stone paper music table window garden bread "
         "green blue red black white small large old new happy quick slow bright dark warm cold").split()


# ---- the simulated device ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimulatedRows:
    """A prefix's keys or values on the simulated device: only their size."""

    nbytes: int


def simulated_scorer(settings, tokens_per_second: float):  # type: ignore[no-untyped-def]
    """The served model's tokenizer and limits, with a simulated device in place of its weights' passes."""
    from core import Scorer

    class SimulatedScorer(Scorer):
        """Passes take tokens / rate seconds on a device timeline of their own; scores are a constant."""

        device_free_at = 0.0

        @property
        def attention_path(self) -> str:
            return SIMULATED

        def _launch(self, arrays, cached, cached_lengths, labels, keep_kv):  # type: ignore[no-untyped-def]
            self._tables(arrays, arrays.tile_ids.shape[1])  # the host work a real pass does
            start = max(time.monotonic(), self.device_free_at)
            self.device_free_at = start + arrays.real_tokens / tokens_per_second
            logprobs = np.full((len(arrays.score_rows), labels.shape[1]), np.log(0.5), np.float32)
            shape_key = (len(arrays.tokens), arrays.cache_len, len(arrays.score_rows), labels.shape[1], keep_kv)
            return (self.device_free_at, logprobs), (None, None), shape_key

        def _fetch(self, handle) -> np.ndarray:  # type: ignore[no-untyped-def]
            ready_at, logprobs = handle
            time.sleep(max(0.0, ready_at - time.monotonic()))
            return logprobs

        def _is_ready(self, handle) -> bool:  # type: ignore[no-untyped-def]
            return time.monotonic() >= handle[0]

        def _prefix_rows(self, keys_or_values, lo: int, hi: int):  # type: ignore[no-untyped-def]
            # A stand-in as large as the real rows (the cache evicts as it would), holding nothing.
            return SimulatedRows(self.prefix_bytes(hi - lo) // 2)

        def warm_up(self) -> int:
            return 0

    # The real weights load but never run: the device is simulated.
    name = settings.worker_model
    scorer = SimulatedScorer.from_pretrained(settings.served_models[name], settings.model_cache_dir, name=name,
                                             attention="xla",
                                             pass_tokens=settings.pass_tokens or 16384,
                                             prefix_cache_bytes=settings.prefix_cache_bytes, **settings.request_limits)
    # As on an accelerator: only passes that keep a prefix return keys/values, and the cache is the device's.
    scorer.always_keep_kv = scorer.host_prefix_cache = False
    scorer.launches_ahead = True
    scorer.attention = "pallas"  # the host tables of an accelerator's kernel (the XLA path's cost more)
    return scorer


def run_simulated_worker(tokens_per_second: float) -> None:
    from store.settings import get_settings
    from worker import scorer as worker_scorer
    from worker.celery_app import app, worker_argv

    worker_scorer.install_scorer(simulated_scorer(get_settings(), tokens_per_second))
    import worker.tasks  # noqa: F401  (registers the task)

    app.worker_main(worker_argv("INFO"))  # as `packscore worker`; the chunk feeds log their CPU at INFO


# ---- measuring -----------------------------------------------------------------------------------------------

def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (from /proc; a process gone counts 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def postgres_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def postgres_cpu() -> float:
    return cpu_seconds(postgres_pids())


def host_cpu() -> str:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores, " + " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
                                                             if f in flags.split())


def roofline_tokens_per_second(target: str) -> float:
    """Tokens/s of `core.aot`'s roofline for Qwen3-0.6B (bfloat16) on `target` at the accelerators' pass size:
    an estimate from published peaks."""
    import jax.numpy as jnp

    from core import aot

    figures = aot.roofline(aot.MODELS["qwen3-0.6b"], aot.TARGETS[target], aot.contract_passes(16384), jnp.bfloat16)
    c = aot.CONTRACT
    return figures["items_per_second_roofline"] * (c["query_tokens"] / c["items"] + c["item_tokens"])


# ---- traffic ---------------------------------------------------------------------------------------------------

def _text(rng: np.random.Generator, words: int, tag: str = "") -> str:
    picked = rng.choice(WORDS, size=max(words - len(tag.split()), 1))
    return " ".join([*tag.split(), *picked])


def request_body(shape: Shape, index: int, rng: np.random.Generator) -> dict:
    # The index in the query: requests share no prefix (the roofline assumes none).
    return {"query": _text(rng, shape.query_tokens, f"request {index}:"),
            "items": [_text(rng, shape.item_tokens) for _ in range(shape.items)],
            "label_token_ids": [9805, 787]}


def jobs_for(shape: Shape, tokens_per_second: float, device_seconds: float) -> int:
    """Jobs holding at least `device_seconds` of simulated device time."""
    tokens = shape.query_tokens + shape.items * shape.item_tokens
    return int(np.ceil(device_seconds * tokens_per_second / tokens))


@dataclass
class Run:
    shape: str
    workers: int
    jobs: int
    items: int = 0
    submit_seconds: float = 0.0
    api_cpu: float = 0.0
    postgres_submit_cpu: float = 0.0
    wall: float = 0.0
    device_seconds: float = 0.0
    worker_cpu: float = 0.0
    postgres_drain_cpu: float = 0.0
    failed: int = 0
    per_worker: list = field(default_factory=list)
    results_seconds: float = 0.0  # a batch's results read back (GET /batches/{id}/results)
    api_results_cpu: float = 0.0
    postgres_results_cpu: float = 0.0

    def figures(self) -> dict:
        jobs = self.jobs
        per_worker_jobs_s = 0.9 * jobs / self.device_seconds  # a worker at 90% duty
        pg_ms = (self.postgres_submit_cpu + self.postgres_drain_cpu + self.postgres_results_cpu) / jobs * 1e3
        return {
            "shape": self.shape, "workers": self.workers, "jobs": jobs, "items": self.items,
            "duty": round(self.device_seconds / (self.wall * self.workers), 3),
            "items_per_s": round(self.items / self.wall),
            "ideal_items_per_s": round(self.items / self.device_seconds * self.workers),
            "api_jobs_per_s": round(jobs / self.submit_seconds, 1),
            "api_cpu_ms_per_job": round(self.api_cpu / jobs * 1e3, 3),
            "worker_cpu_ms_per_job": round(self.worker_cpu / jobs * 1e3, 3),
            "postgres_cpu_ms_per_job": {"submit": round(self.postgres_submit_cpu / jobs * 1e3, 3),
                                        "drain": round(self.postgres_drain_cpu / jobs * 1e3, 3),
                                        "results": round(self.postgres_results_cpu / jobs * 1e3, 3)},
            "results_lines_per_s": round(jobs / self.results_seconds) if self.results_seconds else None,
            "api_results_cpu_ms_per_line": round(self.api_results_cpu / jobs * 1e3, 3),
            "estimate_workers_per_postgres_core_at_90pct_duty": round(1e3 / (pg_ms * per_worker_jobs_s), 1),
            "wall_s": round(self.wall, 2), "device_s": round(self.device_seconds, 2), "failed": self.failed,
            "per_worker": self.per_worker,
        }


class Bench:
    """One service (API + workers) on a fresh database per run."""

    def __init__(self, admin_url: str, redis_url: str, tokens_per_second: float, logs: Path) -> None:
        self.admin_url, self.redis_url = admin_url, redis_url
        self.rate = tokens_per_second
        self.logs = logs

    def _env(self, database_url: str, prefix: str) -> dict[str, str]:
        return {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": self.redis_url,
                "BROKER_KEY_PREFIX": prefix, "WARMUP": "none", "PASS_TOKENS": "16384",
                "PYTHONPATH": str(REPO)}

    def _spawn(self, args: list[str], env: dict, log: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", *args], env=env, cwd=REPO,
                                stdout=open(self.logs / log, "ab"), stderr=subprocess.STDOUT)

    def _create_database(self, tag: str) -> str:
        """A new database named `tag`, migrated to head; its URL."""
        from sqlalchemy import create_engine, make_url, text

        from migrations import upgrade

        admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{tag}"'))
        admin.dispose()
        url = make_url(self.admin_url).set(database=tag).render_as_string(hide_password=False)
        try:
            upgrade(url)
        except Exception:
            self._drop_database(tag)
            raise
        return url

    def _drop_database(self, tag: str) -> None:
        from sqlalchemy import create_engine, text

        admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{tag}" WITH (FORCE)'))
        admin.dispose()

    def _start_api(self, env: dict, tag: str) -> tuple[str, str, subprocess.Popen]:
        """A key for the benchmark, then one API process: (key, base URL, the process) once it answers."""
        import httpx

        created = subprocess.run([sys.executable, "-m", "packscore.cli", "create-key", "--name", "bench"],
                                 env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
        key = created.split("api_key=", 1)[1].split()[0]
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        api = self._spawn(["packscore.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], env,
                          f"{tag}-api.log")
        try:
            wait_until(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 200, 120, "the API")
        except AssertionError:
            stop_processes([api])
            raise
        return key, base, api

    def run(self, name: str, workers: int, device_seconds: float) -> dict:
        from sqlalchemy import create_engine, func, select, text

        from store.models import Job, Pass, Worker

        shape = SHAPES[name]
        n_jobs = jobs_for(shape, self.rate, device_seconds * workers)
        tag = f"capacity_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        url = self._create_database(tag)
        procs: list[subprocess.Popen] = []
        names = [entry.split("=", 1)[0] for entry in shape.models]
        try:
            env = self._env(url, tag) | ({"MODELS": ",".join(shape.models)} if shape.models else {})
            key, base, api = self._start_api(env, tag)
            procs.append(api)
            run = Run(name, workers, n_jobs)
            rng = np.random.default_rng(0)
            bodies = [request_body(shape, i, rng) | ({"model": names[i % len(names)]} if names else {})
                      for i in range(n_jobs)]
            run.items = n_jobs * shape.items
            api_cpu, pg_cpu, start = cpu_seconds([api.pid]), postgres_cpu(), time.perf_counter()
            batch_id = (_upload_batch if shape.batch else _submit_jobs)(base, key, bodies)
            run.submit_seconds = time.perf_counter() - start
            run.api_cpu, run.postgres_submit_cpu = cpu_seconds([api.pid]) - api_cpu, postgres_cpu() - pg_cpu
            engine = create_engine(url)
            with engine.connect() as conn:
                queued = conn.scalar(select(func.count()).select_from(Job).where(Job.status == "queued"))
            assert queued == n_jobs, f"{queued} of {n_jobs} jobs queued; see {self.logs}"
            # With several models, worker i serves model i (modulo their number).
            worker_procs = [self._spawn(["benchmarks.capacity", "simulated-worker", "--device-tokens-per-s",
                                         str(self.rate)], env | ({"MODEL": names[i % len(names)]} if names else {}),
                                        f"{tag}-worker{i}.log") for i in range(workers)]
            procs += worker_procs
            # Their CPU counts from the first claim: loading the model is not the pass loop's work.
            with engine.connect() as conn:
                wait_until(lambda: conn.scalar(select(func.count()).select_from(Job).where(Job.status != "queued")),
                      300, "the first claim", interval=0.02)
            worker_cpu, pg_cpu = cpu_seconds([p.pid for p in worker_procs]), postgres_cpu()
            with engine.connect() as conn:
                # This polling's own backend is not the service's cost.
                poller = conn.scalar(text("SELECT pg_backend_pid()")) if url.startswith("postgresql") else None
                polling = cpu_seconds([poller]) if poller else 0.0
                wait_until(lambda: not conn.scalar(select(func.count()).select_from(Job)
                                              .where(Job.status.in_(("queued", "running")))), 3600, "the jobs")
                polling = (cpu_seconds([poller]) if poller else 0.0) - polling
            run.worker_cpu = cpu_seconds([p.pid for p in worker_procs]) - worker_cpu
            run.postgres_drain_cpu = postgres_cpu() - pg_cpu - polling
            if shape.batch:
                api_cpu, pg_cpu, start = cpu_seconds([api.pid]), postgres_cpu(), time.perf_counter()
                lines = _read_results(base, key, batch_id)
                run.results_seconds = time.perf_counter() - start
                run.api_results_cpu = cpu_seconds([api.pid]) - api_cpu
                run.postgres_results_cpu = postgres_cpu() - pg_cpu
                assert lines == n_jobs, f"{lines} result lines for {n_jobs} requests"
            with engine.connect() as conn:
                first, last = conn.execute(select(func.min(Job.started_at), func.max(Job.finished_at))).one()
                tokens = conn.scalar(select(func.sum(Pass.tokens)))
                run.failed = conn.scalar(select(func.count()).select_from(Job).where(Job.status != "succeeded"))
                # Each worker's first and last pass boundary, and its device time: a worker that started late
                # or ran out of work early shows here.
                run.per_worker = [
                    {"first_pass_s": round((lo - first).total_seconds(), 2),
                     "last_pass_s": round((hi - first).total_seconds(), 2), "device_s": round(n / self.rate, 2),
                     "model": model}
                    for lo, hi, n, model in conn.execute(
                        select(func.min(Pass.created_at), func.max(Pass.created_at), func.sum(Pass.tokens),
                               func.min(Worker.model)).outerjoin(Worker, Worker.id == Pass.worker)
                        .group_by(Pass.worker).order_by(func.min(Pass.created_at)))]
                # Each worker's duty over its own model's wall (first claim to last finish of that model's jobs).
                walls = {model: (hi - lo).total_seconds() for model, lo, hi in conn.execute(
                    select(Job.model, func.min(Job.started_at), func.max(Job.finished_at)).group_by(Job.model))}
                for figures in run.per_worker:
                    if figures["model"] in walls:
                        figures["duty"] = round(figures["device_s"] / walls[figures["model"]], 3)
            engine.dispose()
            run.wall = (last - first).total_seconds()
            run.device_seconds = tokens / self.rate
            return run.figures()
        finally:
            stop_processes(procs)
            self._drop_database(tag)

    def run_datalake(self, workers: int, pairs: int, docs: int = 20) -> dict:
        """The `datalake` shape: a Parquet pair table on a local S3 store (SeaweedFS), `pairs` rows of a
        200-token query and `docs` 15-token documents per query, run as a reference batch with Parquet output
        to the store."""
        import httpx
        import pyarrow as pa
        import pyarrow.parquet as pq
        import s3fs
        from sqlalchemy import create_engine, func, select, text

        from store.models import Batch, Chunk, CounterRow
        from tests.object_stores import CREDENTIALS, SeaweedS3

        tag = f"capacity_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        store = SeaweedS3(self.logs / f"{tag}-s3")
        store.start()
        url = self._create_database(tag)
        procs: list[subprocess.Popen] = []
        try:
            fs = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                   endpoint_url=store.endpoint)
            rng = np.random.default_rng(0)
            queries = pairs // docs
            started = time.perf_counter()
            for part, lo in enumerate(range(0, queries, 5000)):  # files of 5,000 queries, row groups of 5,000 rows
                hi = min(queries, lo + 5000)  # made a file at a time: 10M pairs' words at once take gigabytes
                query_text = [_text(rng, 200, f"query {i}:") for i in range(lo, hi)]
                doc_words = rng.choice(WORDS, size=((hi - lo) * docs, 15))
                table = pa.table({"q": np.repeat(query_text, docs), "doc": [" ".join(w) for w in doc_words],
                                  "pair_id": pa.array(np.arange(lo * docs, hi * docs), pa.int64())})
                with fs.open(f"lake/pairs/part-{part:04d}.parquet", "wb") as f:
                    pq.write_table(table, f, row_group_size=5000)
            print(f"wrote {pairs} pairs in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            requests_before = store.request_counts()
            env = {**self._env(url, tag), **store.env, "BATCH_STORAGE_PREFIXES": "s3://lake/"}
            key, base, api = self._start_api(env, tag)
            procs.append(api)
            api_cpu, pg_cpu = cpu_seconds([api.pid]), postgres_cpu()
            response = httpx.post(f"{base}/batches", headers={"Authorization": f"Bearer {key}"}, timeout=600, json={
                "input": "s3://lake/pairs/", "output": "s3://lake/scores/", "format": "parquet",
                "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": [9805, 787]})
            assert response.status_code == 201, response.text
            batch_id = response.json()["id"]
            api_submit_cpu, pg_submit_cpu = cpu_seconds([api.pid]) - api_cpu, postgres_cpu() - pg_cpu
            worker_procs = [self._spawn(["benchmarks.capacity", "simulated-worker", "--device-tokens-per-s",
                                         str(self.rate)], env, f"{tag}-worker{i}.log") for i in range(workers)]
            procs += worker_procs
            engine = create_engine(url)
            with engine.connect() as conn:
                wait_until(lambda: conn.scalar(select(func.count()).select_from(Chunk).where(Chunk.status != "queued")),
                      300, "the first chunk claim", interval=0.02)
                worker_cpu, pg_cpu, api_cpu = cpu_seconds([p.pid for p in worker_procs]), postgres_cpu(), \
                    cpu_seconds([api.pid])
                poller = conn.scalar(text("SELECT pg_backend_pid()"))
                polling = cpu_seconds([poller])
                wait_until(lambda: conn.scalar(select(Batch.status).where(Batch.id == batch_id)) == "completed", 7200,
                      "the batch", interval=0.5)
                polling = cpu_seconds([poller]) - polling
            worker_cpu = cpu_seconds([p.pid for p in worker_procs]) - worker_cpu
            requests = {kind: n - requests_before.get(kind, 0) for kind, n in store.request_counts().items()}
            feeds = [_last_feed_stats(self.logs / f"{tag}-worker{i}.log") for i in range(workers)]
            feed_rows = sum(f.get("rows", 0) for f in feeds)
            pg_drain = postgres_cpu() - pg_cpu - polling
            rss = {f"worker{i}": _rss_mib(p.pid) for i, p in enumerate(worker_procs)} | {"api": _rss_mib(api.pid)}
            with engine.connect() as conn:
                first, last = conn.execute(select(func.min(Chunk.started_at), func.max(Chunk.finished_at))).one()
                # chunk-only passes leave no Pass row: their tokens are in the running total
                tokens = conn.scalar(select(func.sum(CounterRow.value)).where(CounterRow.name == "pass_tokens"))
                chunks = conn.scalar(select(func.count()).select_from(Chunk))
                rows_done, failed = conn.execute(select(func.sum(Chunk.rows_done), func.sum(Chunk.rows_failed))).one()
                tables = {name: conn.scalar(text(f"SELECT count(*) FROM {name}")) for name in
                          ("batches", "chunks", "jobs", "job_results", "webhook_deliveries", "passes")}
            engine.dispose()
            wall = (last - first).total_seconds()
            device = tokens / self.rate
            assert rows_done == pairs, f"{rows_done} rows done of {pairs}"
            return {"shape": "datalake", "workers": workers, "pairs": pairs, "chunks": chunks,
                    "duty": round(device / (wall * workers), 3), "items_per_s": round(pairs / wall),
                    "ideal_items_per_s": round(pairs / device * workers), "wall_s": round(wall, 1),
                    "device_s": round(device, 1), "rows_failed": failed,
                    "postgres_cpu_ms_per_line": {"submit": round(pg_submit_cpu / pairs * 1e3, 5),
                                                 "drain": round(pg_drain / pairs * 1e3, 5)},
                    "rows_in_postgres": tables, "worker_cpu_ms_per_item": round(worker_cpu / pairs * 1e3, 4),
                    # the chunk feeds' threads, as their last log line says (every 20 chunks: most of the run)
                    # (None: fewer than 20 chunks a worker, none logged)
                    "feed_cpu_ms_per_row": {part: round(sum(f.get(f"{part}_cpu_s", 0) for f in feeds) * 1e3 /
                                                        feed_rows, 4) if feed_rows else None
                                            for part in ("read", "tokenize", "write")},
                    "store_requests": requests,
                    "api_cpu_s_for_the_batch": round(api_submit_cpu + cpu_seconds([api.pid]) - api_cpu, 2),
                    "rss_mib": rss}
        finally:
            stop_processes(procs)
            store.stop()
            self._drop_database(tag)


def _last_feed_stats(log: Path) -> dict:
    lines = [line for line in log.read_text(errors="replace").splitlines() if "chunk feed: {" in line]
    return json.loads(lines[-1].split("chunk feed: ", 1)[1]) if lines else {}


def _rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return round(int(status.split("VmRSS:", 1)[1].split()[0]) / 1024, 1)

def _submit_jobs(base: str, key: str, bodies: list[dict]) -> None:
    import httpx

    queue = list(reversed(bodies))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    body = queue.pop()
                response = http.post("/jobs", json=body)
                if response.status_code != 202:
                    errors.append(response.text)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"POST /jobs failed: {errors[0]}")


def _upload_batch(base: str, key: str, bodies: list[dict]) -> str:
    import httpx

    lines = b"".join(json.dumps({"custom_id": f"line-{i}", **body}).encode() + b"\n" for i, body in enumerate(bodies))
    response = httpx.post(f"{base}/batches", content=lines, timeout=3600,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"})
    if response.status_code != 201:
        raise RuntimeError(f"POST /batches failed: {response.text}")
    return response.json()["id"]


def _read_results(base: str, key: str, batch_id: str) -> int:
    """Streams the batch's results as a user downloads them; returns the number of lines."""
    import httpx

    lines = 0
    with httpx.stream("GET", f"{base}/batches/{batch_id}/results", timeout=3600,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            lines += 1
    return lines


# ---- command line ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the roofline needs no device (nor libtpu's start-up)
    from core.aot import TARGETS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    simulated = sub.add_parser("simulated-worker", help="(started by the benchmark) a worker with a simulated device")
    simulated.add_argument("--device-tokens-per-s", type=float, required=True)
    parser.add_argument("--target", choices=sorted(TARGETS), default="tpu-v6e")
    parser.add_argument("--device-tokens-per-s", type=float, help="the simulated device's rate (default: the "
                        "target's roofline)")
    parser.add_argument("--shapes", default="contract,small,backfill")
    parser.add_argument("--workers", default="1,2", help="worker counts to run each shape with")
    parser.add_argument("--runs", help="shape:workers pairs instead of every combination, e.g. small:1,backfill:2")
    parser.add_argument("--device-seconds", type=float, default=10.0, help="simulated device time per worker")
    parser.add_argument("--database-url", default=os.environ.get("CAPACITY_ADMIN_URL",
                                                                 "postgresql+psycopg://root@127.0.0.1:5432/postgres"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--pairs", type=int, default=1_000_000, help="the datalake shape's pair-table rows")
    args = parser.parse_args(argv)
    if args.command == "simulated-worker":
        run_simulated_worker(args.device_tokens_per_s)
        return 0
    rate = args.device_tokens_per_s or roofline_tokens_per_second(args.target)
    runs = ([tuple(pair.split(":")) for pair in args.runs.split(",")] if args.runs else
            [(shape, w) for shape in args.shapes.split(",") for w in args.workers.split(",")])
    logs = Path(tempfile.mkdtemp(prefix="capacity-"))
    header = {"host": host_cpu(), "device_tokens_per_s": round(rate),
              "rate_from": "--device-tokens-per-s" if args.device_tokens_per_s else
              f"core.aot roofline, Qwen3-0.6B bf16 on {args.target} (an estimate)", "logs": str(logs)}
    print(json.dumps(header), flush=True)
    bench = Bench(args.database_url, args.redis_url, rate, logs)
    results, lake_results = [], []
    for shape, workers in runs:
        if shape == "datalake":  # figures of its own (per line, not per job)
            lake_results.append(bench.run_datalake(int(workers), args.pairs))
            print(json.dumps(lake_results[-1]), flush=True)
            continue
        figures = bench.run(shape, int(workers), args.device_seconds)
        results.append(figures)
        print(json.dumps(figures), flush=True)
        if SHAPES[shape].models:
            print("  per worker (model: duty, device s): " + ", ".join(
                f"{w['model']}: {w.get('duty')}, {w['device_s']}" for w in figures["per_worker"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({**header, "runs": results, "datalake_runs": lake_results}, indent=1))
    if not results:
        return 0
    print("\n| shape | workers | jobs | duty | items/s | ideal items/s | API jobs/s | CPU ms/job: API, workers, "
          "Postgres (submit+drain+results read) | workers per Postgres core at 90% (estimate) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in results:
        pg = f["postgres_cpu_ms_per_job"]
        print(f"| {f['shape']} | {f['workers']} | {f['jobs']} | {f['duty']:.2f} | {f['items_per_s']:,} | "
              f"{f['ideal_items_per_s']:,} | {f['api_jobs_per_s']} | {f['api_cpu_ms_per_job']:.2f}, "
              f"{f['worker_cpu_ms_per_job']:.2f}, {pg['submit']:.2f}+{pg['drain']:.2f}+{pg['results']:.2f} | "
              f"{f['estimate_workers_per_postgres_core_at_90pct_duty']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
