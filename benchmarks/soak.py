"""Soak: mixed traffic and faults on a schedule against a whole deployment, for --minutes.

    python -m benchmarks.soak --minutes 60 --deployment embedded|postgres [--out DIR] [--faults all|kill,api,...]

Deployments (tiny-random under two model names, MODELS=a=tiny-random,b=tiny-random; the soak's own SeaweedFS for
s3:// batches):
- `embedded`: `packscore serve --embedded` as `make run` starts it (SQLite, the filesystem broker, its worker child
  under the supervisor, model a) and a plain `packscore worker` beside it on the same database and broker folder
  (model b);
- `postgres`: `packscore serve`, `packscore worker --devices all --platform cpu` (a supervisor and its child, model
  a) and a plain `packscore worker` (model b), on a PostgreSQL cluster and a redis-server of the soak's own
  (tests/service_harness.py: restarting them disturbs nothing else).

Traffic at steady rates: tests/load_runner.py's Runner (POST /jobs with a webhook, some cancelled, some sent twice
with their Idempotency-Key; synchronous /v1/score), /v1/rerank calls, uploaded batches (both line formats) and
reference batches (Parquet, CSV and JSONL pair tables, on local storage and s3://) in turn, and every 10 minutes a
reference batch of a whole chunk's rows for each model. The webhook receiver answers 500 to a share of the
deliveries and is down for a stretch.

Faults (minutes of a 60-minute run; a shorter run scales them): a worker SIGKILLed at 5, 15, ... 55 (the plain one,
then the supervisor's child, in turn; the soak starts a plain one again, the supervisor its child), the receiver
down 17-21, the API restarted at 12, PostgreSQL stopped for 10 s at 22 and Redis for 5 s at 32 (postgres only),
the object store down for 30 s at 38, and at 47 a local batch whose result folder fills its disk (a 96 KiB tmpfs
mounted by the soak: needs root).

A report per window (10 minutes of 60): p50/p95 of the interactive calls, items/s, RSS and open files of every
process, the database size, the compile-cache and result-folder sizes, the load average. At the end the checks:
every job, batch line and lake row answered exactly once, every webhook delivered once or recorded failed after
its retries, nothing stuck, retention deleting what it should (RESULT_TTL_DAYS: a third of the run), the full disk
a clear failure of its batch with nothing half-committed. Writes DIR/soak.json (and every RSS sample,
DIR/memory_samples.json); exits 1 if a check failed.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple, TypeVar

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from benchmarks.capacity import host_cpu
from benchmarks.lake_scenarios import LABELS, pair_table
from store.settings import Settings
from tests.load_runner import LoadConfig, Runner, rss_mb
from tests.object_stores import SeaweedS3
from tests.service_harness import (PrivatePostgres, PrivateRedis, Service, free_port, stop_processes, wait_until)

REPO = Path(__file__).resolve().parents[1]
MODELS = ("a", "b")
# Seconds before each webhook retry in a 60-minute run (a shorter run scales them): a minute in all, so that
# the receiver's four minutes down fail some deliveries after their last retry.
WEBHOOK_RETRY_SCHEDULE = (1, 2, 4, 8, 15, 30)
FULL_DISK_BYTES = 96 << 10
# A whole chunk of a reference batch: the most rows a worker holds of one batch at once.
FULL_CHUNK_ROWS = Settings.model_fields["batch_chunk_rows_target"].default
# uvicorn's graceful stop waits for the calls in flight (a /v1/score call waits up to SCORE_TIMEOUT_SECONDS).
API_STOP_SECONDS = 90
TERMINAL_BATCH = ("completed", "cancelled", "failed")
ALL_FAULTS = ("kill", "receiver", "api", "database", "broker", "store", "disk")
T = TypeVar("T")


def minutes_of(schedule_minutes: float, run_minutes: float) -> float:
    """A fault's time in a run of `run_minutes`, given its time in a 60-minute one."""
    return schedule_minutes * run_minutes / 60


def retry_schedule(run_minutes: float) -> str:
    return ",".join(str(max(0.2, round(s * min(1.0, run_minutes / 60), 1))) for s in WEBHOOK_RETRY_SCHEDULE)


# ---- processes ---------------------------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """The process's children, whichever of its threads started them (the supervisor restarts a child from its
    watching thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass  # the thread or the process ended
    return sorted(found)


