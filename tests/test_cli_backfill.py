"""The CLI end to end against a running service (uvicorn + a Celery worker, PostgreSQL, Redis, tiny-random):
`score`, `submit --wait`, and `backfill` interrupted (SIGKILL) and resumed: each custom_id exactly once.
Also the client's backoff on 429/503 against a scripted HTTP server."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from core import Scorer
from packscore.backfill import UPLOAD_TIMEOUT, BackfillError, run_backfill
from packscore.client import Client, PackscoreError
from tests.service_harness import REPO, Service, running_service
from tests.load_runner import SCORE_RTOL


@pytest.fixture(scope="module")
def service(redis_url: str, run_id: str, database_factory, tmp_path_factory) -> Iterator[Service]:  # type: ignore[no-untyped-def]
    with database_factory(f"packscore_cli_{run_id}") as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:cli:", "BATCH_ROUND_TOKENS": "256"},
            tmp_path_factory.mktemp("cli-logs"), workers=1) as service:
        yield service


@pytest.fixture(scope="module")
def reference() -> Scorer:
    return Scorer.from_pretrained("tiny-random")


def cli(service: Service, *args: str) -> subprocess.Popen:
    env = {**service.env, "PACKSCORE_URL": service.base_url, "PACKSCORE_API_KEY": service.key}
    return subprocess.Popen([sys.executable, "-m", "packscore.cli", *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run(service: Service, *args: str, timeout: float = 120) -> tuple[str, str]:
    proc = cli(service, *args)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"packscore {' '.join(args)} exited {proc.returncode}\n{out}\n{err}"
    return out, err


def test_score_prints_a_table(service: Service, reference: Scorer) -> None:
    out, _ = run(service, "score", "--query", "The capital of France is", "--item", " Paris", "--item", " London",
                 "--labels", "5,17,300", "--softmax")
    header, *rows = out.strip().splitlines()
    assert header.split() == ["item", "label", "5", "label", "17", "label", "300"]
    expected = reference.score("The capital of France is", [" Paris", " London"], [5, 17, 300], True)
    for row, want in zip(rows, expected, strict=True):
        np.testing.assert_allclose([float(v) for v in row.split()[-3:]], want, rtol=1e-4)


def test_submit_waits_for_the_job(service: Service, reference: Scorer) -> None:
    out, _ = run(service, "submit", "--query", "Best answer?", "--item", "a", "--item", "b", "--labels", "1,2",
                 "--wait", "--poll", "0.1", "--metadata", '{"run": 3}')
    job = json.loads(out)
    assert job["status"] == "succeeded" and job["metadata"] == {"run": 3}
    np.testing.assert_allclose(job["scores"], reference.score("Best answer?", ["a", "b"], [1, 2]), rtol=1e-4)


def write_input(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_backfill_interrupted_and_resumed(service: Service, reference: Scorer, tmp_path: Path) -> None:
    requests = [{"custom_id": f"q{i // 8}-c{i % 8}", "query": f"Rank the answers to question {i // 8}.",
                 "items": [f"candidate {i}", f"other candidate {i % 5}"], "label_token_ids": [5, 17],
                 "apply_softmax": True} for i in range(2400)]
    requests[7]["label_token_ids"] = []  # a bad request: an error result, written once like the others
    source, out = tmp_path / "input.jsonl", tmp_path / "results.jsonl"
    write_input(source, requests)

    # Polled often: the first partial download comes after 10 polls, and it must come before the end.
    first = cli(service, "backfill", str(source), "--out", str(out), "--poll", "0.05")
    deadline = time.monotonic() + 120
    while not (out.exists() and out.stat().st_size > 0):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "no results were written"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # no chance to clean up: a torn line or a stale state file may be left
    first.wait()
    written = len(read_output(out)) if out.read_text().endswith("\n") else None
    assert written is None or written < len(requests), "the backfill finished before it was interrupted"
    with out.open("ab") as f:
        f.write(b'{"custom_id": "q0-c0", "scor')  # as if killed mid-write

    _, err = run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2", timeout=300)
    assert "resuming batch" in err  # the batch in flight is followed, not submitted again
    assert "requests" in err and "/s" in err and "ETA" in err
    assert not Path(f"{out}.batch").exists()

    lines = read_output(out)
    ids = [line["custom_id"] for line in lines]
    assert sorted(ids) == sorted(r["custom_id"] for r in requests), "each custom_id exactly once"
    by_id = {line["custom_id"]: line for line in lines}
    assert by_id["q0-c7"]["error"]["code"] == "empty_label_token_ids"
    for request in requests[8:2400:197]:
        expected = reference.score(request["query"], request["items"], request["label_token_ids"], True)
        np.testing.assert_allclose(by_id[request["custom_id"]]["scores"], expected, rtol=SCORE_RTOL, atol=0)
    with Client(service.base_url, service.key) as client:
        assert len(client.list_batches()["data"]) == 1

    # Requests added to the input later: only they are submitted.
    extra = [{**requests[0], "custom_id": f"late-{i}"} for i in range(5)]
    write_input(source, requests + extra)
    run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2")
    ids = [line["custom_id"] for line in read_output(out)]
    assert len(ids) == len(set(ids)) == len(requests) + len(extra)
    with Client(service.base_url, service.key) as client:
        batches = client.list_batches()["data"]
        assert len(batches) == 2 and batches[0]["counts"]["total"] == len(extra)


def test_backfill_keys_a_repeated_custom_id_by_its_line(service: Service, tmp_path: Path) -> None:
    # As POST /batches does: the repeat is an error result, and it does not take the first line's custom_id.
    source, out = tmp_path / "input.jsonl", tmp_path / "out.jsonl"
    write_input(source, [{"custom_id": "a", "query": "q", "items": ["x"], "label_token_ids": [1]}] * 2)
    run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2")
    lines = {line["custom_id"]: line for line in read_output(out)}
    assert sorted(lines) == ["a", "line-2"] and lines["line-2"]["error"]["code"] == "duplicate_custom_id"
    assert lines["a"]["scores"] is not None


class ScriptedServer:
    """Answers each request with the next scripted (status, headers) and records the bodies it got."""

    def __init__(self, script: list[tuple[int, dict[str, str]]]) -> None:
        server = self
        self.script = script
        self.bodies: list[bytes] = []
        self.delay = 0.0  # seconds before each answer

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if self.headers.get("transfer-encoding") == "chunked":
                    body = b""
                    while size := int(self.rfile.readline().strip(), 16):
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                else:
                    body = self.rfile.read(int(self.headers.get("content-length", 0)))
                server.bodies.append(body)
                time.sleep(server.delay)
                status, headers = server.script.pop(0) if server.script else (200, {})
                payload = json.dumps({"id": "batch_1", "status": "in_progress"} if status < 400 else
                                     {"error": {"code": "unavailable", "message": "busy"}}).encode()
                self.send_response(status)
                for name, value in {**headers, "content-length": str(len(payload))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_client_backs_off_on_429_and_503() -> None:
    server = ScriptedServer([(503, {"Retry-After": "0.3"}), (429, {"Retry-After": "0"}), (429, {})])
    slept: list[float] = []
    try:
        with Client(server.url, "psk_x", sleep=slept.append) as client:
            chunks = [b'{"custom_id": "a"}\n', b'{"custom_id": "b"}\n']
            assert client.create_batch(lambda: iter(chunks))["id"] == "batch_1"
            assert slept[:2] == [0.3, 0.0] and slept[2] > 0  # Retry-After honoured, else exponential backoff
            # The streamed upload is sent again in full on each attempt.
            assert server.bodies == [b"".join(chunks)] * 4
        server.script = [(503, {"Retry-After": "0"})] * 3
        with Client(server.url, "psk_x", sleep=slept.append, max_retries=2) as client:
            with pytest.raises(PackscoreError) as failure:
                client.get_batch("batch_1")
            assert failure.value.status == 503 and failure.value.code == "unavailable"
    finally:
        server.close()


def test_a_batch_upload_waits_for_its_answer_past_the_read_timeout() -> None:
    """The service answers an upload once it has ingested all of it (100,000 lines: over a minute); a read
    timeout before that left a batch on the server that the backfill did not know of, and its re-run uploaded a
    second copy."""
    server = ScriptedServer([])
    server.delay = 1.0
    try:
        with Client(server.url, "psk_x", timeout=0.3, max_retries=0) as client:
            batch = client.create_batch(lambda: iter([b'{"custom_id": "a"}\n']), timeout=UPLOAD_TIMEOUT)
            assert batch["id"] == "batch_1"
    finally:
        server.close()


def test_backfill_follows_the_batch_of_an_upload_whose_answer_was_lost(service: Service, tmp_path: Path) -> None:
    """The batch is made though its answer never came (the client gave up, the connection broke): the re-run
    finds it by the token the state file kept, and does not score everything twice."""
    uploads: list[dict] = []

    class AnswerLost(Client):
        def create_batch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            uploads.append(kwargs)
            super().create_batch(*args, **kwargs)
            raise httpx.ReadError("the connection broke before the answer")

    requests = [{"custom_id": f"r{i}", "query": "Pick one.", "items": ["a", "b"], "label_token_ids": [5, 17]}
                for i in range(20)]
    source, out = tmp_path / "input.jsonl", tmp_path / "results.jsonl"
    write_input(source, requests)
    with Client(service.base_url, service.key) as client:
        before = len(client.list_batches(limit=100)["data"])
    with AnswerLost(service.base_url, service.key) as lost, pytest.raises(BackfillError, match="run the same command"):
        run_backfill(lost, source, out, poll=0.1, stderr=io.StringIO())
    assert uploads[0]["timeout"].read == 3600.0  # the answer is waited for as long as the service gives an upload
    _, err = run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2")
    assert "resuming batch" in err, err
    assert sorted(line["custom_id"] for line in read_output(out)) == sorted(r["custom_id"] for r in requests)
    with Client(service.base_url, service.key) as client:
        assert len(client.list_batches(limit=100)["data"]) == before + 1, "uploaded once"


def failed(service: Service, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    """A command that must fail: its exit status and stderr, which must be one line and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "packscore.cli", *args], cwd=REPO, text=True, capture_output=True,
                          timeout=timeout, env={**service.env, "PACKSCORE_URL": service.base_url, **(env or {})})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    # Besides the retry notes, one line.
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "retrying in" not in line]
    assert len(lines) == 1 or proc.returncode == 2, proc.stderr
    return proc.returncode, proc.stderr


