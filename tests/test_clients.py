"""The Python clients and the CLI against a running service (uvicorn + a Celery worker, PostgreSQL, Redis,
tiny-random): Client.rerank, AsyncClient (the same calls as coroutines, fanned out with asyncio.gather),
`packscore rerank` and `packscore backfill --format openai` with an OpenAI Batch file; AsyncClient's backoff."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from packscore.client import AsyncClient, Client, PackscoreError
from tests.load_runner import SCORE_RTOL
from tests.service_harness import Service, running_service
from tests.test_batches_openai import RERANK_BODY, SCORE_BODY, openai_line
from tests.test_cli_backfill import ScriptedServer, read_output, run, write_input
from tests.test_rerank_api import DOCUMENTS, TEXTS, check_results, expected_relevance
from worker.scorer import get_scorer


@pytest.fixture(scope="module")
def service(redis_url: str, run_id: str, database_factory, tmp_path_factory) -> Iterator[Service]:  # type: ignore[no-untyped-def]
    with database_factory(f"packscore_clients_{run_id}") as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:clients:"},
            tmp_path_factory.mktemp("clients-logs"), workers=1) as service:
        yield service


QUERY = "capital of France"


def test_client_rerank(service: Service) -> None:
    with Client(service.base_url, service.key) as client:
        out = client.rerank(QUERY, DOCUMENTS, top_n=2)
        check_results(out["results"], expected_relevance(QUERY, TEXTS), 2, documents=True)
        bare = client.rerank(QUERY, TEXTS, return_documents=False, instruction="Is it about Paris?")
        check_results(bare["results"], expected_relevance(QUERY, TEXTS, "Is it about Paris?"), None, documents=False)
        with pytest.raises(PackscoreError) as error:
            client.rerank(QUERY, DOCUMENTS, top_n=-1)
        assert error.value.status == 422 and error.value.code == "invalid_input"


def test_async_client(service: Service) -> None:
    relevance = expected_relevance(QUERY, TEXTS)
    scores = get_scorer().score(SCORE_BODY["query"], SCORE_BODY["items"], [5, 17], True)
    lines = [openai_line("s", "/v1/score", SCORE_BODY), openai_line("r", "/v1/rerank", RERANK_BODY)]
    # A key of this test's own: its batches are this test's only, whatever the other tests (in any order) made.
    key, _ = service.create_key("async-client")

    async def main() -> None:
        async with AsyncClient(service.base_url, key) as client:
            # Fanned out: the calls wait together, and their jobs are coalesced by the worker.
            reranked, scored, job = await asyncio.gather(
                client.rerank(QUERY, DOCUMENTS),
                client.score(SCORE_BODY["query"], SCORE_BODY["items"], [5, 17], apply_softmax=True),
                client.submit_job({"kind": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 1}))
            check_results(reranked["results"], relevance, None, documents=True)
            np.testing.assert_allclose(scored["scores"], scores, rtol=SCORE_RTOL, atol=0)
            job = await client.wait_job(job["id"], poll=0.1, timeout=60)
            assert job["kind"] == "rerank" and job["status"] == "succeeded"
            check_results(job["results"], relevance, 1, documents=True)
            with pytest.raises(PackscoreError) as error:
                await client.get_job("job_nonexistent")
            assert error.value.status == 404

            # A streamed upload of OpenAI Batch lines; results in both formats.
            batch = await client.create_batch(lambda: (json.dumps(line).encode() + b"\n" for line in lines))
            batch = await client.wait_batch(batch["id"], poll=0.1, timeout=60)
            assert batch["status"] == "completed" and batch["counts"]["succeeded"] == 2
            native = {line["custom_id"]: line async for line in client.iter_batch_results(batch["id"])}
            openai = {line["custom_id"]: line
                      async for line in client.iter_batch_results(batch["id"], format="openai")}
            np.testing.assert_allclose(native["s"]["scores"], scores, rtol=SCORE_RTOL, atol=0)
            check_results(native["r"]["results"], relevance, 3, documents=True)
            assert openai["s"]["response"]["status_code"] == 200 and openai["s"]["error"] is None
            np.testing.assert_allclose(openai["s"]["response"]["body"]["scores"], scores, rtol=SCORE_RTOL, atol=0)
            check_results(openai["r"]["response"]["body"]["results"], relevance, 3, documents=True)
            assert [b["id"] for b in (await client.list_batches())["data"]] == [batch["id"]]

    asyncio.run(main())


def test_cli_rerank(service: Service) -> None:
    relevance = expected_relevance(QUERY, TEXTS)
    args = ["rerank", "--query", QUERY, *(arg for text in TEXTS[:4] for arg in ("--document", text))]
    out, _ = run(service, *args)
    header, *rows = out.strip().splitlines()
    assert header.split() == ["rank", "index", "relevance", "document"]
    order = np.argsort(-relevance[:4], kind="stable")
    assert [int(row.split()[1]) for row in rows] == order.tolist()
    np.testing.assert_allclose([float(row.split()[2]) for row in rows], relevance[order], atol=1e-4)
    assert rows[0].split(None, 3)[3] == json.dumps(TEXTS[order[0]])
    out, _ = run(service, *args, "--top-n", "1", "--json")
    assert [r["index"] for r in json.loads(out)["results"]] == order[:1].tolist()


def test_backfill_openai_format(service: Service, tmp_path: Path) -> None:
    source, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    lines = [openai_line(f"s{i}", "/v1/score", {**SCORE_BODY, "query": f"Is it good, {i}?"}) for i in range(3)]
    lines += [openai_line("r", "/rerank", RERANK_BODY), openai_line("bad", "/v1/embeddings", {"input": "x"})]
    write_input(source, lines)
    run(service, "backfill", str(source), "--out", str(out), "--format", "openai", "--poll", "0.2")
    results = {line["custom_id"]: line for line in read_output(out)}
    assert sorted(results) == sorted(line["custom_id"] for line in lines)
    assert results["bad"]["response"]["status_code"] == 404
    assert results["bad"]["response"]["body"]["error"]["code"] == "unknown_url"
    for i in range(3):
        expected = get_scorer().score(f"Is it good, {i}?", SCORE_BODY["items"], [5, 17], True)
        body = results[f"s{i}"]["response"]["body"]
        np.testing.assert_allclose(body["scores"], expected, rtol=SCORE_RTOL, atol=0)
    check_results(results["r"]["response"]["body"]["results"], expected_relevance(QUERY, TEXTS), 3, documents=True)
    # Run again: everything is done, nothing is submitted or written twice.
    run(service, "backfill", str(source), "--out", str(out), "--format", "openai")
    assert len(read_output(out)) == len(lines)


def test_async_client_backs_off_on_503() -> None:
    server = ScriptedServer([(503, {"Retry-After": "0"}), (429, {"Retry-After": "0"})])
    retries: list[str] = []

    async def main() -> dict:
        async with AsyncClient(server.url, "psk_x", on_retry=retries.append) as client:
            return await client.create_batch(lambda: iter([b'{"custom_id": "a"}\n']))

    try:
        assert asyncio.run(main())["id"] == "batch_1"
        assert retries == ["HTTP 503; retrying in 0.0s", "HTTP 429; retrying in 0.0s"]
        assert server.bodies == [b'{"custom_id": "a"}\n'] * 3  # the streamed upload, sent again in full
    finally:
        server.close()


@contextmanager
def answering(answers: list[tuple[int, dict, dict[str, str]]], delay: float = 0.0) -> Iterator[tuple[str, list[str]]]:
    """A local server answering each POST, `delay` seconds after it came, with the next (status, JSON body, headers),
    the last again once they run out; yields its URL and the paths it was sent."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(self.path)
            status, body, headers = answers[min(len(seen), len(answers)) - 1]
            time.sleep(delay)
            payload = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {**headers, "content-length": str(len(payload))}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http.handle_error = lambda *args: None  # type: ignore[method-assign]  # a client that gave up closed its end
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", seen
    finally:
        http.shutdown()
        http.server_close()