def open_files(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


class Deployment:
    """What both deployments share: the environment, the soak's SeaweedFS, the webhook secret and key."""

    name = ""

    def __init__(self, home: Path, run_minutes: float, compile_cache: Path,
                 settings: dict[str, str] | None = None) -> None:
        """`settings`: environment variables of the deployment's processes, over the soak's."""
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lake = home / "lake"
        self.lake.mkdir(exist_ok=True)
        self.s3 = SeaweedS3(home / "s3")
        self.s3.start()
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "BROKER_URL",
                                                                        "BROKER_DIR", "MODEL")},
                    **self.s3.env, "PYTHONPATH": str(REPO), "MODELS": ",".join(f"{m}=tiny-random" for m in MODELS),
                    "JAX_PLATFORMS": "cpu", "WARMUP": "ladder", "BATCH_LOCAL_ROOT": str(self.lake),
                    "BATCH_STORAGE_PREFIXES": f"s3://{self.s3.bucket}/", "WEBHOOK_ALLOWLIST": "127.0.0.1",
                    "WEBHOOK_RETRY_SCHEDULE": retry_schedule(run_minutes), "WEBHOOK_TIMEOUT_SECONDS": "5",
                    # Retention a third of the run: the jobs of its first two thirds go before it ends.
                    "RESULT_TTL_DAYS": str(run_minutes / 3 / 1440),
                    "RETENTION_INTERVAL_SECONDS": str(min(20.0, run_minutes * 60 / 20)),
                    "MEMORY_LOG_SECONDS": str(min(300.0, run_minutes * 60 / 12)),
                    "LEASE_SECONDS": "15", "SWEEP_INTERVAL_SECONDS": "1", "RETRY_AFTER_SECONDS": "1",
                    "COMPILE_CACHE_DIR": str(compile_cache), "MODEL_CACHE_DIR": str(home / "model-cache"),
                    **(settings or {})}
        self.base_url = self.key = self.secret = ""
        self.plain: subprocess.Popen | None = None
        self.plain_starts = 0

    def spawn(self, args: list[str], log: str, env: dict[str, str] | None = None,
              cwd: Path = REPO) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "packscore.cli", *args], env={**self.env, **(env or {})},
                                cwd=cwd, stdout=open(self.logs / log, "ab"), stderr=subprocess.STDOUT)

    def prefix_caches_mb(self) -> dict[str, float]:
        """Each worker log's last reported prefix-cache size (worker/tasks.py logs its memory now and then)."""
        sizes = {}
        for log in self.logs.glob("worker*.log"):
            found = re.findall(r"memory: RSS .*?; prefix cache ([\d.]+) of", log.read_text(errors="replace"))
            if found:
                sizes[log.stem] = float(found[-1])
        return sizes

    def worker_memory_logs(self) -> dict[str, list["MemoryLog"]]:
        """Each worker life's memory log (worker/tasks.py, every MEMORY_LOG_SECONDS), keyed log:pid. Taken after
        the worker handed its free pages back, so without the freed pages jemalloc holds between purges that
        swing the soak's samples."""
        lives: dict[str, list[MemoryLog]] = {}
        for log in self.logs.glob("*.log"):
            life, ready = None, 0.0
            for line in log.read_text(errors="replace").splitlines():
                if not (stamp := _LOG_TIME.match(line)):
                    continue
                at = datetime.fromisoformat(stamp[1]).timestamp()
                if found := _WORKER_READY.search(line):
                    life, ready = f"{log.stem}:{found[1]}", at
                    lives[life] = []
                elif life and (found := _MEMORY_LINE.search(line)):
                    used, resident = (float(found[6]), float(found[7])) if found[6] else (None, None)
                    lives[life].append(MemoryLog(at - ready, float(found[1]), float(found[2]), float(found[4]),
                                                 int(found[5]), used, resident,
                                                 float(found[8]) if found[8] else None,
                                                 float(found[3]) if found[3] else None))
        return lives

    def worker_allocators(self) -> dict[str, str]:
        """The C allocator each worker log's memory lines name (WORKER_ALLOCATOR; worker/tasks.py)."""
        found = {log.stem: re.findall(r"handed back to the system by (\w+)", log.read_text(errors="replace"))
                 for log in self.logs.glob("worker*.log")}
        return {stem: names[-1] for stem, names in found.items() if names}

    def programs_compiled(self) -> int:
        """Pass programs the workers compiled for shapes met after their warm-up (core.scorer logs each)."""
        return sum(log.read_text(errors="replace").count("compiled a pass program for a new shape")
                   for log in self.logs.glob("*.log"))

    def start_plain_worker(self) -> None:
        self.plain_starts += 1
        self.plain = self.spawn(["worker"], f"worker-plain-{self.plain_starts}.log", {"MODEL": "b"})

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120)

    def wait_ready(self, seconds: float = 900) -> None:
        def both_models() -> bool:
            ready = httpx.get(f"{self.base_url}/readyz", timeout=10)
            models = ready.json().get("models", {})
            return ready.status_code == 200 and all(models.get(m, {}).get("workers", 0) > 0 for m in MODELS)

        wait_until(both_models, seconds, f"both models' workers ({self.logs})", interval=1)

    def supervisor_pid(self) -> int:
        raise NotImplementedError

    def processes(self) -> dict[str, int]:
        """Every process of the deployment by role (a restarted one has a new pid: a new series)."""
        named = {"supervisor": self.supervisor_pid()}
        for i, pid in enumerate(children(named["supervisor"])):
            named[f"supervisor-child{i}"] = pid
        if self.plain is not None and self.plain.poll() is None:
            named["worker-plain"] = self.plain.pid
        if self.s3.proc is not None and self.s3.proc.poll() is None:
            named["seaweedfs"] = self.s3.proc.pid
        return named

    def kill_worker(self, which: str) -> int:
        """SIGKILL to the plain worker (started again after 2 s, as an orchestrator would) or the supervisor's
        child (its supervisor starts it again); returns the pid killed."""
        if which == "plain":
            pid = self.plain.pid
            self.plain.kill()
            self.plain.wait()
            time.sleep(2)
            self.start_plain_worker()
            return pid
        pids = children(self.supervisor_pid())
        if not pids:
            raise RuntimeError("the supervisor has no child to kill")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def restart_api(self) -> None:
        raise NotImplementedError

    def database_bytes(self) -> int | None:
        raise NotImplementedError

    def close(self) -> None:
        stop_processes([p for p in [self.plain] if p is not None])
        self.s3.stop()


class Embedded(Deployment):
    name = "embedded"

    def __init__(self, home: Path, run_minutes: float, compile_cache: Path,
                 settings: dict[str, str] | None = None) -> None:
        super().__init__(home, run_minutes, compile_cache, settings)
        state = home / ".packscore"
        self.database_url = f"sqlite:///{state / 'packscore.db'}"
        # Explicit, so that the plain worker beside the embedded service finds the same database and broker.
        self.env.update({"PACKSCORE_HOME": str(state), "XDG_CONFIG_HOME": str(home / "config"),
                         "DATABASE_URL": self.database_url, "BROKER_URL": "filesystem://",
                         "BROKER_DIR": str(state / "broker")})
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.serve: subprocess.Popen | None = None
        self.serve_starts = 0

    def start(self) -> None:
        self._start_serve()
        self.key, self.secret = (self.home / ".packscore" / "api_key").read_text().split()[:2]
        self.start_plain_worker()
        self.wait_ready()

    def _start_serve(self) -> None:
        self.serve_starts += 1
        self.serve = self.spawn(["serve", "--embedded", "--port", str(self.port)], f"serve-{self.serve_starts}.log",
                                cwd=self.home)
        wait_until(lambda: httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200, 600, "the API")

    def supervisor_pid(self) -> int:
        return self.serve.pid  # `serve --embedded` is the API and its worker's supervisor

    def processes(self) -> dict[str, int]:
        named = super().processes()
        named["api+supervisor"] = named.pop("supervisor")
        return named

    def restart_api(self) -> None:
        """`packscore serve --embedded` stopped (SIGTERM, its worker child with it) and started again."""
        child_pids = children(self.serve.pid)
        stop_processes([self.serve], API_STOP_SECONDS)
        for pid in child_pids:  # a supervisor SIGKILLed after its grace did not stop its child
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._start_serve()

    def database_bytes(self) -> int | None:
        state = self.home / ".packscore"
        return sum(p.stat().st_size for p in state.glob("packscore.db*"))

    def close(self) -> None:
        stop_processes([p for p in [self.serve] if p is not None])
        super().close()


