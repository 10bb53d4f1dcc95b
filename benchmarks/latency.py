"""Latency benchmark: the embedded service (`make run`) with the real bundled model, as a new user meets it.

    python -m benchmarks.latency [--calls 20] [--lines 400] [--short-lines 600] [--big-request 3000] [--home DIR]

It starts `packscore serve --embedded` (SQLite, the filesystem broker, the real engine on this machine's CPU)
in a folder of its own (--home keeps its compile cache between runs), and prints:
- start-up: seconds to /readyz, and the worker's warm-up (programs compiled or loaded, and seconds);
- README's 2-item `/v1/score`, called --calls times one after another on the warm service: p50, p95, max;
- a backfill alone (--lines lines of a 30-word query and 20 items of 12 words, one upload): items/s from its
  first claim to its end;
- the same 2-item call --calls times while such a backfill runs (after each answer a pause of 0.2-3 s, so
  that calls come at any point of a batch pass): p50, p95, max;
- a backfill of --short-lines lines of 2 items alone, then one of lines shaped as README's call (a 9-word
  query, 2 items of 3 words, about 25 tokens a line): items/s and lines/s (0 skips them);
- a 1-item `/v1/score` sent 50 ms after a --big-request-item `/v1/score` (claimed with it, as a rule), then 7
  more 0.5-2.5 s apart while the big one runs (it may end in a 504 while its job goes on): the first call's
  seconds, the others' p50, p95, max, and the big request's items/s from its job's first claim to its end
  (0 skips it);
- SIGINT to `packscore serve` during a backfill: seconds until every process exited, whether the worker had
  to be killed, and the jobs left `running` in the database.

Timings are the client's wall time per call. Report the host's CPU flags with the figures (printed first).
"""

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.capacity import WORDS, host_cpu
from tests.service_harness import free_port, wait_until

SCORE_BODY = {"query": "Is the city in France? Answer yes or no.", "items": ["\nCity: Lyon\nAnswer:",
              "\nCity: Berlin\nAnswer:"], "label_token_ids": [9805, 787], "apply_softmax": True}


def backfill_lines(lines: int, tag: str, seed: int = 0, items: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    text = lambda n: " ".join(rng.choice(WORDS, size=n))
    return b"".join(json.dumps({"custom_id": f"{tag}-{i}", "query": f"{tag} {i}: {text(30)}",
                                "items": [text(12) for _ in range(items)], "label_token_ids": [9805, 787]}).encode()
                    + b"\n" for i in range(lines))


def percentiles(seconds: list[float]) -> dict:
    a = np.asarray(seconds)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p95": round(float(np.percentile(a, 95)), 3),
            "max": round(float(a.max()), 3), "calls": len(a)}