def test_client_does_not_resend_on_worker_lost() -> None:
    # Workers kept dying on the job: sending the POST again makes another job, which kills them again.
    lost = {"error": {"code": "worker_lost", "message": "the worker running this job stopped", "job_id": "job_1"}}
    with answering([(503, lost, {"Retry-After": "0"})]) as (url, seen), Client(url, "psk_x") as client:
        with pytest.raises(PackscoreError) as failure:
            client.score("q", ["a"], [1])
        assert (failure.value.code, failure.value.body["error"]["job_id"]) == ("worker_lost", "job_1")
        assert seen == ["/v1/score"]
    # The database down or busy is worth another try, and so is a gateway's 503 with a JSON body of its own.
    busy = {"error": {"code": "unavailable", "message": "the database is busy; retry later"}}
    gateway = {"error": {"code": 503, "status": "UNAVAILABLE", "message": "upstream connect error"}}
    for answer in (busy, gateway):
        with answering([(503, answer, {"Retry-After": "0"}), (200, {"scores": [[0.5]]}, {})]) as (url, seen):
            with Client(url, "psk_x") as client:
                assert client.score("q", ["a"], [1]) == {"scores": [[0.5]]}
            assert seen == ["/v1/score"] * 2


def test_client_retry_after_kept_within_retry_seconds() -> None:
    server = ScriptedServer([(503, {"Retry-After": "120"})] * 9)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(min(seconds, 1.0))

    try:
        with Client(server.url, "psk_x", sleep=sleep, retry_seconds=0.5) as client:
            with pytest.raises(PackscoreError) as failure:
                client.get_batch("batch_1")
        # One wait, to the end of the half second, then the server's own error once none is left.
        assert len(slept) == 1 and 0 < slept[0] <= 0.5 and len(server.bodies) == 2
        assert (failure.value.status, failure.value.code, failure.value.message) == (503, "unavailable", "busy")
    finally:
        server.close()


