"""Load runner for the job service: Poisson arrivals of a seeded, weighted small/medium/large mix of jobs at a
bounded concurrency, for a duration; every job is followed (POST /jobs, then polled) to a terminal state. A
share of the requests (`--sync-share`) goes through the synchronous POST /v1/score instead; one that answers
504 is followed by polling its `job_id`, never sent again. /healthz is timed throughout.

Writes `<prefix>_requests.csv` (one row per request), `<prefix>_memory.csv` (RSS samples of the API and
workers from /proc/<pid>/status) and `<prefix>_summary.json`: throughput in items/s, p50/p95/p99 latency
(submit to terminal, successful jobs; polling adds up to one poll interval), error rate, errors by kind,
memory trend in MB/hour per process (least squares over the samples after the warm-up), and how many
succeeded jobs were checked against the engine (`Scorer.score`, within 1e-5) and how many disagreed.

Clients behave as the README asks: connection errors, 502/503/504 (honouring Retry-After) are retried with
the same Idempotency-Key, so a retried submission never makes a second job. Traffic goes to loopback only.

    python -m tests.load_runner --start-service --workers 2 --model smollm2-135m --duration 2h --out load-out
    python -m tests.load_runner --url http://127.0.0.1:8000 --key psk_... --pid api=123 --pid worker=456 ...
"""

import argparse
import csv
import json
import math
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

TERMINAL = ("succeeded", "failed", "cancelled")
# Scores agree within this relative tolerance and no absolute one: the tiny model's probabilities are about
# 1.5e-5, so an absolute 1e-5 let a score off by half a nat pass. Relative 1e-4 on a probability is 1e-4 on
# its log-probability (the contract's packed-vs-single bound).
SCORE_RTOL = 1e-4
RETRY_STATUSES = (502, 503, 504)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu the a of good bad yes no maybe").split()


@dataclass
class LoadConfig:
    duration_s: float = 120.0
    seed: int = 0
    # Mean arrivals per second (Poisson); 0: closed loop, a new request as soon as one of `concurrency` ends.
    rate: float = 0.0
    concurrency: int = 16
    mix: dict[str, float] = field(default_factory=lambda: {"small": 0.6, "medium": 0.3, "large": 0.1})
    sizes: dict[str, int] = field(default_factory=lambda: {"small": 3, "medium": 30, "large": 200})
    query_words: int = 12
    item_words: int = 6
    # Labels are drawn below this id (valid for every bundled model's vocabulary).
    max_label_id: int = 100
    max_requests: int = 100_000
    poll_interval_s: float = 0.25
    # A request not terminal this long after its submission counts as a `timeout` error.
    request_timeout_s: float = 300.0
    max_retry_wait_s: float = 5.0
    sample_interval_s: float = 2.0
    # Fraction of the run whose memory samples are left out of the trend (start-up, compilation, pools).
    warmup_fraction: float = 0.2
    # Succeeded jobs checked against the engine: -1 all, else a seeded sample of this many.
    verify: int = -1
    webhook_url: str | None = None
    # Fraction of the requests sent to POST /v1/score (the rest: POST /jobs and polling).
    sync_share: float = 0.0
    healthz_interval_s: float = 0.5
    # The deployment's model names the requests take in turn (MODELS); () leaves `model` out (the default).
    models: tuple[str, ...] = ()
    # Fractions of the POST /jobs requests cancelled right after their submission (they end cancelled, or
    # succeeded if they were faster), and sent twice with their Idempotency-Key (the second must be a replay).
    cancel_share: float = 0.0
    resend_share: float = 0.0
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class Record:
    seq: int
    kind: str
    n_items: int
    sync: bool = False
    sync_timeout: bool = False  # /v1/score answered 504: followed by polling
    cancel: bool = False  # cancelled right after its submission (POST /jobs only)
    resend: bool = False  # submitted twice with its Idempotency-Key (POST /jobs only)
    finished_s: float | None = None  # when the client saw it end, seconds into the run
    started_s: float = 0.0
    latency_s: float | None = None
    outcome: str = "pending"  # ok, or an error kind
    job_id: str = ""
    job_status: str = ""
    job_attempts: int = 0
    http_retries: int = 0
    verified: str = ""  # "", "ok", "mismatch"
    body: dict = field(default_factory=dict, repr=False)
    job: dict = field(default_factory=dict, repr=False)


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def parse_weights(text: str, cast: Callable = float) -> dict:
    return {k.strip(): cast(v) for k, v in (part.split("=") for part in text.split(","))}