class EmbeddedService:
    def __init__(self, home: Path, model: str, extra_env: dict[str, str]) -> None:
        self.home, self.port = home, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "REDIS_URL", "BROKER_URL", "BROKER_DIR")}
        env.update({"PACKSCORE_HOME": str(home / ".packscore"), "MODEL": model, **extra_env})
        self.log_path = home / "serve.log"
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "packscore.cli", "serve", "--embedded", "--port",
                                      str(self.port)], cwd=home, env=env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200, 900, "the service's /readyz")
        self.ready_seconds = time.monotonic() - self.started
        self.key = (home / ".packscore" / "api_key").read_text().split()[0]
        self.http = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=300)

    def warm_up(self) -> dict:
        found = re.search(r"warmed (\d+) programs in ([\d.]+) s", self.log_path.read_text(errors="replace"))
        return {"programs": int(found[1]), "seconds": float(found[2])} if found else {}

    def score(self, body: dict = SCORE_BODY) -> float:
        start = time.perf_counter()
        response = self.http.post("/v1/score", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/score: {response.status_code} {response.text}")
        return time.perf_counter() - start

    def upload(self, lines: bytes) -> str:
        response = self.http.post("/batches", content=lines, headers={"Content-Type": "application/jsonl"})
        if response.status_code != 201:
            raise RuntimeError(f"POST /batches: {response.status_code} {response.text}")
        return response.json()["id"]

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/batches/{batch_id}").json()

    def running_jobs(self) -> int:
        with sqlite3.connect(self.home / ".packscore" / "packscore.db") as db:
            return db.execute("SELECT count(*) FROM jobs WHERE status = 'running'").fetchone()[0]

    def batch_window(self, batch_id: str | None = None, items_total: int | None = None) -> tuple[float, float, int]:
        """(first claim, last finish, items) of the batch's lines (or of the newest job of `items_total` items),
        by the jobs' own timestamps."""
        query = "SELECT started_at, finished_at, items_done FROM jobs WHERE " + (
            "batch_id = ?" if batch_id else "items_total = ? ORDER BY created_at DESC LIMIT 1")
        with sqlite3.connect(self.home / ".packscore" / "packscore.db") as db:
            rows = db.execute(query, (batch_id or items_total,)).fetchall()
        parse = lambda s: time.mktime(time.strptime(s[:19], "%Y-%m-%d %H:%M:%S")) + float("0" + s[19:26])
        return min(parse(r[0]) for r in rows), max(parse(r[1]) for r in rows), sum(r[2] for r in rows)

    def stop(self, timeout: float = 30) -> dict:
        """SIGINT to the process group, as Ctrl-C in a terminal sends it."""
        signalled = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        seconds = time.monotonic() - signalled
        killed = "killing it" in self.log_path.read_text(errors="replace")
        return {"seconds": round(seconds, 2), "worker_killed": killed, "jobs_left_running": self.running_jobs()}


def wait_batch(service: EmbeddedService, batch_id: str, seconds: float = 3600) -> dict:
    wait_until(lambda: service.batch(batch_id)["status"] in ("completed", "failed", "cancelled"), seconds,
          "the backfill", interval=0.5)
    return service.batch(batch_id)


def readme_lines(lines: int, seed: int = 0) -> bytes:
    """Lines shaped as README's 2-item call (about 25 tokens), each with its own query."""
    rng = np.random.default_rng(seed)
    city = lambda: "\nCity: " + str(rng.choice(WORDS)).title() + "\nAnswer:"
    return b"".join(json.dumps({**SCORE_BODY, "custom_id": f"readme-{i}", "query": f"Is it in France ({i})? Answer "
                                "yes or no.", "items": [city(), city()]}).encode() + b"\n" for i in range(lines))


def short_lines(service: EmbeddedService, lines: int, readme_shaped: bool) -> dict:
    body = readme_lines(lines, seed=3) if readme_shaped else backfill_lines(lines, "short", seed=3, items=2)
    batch_id = service.upload(body)
    done = wait_batch(service, batch_id)
    first, last, items = service.batch_window(batch_id)
    return {"lines": lines, "items": items, "seconds": round(last - first, 1),
            "items_per_s": round(items / (last - first), 1), "lines_per_s": round(lines / (last - first), 2),
            "status": done["status"]}


def beside_big_request(service: EmbeddedService, items: int) -> dict:
    rng = np.random.default_rng(4)
    text = lambda n: " ".join(rng.choice(WORDS, size=n))
    big = {"query": text(30), "items": [text(12) for _ in range(items)], "label_token_ids": [9805, 787]}
    answers: list[int] = []
    sender = threading.Thread(target=lambda: answers.append(service.http.post("/v1/score", json=big).status_code))
    sender.start()
    small = {**SCORE_BODY, "items": SCORE_BODY["items"][:1]}
    time.sleep(0.05)
    with_it = service.score(small)  # likely claimed with the big one, and so in its first pass
    wait_until(lambda: service.running_jobs() > 0, 120, "the big request's job to start", interval=0.1)
    calls = []
    for pause in rng.uniform(0.5, 2.5, 7):
        time.sleep(pause)
        calls.append(service.score(small))
    wait_until(lambda: not service.running_jobs(), 900, "the big request's job to end", interval=0.5)
    sender.join()
    first, last, done = service.batch_window(items_total=items)
    return {**percentiles(calls), "seconds": [round(c, 2) for c in calls], "sent_with_it": round(with_it, 2),
            "big_status": answers[0],
            "big_items_per_s": round(done / (last - first), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--lines", type=int, default=400, help="backfill lines (20 items of 12 words each)")
    parser.add_argument("--short-lines", type=int, default=600, help="backfill lines of 2 items (0: none)")
    parser.add_argument("--big-request", type=int, default=3000,
                        help="items of the large /v1/score a 1-item call runs beside (0: none)")
    parser.add_argument("--home", type=Path, help="the service's folder (default: a new temporary one)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the service (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the service is stopped on the way out
    home = args.home or Path(tempfile.mkdtemp(prefix="packscore-latency-"))
    home.mkdir(parents=True, exist_ok=True)
    extra = dict(item.split("=", 1) for item in args.env)
    figures: dict = {"host": host_cpu(), "env": extra}
    print(f"host: {figures['host']}", flush=True)
    service = EmbeddedService(home, args.model, extra)
    try:
        figures["ready_seconds"] = round(service.ready_seconds, 1)
        figures["warm_up"] = service.warm_up()
        print(f"ready after {figures['ready_seconds']} s; warm-up {figures['warm_up']}", flush=True)
        for _ in range(2):
            service.score()
        figures["alone"] = percentiles([service.score() for _ in range(args.calls)])
        print(f"2-item /v1/score alone: {figures['alone']}", flush=True)

        batch_id = service.upload(backfill_lines(args.lines, "alone"))
        done = wait_batch(service, batch_id)
        first, last, items = service.batch_window(batch_id)
        figures["backfill"] = {"lines": args.lines, "items": items, "seconds": round(last - first, 1),
                               "items_per_s": round(items / (last - first), 1), "status": done["status"]}
        print(f"backfill alone: {figures['backfill']}", flush=True)

        batch_id = service.upload(backfill_lines(args.lines, "beside", seed=1))
        wait_until(lambda: service.batch(batch_id)["counts"]["succeeded"] > 0, 600, "the backfill to start")
        busy = []
        pauses = np.random.default_rng(2).uniform(0.2, 3.0, args.calls)  # calls land anywhere in a batch pass
        for pause in pauses:
            busy.append(service.score())
            time.sleep(pause)
        figures["beside_backfill"] = percentiles(busy)
        figures["beside_backfill"]["backfill_still_running"] = service.batch(batch_id)["status"] == "in_progress"
        print(f"2-item /v1/score beside a backfill: {figures['beside_backfill']}", flush=True)
        time.sleep(1.0)
        figures["stop"] = service.stop()
        print(f"SIGINT during the backfill: {figures['stop']}", flush=True)
        if args.short_lines or args.big_request:
            service = EmbeddedService(home, args.model, extra)  # the same folder: its compile cache is warm
            service.http.post(f"/batches/{batch_id}/cancel")  # the interrupted backfill would go on
            wait_until(lambda: not service.running_jobs(), 120, "the interrupted backfill to stop", interval=0.2)
        if args.short_lines:
            figures["short_lines"] = short_lines(service, args.short_lines, readme_shaped=False)
            print(f"backfill of 2-item lines alone: {figures['short_lines']}", flush=True)
            figures["readme_lines"] = short_lines(service, args.short_lines, readme_shaped=True)
            print(f"backfill of README-shaped 2-item lines alone: {figures['readme_lines']}", flush=True)
        if args.big_request:
            figures["beside_big_request"] = beside_big_request(service, args.big_request)
            print(f"1-item /v1/score beside a {args.big_request}-item one: {figures['beside_big_request']}", flush=True)
        if service.proc.poll() is None:
            service.stop()
    finally:
        if service.proc.poll() is None:
            service.stop()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
