"""Reference-batch scenarios on the real service: a big Parquet pair table, a small batch behind it, and a cancel
that has to survive a hard stop.

    python -m benchmarks.lake_scenarios [--deployments embedded,postgres] [--rows 200000] [--small-rows 200]
                                    [--home DIR] [--model smollm2-135m] [--json PATH]

Each deployment runs the model on this machine's CPU: `embedded` is `packscore serve --embedded` as
benchmarks/latency.py starts it (SQLite, the filesystem broker, one worker child); `postgres` is `packscore serve`
and one `packscore worker` on a new database of the local PostgreSQL (dropped at the end) and the local Redis
under a key prefix of their own (removed at the end). Both read and write the pair tables under --home
(BATCH_LOCAL_ROOT). For each it prints:
- the big batch (--rows rows of 20 documents per query, POST /batches naming the Parquet file): seconds from
  its submission to its first rows done and to its first `eta_seconds` (and that ETA), its chunks as planned
  and the rows per chunk;
- a small batch (--small-rows rows) submitted once the big one has rows done: seconds to its first rows and to
  its end, beside the big batch's chunk seconds (claim to commit in the chunks table, which counts the time a
  chunk waited read ahead; and the gaps between chunk completions seen by polling): the small batch should
  start within one chunk of the big one;
- the big batch cancelled with a chunk in flight, its worker SIGKILLed and the service stopped, then started
  again on the same database and folders: seconds from the restart until the batch is `cancelled` with its
  `_manifest.json` written (by the batch's `finished_at`, and as polling saw it), its chunks done, cancelled
  and in flight, and the chunks that ran more than once (`chunks.attempts`).

Seconds are the client's wall time, polling GET /batches/{id} every 0.5 s (so to within about that, and the
worker writes a running chunk's rows every SWEEP_INTERVAL_SECONDS). The host's CPU flags are printed first.
--home keeps the compile and model caches between runs; the services' own state in it is made afresh.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.capacity import REPO, Bench, host_cpu
from benchmarks.latency import EmbeddedService
from tests.service_harness import stop_processes, wait_until

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"
LABELS = [9805, 787]  # " yes" and " no" in the bundled tokenizer (tiny-random shares it)
DOCS_PER_QUERY = 20
POLL_SECONDS = 0.5
TERMINAL = ("completed", "cancelled", "failed")

CITIES = "Lisbon Porto Paris Lyon Berlin Munich Madrid Seville Rome Milan Vienna Prague Oslo Dublin Athens".split()
MONTHS = "January March May June August October December".split()
THINGS = "bicycle dishwasher laptop boiler window lock printer kettle roof fence".split()
PARTS = "filter hinge valve fuse belt seal cable pump".split()
FOODS = "lentil soup|apple pie|paella|risotto|banana bread|fish curry|pancake|tomato salad".split("|")
ADJECTIVES = "warm rainy quiet busy sunny windy cheap crowded".split()
TOPICS = ("cheap flights to {city}", "hotels near the old town of {city}", "{city} weather in {month}",
          "how to repair a {thing}", "the best {food} recipe", "trains from {city} to {city2}",
          "replacing the {part} of a {thing}", "museums in {city} open on Monday")
DOCUMENTS = ("TAP fares from {n} EUR to {city} in {month}.", "{city} in {month}: {adj} days and {adj2} evenings.",
             "Step {n}: take the cover off the {thing} and check the {part}.",
             "Our {food} recipe takes {n} minutes and serves four.",
             "{n} hotels within walking distance of {city} central station.",
             "The night train from {city} to {city2} leaves at {n}:15 every day.",
             "A new {part} for most {thing} models costs about {n} EUR.",
             "Reviews of {food} places in {city}, updated in {month}.")


def pair_table(rows: int, seed: int) -> pa.Table:
    """`rows` (q, doc, pair_id) rows, DOCS_PER_QUERY documents per query, sorted by query as the README asks."""
    rng = random.Random(seed)

    def fill(template: str) -> str:
        return template.format(city=rng.choice(CITIES), city2=rng.choice(CITIES), month=rng.choice(MONTHS),
                               thing=rng.choice(THINGS), part=rng.choice(PARTS), food=rng.choice(FOODS),
                               adj=rng.choice(ADJECTIVES), adj2=rng.choice(ADJECTIVES), n=rng.randint(2, 95))

    queries = [f"Is this document relevant to: {fill(rng.choice(TOPICS))}? Answer yes or no."
               for _ in range(-(-rows // DOCS_PER_QUERY))]
    return pa.table({"q": [queries[i // DOCS_PER_QUERY] for i in range(rows)],
                     "doc": [f"\nDoc: {fill(rng.choice(DOCUMENTS))}\nAnswer:" for _ in range(rows)],
                     "pair_id": pa.array(range(rows), pa.int64())})


def write_pairs(path: Path, rows: int, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Row groups of 20,000 rows: several planned chunks (5,000 rows) per group, as in exported tables.
    pq.write_table(pair_table(rows, seed), path, row_group_size=20_000)


# ---- following a batch ---------------------------------------------------------------------------------------

@dataclass
class Followed:
    """A batch as polling saw it: when things were first seen, in seconds after its submission."""

    http: httpx.Client
    id: str
    submitted: float  # time.monotonic() just before POST /batches
    batch: dict = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    eta: float | None = None
    chunk_done_at: list[float] = field(default_factory=list)

    def poll(self) -> dict:
        response = self.http.get(f"/batches/{self.id}")
        response.raise_for_status()
        self.batch = response.json()
        now = round(time.monotonic() - self.submitted, 1)
        if self.batch["rows"]["done"] > 0:
            self.first.setdefault("rows", now)
        if self.batch["eta_seconds"] is not None and "eta" not in self.first:
            self.first["eta"], self.eta = now, round(self.batch["eta_seconds"], 1)
        # A piece cut from a chunk counts as a chunk; two done between polls get the same time.
        self.chunk_done_at += [now] * (self.batch["chunks"]["done"] - len(self.chunk_done_at))
        if self.batch["status"] in TERMINAL:
            self.first.setdefault(self.batch["status"], now)
        return self.batch

    @property
    def ended(self) -> bool:
        return self.batch.get("status") in TERMINAL


def submit(http: httpx.Client, table: Path, output: Path) -> Followed:
    submitted = time.monotonic()
    response = http.post("/batches", json={"input": str(table), "output": str(output),
                                           "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
                                           "label_token_ids": LABELS})
    if response.status_code != 201:
        raise RuntimeError(f"POST /batches ({table.name}): {response.status_code} {response.text}")
    followed = Followed(http, response.json()["id"], submitted, response.json())
    followed.first["accepted"] = round(time.monotonic() - submitted, 1)
    return followed


def watch(batches: list[Followed], check: Callable[[], bool], seconds: float, what: str) -> None:
    """Polls every batch until `check()` holds (connection errors are retried until `seconds` are up)."""
    def step() -> bool:
        for followed in batches:
            followed.poll()
        return check()

    wait_until(step, seconds, what, interval=POLL_SECONDS)


def chunk_rows(database_url: str, batch_id: str) -> list:
    """The batch's chunk rows: index, status, attempts, rows_total, started_at, finished_at."""
    from sqlalchemy import create_engine, select

    from store.models import Chunk

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(Chunk.index, Chunk.status, Chunk.attempts, Chunk.rows_total,
                                            Chunk.started_at, Chunk.finished_at)
                                     .where(Chunk.batch_id == batch_id).order_by(Chunk.index)))
    finally:
        engine.dispose()