class Postgres(Deployment):
    name = "postgres"

    def __init__(self, home: Path, run_minutes: float, compile_cache: Path,
                 settings: dict[str, str] | None = None) -> None:
        super().__init__(home, run_minutes, compile_cache, settings)
        from migrations import upgrade

        self.postgres = PrivatePostgres()
        self.postgres.init()
        self.redis = PrivateRedis()
        self.redis.start()
        self.database_url = self.postgres.admin_url
        upgrade(self.database_url)
        self.env.update({"DATABASE_URL": self.database_url, "REDIS_URL": self.redis.url, "BROKER_KEY_PREFIX": ""})
        self.service = Service(env=self.env, logs=self.logs)
        self.supervisor: subprocess.Popen | None = None

    def start(self) -> None:
        self.key, self.secret = self.service.create_key("soak")
        self.service.key = self.key
        self.service.start_api(600)
        self.base_url = self.service.base_url
        self.supervisor = self.spawn(["worker", "--devices", "all", "--platform", "cpu"], "worker-devices.log",
                                     {"MODEL": "a"})
        self.start_plain_worker()
        self.wait_ready()

    def supervisor_pid(self) -> int:
        return self.supervisor.pid

    def processes(self) -> dict[str, int]:
        named = super().processes()
        if self.service.api is not None and self.service.api.poll() is None:
            named["api"] = self.service.api.pid
        named["redis"] = self.redis.proc.pid
        return named

    def restart_api(self) -> None:
        stop_processes([self.service.api], API_STOP_SECONDS)
        self.service.start_api(600)

    def restart_database(self, seconds: float = 10) -> None:
        self.postgres.stop()
        time.sleep(seconds)
        self.postgres.start()

    def restart_broker(self, seconds: float = 5) -> None:
        self.redis.stop()
        time.sleep(seconds)
        self.redis.start()

    def database_bytes(self) -> int | None:
        from sqlalchemy import create_engine, text
        from sqlalchemy.exc import OperationalError

        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar())
        except OperationalError:
            return None  # stopped by a fault just now
        finally:
            engine.dispose()

    def close(self) -> None:
        try:
            stop_processes([p for p in [self.supervisor, self.service.api] if p is not None])
            super().close()
        finally:
            self.redis.stop()
            self.postgres.destroy()


# ---- the webhook receiver ----------------------------------------------------------------------------------------

