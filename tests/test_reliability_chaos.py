"""Chaos: faults injected into a real service under load. The service runs on a private PostgreSQL instance and
a private redis-server (so stopping them disturbs no other test), two Celery workers and tiny-random; every
job has a webhook. After each fault, every accepted job must end succeeded with the engine's scores, none lost
and none duplicated (one job per Idempotency-Key, one result, one webhook message whose every delivery carries
the same webhook-id and a valid signature), and /readyz must be 200 again within 60 s.

PACKSCORE_CHAOS_SECONDS (default 12: the shortest load each fault still lands in; 20 before) sets the load of each
test; the long version raises it."""

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text
from standardwebhooks import Webhook

from core import Scorer
from tests.load_runner import LoadConfig, Runner
from tests.service_harness import (
    PrivatePostgres,
    PrivateRedis,
    Service,
    assert_exactly_once,
    assert_scores,
    running_service,
    wait_terminal,
    wait_until,
)

SECONDS = float(os.environ.get("PACKSCORE_CHAOS_SECONDS", 12))


@pytest.fixture(scope="module")
def postgres() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.init()
        yield pg
    finally:
        pg.destroy()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service(postgres: PrivatePostgres, redis_server: PrivateRedis,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from migrations import upgrade

    url = postgres.admin_url
    upgrade(url)
    # Retries long enough to outlast a receiver that is down for several seconds.
    env = {"DATABASE_URL": url, "REDIS_URL": redis_server.url, "BROKER_KEY_PREFIX": "",
           "WEBHOOK_RETRY_SCHEDULE": "0.5,1,2,3,4,5,5,5,5", "RETRY_AFTER_SECONDS": "1"}
    # COMPILE_CACHE_DIR is the run's (tests/conftest.py), as docker-compose's volume is a deployment's: a
    # replacement worker loads the warm-up programs instead of compiling them again before it takes work.
    with running_service(env, tmp_path_factory.mktemp("chaos-logs"), workers=2) as service:
        yield service


@pytest.fixture(scope="module")
def reference() -> Scorer:
    return Scorer.from_pretrained("tiny-random")


def run_with_fault(service: Service, reference: Scorer, receiver, fault: Callable[[Runner], None],  # type: ignore[no-untyped-def]
                   tmp_path, seed: int) -> Runner:
    """Runs load with `fault(runner)` in a second thread, then checks the invariants of this module."""
    service.wait_ready()
    cfg = LoadConfig(duration_s=SECONDS, seed=seed, rate=6, concurrency=8, sizes={"small": 3, "medium": 30,
                                                                                 "large": 200},
                     webhook_url=receiver.url, request_timeout_s=240, sample_interval_s=1)
    runner = Runner(cfg, service.base_url, service.key, service.pids)
    failures: list[BaseException] = []

    def inject() -> None:
        try:
            fault(runner)
        except BaseException as exc:  # reported by the test, after the load has ended
            failures.append(exc)

    injector = threading.Thread(target=inject)
    injector.start()
    runner.run()
    injector.join()
    assert not failures, failures
    recovered = service.wait_ready(60)
    runner.verify(reference)
    summary = runner.write(tmp_path)
    print(f"\nchaos summary (ready again after {recovered:.1f}s):\n"
          + json.dumps({k: v for k, v in summary.items() if k not in ("config", "memory")}, indent=2))
    assert summary["requests"] > 0
    assert summary["errors"] == 0, summary["errors_by_kind"]
    assert summary["verified"] == summary["requests"]
    job_ids = [r.job_id for r in runner.records]
    assert_exactly_once(service.env["DATABASE_URL"], job_ids, cfg.tag)
    assert_webhooks(service, receiver, {r.job_id: r.job for r in runner.records})
    # Faults are expected conditions: the API handles them (503, retries) and logs no unhandled error.
    assert "Traceback" not in (service.logs / "api.log").read_text(errors="replace")
    return runner


def assert_webhooks(service: Service, receiver, jobs: dict[str, dict]) -> None:  # type: ignore[no-untyped-def]
    """Every job's webhook arrives (after retries), signed; all deliveries of one job carry one webhook-id."""
    def ids_by_job() -> dict[str, set[str]]:
        seen: dict[str, set[str]] = defaultdict(set)
        with receiver.lock:
            received = list(receiver.requests)
        for headers, body in received:
            event = Webhook(service.secret).verify(body, headers)
            seen[event["data"]["id"]].add(headers["webhook-id"])
        return seen

    wait_until(lambda: set(jobs) <= set(ids_by_job()), 90, "every job's webhook")
    seen = ids_by_job()
    assert all(len(seen[job_id]) == 1 for job_id in jobs), {j: seen[j] for j in jobs if len(seen[j]) != 1}
    for headers, body in receiver.requests:
        event = json.loads(body)
        if event["data"]["id"] in jobs:
            assert event["type"] == "job.succeeded"
            assert event["data"]["scores"] == jobs[event["data"]["id"]]["scores"]


def running_job_owner_pid(service: Service, seconds: float = 30) -> int:
    """Waits for a live worker holding a running job (mid-pass) and returns its pid (lease_owner: host:pid:uuid)."""
    engine = create_engine(service.env["DATABASE_URL"])
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                owners = conn.execute(text("SELECT lease_owner FROM jobs WHERE status = 'running'")).scalars().all()
            live = {w.pid for w in service.live_workers()}
            pids = [int(owner.split(":")[1]) for owner in owners if owner and int(owner.split(":")[1]) in live]
            if pids:
                return pids[0]
            time.sleep(0.05)
    finally:
        engine.dispose()
    raise AssertionError("no running job to kill")


def test_worker_sigkilled_mid_pass_three_times(service: Service, reference: Scorer, webhook_receiver,  # type: ignore[no-untyped-def]
                                               tmp_path) -> None:
    kills = []

    def fault(runner: Runner) -> None:
        for _ in range(3):
            time.sleep(SECONDS / 5)
            pid = running_job_owner_pid(service)
            service.kill_worker(next(w for w in service.workers if w.pid == pid))
            kills.append(pid)
            service.start_worker()

    runner = run_with_fault(service, reference, webhook_receiver, fault, tmp_path, seed=11)
    assert len(kills) == 3, kills
    assert runner.summary()["job_attempts_over_1"] >= 1, "no job was re-run after a kill"


def test_redis_restarted_during_load(service: Service, redis_server: PrivateRedis, reference: Scorer,  # type: ignore[no-untyped-def]
                                     webhook_receiver, tmp_path) -> None:
    outages_seen = []

    def fault(runner: Runner) -> None:
        for _ in range(2):  # twice: whether a consumer goes deaf depends on what it was doing at the time
            time.sleep(SECONDS / 4)
            redis_server.stop()
            outages_seen.append(broker_reported_down(service, 3))
            redis_server.start()

    run_with_fault(service, reference, webhook_receiver, fault, tmp_path, seed=12)
    # The fault happened: the service itself saw its broker gone each time (/readyz's broker check).
    assert outages_seen == [True, True], outages_seen


def broker_reported_down(service: Service, seconds: float) -> bool:
    """Whether /readyz reports the broker unreachable within `seconds`; waits out the rest of `seconds`."""
    start, seen = time.monotonic(), False
    with service.http() as client:
        while time.monotonic() - start < seconds:
            if not seen:
                checks = client.get("/readyz", timeout=5).json()["checks"]
                seen = checks["broker"] is False
            time.sleep(0.2)
    return seen


def test_api_restarted_during_load(service: Service, reference: Scorer, webhook_receiver,  # type: ignore[no-untyped-def]
                                   tmp_path) -> None:
    def fault(runner: Runner) -> None:
        time.sleep(SECONDS / 3)
        service.stop_api()
        time.sleep(2)
        service.start_api()

    runner = run_with_fault(service, reference, webhook_receiver, fault, tmp_path, seed=13)
    assert runner.summary()["http_retries"] > 0, "no client saw the API down"


def test_postgres_stopped_for_10s_during_load(service: Service, postgres: PrivatePostgres, reference: Scorer,  # type: ignore[no-untyped-def]
                                              webhook_receiver, tmp_path) -> None:
    seen: list[tuple[int, str | None, float]] = []

    def fault(runner: Runner) -> None:
        time.sleep(SECONDS / 3)
        postgres.stop()
        stopped = time.monotonic()
        try:
            # While it is down the API answers quickly with a retryable 503, never a 500 or a hang.
            with service.http() as client:
                while time.monotonic() - stopped < 10:
                    start = time.monotonic()
                    response = client.post("/jobs", json={"query": "q", "items": ["a"], "label_token_ids": [1]},
                                           timeout=20)
                    seen.append((response.status_code, response.headers.get("Retry-After"),
                                 time.monotonic() - start))
                    time.sleep(1)
        finally:
            postgres.start()

    run_with_fault(service, reference, webhook_receiver, fault, tmp_path, seed=14)
    assert seen and all(status == 503 and retry for status, retry, _ in seen), seen
    assert max(took for _, _, took in seen) < 15, seen


def test_webhook_receiver_down_for_a_while(service: Service, reference: Scorer, webhook_receiver,  # type: ignore[no-untyped-def]
                                           tmp_path) -> None:
    def fault(runner: Runner) -> None:
        time.sleep(SECONDS / 4)
        webhook_receiver.close()  # connection refused from now on
        time.sleep(min(10.0, SECONDS / 2))
        webhook_receiver.come_back()

    runner = run_with_fault(service, reference, webhook_receiver, fault, tmp_path, seed=15)
    with service.http() as client:
        attempts = [client.get(f"/jobs/{r.job_id}").json()["webhook"]["attempts"] for r in runner.records]
    assert max(attempts) > 1, "no delivery was retried"


def test_worker_whose_broker_is_gone_still_drains(service: Service, reference: Scorer) -> None:
    """A worker that hears no broker message at all (after a Redis restart, Celery's consumer can sit on a dead
    connection for good) still drains: the jobs table is the queue of record and the sweeper drains it. Its
    broker here is a redis-server of its own, stopped once the worker is up. Runs last: it replaces the
    module's workers."""
    for worker in service.live_workers():
        service.kill_worker(worker)
    own_broker = PrivateRedis()
    own_broker.start()
    try:
        worker = service.start_worker(env={"REDIS_URL": own_broker.url})
        wait_until(lambda: "ready" in (service.logs / f"worker{len(service.workers) - 1}.log").read_text(), 90,
                   "the worker")
        own_broker.stop()
        bodies = [{"query": f"No broker {i}?", "items": ["yes", "no"], "label_token_ids": [3, 4]} for i in range(5)]
        with service.http() as client:
            ids = [client.post("/jobs", json=body).json()["id"] for body in bodies]
            jobs = wait_terminal(client, ids, seconds=90)
        for job_id, body in zip(ids, bodies):
            assert jobs[job_id]["status"] == "succeeded", jobs[job_id]
            assert_scores(jobs[job_id], body, reference)
        assert worker.poll() is None
    finally:
        own_broker.stop()