def test_commands_report_errors_in_one_line(service: Service, tmp_path: Path) -> None:
    request = ["--query", "Best answer?", "--item", "a", "--labels", "1,2"]
    home = {"PACKSCORE_HOME": str(tmp_path / "nowhere")}  # no key file to find
    for command in ("score", "submit"):
        status, err = failed(service, command, *request, env=home)
        assert status == 1 and "401 unauthorized" in err and "--api-key" in err and "PACKSCORE_API_KEY" in err, err
    status, err = failed(service, "rerank", "--query", "q", "--document", "d", "--api-key", "psk_wrong")
    assert status == 1 and "401 unauthorized: invalid API key (key from --api-key)" in err, err
    status, err = failed(service, "score", "--query", "q", "--item", "a", "--labels", "1000000000",
                         "--api-key", service.key)
    assert status == 1 and "400 label_token_id_out_of_range" in err, err
    status, err = failed(service, "score", "--query", "q", "--item", "a", "--labels", "yes", "--api-key", service.key)
    assert status == 2 and "--labels: 'yes' is not a comma-separated list of token ids" in err, err


def test_an_unreachable_service_is_named_and_given_up_on(service: Service) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    started = time.monotonic()
    status, err = failed(service, "score", "--url", url, "--query", "q", "--item", "a", "--labels", "1",
                         "--api-key", "k", "--retry-seconds", "3")
    assert status == 1 and f"cannot reach {url}" in err and "gave up after 3 s" in err, err
    assert time.monotonic() - started < 20