class FlakyReceiver:
    """Records every delivery (webhook-id, job or batch id, the status it answered); answers 500 to a seeded
    share of them, and is down (connection refused) between `down()` and `up()`."""

    def __init__(self, fail_share: float, seed: int) -> None:
        receiver = self
        self.fail_share = fail_share
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, str, int, float]] = []  # (webhook-id, data id, status, when)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    status = 500 if receiver.rng.random() < receiver.fail_share else 200
                    receiver.deliveries.append((self.headers.get("webhook-id", ""),
                                                json.loads(body)["data"]["id"], status, time.monotonic()))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.up()

    def up(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def by_id(self) -> dict[str, list[tuple[str, int, float]]]:
        with self.lock:
            seen: dict[str, list[tuple[str, int, float]]] = {}
            for webhook_id, data_id, status, when in self.deliveries:
                seen.setdefault(data_id, []).append((webhook_id, status, when))
            return seen


# ---- traffic besides the load runner's -------------------------------------------------------------------------

@dataclass
class Call:
    """One interactive call, or one batch, as the soak saw it."""

    kind: str
    started_s: float
    seconds: float | None = None
    ok: bool = False
    items: int = 0
    detail: str = ""
    id: str = ""


@dataclass
class Soak:
    deployment: Deployment
    minutes: float
    faults: tuple[str, ...]
    out: Path
    seed: int = 0
    calls: list[Call] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)  # every batch made: id, kind, expected ids, outcome
    fault_log: list[dict] = field(default_factory=list)
    samples: list[tuple[float, str, int, float, int]] = field(default_factory=list)  # (t, name, pid, MB, files)
    windows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    compiled_before: int = 0  # the workers' compiles after warm-up, as their logs said at the last window's end

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.receiver = FlakyReceiver(0.1, self.seed)
        self.tag = f"soak{os.getpid()}"
        self.kills: list[float] = []  # when a worker was SIGKILLed (time.monotonic())

    def now(self) -> float:
        return time.monotonic() - self.t0

    def every(self, seconds: float, step: Callable[[int], None]) -> None:
        """`step(i)` every `seconds` until the run's end (errors recorded, never fatal)."""
        i = 0
        while not self.stop.wait(0 if i == 0 else seconds):
            try:
                step(i)
            except Exception as exc:  # noqa: BLE001  (a client-side error is a finding, reported at the end)
                with self.lock:
                    self.problems.append(f"{step.__name__} {i}: {type(exc).__name__}: {exc}")
            i += 1

    def request(self, http: httpx.Client, method: str, path: str, seconds: float = 600,
                **kwargs: object) -> httpx.Response:
        """As README's clients do: connection errors, 502/503/504 retried (what the API restart causes)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                response = http.request(method, path, **kwargs)
                if response.status_code not in (502, 503) or time.monotonic() > deadline:
                    return response
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(1)

    # -- interactive rerank ------------------------------------------------------------------------------------
    def rerank(self, i: int) -> None:
        documents = [f"document {i} number {k} about {random.Random(i * 7 + k).choice(['cats', 'rain', 'trains'])}"
                     for k in range(3)]
        call = Call("rerank", self.now(), items=len(documents))
        with self.deployment.http() as http:
            started = time.monotonic()
            response = self.request(http, "POST", "/v1/rerank", json={"model": MODELS[i % 2], "query": f"q{i}?",
                                                                       "documents": documents})
            if response.status_code == 504:  # as README asks: the job goes on, polled (never sent again)
                job_id = response.json()["error"]["job_id"]
                while (job := self.request(http, "GET", f"/jobs/{job_id}").json())["status"] not in (
                        "succeeded", "failed", "cancelled"):
                    time.sleep(1)
                call.detail = f"504, then {job['status']}"
                call.ok = job["status"] == "succeeded"
            call.seconds = time.monotonic() - started
        if response.status_code != 504:
            results = response.json().get("results", []) if response.status_code == 200 else []
            call.ok = sorted(r["index"] for r in results) == list(range(len(documents)))
            call.detail = "" if call.ok else f"{response.status_code} {response.text[:200]}"
        with self.lock:
            self.calls.append(call)

    # -- uploaded batches ----------------------------------------------------------------------------------------
    def upload_batch(self, i: int) -> None:
        """A JSONL upload mixing job lines and OpenAI Batch lines (/v1/score and /v1/rerank), with a webhook."""
        lines, expected = [], []
        for k in range(12):
            custom_id = f"{self.tag}-u{i}-{k}"
            expected.append(custom_id)
            if k % 3 == 0:
                lines.append({"custom_id": custom_id, "query": f"Upload {i} line {k}?", "items": [" yes", " no"],
                              "label_token_ids": LABELS})
            elif k % 3 == 1:
                lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/score",
                              "body": {"text_1": f"Upload {i} line {k}?", "text_2": [" a", " b", " c"],
                                       "label_token_ids": LABELS}})
            else:
                lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/rerank",
                              "body": {"query": f"Upload {i} {k}", "documents": ["one", "two"]}})
        body = "".join(json.dumps(line) + "\n" for line in lines).encode()
        with self.deployment.http() as http:
            response = self.request(http, "POST", "/batches", content=body,
                                    headers={"content-type": "application/jsonl"},
                                    params={"webhook_url": self.receiver.url, "model": MODELS[i % 2],
                                            "metadata": json.dumps({"soak": self.tag})})
            if response.status_code != 201:
                raise RuntimeError(f"upload {i}: {response.status_code} {response.text[:300]}")
            self.follow_batch(http, response.json()["id"], "upload", expected, lambda b: self.upload_results(http, b))

    def upload_results(self, http: httpx.Client, batch: dict) -> list[str]:
        response = self.request(http, "GET", f"/batches/{batch['id']}/results")
        lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        bad = [line for line in lines if line.get("error")]
        if bad:
            raise RuntimeError(f"batch {batch['id']}: lines failed: {bad[:3]}")
        return [line["custom_id"] for line in lines]

    # -- reference batches ---------------------------------------------------------------------------------------
    def reference_batch(self, i: int) -> None:
        """A pair table of 40-68 rows in turn Parquet, CSV and JSONL, on local storage and s3:// in turn."""
        self.pair_table_batch(f"ref-{i}", ("parquet", "csv", "jsonl")[i % 3], (i // 3) % 2 == 1, 40 + 7 * (i % 5),
                              MODELS[i % 2], seed=i)

    def full_chunk_batches(self) -> None:
        """A pair table of a whole chunk (BATCH_CHUNK_ROWS_TARGET rows) for each model at minutes 1, 11, ..., 51:
        what a backfill gives a worker all day. A worker's memory after its first such chunk is its high-water
        mark; each life meets one in its first 10 minutes and another in the 10 its memory is fitted over, so a
        chunk that leaves memory behind shows as growth (docs/soak.md). Only in runs of 10 minutes or more."""
        for k in range(6 if self.minutes >= 10 else 0):
            if self.stop.wait(max(0.0, minutes_of(1 + 10 * k, self.minutes) * 60 - self.now())):
                return
            for model in MODELS:
                try:
                    self.pair_table_batch(f"chunk-{k}-{model}", ("parquet", "csv", "jsonl")[k % 3], k % 2 == 1,
                                          FULL_CHUNK_ROWS, model, seed=1000 + k)
                except Exception as exc:  # noqa: BLE001  (a client-side error is a finding, reported at the end)
                    with self.lock:
                        self.problems.append(f"full_chunk_batches {k} {model}: {type(exc).__name__}: {exc}")

    def pair_table_batch(self, name: str, fmt: str, remote: bool, rows: int, model: str, seed: int) -> None:
        """Writes a pair table (pair ids `{name}-{k}`) where a reference batch reads it, sends the batch and follows
        it to its end: every pair id answered once, in part objects the manifest lists."""
        table = pair_table(rows, seed=seed)
        table = table.set_column(2, "pair_id", pa.array([f"{name}-{k}" for k in range(rows)]))
        if remote:
            where, out = f"{self.deployment.s3.bucket}/in/{name}.{fmt}", f"s3://{self.deployment.s3.bucket}/out/{name}/"

            def write() -> None:
                with self.s3_fs().open(where, "wb") as f:
                    write_pairs(table, fmt, f)
            when_store_is_up(write)
            uri = f"s3://{where}"
        else:
            path = self.deployment.lake / "in" / f"{name}.{fmt}"
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as f:
                write_pairs(table, fmt, f)
            uri, out = str(path), str(self.deployment.lake / "out" / name)
        body = {"input": uri, "output": out, "format": fmt, "label_token_ids": LABELS, "model": model,
                "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "webhook_url": self.receiver.url,
                "metadata": {"soak": self.tag}}
        with self.deployment.http() as http:
            response = self.request(http, "POST", "/batches", json=body)
            if response.status_code != 201:
                raise RuntimeError(f"reference batch {name}: {response.status_code} {response.text[:300]}")
            kind = "reference" if rows < FULL_CHUNK_ROWS else "full-chunk"
            self.follow_batch(http, response.json()["id"], f"{kind}-{fmt}-{'s3' if remote else 'local'}",
                              [f"{name}-{k}" for k in range(rows)], self.lake_rows)

    def s3_fs(self):  # type: ignore[no-untyped-def]
        import s3fs

        env = self.deployment.s3.env
        return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)

    def lake_files(self, prefix: str):  # type: ignore[no-untyped-def]
        """(filesystem, path) of an output prefix."""
        if prefix.startswith("s3://"):
            return self.s3_fs(), prefix[len("s3://"):]
        import fsspec

        return fsspec.filesystem("file"), prefix.removeprefix("file://")

    def lake_rows(self, batch: dict) -> list[str]:
        """The pair ids of a completed batch's objects, as its manifest lists them; every part object listed,
        _SUCCESS there."""
        if batch["output"].startswith("s3://"):
            return when_store_is_up(lambda: self._lake_rows(batch))
        return self._lake_rows(batch)

    def _lake_rows(self, batch: dict) -> list[str]:
        fs, prefix = self.lake_files(batch["output"])
        manifest = json.loads(fs.cat(f"{prefix.rstrip('/')}/_manifest.json"))
        names = {o["name"] for o in manifest["objects"]}
        parts = {p.rsplit("/", 1)[1] for p in fs.find(prefix) if p.rsplit("/", 1)[1].startswith("part-")}
        if parts != names or not fs.exists(f"{prefix.rstrip('/')}/_SUCCESS"):
            raise RuntimeError(f"batch {batch['id']}: objects {sorted(parts)} vs manifest {sorted(names)}")
        ids = []
        for name in sorted(names):
            with fs.open(f"{prefix.rstrip('/')}/{name}", "rb") as f:
                rows = pq.read_table(f).to_pylist() if name.endswith(".parquet") else \
                    [json.loads(line) for line in f.read().splitlines()]
            bad = [r for r in rows if r.get("error_code")]
            if bad:
                raise RuntimeError(f"batch {batch['id']}: rows failed: {bad[:3]}")
            ids += [r["pair_id"] for r in rows]
        return ids

    def follow_batch(self, http: httpx.Client, batch_id: str, kind: str, expected: list[str],
                     answered: Callable[[dict], list[str]], seconds: float = 1800) -> dict:
        started = self.now()
        record = {"id": batch_id, "kind": kind, "rows": len(expected), "started_s": round(started, 1)}
        with self.lock:
            self.batches.append(record)
        deadline = time.monotonic() + seconds
        while True:
            response = self.request(http, "GET", f"/batches/{batch_id}")
            batch = response.json()
            if batch.get("status") in TERMINAL_BATCH or time.monotonic() > deadline:
                break
            time.sleep(2)
        record.update(status=batch.get("status"), finished_s=round(self.now(), 1))
        if batch.get("status") != "completed":
            record["outcome"] = f"not completed: {batch.get('status')} {batch.get('error')}"
            return batch
        ids = answered(batch)
        duplicated = len(ids) - len(set(ids))
        lost = len(set(expected) - set(ids))
        extra = len(set(ids) - set(expected))
        record.update(outcome="ok" if not (duplicated or lost or extra) else
                      f"lost {lost}, duplicated {duplicated}, unknown {extra}", items=len(ids))
        return batch

    # -- the full disk -------------------------------------------------------------------------------------------
    def full_disk(self) -> dict:
        """A local batch whose result folder is a tmpfs nearly full: it must end as a clear failure, with no
        _SUCCESS and no object but those its manifest lists as committed."""
        folder = self.deployment.lake / "full"
        folder.mkdir(exist_ok=True)
        if self.stop.is_set():  # the run ended (or failed) meanwhile: no mount left behind
            return {"skipped": "the run had ended"}
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_BYTES}", "tmpfs", str(folder)], check=True)
        try:
            # Most of it taken: the first part object (tens of KB) cannot fit; a manifest of a few hundred bytes can.
            (folder / "filler").write_bytes(b"\0" * (FULL_DISK_BYTES - (16 << 10)))
            rows = 3000
            table = pair_table(rows, seed=99)
            table = table.set_column(2, "pair_id", pa.array([f"full-{k}" for k in range(rows)]))
            path = self.deployment.lake / "in" / "full.parquet"
            path.parent.mkdir(exist_ok=True)
            pq.write_table(table, path)
            body = {"input": str(path), "output": str(folder / "out"), "label_token_ids": LABELS,
                    "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "metadata": {"soak": self.tag}}
            with self.deployment.http() as http:
                response = self.request(http, "POST", "/batches", json=body)
                if response.status_code != 201:
                    raise RuntimeError(f"the full-disk batch: {response.status_code} {response.text[:300]}")
                batch = self.follow_batch(http, response.json()["id"], "full-disk", [], lambda b: [],
                                          seconds=900)
            left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                          and p.name != "filler")
            error = batch.get("error") or {}
            outcome = {"status": batch.get("status"), "error": error, "files_left": left,
                       "chunks": batch.get("chunks"), "rows": batch.get("rows")}
            clear = batch.get("status") == "failed" and "space" in (error.get("message") or "").lower()
            # A failed batch keeps the objects its manifest lists (the same request resumes from them), no other.
            manifests = list(folder.rglob("_manifest.json"))
            listed = {Path(entry["name"]).name for m in manifests for entry in json.loads(m.read_text())["objects"]}
            half = [name for name in left if ("part-" in name and Path(name).name not in listed)
                    or name.endswith("_SUCCESS")]
            outcome["committed"] = len(listed)
            outcome["ok"] = clear and not half
            return outcome
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)

    # -- faults ----------------------------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[float, str, Callable[[], object]]]:
        d, m = self.deployment, self.minutes
        plan: list[tuple[float, str, Callable[[], object]]] = []
        # Outages last as long as in a 60-minute run, but at most a tenth of a shorter one.
        outage = min(1.0, m * 60 / 300)
        if "kill" in self.faults:  # every 10 minutes of 60, in a short run every 30 s at the most
            period = max(m / 6, 0.5)
            for k in range(int(m / period + 0.5)):
                which = ("plain", "child")[k % 2]
                plan.append((period * (k + 0.5), f"SIGKILL {which} worker", lambda w=which: d.kill_worker(w)))
        if "receiver" in self.faults:
            plan.append((minutes_of(17, m), "webhook receiver down", self.receiver.down))
            plan.append((minutes_of(21, m), "webhook receiver up", self.receiver.up))
        if "api" in self.faults:
            plan.append((minutes_of(12, m), "API restarted", d.restart_api))
        if "database" in self.faults and isinstance(d, Postgres):
            plan.append((minutes_of(22, m), f"PostgreSQL stopped {10 * outage:.0f} s",
                         lambda: d.restart_database(10 * outage)))
        if "broker" in self.faults and isinstance(d, Postgres):
            plan.append((minutes_of(32, m), f"Redis stopped {5 * outage:.0f} s", lambda: d.restart_broker(5 * outage)))
        if "store" in self.faults:
            def store_down() -> None:
                d.s3.stop()
                time.sleep(30 * outage)
                d.s3.start()
            plan.append((minutes_of(38, m), f"object store down {30 * outage:.0f} s", store_down))
        if "disk" in self.faults:
            plan.append((minutes_of(47, m), "a batch's result folder fills its disk", self.full_disk))
        return sorted(plan, key=lambda p: p[0])

    def inject(self) -> None:
        for at, what, fault in self.schedule():
            if self.stop.wait(max(0.0, at * 60 - self.now())):
                return
            started = self.now()
            entry = {"at_s": round(started, 1), "fault": what}
            if what.startswith("SIGKILL"):
                self.kills.append(time.monotonic())
            try:
                entry["result"] = fault()
            except Exception as exc:  # noqa: BLE001  (reported, and fails the run)
                entry["error"] = f"{type(exc).__name__}: {exc}"
                self.problems.append(f"fault {what}: {entry['error']}")
            entry["seconds"] = round(self.now() - started, 1)
            print(f"[{entry['at_s']:7.1f} s] {what}: {json.dumps(entry.get('result') or entry.get('error'))}",
                  flush=True)
            with self.lock:
                self.fault_log.append(entry)

    # -- windows ---------------------------------------------------------------------------------------------------
    def sample(self) -> None:
        # Every 5 s: a worker's RSS swings by an sd of 3-7 MB from one sample to the next (mostly the 10-26 MB of
        # freed pages jemalloc holds between two purges), and its fit covers the 10 minutes it lives after its
        # first 10; at 15 s that scatter alone would give the slope a standard error of about 18 MB/h.
        while not self.stop.wait(min(5.0, max(2.0, self.minutes * 2))):
            now = self.now()
            for name, pid in self.deployment.processes().items():
                rss, files = rss_mb(pid), open_files(pid)
                if rss is not None and files is not None:
                    self.samples.append((now, name, pid, rss, files))

    def window(self, index: int, start: float, end: float, runner: Runner) -> dict:
        interactive = [r.latency_s for r in runner.records if r.sync and r.outcome == "ok"
                       and start <= r.started_s < end]
        interactive += [c.seconds for c in self.calls if c.ok and start <= c.started_s < end]
        items = sum(r.n_items for r in runner.records if r.outcome == "ok" and r.finished_s is not None
                    and start <= r.finished_s < end)
        items += sum(c.items for c in self.calls if c.ok and start <= c.started_s < end)
        items += sum(b.get("items", 0) for b in self.batches if start <= b.get("finished_s", -1) < end)
        processes = {}
        for t, name, pid, rss, files in self.samples:
            if start <= t < end:
                processes[f"{name}:{pid}"] = {"rss_mb": round(rss, 1), "open_files": files}  # the last sample
        cache = Path(self.deployment.env["COMPILE_CACHE_DIR"])
        compiled, self.compiled_before = self.compiled_before, self.deployment.programs_compiled()
        window = {
            "window": index, "minutes": [round(start / 60, 1), round(end / 60, 1)],
            "load_1m": os.getloadavg()[0],
            "interactive_calls": len(interactive),
            "interactive_p50_ms": round(float(np.percentile(interactive, 50)) * 1000) if interactive else None,
            "interactive_p95_ms": round(float(np.percentile(interactive, 95)) * 1000) if interactive else None,
            "items_per_s": round(items / (end - start), 2),
            "processes": processes,
            "database_mb": round(size / 2**20, 2) if (size := self.deployment.database_bytes()) is not None else None,
            "compile_cache_mb": round(folder_bytes(cache) / 2**20, 1),
            "programs_compiled": self.compiled_before - compiled,  # by workers after their warm-up
            "prefix_cache_mb": self.deployment.prefix_caches_mb(),  # bounded (PREFIX_CACHE_BYTES): part of RSS
            "result_folders_mb": round((folder_bytes(self.deployment.lake / "out")
                                        + folder_bytes(self.deployment.s3.folder)) / 2**20, 1),
            "faults": [f["fault"] for f in self.fault_log if start <= f["at_s"] < end],
        }
        print(json.dumps({k: v for k, v in window.items() if k != "processes"}), flush=True)
        print("  processes: " + ", ".join(f"{k} {v['rss_mb']} MB {v['open_files']} fds"
                                          for k, v in processes.items()), flush=True)
        return window

    # -- the run ---------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        seconds = self.minutes * 60
        cfg = LoadConfig(duration_s=seconds, seed=self.seed, rate=0.4, concurrency=8, sync_share=0.4,
                         mix={"small": 0.7, "medium": 0.25, "large": 0.05}, sizes={"small": 3, "medium": 20,
                                                                                    "large": 100},
                         request_timeout_s=900, webhook_url=self.receiver.url, models=MODELS, cancel_share=0.1,
                         resend_share=0.2, healthz_interval_s=5, sample_interval_s=3600, tag=self.tag)
        self.runner = runner = Runner(cfg, self.deployment.base_url, self.deployment.key, dict)
        injector = threading.Thread(target=self.inject, daemon=True)
        # All daemons, the load too (joined below): on SIGTERM the deployment is closed and the process ends,
        # rather than waiting for the rest of the run's load.
        threads = [threading.Thread(target=runner.run, name="load", daemon=True),
                   threading.Thread(target=self.every, args=(4.0, self.rerank), daemon=True),
                   threading.Thread(target=self.every, args=(max(20.0, seconds / 40), self.upload_batch), daemon=True),
                   threading.Thread(target=self.every, args=(max(20.0, seconds / 40), self.reference_batch),
                                    daemon=True),
                   threading.Thread(target=self.full_chunk_batches, daemon=True),
                   injector, threading.Thread(target=self.sample, daemon=True)]
        for thread in threads:
            thread.start()
        window_s = seconds / 6
        try:
            for index in range(6):
                time.sleep(max(0.0, (index + 1) * window_s - self.now()))
                self.windows.append(self.window(index, index * window_s, (index + 1) * window_s, runner))
        finally:
            self.stop.set()
            injector.join(timeout=600)  # a fault under way ends before the deployment is closed (the tmpfs)
        threads[0].join()
        for thread in threads[1:]:
            thread.join(timeout=1200)  # a batch followed to its end; a fault to its end
        runner.verify(_reference())
        return self.finish(runner)

    def finish(self, runner: Runner) -> dict:
        summary = runner.summary()
        checks = {"runner_errors": summary["errors_by_kind"], "mismatches": summary["mismatches"]}
        checks["interactive_failed"] = [c.detail for c in self.calls if not c.ok][:20]
        checks["batches_not_ok"] = [b for b in self.batches if b["kind"] != "full-disk" and b.get("outcome") != "ok"]
        checks["full_disk"] = next((f.get("result") for f in self.fault_log if f["fault"].startswith("a batch's")),
                                   None)
        checks.update(self.database_checks(runner))
        checks["webhooks"] = self.webhook_checks(runner)
        checks["problems"] = self.problems
        first, last = self.windows[0]["interactive_p95_ms"], self.windows[-1]["interactive_p95_ms"]
        memory = memory_growth(self.samples, self.minutes * 60 / 6)
        report = {"deployment": self.deployment.name, "minutes": self.minutes, "host": host_cpu(),
                  "faults": self.fault_log, "windows": self.windows, "load": {k: v for k, v in summary.items()
                                                                              if k not in ("config", "memory")},
                  "batches": self.batches, "calls": len(self.calls), "checks": checks, "memory_mb_per_hour": memory,
                  "memory_logged_mb_per_hour": logged_memory_growth(self.deployment.worker_memory_logs(),
                                                                    self.minutes * 60 / 6),
                  "worker_allocators": self.deployment.worker_allocators(),
                  "p95_last_over_first": round(last / first, 2) if first and last else None}
        failed = []
        if checks["runner_errors"] or checks["mismatches"]:
            failed.append("load runner errors")
        if checks["interactive_failed"]:
            failed.append("interactive calls failed")
        if checks["batches_not_ok"]:
            failed.append("batches not answered exactly once")
        if "disk" in self.faults and not (checks["full_disk"] or {}).get("ok"):
            failed.append("the full disk")
        failed += [name for name in ("jobs_unknown", "jobs_missing", "jobs_stuck", "jobs_wrong", "overdue",
                                     "batches_stuck", "chunks_stuck") if checks.get(name)]
        if checks["webhooks"]["wrong"]:
            failed.append("webhooks")
        if self.problems:
            failed.append("problems")
        report["failed"] = failed
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
        # Every RSS sample, for fits other than the report's (a window, a process's life less its caches).
        (self.out / "memory_samples.json").write_text(json.dumps(
            [{"t_s": round(t, 1), "process": f"{name}:{pid}", "rss_mb": rss, "open_files": files}
             for t, name, pid, rss, files in self.samples]))
        runner.write(self.out, "soak-load")
        return report

    def database_checks(self, runner: Runner) -> dict:
        """Jobs of the load (its metadata tag): none the clients do not know, none stuck, a result exactly for
        the succeeded; nothing left past retention (finished more than TTL + two retention rounds ago); a job
        the clients saw end and the database no longer has must be one retention was due to delete."""
        from sqlalchemy import create_engine, text

        ttl_s = float(self.deployment.env["RESULT_TTL_DAYS"]) * 86400
        slack_s = 2 * float(self.deployment.env["RETENTION_INTERVAL_SECONDS"]) + min(30.0, ttl_s / 4)
        engine = create_engine(self.deployment.database_url)
        try:
            with engine.connect() as conn:
                now = conn.execute(text("SELECT CURRENT_TIMESTAMP")).scalar()
                jobs = conn.execute(text(
                    "SELECT j.id, j.status, j.finished_at, j.items_done = j.items_total AS all_done,"
                    " EXISTS (SELECT 1 FROM job_results r WHERE r.job_id = j.id) AS has_result"
                    " FROM jobs j WHERE j.batch_id IS NULL")).all()
                metadata = conn.execute(text("SELECT id, metadata FROM jobs WHERE batch_id IS NULL")).all()
                batches = conn.execute(text("SELECT id, status, finished_at FROM batches")).all()
                chunks = conn.execute(text("SELECT batch_id, status FROM chunks WHERE status IN "
                                           "('queued', 'running')")).all()
        finally:
            engine.dispose()
        now = now if isinstance(now, datetime) else datetime.fromisoformat(str(now))
        now = now if now.tzinfo else now.replace(tzinfo=UTC)

        def age(finished: object) -> float:
            if finished is None:
                return 0.0
            finished = finished if isinstance(finished, datetime) else datetime.fromisoformat(str(finished))
            return (now - (finished if finished.tzinfo else finished.replace(tzinfo=UTC))).total_seconds()

        client_ids = {r.job_id for r in runner.records if r.job_id}
        tagged = {row.id for row in metadata if _load_tag(row.metadata) == self.tag}
        by_id = {j.id: j for j in jobs}
        end_s = self.now()
        missing = [r.job_id for r in runner.records if r.job_id and r.job_id not in by_id
                   and (r.finished_s is None or end_s - r.finished_s < ttl_s - slack_s)]
        return {
            "jobs_in_database": len(jobs), "jobs_clients_know": len(client_ids),
            "jobs_deleted_by_retention": len([i for i in client_ids if i not in by_id]),
            "jobs_gone": sorted(i for i in client_ids if i not in by_id),
            "jobs_unknown": sorted(tagged - client_ids)[:20],
            "jobs_missing": missing[:20],
            "jobs_stuck": [j.id for j in jobs if j.status not in ("succeeded", "failed", "cancelled")][:20],
            "jobs_wrong": [j.id for j in jobs if (j.status == "succeeded") != j.has_result
                           or (j.status == "succeeded" and not j.all_done)][:20],
            "overdue": [j.id for j in jobs if j.finished_at is not None and age(j.finished_at) > ttl_s + slack_s][:20]
            + [b.id for b in batches if b.finished_at is not None and age(b.finished_at) > ttl_s + slack_s][:20],
            "batches_stuck": [b.id for b in batches if b.status not in TERMINAL_BATCH][:20],
            "chunks_stuck": sorted({c.batch_id for c in chunks})[:20],
        }

    def webhook_checks(self, runner: Runner) -> dict:
        """Every job with a webhook that ended (POST /jobs: cancelled ones too) and every batch: delivered with
        one webhook-id, and exactly one 2xx answer, or failed after every retry (no 2xx); asked of the API while
        the job is there (retention may have deleted it: then by the receiver alone). A second 2xx of the same
        webhook-id is counted apart, not as wrong, when a worker was SIGKILLed between the two: its worker died
        after the receiver answered and before it recorded the delivery, and another worker delivered it again
        once its claim expired (at least once, as Standard Webhooks receivers expect: they dedupe by id)."""
        ids = [r.job_id for r in runner.records if not r.sync and r.job_id and r.outcome in ("ok", "cancelled")]
        ids += [b["id"] for b in self.batches if b.get("status") in TERMINAL_BATCH and b["kind"] != "full-disk"]
        seen = self.receiver.by_id()
        wrong, redelivered, delivered, failed, gone, gone_unanswered = [], [], 0, 0, 0, 0
        retries = len(WEBHOOK_RETRY_SCHEDULE)
        with self.deployment.http() as http:
            for item_id in ids:
                path = f"/batches/{item_id}" if item_id.startswith("batch") else f"/jobs/{item_id}"
                state = None
                # Delivered or failed within the retry schedule's minute (and the receiver's outage).
                for _ in range(120):
                    response = self.request(http, "GET", path)
                    state = response.json().get("webhook") if response.status_code == 200 else "gone"
                    if state == "gone" or state and state["status"] != "pending":
                        break
                    time.sleep(1)
                answers = seen.get(item_id, [])
                ok_answers = [a for a in answers if a[1] < 300]
                if len(ok_answers) > 1 and len({a[0] for a in answers}) == 1 and any(
                        ok_answers[0][2] - 1 <= kill <= ok_answers[-1][2] for kill in self.kills):
                    redelivered.append(item_id)
                    ok_answers = ok_answers[:1]
                if state == "gone":
                    gone += 1
                    # (no 2xx at the receiver: failed after its retries; retention hid its state from the API)
                    gone_unanswered += not ok_answers
                    if len({a[0] for a in answers}) > 1 or len(ok_answers) > 1:
                        wrong.append((item_id, "gone", answers))
                elif state is None or state["status"] == "pending":
                    wrong.append((item_id, "pending", answers))
                elif state["status"] == "delivered":
                    delivered += 1
                    if len({a[0] for a in answers}) != 1 or len(ok_answers) != 1:
                        wrong.append((item_id, "delivered", answers))
                else:
                    failed += 1
                    if ok_answers or state["attempts"] != retries + 1:
                        wrong.append((item_id, f"failed after {state['attempts']}", answers))
        return {"checked": len(ids), "delivered": delivered, "failed_after_retries": failed,
                "deleted_by_retention": gone, "deleted_by_retention_without_a_2xx": gone_unanswered,
                "redelivered_after_a_kill": redelivered, "wrong": wrong[:20]}


