"""Batches against a real service (uvicorn + a Celery worker subprocess, PostgreSQL, Redis, tiny-random):
the API's memory while a 100,000-line upload streams in, and interactive latency while a backfill runs."""

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service_harness import Service, running_service


@pytest.fixture
def service(redis_url: str, run_id: str, database_factory, tmp_path_factory) -> Iterator[Service]:  # type: ignore[no-untyped-def]
    """An API with a database of its own for each test (the 100k-row upload's cleanup must not weigh on the
    latency measurement); the fairness test starts the worker."""
    with database_factory(f"packscore_batches_{run_id}") as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:batches:",
             "BATCH_ROUND_TOKENS": os.environ.get("TEST_BATCH_ROUND_TOKENS", "64"),
             "WARMUP": "ladder",  # the latency test measures warm programs (the suite's default: none)
             # One compute thread for the worker: on this 2-core machine it stands in for an accelerator, and
             # must not take the CPU the API and PostgreSQL need (which would measure CPU starvation instead).
             "XLA_FLAGS": os.environ.get("TEST_XLA_FLAGS", f"{os.environ['XLA_FLAGS']} "
                                         "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")},
            tmp_path_factory.mktemp("batch-logs")) as service:
        yield service


def memory_kib(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {name: int(re.search(rf"^{name}:\s+(\d+) kB", status, re.M).group(1)) for name in ("VmRSS", "VmHWM")}


def test_upload_of_100k_lines_keeps_api_memory_bounded(service: Service) -> None:
    n = 100_000

    def body() -> Iterator[bytes]:
        for start in range(0, n, 1000):
            yield "".join(json.dumps({"custom_id": f"row-{i}", "query": [1 + i % 97, 2, 3],
                                      "items": [[4 + i % 50], [5, 6]], "label_token_ids": [1, 2]}) + "\n"
                          for i in range(start, start + 1000)).encode()

    with service.http() as client:
        client.timeout = httpx.Timeout(300)
        # Warm the upload path (imports, pools), then take the idle figure.
        assert client.post("/batches", content=b'{"custom_id": "w", "query": [1], "items": [[2]], '
                                               b'"label_token_ids": [1]}\n').status_code == 201
        idle = memory_kib(service.api.pid)["VmRSS"]
        started = time.monotonic()
        response = client.post("/batches", content=body(), headers={"content-type": "application/jsonl"})
        seconds = time.monotonic() - started
        assert response.status_code == 201, response.text
        batch = response.json()
        peak = memory_kib(service.api.pid)["VmHWM"]
        print(f"\n100k-line upload: {seconds:.1f} s, API idle RSS {idle / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, "
              f"peak above idle {(peak - idle) / 1024:.0f} MiB (bound 300 MiB)")
        assert batch["counts"] == {"total": n, "succeeded": 0, "failed": 0, "cancelled": 0}
        assert batch["progress"]["items_total"] == 2 * n
        assert (peak - idle) < 300 * 1024
        # No worker runs in this test: cancel, so the fairness test does not score these.
        assert client.post(f"/batches/{batch['id']}/cancel").json()["status"] == "cancelled"


def latency(client: httpx.Client, body: dict) -> tuple[float, float]:
    """(seconds from submission to the job's end, of which waiting to be claimed), by the service's own
    timestamps, so polling adds no error."""
    job_id = client.post("/jobs", json=body).json()["id"]
    while (job := client.get(f"/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.05)  # polling slowly only spares the CPU
    assert job["status"] == "succeeded", job
    created, started, finished = (np.datetime64(job[k].rstrip("Z"))
                                  for k in ("created_at", "started_at", "finished_at"))
    return (float((finished - created) / np.timedelta64(1, "us")) / 1e6,
            float((started - created) / np.timedelta64(1, "us")) / 1e6)


def measure(client: httpx.Client, bodies: list[dict]) -> tuple[list[float], list[float]]:
    samples = []
    for i, body in enumerate(bodies):
        time.sleep(0.013 * (i % 5))  # land at different points of the batch rounds
        samples.append(latency(client, body))
    return [total for total, _ in samples], [wait for _, wait in samples]


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95, method="inverted_cdf"))


def ms(values: list[float]) -> str:
    return f"p50 {np.median(values) * 1e3:.0f} ms, p95 {p95(values) * 1e3:.0f} ms"


def test_interactive_latency_during_backfill(service: Service) -> None:
    """Tenant A runs a backfill of thousands of requests; tenant B's small jobs stay within 4x their median
    and 5x their p95 on the idle service. Idle is measured before and after the backfill, so that load from outside
    the test (other processes on the machine) weighs on both figures alike."""
    service.start_worker()
    service.wait_for_workers(1)
    tenant_b, _ = service.create_key("tenant-b")
    small = [{"query": f"Is answer {i} right?", "items": ["yes", "no"], "label_token_ids": [5, 17]}
             for i in range(10, 80)]
    backfill = [{"custom_id": f"bf-{i}", "query": f"Rank the candidates for query {i // 10}:",
                 "items": [f"candidate {i} {j}" for j in range(4)], "label_token_ids": [5, 17, 300]}
                for i in range(4000)]
    with service.http() as a, service.http(tenant_b) as b:
        # Warm-up: compile the shapes of interactive jobs and of batch rounds.
        measure(b, small[:10])
        warm = a.post("/batches", json={"requests": backfill[:400]}).json()["id"]
        deadline = time.monotonic() + 120
        while a.get(f"/batches/{warm}").json()["status"] != "completed":
            assert time.monotonic() < deadline, "the warm-up batch did not complete"
            time.sleep(0.1)

        idle, idle_waits = measure(b, small[:30])
        batch_id = a.post("/batches", json={"requests": [{**r, "custom_id": "x" + r["custom_id"]}
                                                         for r in backfill]}).json()["id"]
        deadline = time.monotonic() + 120
        while a.get(f"/batches/{batch_id}").json()["counts"]["succeeded"] < 200:
            assert time.monotonic() < deadline, "the backfill does not progress"
            time.sleep(0.05)
        before = a.get(f"/batches/{batch_id}").json()["counts"]["succeeded"]
        busy, busy_waits = measure(b, small[:60])
        batch = a.get(f"/batches/{batch_id}").json()
        assert batch["status"] == "in_progress", "the backfill ended before the measurement did"
        assert batch["counts"]["succeeded"] - before > 50, "the backfill did not run alongside"
        assert a.post(f"/batches/{batch_id}/cancel").status_code in (200, 202)
        deadline = time.monotonic() + 30
        while a.get(f"/batches/{batch_id}").json()["status"] != "cancelled":
            assert time.monotonic() < deadline, "the cancelled backfill did not end"
            time.sleep(0.05)
        after, after_waits = measure(b, small[30:60])
        idle, idle_waits = idle + after, idle_waits + after_waits
        print(f"\ninteractive jobs, submission to result: idle {ms(idle)}; during the backfill {ms(busy)} "
              f"(bounds: p50 <= {4 * np.median(idle) * 1e3:.0f} ms, p95 <= {5 * p95(idle) * 1e3:.0f} ms). "
              f"Waiting to be claimed: idle {ms(idle_waits)}; "
              f"during the backfill {ms(busy_waits)}. Backfill requests done meanwhile: "
              f"{batch['counts']['succeeded'] - before}")
        # Interactive jobs join the next pass, and batch rounds wait while they run, but on CPU a job arriving
        # waits for the batch pass already on the engine, and the worker's database writes for the backfill
        # (behind the device, in the writer's thread) share the two cores. Measured on this machine: busy
        # median 41-50 ms against 40 idle (2026-11-24); 2026-11-25, the API faster: median 62-84 ms against
        # 31-34 idle (up to 2.6x), p95 85-139 ms against 37-41 (up to 3.6x), in five runs. The code before
        # the pass-loop fix of that day gave the same ratio on one host; where the time goes: docs/batches.md.
        assert np.median(busy) <= 4 * np.median(idle) and p95(busy) <= 5 * p95(idle)