def test_backfill_bad_lines_become_error_results(service: Service, reference: Scorer, tmp_path: Path) -> None:
    good = {"query": "Pick one.", "items": ["a", "b"], "label_token_ids": [5, 17]}
    file_lines = [
        json.dumps({**good, "custom_id": "first"}),                  # 1
        "",                                                           # 2: blank, skipped
        "this is not json",                                           # 3
        json.dumps(good),                                             # 4: no custom_id -> "line-4"
        json.dumps({**good, "custom_id": "first"}),                  # 5: repeats line 1
        json.dumps({**good, "custom_id": "empty", "label_token_ids": []}),  # 6: the service refuses it
        json.dumps({**good, "custom_id": 7}),                         # 7: not a string
        json.dumps({**good, "custom_id": "last"}),                   # 8
    ]
    source, out = tmp_path / "input.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(file_lines) + "\n")
    _, err = run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2", timeout=300)
    # The bar counts what the output will hold, the lines refused here included: it ends where it says.
    assert "/7 requests" in err and "/3 requests" not in err and "done: 7 results" in err, err
    by_id = {line["custom_id"]: line for line in read_output(out)}
    assert len(by_id) == len(read_output(out)) == 7, read_output(out)  # one result per non-blank line, ids unique
    errors = {custom_id: line["error"] for custom_id, line in by_id.items() if line.get("error")}
    assert {k: v["code"] for k, v in errors.items()} == {
        "line-3": "invalid_json", "line-5": "duplicate_custom_id", "empty": "empty_label_token_ids",
        "line-7": "invalid_input"}
    for custom_id, number in (("line-3", 3), ("line-5", 5), ("empty", 6), ("line-7", 7)):
        assert errors[custom_id]["message"].startswith(f"line {number}: "), errors[custom_id]
    assert "already used on line 1" in errors["line-5"]["message"]
    expected = reference.score(good["query"], good["items"], good["label_token_ids"])
    for custom_id in ("first", "line-4", "last"):
        np.testing.assert_allclose(by_id[custom_id]["scores"], expected, rtol=SCORE_RTOL, atol=0)
    # Run again: everything is done, nothing is written twice.
    run(service, "backfill", str(source), "--out", str(out), "--poll", "0.2")
    assert len(read_output(out)) == 7