def test_score_waits_for_the_service_answer() -> None:
    timed_out = {"error": {"code": "timeout", "message": "job job_1 did not finish within 1 s", "job_id": "job_1"}}
    # The service's 504 comes after the client's `timeout`, which score and rerank do not apply to their answer.
    with answering([(504, timed_out, {})], delay=1.0) as (url, seen):
        with Client(url, "psk_x", timeout=0.5) as client:
            with pytest.raises(PackscoreError) as failure:
                client.score("q", ["a"], [1])
            assert (failure.value.code, failure.value.body["error"]["job_id"]) == ("timeout", "job_1")

            async def rerank() -> dict:
                async with AsyncClient(url, "psk_x", timeout=0.5) as client:
                    return await client.rerank("q", ["a"])
            with pytest.raises(PackscoreError) as failure:
                asyncio.run(rerank())
            assert failure.value.code == "timeout"
            # No answer in time to a POST: not sent again, and not told as a service that cannot be reached.
            with pytest.raises(PackscoreError) as failure:
                client.submit_job({"query": "q", "items": ["a"], "label_token_ids": [1]})
            assert failure.value.code == "no_answer" and "within 0.5 s; the request may still have run" in str(
                failure.value)
        with Client(url, "psk_x", score_timeout=0.5) as client, pytest.raises(PackscoreError) as failure:
            client.score("q", ["a"], [1])
        assert failure.value.code == "no_answer" and failure.value.message.startswith("no answer to POST /v1/score")
        assert seen == ["/v1/score", "/v1/rerank", "/jobs", "/v1/score"]
    # Longer than the service's own answer takes, but not for ever: a service that took the call and hangs.
    from packscore.client import SCORE_READ_SECONDS

    with Client("http://127.0.0.1:9", "psk_x") as client:
        assert client._score_timeout().read == SCORE_READ_SECONDS < 3600