def make_body(rng: random.Random, kind: str, cfg: LoadConfig, seq: int) -> dict:
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    n_items = cfg.sizes[kind]
    body = {
        "query": f"Request {seq}: {words(rng.randint(1, cfg.query_words))}?",
        "items": [" " + words(rng.randint(1, cfg.item_words)) for _ in range(n_items)],
        "label_token_ids": rng.sample(range(1, cfg.max_label_id), rng.randint(1, 4)),
        "apply_softmax": rng.random() < 0.5,
        "item_first": rng.random() < 0.2,
        "metadata": {"load_tag": cfg.tag, "seq": seq},
    }
    if cfg.models:
        body["model"] = cfg.models[seq % len(cfg.models)]
    if cfg.webhook_url:
        body["webhook_url"] = cfg.webhook_url
    return body


def _only_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"the load runner sends traffic to loopback only, not to {host!r}")


class Runner:
    def __init__(self, cfg: LoadConfig, base_url: str, key: str, pids: Callable[[], dict[str, int]] = dict) -> None:
        _only_loopback(base_url)
        self.cfg = cfg
        self.pids = pids
        self.client = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                                   # a /v1/score call holds one while it waits; polls need others
                                   limits=httpx.Limits(max_connections=2 * cfg.concurrency + 4))
        self.records: list[Record] = []
        self.memory: list[tuple[float, str, int, float]] = []  # (t, name, pid, rss MB)
        self.healthz_s: list[float] = []
        self.t0 = 0.0
        self._done = threading.Event()

    # -- one request ------------------------------------------------------------------------------------
    def _call(self, record: Record, method: str, path: str, deadline: float,
              retry: tuple[int, ...] = RETRY_STATUSES, **kwargs: object) -> httpx.Response:
        """One API call, retried on connection errors and `retry` statuses until `deadline`."""
        while True:
            wait = 0.5
            try:
                response = self.client.request(method, path, **kwargs)
                if response.status_code not in retry:
                    return response
                wait = float(response.headers.get("Retry-After", wait))
                failure = f"http_{response.status_code}"
            except httpx.TransportError as exc:
                failure = "connection_error" if isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError |
                                                           httpx.ReadError) else type(exc).__name__
            if time.monotonic() + wait > deadline:
                raise _Failed(failure)
            record.http_retries += 1
            time.sleep(min(wait, self.cfg.max_retry_wait_s))

    def _run_one(self, record: Record) -> None:
        start = time.monotonic()
        record.started_s = start - self.t0
        deadline = start + self.cfg.request_timeout_s
        try:
            job = self._submit_sync(record, deadline) if record.sync else self._submit(record, deadline)
            while job["status"] not in TERMINAL:
                if time.monotonic() > deadline:
                    raise _Failed("timeout")
                time.sleep(self.cfg.poll_interval_s)
                response = self._call(record, "GET", f"/jobs/{record.job_id}", deadline)
                if response.status_code != 200:
                    raise _Failed(f"http_{response.status_code}:{_error_code(response)}")
                job = response.json()
            record.job, record.job_status, record.job_attempts = job, job["status"], job["attempts"]
            record.finished_s = time.monotonic() - self.t0
            if job["status"] == "succeeded":
                record.outcome = "ok"
                record.latency_s = time.monotonic() - start
            elif record.cancel and job["status"] == "cancelled":
                record.outcome = "cancelled"
            else:
                record.outcome = f"job_{job['status']}:{(job.get('error') or {}).get('code', '')}"
        except _Failed as exc:
            record.outcome = str(exc)
        except Exception as exc:  # a bug in the service's answers (bad JSON...), counted, not fatal to the run
            record.outcome = f"client_{type(exc).__name__}"

    def _submit(self, record: Record, deadline: float) -> dict:
        response = self._call(record, "POST", "/jobs", deadline, json=record.body,
                              headers={"Idempotency-Key": f"load-{self.cfg.tag}-{record.seq}"})
        if response.status_code != 202:
            raise _Failed(f"http_{response.status_code}:{_error_code(response)}")
        job = response.json()
        record.job_id = job["id"]
        if record.resend:  # a client that never saw the first answer sends it again: the same job comes back
            again = self._call(record, "POST", "/jobs", deadline, json=record.body,
                               headers={"Idempotency-Key": f"load-{self.cfg.tag}-{record.seq}"})
            if again.status_code not in (200, 202) or again.json()["id"] != job["id"] \
                    or again.headers.get("idempotent-replayed") != "true":
                raise _Failed(f"resend_not_replayed:{again.status_code}")
        if record.cancel:
            response = self._call(record, "POST", f"/jobs/{job['id']}/cancel", deadline)
            if response.status_code not in (200, 202, 409):  # 409: it had finished already
                raise _Failed(f"cancel_http_{response.status_code}:{_error_code(response)}")
        return job

    def _submit_sync(self, record: Record, deadline: float) -> dict:
        """POST /v1/score; a 504 is followed as the job it names (sending it again would score it twice)."""
        body = {k: v for k, v in record.body.items() if k not in ("metadata", "webhook_url")}
        response = self._call(record, "POST", "/v1/score", deadline, retry=(502, 503), json=body,
                              timeout=self.cfg.request_timeout_s)
        if response.status_code == 504 and _error_code(response) == "timeout":
            record.job_id = response.json()["error"]["job_id"]
            record.sync_timeout = True
            return {"status": "queued"}
        if response.status_code != 200:
            raise _Failed(f"http_{response.status_code}:{_error_code(response)}")
        out = response.json()
        record.job_id = out["id"]
        return {"status": "succeeded", "attempts": 1, "scores": out["scores"]}

    def _time_healthz(self) -> None:
        with httpx.Client(base_url=str(self.client.base_url), timeout=30) as client:
            while not self._done.wait(self.cfg.healthz_interval_s):
                start = time.monotonic()
                try:
                    client.get("/healthz")
                except httpx.TransportError:
                    pass  # the API is down (a chaos test): timed all the same
                self.healthz_s.append(time.monotonic() - start)

    # -- memory -----------------------------------------------------------------------------------------
    def _sample_memory(self) -> None:
        while not self._done.wait(self.cfg.sample_interval_s):
            now = time.monotonic() - self.t0
            for name, pid in self.pids().items():
                rss = rss_mb(pid)
                if rss is not None:
                    self.memory.append((now, name, pid, rss))

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        kinds, weights = zip(*cfg.mix.items())
        slots = threading.Semaphore(cfg.concurrency)
        threads: list[threading.Thread] = []
        self.t0 = time.monotonic()
        sampler = threading.Thread(target=self._sample_memory, daemon=True)
        sampler.start()
        healthz = threading.Thread(target=self._time_healthz, daemon=True)
        healthz.start()
        next_arrival = self.t0

        def worker(record: Record) -> None:
            try:
                self._run_one(record)
            finally:
                slots.release()

        for seq in range(cfg.max_requests):
            if cfg.rate > 0:
                next_arrival += rng.expovariate(cfg.rate)
                time.sleep(max(0.0, next_arrival - time.monotonic()))
            if time.monotonic() - self.t0 >= cfg.duration_s:
                break
            kind = rng.choices(kinds, weights)[0]
            record = Record(seq=seq, kind=kind, n_items=cfg.sizes[kind], body=make_body(rng, kind, cfg, seq),
                            sync=rng.random() < cfg.sync_share)
            if not record.sync:
                record.cancel, record.resend = rng.random() < cfg.cancel_share, rng.random() < cfg.resend_share
            slots.acquire()  # bounded concurrency: an arrival waits for a free slot
            self.records.append(record)
            thread = threading.Thread(target=worker, args=(record,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        self._done.set()
        sampler.join()
        healthz.join()
        self.elapsed_s = time.monotonic() - self.t0
        self.client.close()

    def verify(self, reference) -> None:  # type: ignore[no-untyped-def]
        """Checks succeeded jobs' scores against the engine (all, or a seeded sample)."""
        from core import scores_from_logprobs

        done = [r for r in self.records if r.outcome == "ok"]
        if self.cfg.verify >= 0:
            done = random.Random(self.cfg.seed + 1).sample(done, min(self.cfg.verify, len(done)))
        # All in one go, packed as the workers pack them: one request at a time was a pass (and often a compile)
        # each.
        requests = [reference.tokenize(r.body["query"], r.body["items"], r.body["label_token_ids"],
                                       r.body["item_first"]) for r in done]
        for record, logprobs in zip(done, reference.logprobs_of(requests)):
            expected = scores_from_logprobs(logprobs, record.body["apply_softmax"])
            got = np.asarray(record.job["scores"], np.float64)
            ok = scores_agree(got, expected)
            record.verified = "ok" if ok else "mismatch"
            if not ok:
                record.outcome = "wrong_scores"

    # -- results ----------------------------------------------------------------------------------------
    def summary(self) -> dict:
        ok = [r for r in self.records if r.outcome == "ok"]
        errors = Counter(r.outcome for r in self.records if r.outcome not in ("ok", "cancelled"))
        latencies = np.array([r.latency_s for r in ok]) * 1000 if ok else np.array([0.0])
        items = sum(r.n_items for r in ok)
        return {
            "requests": len(self.records),
            "ok": len(ok),
            "cancelled": sum(r.outcome == "cancelled" for r in self.records),
            "errors": sum(errors.values()),
            "error_rate": sum(errors.values()) / max(1, len(self.records)),
            "errors_by_kind": dict(errors),
            "elapsed_s": round(self.elapsed_s, 2),
            "items_ok": items,
            "throughput_items_s": round(items / self.elapsed_s, 2),
            "latency_ms": {f"p{q}": round(float(np.percentile(latencies, q)), 1) for q in (50, 95, 99)},
            "latency_by_kind_ms_p99": {k: round(float(np.percentile([r.latency_s * 1000 for r in ok if r.kind == k],
                                                                       99)), 1)
                                       for k in self.cfg.mix if any(r.kind == k for r in ok)},
            "http_retries": sum(r.http_retries for r in self.records),
            "sync_requests": sum(r.sync for r in self.records),
            "sync_ok": sum(r.sync and r.outcome == "ok" for r in self.records),
            "sync_504": sum(r.sync_timeout for r in self.records),
            "healthz_ms": {"max": round(max(self.healthz_s, default=0) * 1000, 1),
                           "p99": round(float(np.percentile(self.healthz_s, 99)) * 1000 if self.healthz_s else 0, 1),
                           "samples": len(self.healthz_s)},
            "job_attempts_over_1": sum(r.job_attempts > 1 for r in ok),
            "verified": sum(r.verified == "ok" for r in self.records),
            "mismatches": sum(r.verified == "mismatch" for r in self.records),
            "memory": memory_trend(self.memory, self.cfg.warmup_fraction * self.elapsed_s),
            "config": {k: v for k, v in asdict(self.cfg).items()},
        }

    def write(self, out: Path, prefix: str = "load") -> dict:
        out.mkdir(parents=True, exist_ok=True)
        columns = ["seq", "kind", "n_items", "sync", "sync_timeout", "cancel", "resend", "started_s", "latency_s",
                   "finished_s", "outcome", "job_id", "job_status", "job_attempts", "http_retries", "verified"]
        with open(out / f"{prefix}_requests.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for r in self.records:
                writer.writerow([getattr(r, c) for c in columns])
        with open(out / f"{prefix}_memory.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["t_s", "process", "pid", "rss_mb"])
            writer.writerows(self.memory)
        summary = self.summary()
        (out / f"{prefix}_summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def scores_agree(got: np.ndarray, expected: np.ndarray) -> bool:
    return got.shape == np.shape(expected) and bool(np.allclose(got, expected, rtol=SCORE_RTOL, atol=0))


class _Failed(Exception):
    """A request that ended in an error of the given kind."""


def _error_code(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["code"]
    except Exception:
        return "no_json"


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None  # the process is gone (killed by a chaos test, say)
    return None


def memory_trend(samples: list[tuple[float, str, int, float]], warmup_s: float) -> dict:
    """Per process (a restarted process is a new series): first/last RSS and the least-squares slope in MB/hour
    over the samples after the warm-up."""
    series: dict[str, list[tuple[float, float]]] = {}
    for t, name, pid, rss in samples:
        series.setdefault(f"{name}:{pid}", []).append((t, rss))
    out = {}
    for name, points in series.items():
        steady = [p for p in points if p[0] >= warmup_s] or points
        t, rss = np.array(steady).T
        slope = float(np.polyfit(t / 3600, rss, 1)[0]) if len(steady) >= 3 and np.ptp(t) > 0 else math.nan
        out[name] = {"start_mb": round(points[0][1], 1), "end_mb": round(points[-1][1], 1),
                     "peak_mb": round(max(p[1] for p in points), 1), "samples": len(points),
                     "trend_mb_per_hour": round(slope, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="the API's base URL (loopback only)")
    parser.add_argument("--key", default=os.environ.get("PACKSCORE_API_KEY"))
    parser.add_argument("--pid", action="append", default=[], help="NAME=PID to sample RSS of (repeatable)")
    parser.add_argument("--start-service", action="store_true",
                        help="start an API and workers of our own on a fresh database (DATABASE_URL's server)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--duration", default="2m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--mix", default="small=0.6,medium=0.3,large=0.1")
    parser.add_argument("--sizes", default="small=3,medium=30,large=200", help="items per request of each kind")
    parser.add_argument("--trend-skip", type=float, default=0.2,
                        help="leading fraction of the run left out of the memory trend (0.5: the second half)")
    parser.add_argument("--query-words", type=int, default=12, help="a query has 1 to this many words")
    parser.add_argument("--item-words", type=int, default=6, help="an item has 1 to this many words")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--sync-share", type=float, default=0.0,
                        help="fraction of the requests sent to POST /v1/score instead of POST /jobs")
    parser.add_argument("--verify", type=int, default=-1, help="jobs checked against the engine (-1: all)")
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--out", default="load-out")
    parser.add_argument("--prefix", default="load")
    args = parser.parse_args()
    cfg = LoadConfig(duration_s=parse_duration(args.duration), seed=args.seed, rate=args.rate,
                     concurrency=args.concurrency, mix=parse_weights(args.mix),
                     sizes=parse_weights(args.sizes, int), max_requests=args.max_requests, verify=args.verify,
                     sync_share=args.sync_share, query_words=args.query_words, item_words=args.item_words,
                     warmup_fraction=args.trend_skip,
                     sample_interval_s=args.sample_interval)
    out = Path(args.out)
    if args.start_service:
        summary = _run_with_own_service(cfg, args.model, args.workers, out, args.prefix)
    else:
        if not (args.url and args.key):
            parser.error("--url and --key (or --start-service) are needed")
        pids = {name: int(pid) for name, pid in (p.split("=") for p in args.pid)}
        runner = Runner(cfg, args.url, args.key, lambda: pids)
        runner.run()
        _verify_with(runner, args.model)
        summary = runner.write(out, args.prefix)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


def _verify_with(runner: Runner, model: str) -> None:
    if runner.cfg.verify != 0:
        from core import Scorer

        runner.verify(Scorer.from_pretrained(model))


def _run_with_own_service(cfg: LoadConfig, model: str, workers: int, out: Path, prefix: str) -> dict:
    from tests.service_harness import fresh_database, running_service

    admin = os.environ.get("PACKSCORE_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    name = f"packscore_load_{cfg.tag}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with fresh_database(admin, name) as url:
        env = {"DATABASE_URL": url, "MODEL": model, "BROKER_KEY_PREFIX": f"{name}:",
               "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")}
        with running_service(env, logs, workers=workers) as service:
            runner = Runner(cfg, service.base_url, service.key, service.pids)
            runner.run()
        _verify_with(runner, model)
        return runner.write(out, prefix)


if __name__ == "__main__":
    main()