@pytest.mark.parametrize("status, failed, code", [("completed", 0, 0), ("completed", 2, 1), ("failed", 0, 1)])
def test_a_reference_backfill_exits_1_where_a_chunk_failed(monkeypatch, status: str, failed: int,  # type: ignore[no-untyped-def]
                                                         code: int) -> None:
    """A chunk that failed is whole objects unscored (missing, corrupt): the batch still completes, and a
    script running the command must see it."""
    import packscore.backfill
    from packscore import cli

    monkeypatch.setattr(packscore.backfill, "run_reference_backfill",
                        lambda *args, **kwargs: {"status": status, "chunks": {"failed": failed}})
    monkeypatch.setenv("PACKSCORE_URL", "http://127.0.0.1:9")
    with pytest.raises(SystemExit) as ended:
        cli.main(["backfill", "s3://bucket/pairs/", "--out", "s3://bucket/scores/", "--query-column", "q",
                  "--item-column", "doc"])
        raise SystemExit(0)
    assert ended.value.code == code


@pytest.mark.parametrize("status, failed, code", [("completed", 0, 0), ("completed", 1, 1), ("failed", 0, 1)])
def test_a_jsonl_file_run_as_a_reference_batch_exits_1_where_a_chunk_failed(monkeypatch, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                             status: str, failed: int,
                                                                             code: int) -> None:
    """A JSONL file over the upload limit runs as a reference batch: a failed chunk there is requests with no
    result line, and it exited 0 ("completed: 0 rows (0 errors, 1 chunks failed)")."""
    import packscore.backfill
    from packscore import cli

    source = tmp_path / "big.jsonl"
    write_input(source, [{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}])
    monkeypatch.setattr(packscore.backfill, "UPLOAD_MAX_BYTES", 10)
    monkeypatch.setattr(packscore.backfill, "run_reference_backfill",
                        lambda *args, **kwargs: {"id": "batch_1", "status": status, "chunks": {"failed": failed}})
    monkeypatch.setattr(Client, "iter_batch_results", lambda *args, **kwargs: iter([]))
    monkeypatch.setenv("PACKSCORE_URL", "http://127.0.0.1:9")
    with pytest.raises(SystemExit) as ended:
        cli.main(["backfill", str(source), "--out", str(tmp_path / "out.jsonl"), "--api-key", "psk_x"])
        raise SystemExit(0)
    assert ended.value.code == code
