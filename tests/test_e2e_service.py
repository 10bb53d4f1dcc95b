"""End to end: a real uvicorn server and real Celery workers (subprocesses, solo pool), PostgreSQL, Redis and
the tiny-random model. Submit, poll, webhooks, cancel, idempotency, coalescing, and a worker SIGKILLed
mid-job whose job still completes exactly once."""

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, text
from standardwebhooks import Webhook

from core import Scorer
from tests.service_harness import Service, assert_scores, running_service, wait_terminal


@pytest.fixture(scope="module")
def service(redis_url: str, run_id: str, database_factory,  # type: ignore[no-untyped-def]
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with database_factory(f"packscore_e2e_{run_id}") as url:
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:e2e:"}
        with running_service(env, tmp_path_factory.mktemp("e2e-logs")) as service:
            yield service


@pytest.fixture(scope="module")
def reference() -> Scorer:
    return Scorer.from_pretrained("tiny-random")


def metric(client: httpx.Client, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    assert found, name
    return float(found.group(1))


def test_jobs_coalesce_and_complete(service: Service, reference: Scorer, webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    receiver = webhook_receiver
    with service.http() as client:
        # No worker yet: everything queues, then one worker finds 20 jobs at once.
        bodies = [{"query": f"Is answer {i} correct?", "items": [f"yes {i}", "no", "maybe so"][: 1 + i % 3],
                   "label_token_ids": [9, 42, 100 + i], "apply_softmax": i % 2 == 0,
                   "item_first": i % 5 == 0} for i in range(20)]
        bodies[0]["webhook_url"] = receiver.url
        bodies[0]["metadata"] = {"trace": str(uuid.uuid4())}
        ids = []
        for i, body in enumerate(bodies):
            headers = {"Idempotency-Key": "first-job"} if i == 1 else {}
            response = client.post("/jobs", json=body, headers=headers)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        replay = client.post("/jobs", json=bodies[1], headers={"Idempotency-Key": "first-job"})
        assert replay.json()["id"] == ids[1]
        assert client.post("/jobs", json=bodies[2], headers={"Idempotency-Key": "first-job"}).status_code == 409
        cancelled = client.post("/jobs", json=bodies[3]).json()["id"]
        assert client.post(f"/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
        assert metric(client, "packscore_queue_depth") == 20

        service.start_worker()
        service.wait_for_workers(1)
        jobs = wait_terminal(client, ids)
        for job_id, body in zip(ids, bodies):
            assert jobs[job_id]["status"] == "succeeded", jobs[job_id]
            assert_scores(jobs[job_id], body, reference)
        passes = metric(client, "packscore_passes_total")
        assert 1 <= passes < len(ids), f"{passes} passes for {len(ids)} jobs: not coalesced"
        assert client.get(f"/jobs/{cancelled}").json()["status"] == "cancelled"

        deadline = time.monotonic() + 30
        while not receiver.requests and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(receiver.requests) == 1
        headers, body = receiver.requests[0]
        event = Webhook(service.secret).verify(body, headers)
        assert event["type"] == "job.succeeded"
        assert event["data"]["id"] == ids[0] and event["data"]["metadata"] == bodies[0]["metadata"]
        assert event["data"]["scores"] == jobs[ids[0]]["scores"]
        deadline = time.monotonic() + 10
        while client.get(f"/jobs/{ids[0]}").json()["webhook"]["status"] != "delivered":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert client.get(f"/jobs/{ids[0]}").json()["webhook"]["id"] == headers["webhook-id"]


def test_sync_score(service: Service, reference: Scorer) -> None:
    body = {"query": "The capital of France is", "items": [" Paris", " London", ""], "label_token_ids": [1, 2, 3],
            "apply_softmax": True}
    with service.http() as client:
        response = client.post("/v1/score", json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["object"] == "scoring" and out["model"] == "tiny-random"
        assert out["usage"]["prompt_tokens"] > 0
        assert_scores(out, body, reference)
        assert client.post("/v1/score", json={**body, "model": "other"}).json()["error"]["code"] == "unknown_model"


def big_body(n: int, tag: str) -> dict:
    return {"query": f"Rank these candidates ({tag}):", "items": [f"candidate {i} of many" for i in range(n)],
            "label_token_ids": [11, 22], "return_logprobs": True}


def wait_running_with_progress(client: httpx.Client, job_id: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["status"] == "running" and 0 < job["progress"]["items_done"] < job["progress"]["items_total"]:
            return job
        assert job["status"] in ("queued", "running"), job
        time.sleep(0.05)
    raise AssertionError("the job never showed partial progress")


def test_cancel_running_job(service: Service) -> None:
    with service.http() as client:
        job_id = client.post("/jobs", json=big_body(2000, "cancel")).json()["id"]
        wait_running_with_progress(client, job_id)
        response = client.post(f"/jobs/{job_id}/cancel")
        assert response.status_code in (200, 202), response.text
        job = wait_terminal(client, [job_id])[job_id]
        assert job["status"] == "cancelled"
        assert job["progress"]["items_done"] < job["progress"]["items_total"]
        assert job["scores"] is None


def test_worker_killed_mid_job_completes_once(service: Service, reference: Scorer, webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    receiver = webhook_receiver
    with service.http() as client:
        body = {**big_body(2000, "kill"), "webhook_url": receiver.url}
        job_id = client.post("/jobs", json=body).json()["id"]
        wait_running_with_progress(client, job_id)
        victim = service.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        service.start_worker()  # the replacement's sweeper re-queues the job once its lease expires
        job = wait_terminal(client, [job_id], seconds=150)[job_id]
        assert job["status"] == "succeeded", job
        assert job["attempts"] == 2
        assert_scores(job, body, reference)
        expected = reference.logprobs(body["query"], body["items"], body["label_token_ids"])
        np.testing.assert_allclose(job["logprobs"], expected, atol=1e-4)

        deadline = time.monotonic() + 20
        while not receiver.requests and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        assert len(receiver.requests) == 1  # one terminal transition, one webhook
    engine = create_engine(service.env["DATABASE_URL"])
    with engine.connect() as conn:
        results = conn.execute(text("SELECT count(*) FROM job_results WHERE job_id = :id"), {"id": job_id})
        assert results.scalar() == 1
        deliveries = conn.execute(text("SELECT count(*) FROM webhook_deliveries WHERE job_id = :id"),
                                  {"id": job_id})
        assert deliveries.scalar() == 1
    engine.dispose()


def test_a_score_call_waiting_when_the_api_stops_answers_503_stopping(redis_url: str, run_id: str,  # type: ignore[no-untyped-def]
                                                                     database_factory, tmp_path) -> None:
    """No worker: the call waits; SIGTERM to `serve` answers it 503 `stopping` with its job id at once (not
    the 500 of a connection cut after the server's graceful timeout), and the job is there to poll."""
    from concurrent.futures import ThreadPoolExecutor

    with database_factory(f"packscore_stop_api_{run_id}") as url:
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:stop-api:"}
        with running_service(env, tmp_path) as service, service.http() as client, ThreadPoolExecutor(1) as pool:
            body = {"query": "Is this relevant?", "items": ["yes", "no"], "label_token_ids": [1, 2]}
            call = pool.submit(client.post, "/v1/score", json=body)
            deadline = time.monotonic() + 60
            while not client.get("/jobs").json()["data"]:
                assert time.monotonic() < deadline and not call.done(), "the call's job never appeared"
                time.sleep(0.1)
            stopped_at = time.monotonic()
            service.api.send_signal(signal.SIGTERM)
            answer = call.result(timeout=30)
            assert time.monotonic() - stopped_at < 4, "answered at the cut, not at the stop"
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "stopping" and answer.headers["Retry-After"]
            service.api.wait(timeout=30)
            service.start_api()
            assert client.get(f"/jobs/{error['job_id']}").json()["status"] == "queued"