def local_folder(uri: str) -> Path:
    return Path(unquote(urlsplit(uri).path))


# ---- the two deployments -------------------------------------------------------------------------------------

def _processes_in(folder: Path) -> list[int]:
    """The service's processes working in `folder`: the embedded service started there and its worker child
    (by their command lines, so that a shell left in the folder is not one of them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if Path(os.readlink(entry / "cwd")) == folder and {b"packscore.cli", b"celery"} & set(argv):
                    pids.append(int(entry.name))
            except OSError:  # gone, or another user's
                pass
    return pids


class Embedded:
    """`packscore serve --embedded` in `home/embedded` (benchmarks/latency.py's EmbeddedService), restartable there."""

    name = "embedded"

    def __init__(self, home: Path, model: str, env: dict[str, str]) -> None:
        self.folder = home / "embedded"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.model = model
        # A config folder of its own: the service records where its key is there, not in the user's ~/.config.
        self.env = {**env, "XDG_CONFIG_HOME": str(self.folder / "config")}
        self.service: EmbeddedService | None = None
        self.starts = 0
        self.database_url = f"sqlite:///{self.folder / '.packscore' / 'packscore.db'}"

    def start(self) -> None:
        if self.starts:  # EmbeddedService writes serve.log afresh: keep the earlier run's
            (self.folder / "serve.log").rename(self.folder / f"serve-{self.starts}.log")
        self.starts += 1
        self.service = EmbeddedService(self.folder, self.model, self.env)
        self.http = self.service.http
        self.ready_seconds = self.service.ready_seconds

    def worker_log(self) -> str:
        return (self.folder / "serve.log").read_text(errors="replace")  # the worker child writes there too

    def kill(self) -> None:
        """SIGKILL to the worker child, then `packscore serve` stopped (before its supervisor restarts the
        worker: it waits a second)."""
        workers = [pid for pid in _processes_in(self.folder) if pid != self.service.proc.pid]
        if not workers:
            raise RuntimeError(f"no worker process of the embedded service; see {self.folder / 'serve.log'}")
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        self.service.stop()

    def close(self) -> None:
        if self.service is not None and self.service.proc.poll() is None:
            self.service.stop()
        # A start that fails before EmbeddedService returns leaves its processes with no handle on them.
        for pid in _processes_in(self.folder):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Postgres:
    """`packscore serve` and one `packscore worker` on a new database (benchmarks/capacity.py's Bench makes and drops
    it, and starts the processes), Redis keys under a prefix of their own."""

    name = "postgres"

    def __init__(self, home: Path, model: str, env: dict[str, str]) -> None:
        self.tag = f"lake_scenarios_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        logs = home / "postgres"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        self.bench = Bench(ADMIN_URL, REDIS_URL, 0.0, logs)  # no simulated device: its rate is unused
        self.database_url = self.bench._create_database(self.tag)
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("BROKER_URL", "BROKER_DIR")},
                    "DATABASE_URL": self.database_url, "REDIS_URL": REDIS_URL, "BROKER_KEY_PREFIX": f"{self.tag}:",
                    "MODEL": model, "PYTHONPATH": str(REPO), **env}
        self.worker_log_path = logs / f"{self.tag}-worker.log"
        self.api = self.worker = None
        self.key = self.base = ""

    def start(self) -> None:
        started = time.monotonic()
        if not self.key:  # the first start makes the key; a restart keeps it (a batch is its key's only)
            self.key, self.base, self.api = self.bench._start_api(self.env, self.tag)
        else:
            self.api = self.bench._spawn(["packscore.cli", "serve", "--host", "127.0.0.1", "--port",
                                          self.base.rsplit(":", 1)[1]], self.env, f"{self.tag}-api.log")
            wait_until(lambda: httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200, 120, "the API")
        self.worker = self.bench._spawn(["packscore.cli", "worker"], self.env, self.worker_log_path.name)
        self.http = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=300)
        wait_until(lambda: httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200, 900, "a ready worker")
        self.ready_seconds = time.monotonic() - started

    def worker_log(self) -> str:
        return self.worker_log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the worker (`packscore worker` execs Celery: the process itself), then the API stopped."""
        os.kill(self.worker.pid, signal.SIGKILL)
        self.worker.wait()
        stop_processes([self.api])

    def close(self) -> None:
        import redis

        try:
            stop_processes([p for p in (self.worker, self.api) if p is not None])
        finally:
            self.bench._drop_database(self.tag)
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{self.tag}:*"):
                client.delete(key)
            client.close()


# ---- the scenarios ---------------------------------------------------------------------------------------------

def run_scenarios(service: Embedded | Postgres, big_table: Path, small_table: Path, out: Path) -> dict:
    """The three scenarios on a started service; every figure printed as it comes, and returned."""
    def say(text: str) -> None:
        print(f"{service.name}: {text}", flush=True)

    figures: dict = {"ready_seconds": round(service.ready_seconds, 1)}
    say(f"service ready after {figures['ready_seconds']} s")

    big = submit(service.http, big_table, out / "big")
    planned = big.batch["chunks"]["total"]
    figures["big"] = {"id": big.id, "post_seconds": big.first["accepted"], "rows": big.batch["rows"]["total"],
                      "chunks_planned": planned, "rows_per_planned_chunk": round(big.batch["rows"]["total"] / planned)}
    say(f"big batch: {figures['big']['rows']} rows planned as {planned} chunks of "
        f"{figures['big']['rows_per_planned_chunk']} rows; POST /batches answered in {big.first['accepted']} s")
    watch([big], lambda: big.batch["rows"]["done"] > 0 and big.eta is not None or big.ended, 1800,
          "the big batch's first rows")
    if big.ended:
        raise RuntimeError(f"the big batch ended before any progress was seen: {big.batch}")
    figures["big"].update(first_rows_seconds=big.first["rows"], first_eta_seconds=big.first["eta"], eta=big.eta)
    say(f"big batch: first rows done after {big.first['rows']} s")
    say(f"big batch: first eta_seconds after {big.first['eta']} s: {big.eta} s")

    small = submit(service.http, small_table, out / "small")
    at = {"seconds": round(small.submitted - big.submitted, 1), "chunks_done": big.batch["chunks"]["done"],
          "rows_done": big.batch["rows"]["done"]}
    say(f"small batch: {small.batch['rows']['total']} rows submitted {at['seconds']} s into the big one (big: "
        f"{at['chunks_done']} chunks, {at['rows_done']} rows done)")
    watch([big, small], lambda: small.ended, 3600, "the small batch")
    figures["small"] = {"id": small.id, "status": small.batch["status"], "submitted_into_big_seconds": at["seconds"],
                        "big_at_submission": at, "first_rows_seconds": small.first.get("rows"),
                        "end_seconds": small.first[small.batch["status"]], "chunks": small.batch["chunks"]}
    say(f"small batch: first rows done after {figures['small']['first_rows_seconds']} s, "
        f"{small.batch['status']} after {figures['small']['end_seconds']} s")

    ran = [c for c in chunk_rows(service.database_url, big.id) if c.status == "succeeded"]
    seconds = [round((c.finished_at - c.started_at).total_seconds(), 1) for c in ran]
    gaps = [round(b - a, 1) for a, b in zip(big.chunk_done_at, big.chunk_done_at[1:])]
    sizing = sorted({int(t) for t in re.findall(r"cut into \d+ pieces of about (\d+) tokens", service.worker_log())})
    figures["big"].update(chunk_seconds=seconds, chunk_rows=[c.rows_total for c in ran],
                          chunk_done_gaps_seconds=gaps, piece_tokens_logged=sizing)
    say(f"big batch chunks done so far: {len(ran)}, seconds each from claim to commit (chunks table): {seconds}"
        + (f", median {statistics.median(seconds)}" if seconds else ""))
    say(f"big batch chunks' rows: {figures['big']['chunk_rows']}; pieces the worker cut, tokens each: {sizing}")
    say(f"big batch: seconds between chunk completions seen by polling: {gaps}")

    if big.ended:
        say(f"big batch {big.batch['status']} before the cancel: no cancel scenario")
        return figures
    watch([big], lambda: big.batch["chunks"]["in_flight"] > 0 or big.ended, 600, "a big batch chunk in flight")
    response = service.http.post(f"/batches/{big.id}/cancel")
    cancelled = response.json()
    figures["cancel"] = {"http_status": response.status_code, "status": cancelled.get("status"),
                         "seconds_into_big": round(time.monotonic() - big.submitted, 1),
                         "rows_done": cancelled.get("rows", {}).get("done"), "chunks": cancelled.get("chunks")}
    say(f"cancel after {figures['cancel']['seconds_into_big']} s: {response.status_code} "
        f"{cancelled.get('status')}, rows done {figures['cancel']['rows_done']}, chunks {cancelled.get('chunks')}")
    if response.status_code != 202:
        say("the batch had no chunk in flight at the cancel: no hard stop")
        return figures

    service.kill()
    restarted_at, restarted = datetime.now(UTC), time.monotonic()
    service.start()
    big.http = service.http
    manifest = local_folder(big.batch["output"]) / "_manifest.json"
    watch([big], lambda: big.ended and manifest.exists(), 900, "the cancelled batch to settle after the restart")
    final = big.batch
    settled = datetime.fromisoformat(final["finished_at"])
    settled = settled if settled.tzinfo else settled.replace(tzinfo=UTC)
    chunks = chunk_rows(service.database_url, big.id)
    objects = sorted(p.name for p in manifest.parent.glob("part-*"))
    listed = json.loads(manifest.read_text())
    figures["restart"] = {
        "ready_seconds": round(service.ready_seconds, 1), "status": final["status"],
        "settled_seconds": round((settled - restarted_at).total_seconds(), 1),
        "seen_seconds": round(time.monotonic() - restarted, 1), "chunks": final["chunks"], "rows": final["rows"],
        "chunks_run_twice": [{"index": c.index, "status": c.status, "attempts": c.attempts} for c in chunks
                             if c.attempts > 1],
        "max_attempts": max((c.attempts for c in chunks), default=0),
        "manifest": {"status": listed["status"], "objects": len(listed["objects"]),
                     "cancelled_chunks": len(listed["cancelled_chunks"]),
                     "failed_chunks": len(listed["failed_chunks"])},
        "objects_in_folder": len(objects)}
    r = figures["restart"]
    say(f"restart: service ready after {r['ready_seconds']} s; batch {final['status']} with _manifest.json "
        f"{r['settled_seconds']} s after the restart (its finished_at), seen by polling after {r['seen_seconds']} s")
    say(f"restart: chunks {final['chunks']}; rows {final['rows']}")
    say(f"restart: chunks with attempts > 1: {r['chunks_run_twice']} (max attempts {r['max_attempts']})")
    say(f"restart: manifest {r['manifest']}; part objects in the folder: {r['objects_in_folder']}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lake_scenarios", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", default="embedded,postgres")
    parser.add_argument("--rows", type=int, default=200_000, help="the big batch's pair-table rows")
    parser.add_argument("--small-rows", type=int, default=200, help="the small batch's pair-table rows")
    parser.add_argument("--home", type=Path, help="working folder (default: a new temporary one)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the services are stopped on the way out
    home = (args.home or Path(tempfile.mkdtemp(prefix="packscore-lake-"))).resolve()
    home.mkdir(parents=True, exist_ok=True)
    figures: dict = {"host": host_cpu(), "model": args.model, "rows": args.rows, "small_rows": args.small_rows,
                     "home": str(home)}
    print(f"host: {figures['host']}", flush=True)
    print(f"model {args.model}; working folder {home}", flush=True)
    lake = home / "lake"
    shutil.rmtree(lake, ignore_errors=True)
    started = time.perf_counter()
    write_pairs(lake / "big.parquet", args.rows, seed=0)
    write_pairs(lake / "small.parquet", args.small_rows, seed=1)
    print(f"wrote {args.rows} + {args.small_rows} pairs in {time.perf_counter() - started:.1f} s", flush=True)
    # Both deployments read the tables under home, and share the compile and model caches (a warm restart).
    env = {"BATCH_LOCAL_ROOT": str(home), "COMPILE_CACHE_DIR": str(home / "caches" / "compile-cache"),
           "MODEL_CACHE_DIR": str(home / "caches" / "model-cache")}
    for name in args.deployments.split(","):
        service = {"embedded": Embedded, "postgres": Postgres}[name](home, args.model, env)
        try:
            service.start()
            figures[name] = run_scenarios(service, lake / "big.parquet", lake / "small.parquet", lake / f"out-{name}")
        finally:
            service.close()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