def write_pairs(table: pa.Table, fmt: str, sink) -> None:  # type: ignore[no-untyped-def]
    if fmt == "parquet":
        pq.write_table(table, sink)
    elif fmt == "csv":
        pacsv.write_csv(table, sink)
    else:
        sink.write("".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode())


def when_store_is_up(action: Callable[[], T], pause_s: float = 2) -> T:
    """action(), tried again while the object store is down (a fault), as a user's client would, 5 minutes at
    most. A RuntimeError (what the checks raise) is not retried."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return action()
        except RuntimeError:
            raise
        except Exception:  # noqa: BLE001  (botocore's connection errors are no OSError)
            if time.monotonic() > deadline:
                raise
            time.sleep(pause_s)


_LOG_TIME = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_WORKER_READY = re.compile(r"worker \S+:(\d+):\S+ ready \(model")
_MEMORY_LINE = re.compile(r"memory: RSS ([\d.]+) MB \(([\d.]+) anonymous, (?:([\d.]+) of it in huge pages, )?"
                          r"([\d.]+) file-backed; (\d+) threads\);"
                          r".*?(?:jemalloc \(([\d.]+) MB in use, ([\d.]+) MB resident"
                          r"(?:, ([\d.]+) MB of it metadata)?\))?; Python:")


class MemoryLog(NamedTuple):
    """One line of a worker's memory log (MB): its RSS and the RSS's parts, and jemalloc's figures if it runs on
    it (memory in use, and the resident set: in use, freed pages not yet handed back, its own metadata)."""
    seconds: float  # since the worker was ready
    rss: float
    anonymous: float
    file_backed: float
    threads: int
    jemalloc_in_use: float | None
    jemalloc_resident: float | None
    jemalloc_metadata: float | None = None  # absent from older logs
    huge_pages: float | None = None  # of the anonymous, in transparent huge pages (absent from older logs)


def logged_memory_growth(lives: dict[str, list[MemoryLog]], skip_s: float) -> dict:
    """MB/hour of each worker life's memory log after its first `skip_s` (least squares, 3 logs at least): RSS,
    its anonymous and file-backed parts (the libraries' pages), the anonymous in transparent huge pages, and under
    jemalloc its memory in use, its metadata, the slabs it keeps beside what is in use (resident less both, after
    the purge) and the anonymous memory outside it (thread stacks; Python's own arenas where PYTHONMALLOC is not
    malloc; pages a huge page made resident around what jemalloc purged)."""
    out = {}
    for life, logs in lives.items():
        steady = [entry for entry in logs if entry.seconds >= skip_s]
        if len(steady) < 3:
            continue
        hours = np.array([entry.seconds for entry in steady]) / 3600
        fits = {name: np.array([getattr(entry, name) for entry in steady])
                for name in ("rss", "anonymous", "file_backed")}
        if all(entry.huge_pages is not None for entry in steady):
            fits["huge_pages"] = np.array([entry.huge_pages for entry in steady])
        if all(entry.jemalloc_in_use is not None for entry in steady):
            fits["jemalloc_in_use"] = np.array([entry.jemalloc_in_use for entry in steady])
            resident = np.array([entry.jemalloc_resident for entry in steady])
            fits["anonymous_outside_jemalloc"] = fits["anonymous"] - resident
            if all(entry.jemalloc_metadata is not None for entry in steady):
                metadata = np.array([entry.jemalloc_metadata for entry in steady])
                fits["jemalloc_metadata"] = metadata
                fits["jemalloc_slabs_beside_in_use"] = resident - metadata - fits["jemalloc_in_use"]
        out[life] = {"logs": len(steady), "minutes": round(float(np.ptp(hours)) * 60, 1),
                     **{f"{name}_mb_per_hour": round(float(np.polyfit(hours, values, 1)[0]), 1)
                        for name, values in fits.items()},
                     "rss_mb": [round(float(fits["rss"][0]), 1), round(float(fits["rss"][-1]), 1)],
                     "threads": [steady[0].threads, steady[-1].threads]}
        if (windows := window_fits(hours, fits["rss"])) is not None:
            out[life]["rss_ten_minute_windows_mb_per_hour"] = windows
    return out


GOAL_MB_PER_HOUR = 20  # the soak's memory criterion: RSS growth per process after its first 10 minutes
WINDOW_HOURS = 1 / 6  # a worker killed every 20 minutes has 10 minutes to be fitted over


def window_fits(hours: np.ndarray, values: np.ndarray) -> dict | None:
    """How fits over WINDOW_HOURS (every minute's start) scatter within a longer span: a worker killed every 20
    minutes has only one such window, which scatters far beyond a whole life's fit (docs/soak.md). None for a span
    under two windows or points too sparse for three in a window."""
    if np.ptp(hours) < 2 * WINDOW_HOURS:
        return None
    slopes = []
    for start in np.arange(hours[0], hours[-1] - WINDOW_HOURS + 1e-9, 1 / 60):
        inside = (hours >= start) & (hours <= start + WINDOW_HOURS)
        if inside.sum() >= 3:
            slopes.append(float(np.polyfit(hours[inside], values[inside], 1)[0]))
    if not slopes:  # logs 5 minutes apart: no window holds three
        return None
    return {"windows": len(slopes), "min": round(min(slopes), 1), "median": round(float(np.median(slopes)), 1),
            "max": round(max(slopes), 1), "over_goal": sum(slope > GOAL_MB_PER_HOUR for slope in slopes)}


def memory_growth(samples: list[tuple[float, str, int, float, int]], skip_s: float) -> dict:
    """Per process series (name:pid; a restarted process is a new one): MB/hour (least squares) over its samples
    after its own first `skip_s` (start-up: a worker's warm-up, its pools and caches filling) and after the run's
    first `skip_s`; series with fewer than 8 such samples are left out."""
    series: dict[str, list[tuple[float, float]]] = {}
    for t, name, pid, rss, _ in samples:
        series.setdefault(f"{name}:{pid}", []).append((t, rss))
    out = {}
    for name, points in series.items():
        steady = [p for p in points if p[0] >= max(skip_s, points[0][0] + skip_s)]
        if len(steady) >= 8:
            t, rss = np.array(steady).T
            out[name] = {"mb_per_hour": round(float(np.polyfit(t / 3600, rss, 1)[0]), 1),
                         "minutes": round(float(np.ptp(t)) / 60, 1), "first_mb": round(rss[0], 1),
                         "last_mb": round(rss[-1], 1)}
            if (windows := window_fits(t / 3600, rss)) is not None:
                out[name]["ten_minute_windows_mb_per_hour"] = windows
    return out


def _load_tag(metadata: object) -> str | None:
    value = json.loads(metadata) if isinstance(metadata, str) else metadata
    return value.get("load_tag") if isinstance(value, dict) else None


def _reference():  # type: ignore[no-untyped-def]
    from core import Scorer

    return Scorer.from_pretrained("tiny-random")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--deployment", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--faults", default="all", help=f"'all' or some of {','.join(ALL_FAULTS)}")
    parser.add_argument("--out", type=Path, help="report folder (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-cache", type=Path, help="COMPILE_CACHE_DIR of the deployment (default: its "
                        "own, empty: the workers' first warm-up compiles every program)")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the deployment's processes, over the soak's "
                        "(MEMORY_LOG_SECONDS=60, MALLOC_CONF=...); repeatable")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the deployment is stopped on the way out
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the reference scorer of the checks: no probing for a TPU
    faults = ALL_FAULTS if args.faults == "all" else tuple(args.faults.split(","))
    out = (args.out or Path(tempfile.mkdtemp(prefix="packscore-soak-"))).resolve()
    home = out / "home"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    print(f"host: {host_cpu()}; {args.deployment}, {args.minutes} minutes, faults {faults}; in {out}", flush=True)
    if bad := [s for s in args.setting if "=" not in s]:
        parser.error(f"--setting takes NAME=VALUE, not {bad[0]!r}")
    deployment = {"embedded": Embedded, "postgres": Postgres}[args.deployment](
        home, args.minutes, (args.compile_cache or home / "compile-cache").resolve(),
        dict(s.split("=", 1) for s in args.setting))
    try:
        started = time.monotonic()
        deployment.start()
        print(f"deployment ready after {time.monotonic() - started:.0f} s", flush=True)
        report = Soak(deployment, args.minutes, faults, out, args.seed).run()
    finally:
        deployment.close()
    shown = {**report, "checks": {k: v for k, v in report["checks"].items() if k != "jobs_gone"}}
    print(json.dumps({k: shown[k] for k in ("checks", "memory_mb_per_hour", "p95_last_over_first", "failed")},
                     indent=1, default=str))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
