"""The API under a burst of synchronous calls and when its database is short of connections (issue 12, items 1
to 3): waiting /v1/score calls hold no thread and no connection and share one poll; an exhausted pool is a
503 with Retry-After. (README's error table against the code: tests/test_readme.py.)"""

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine, event, select, text, update
from sqlalchemy.orm import sessionmaker

from api.deps import get_api_settings, get_db
from api.main import create_app
from store.db import get_engine, session_scope
from store.models import Job
from store.settings import Settings, get_settings
from tests.service_harness import free_port
from tests.test_readme import documented_errors

BODY = {"query": "Is it true?", "items": ["yes", "no", "maybe", "never", "always"], "label_token_ids": [1, 2]}


class InProcessServer:
    """The app under a real uvicorn on a free port, in a thread of this process, so a test can count the
    statements the API sends to the database."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_waiting_score_calls_hold_no_thread_and_share_one_poll(database: str, make_key) -> None:  # type: ignore[no-untyped-def]
    """64 concurrent /v1/score calls with no worker running: each waits its SCORE_TIMEOUT_SECONDS and gets 504
    with its job id; meanwhile /healthz answers at once and the API sends a handful of statements, not a poll
    per waiting call."""
    key, _ = make_key()
    app = create_app()
    app.dependency_overrides[get_api_settings] = lambda: Settings(score_timeout_seconds=4)
    statements: list[float] = []

    def count(_conn, _cursor, statement, *_: object) -> None:  # type: ignore[no-untyped-def]
        statements.append((time.monotonic(), statement[:60]))

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", count)
    try:
        with InProcessServer(app) as base, ThreadPoolExecutor(64) as pool:
            def call(i: int) -> httpx.Response:
                return httpx.post(f"{base}/v1/score", json={**BODY, "query": f"Question {i}?"},
                                  headers={"Authorization": f"Bearer {key}"}, timeout=30)

            futures = [pool.submit(call, i) for i in range(64)]
            _wait_for_queued(database, [f"Question {i}?" for i in range(64)])  # every call waits now
            window_start = time.monotonic()
            health = []
            for _ in range(5):
                t = time.monotonic()
                assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
                health.append(time.monotonic() - t)
                time.sleep(0.2)
            window = time.monotonic() - window_start
            in_window = [s for t, s in statements if window_start <= t <= window_start + window]
            checked_out = engine.pool.checkedout()
            responses = [f.result() for f in futures]
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert [r.status_code for r in responses] == [504] * 64, {r.status_code: r.text for r in responses}
    job_ids = {r.json()["error"]["job_id"] for r in responses}
    assert len(job_ids) == 64
    assert all("not started yet: 5 items" in r.json()["error"]["message"] for r in responses), responses[0].text
    assert max(health) < 1.0, health
    # One poll a second for all 64 calls (Postgres notifies), where a poll per call made about 1,000 a second.
    assert len(in_window) <= 5 * window, f"{len(in_window)} statements in {window:.1f} s, e.g. {in_window[:3]}"
    assert checked_out <= 2, f"{checked_out} connections held by waiting calls"


def _wait_for_queued(database_url: str, queries: list[str], seconds: float = 20) -> None:
    """Through an engine of its own, so the counted statements are the API's only."""
    engine = create_engine(database_url)
    deadline = time.monotonic() + seconds
    try:
        while True:
            with engine.connect() as conn:
                found = {r["query"] for (r,) in conn.execute(select(Job.request).where(Job.status == "queued"))}
            if found >= set(queries):
                return
            assert time.monotonic() < deadline, f"{len(set(queries) - found)} jobs were not created in time"
            time.sleep(0.1)
    finally:
        engine.dispose()


def test_score_wakes_on_finish(client, make_key) -> None:  # type: ignore[no-untyped-def]
    """A waiting call answers as soon as its job ends, through the notification, not after a poll period."""
    key, _ = make_key()
    body = {**BODY, "query": "Wake me up?"}
    result: dict = {}

    def call() -> None:
        result["response"] = client.post("/v1/score", json=body, headers={"Authorization": f"Bearer {key}"})
        result["at"] = time.monotonic()

    thread = threading.Thread(target=call)
    thread.start()
    job_id = _queued_job(body["query"])
    time.sleep(0.5)
    ended = time.monotonic()
    _end_job(job_id, "cancelled")
    thread.join(timeout=30)
    assert result["response"].status_code == 409
    assert result["response"].json()["error"] == {"code": "cancelled", "message": f"job {job_id} was cancelled",
                                                  "job_id": job_id}
    assert result["at"] - ended < 0.5


def test_a_call_its_job_outlasts_says_how_far_it_got_and_where_large_requests_go(make_key) -> None:  # type: ignore[no-untyped-def]
    """The 504 of /v1/score: the job's progress as the waiters' poll saw it (no query of its own), the time the
    rest takes at its pace so far, and POST /jobs for requests this large; GET /jobs/{id} has the same ETA."""
    from datetime import timedelta

    from fastapi.testclient import TestClient

    from store.models import utcnow

    key, _ = make_key()
    headers = {"Authorization": f"Bearer {key}"}
    app = create_app()
    app.dependency_overrides[get_api_settings] = lambda: Settings(score_timeout_seconds=3)
    body = {**BODY, "query": "How long will it take?"}
    result: dict = {}
    with TestClient(app) as client:
        thread = threading.Thread(target=lambda: result.setdefault(
            "response", client.post("/v1/score", json=body, headers=headers)))
        thread.start()
        job_id = _queued_job(body["query"])
        started = utcnow() - timedelta(seconds=10)
        with session_scope() as session:  # the test plays a worker 10 s into the job, 1 of its 5 items done
            session.execute(update(Job).where(Job.id == job_id).values(status="running", items_done=1,
                                                                        started_at=started))
        thread.join(timeout=30)
        response = result["response"]
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert (error["code"], error["job_id"], error["items_done"], error["items_total"]) == ("timeout", job_id, 1, 5)
        # 4 items left at the pace of the first: 4 x the seconds since the job started, when the 504 was made
        # (rounded to 0.1 s)
        assert 40 <= error["eta_seconds"] <= 4 * (utcnow() - started).total_seconds() + 0.1, error
        assert f"1 of 5 items scored, about {error['eta_seconds']:.0f} s to go" in error["message"], error
        assert "POST /jobs" in error["message"] and f"GET /jobs/{job_id}" in error["message"]
        before = (utcnow() - started).total_seconds()
        job = client.get(f"/jobs/{job_id}", headers=headers).json()
        after = (utcnow() - started).total_seconds()
        assert job["status"] == "running" and 4 * before - 0.1 <= job["eta_seconds"] <= 4 * after + 0.1, job


def _queued_job(query: str, seconds: float = 10) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with session_scope() as session:
            for job_id, request in session.execute(select(Job.id, Job.request).where(Job.status == "queued")):
                if request["query"] == query:
                    return job_id
        time.sleep(0.05)
    raise AssertionError(f"no queued job for {query!r}")


def _end_job(job_id: str, status: str, code: str | None = None) -> None:
    """What a worker or the sweeper does when a job ends (the test plays the worker)."""
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=status, error_code=code,
                                                                  error_message=f"test: {code}"))


@pytest.mark.parametrize("code, status", [("worker_lost", 503), ("internal_error", 500),
                                          ("too_many_items", 400)])
def test_score_maps_job_errors_to_documented_statuses(client, make_key, code: str, status: int) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = {**BODY, "query": f"Will it fail with {code}?"}
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "response", client.post("/v1/score", json=body, headers={"Authorization": f"Bearer {key}"})))
    thread.start()
    job_id = _queued_job(body["query"])
    _end_job(job_id, "failed", code)
    thread.join(timeout=30)
    response = result["response"]
    assert response.status_code == status, response.text
    assert response.json()["error"] == {"code": code, "message": f"test: {code}", "job_id": job_id}
    if status == 503:
        assert response.headers["Retry-After"] == str(get_settings().retry_after_seconds)
    assert (status, code) in documented_errors()


def test_exhausted_pool_is_503_with_retry_after(client, make_key, database: str) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    tiny = create_engine(database, pool_size=1, max_overflow=0, pool_timeout=0.2)
    sessions = sessionmaker(tiny, expire_on_commit=False)

    def db():  # type: ignore[no-untyped-def]
        with sessions() as session:
            yield session

    client.app.dependency_overrides[get_db] = db
    held = tiny.connect()  # every connection of the pool is in use
    try:
        response = client.get("/jobs", headers={"Authorization": f"Bearer {key}"})
    finally:
        held.close()
        client.app.dependency_overrides.pop(get_db)
        tiny.dispose()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "unavailable"
    assert response.headers["Retry-After"] == str(get_settings().retry_after_seconds)


# -- batch uploads (items 7 and 8) --------------------------------------------------------------------------------

def test_upload_that_dies_on_a_database_error_ends_failed(client, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy.exc import OperationalError

    from store import batches

    key, _ = make_key()

    def database_gone(self, lines) -> None:  # type: ignore[no-untyped-def]
        raise OperationalError("INSERT INTO jobs ...", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(batches.Ingest, "add_lines", database_gone)
    body = json.dumps({"custom_id": "a", **BODY}).encode()
    response = client.post("/batches", content=body, headers={"Authorization": f"Bearer {key}",
                                                              "content-type": "application/jsonl"})
    monkeypatch.undo()
    assert response.status_code == 503, response.text
    listed = client.get("/batches", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [(b["status"], b["error"]["code"]) for b in listed] == [("failed", "upload_failed")]
    assert "OperationalError" in listed[0]["error"]["message"]


def test_sweeper_fails_an_upload_abandoned_by_its_api(client, make_key) -> None:  # type: ignore[no-untyped-def]
    """The API process died mid-upload: nothing but the sweeper can end the batch, which must not stay
    `validating` (and uncancellable) for ever."""
    from datetime import timedelta

    from store import sweeper
    from store.models import Batch, utcnow

    key, _ = make_key()
    settings = get_settings()
    with session_scope() as session:
        key_id = _key_id(session, key)
        old = Batch(api_key_id=key_id, model="tiny-random",
                    created_at=utcnow() - timedelta(seconds=settings.batch_upload_timeout_seconds + 5))
        fresh = Batch(api_key_id=key_id, model="tiny-random")
        session.add_all([old, fresh])
        session.flush()
        old_id, fresh_id = old.id, fresh.id
    headers = {"Authorization": f"Bearer {key}"}
    assert client.post(f"/batches/{old_id}/cancel", headers=headers).json()["error"]["code"] == "batch_validating"
    sweeper.sweep(settings)
    old_out = client.get(f"/batches/{old_id}", headers=headers).json()
    assert (old_out["status"], old_out["error"]["code"]) == ("failed", "upload_timeout")
    assert client.get(f"/batches/{fresh_id}", headers=headers).json()["status"] == "validating"
    assert (408, "upload_timeout") in documented_errors()


def _key_id(session, key: str) -> str:  # type: ignore[no-untyped-def]
    from api.auth import find_api_key

    return find_api_key(session, key).id


def _split_seconds(line_bytes: int, chunk: int = 4096) -> float:
    """Best of three: seconds to split one line of `line_bytes` that arrives in `chunk`-byte pieces."""
    from store import batches

    settings = Settings(max_body_bytes=64 << 20, batch_max_bytes=128 << 20)
    data = b"x" * line_bytes + b"\n"
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)]

    async def stream():  # type: ignore[no-untyped-def]
        for piece in pieces:
            yield piece

    async def split() -> list:  # type: ignore[type-arg]
        return [lines async for lines in batches.jsonl_lines(stream(), settings)]

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = asyncio.run(split())
        best = min(best, time.perf_counter() - start)
    assert out == [[data[:-1]]]
    return best


@pytest.mark.alone  # a wall-time bound: nothing runs beside it (Makefile: test)
def test_line_splitting_is_linear() -> None:
    """8x the bytes takes about 8x the time (it took 64x when every chunk copied the growing line)."""
    small, large = _split_seconds(1 << 20), _split_seconds(8 << 20)
    assert large / small < 24, f"1 MiB: {small * 1000:.1f} ms, 8 MiB: {large * 1000:.1f} ms"


@pytest.mark.alone  # a wall-time bound: nothing runs beside it (Makefile: test)
def test_large_upload_does_not_block_the_event_loop(database: str, make_key) -> None:  # type: ignore[no-untyped-def]
    """A 24 MiB line (not JSON: an error line of its own) streams in while /healthz is asked: the API keeps
    answering."""
    key, _ = make_key()
    app = create_app()
    app.dependency_overrides[get_api_settings] = lambda: Settings(max_body_bytes=64 << 20, batch_max_bytes=128 << 20)
    line = b"x" * (24 << 20) + b"\n" + json.dumps({"custom_id": "small", **BODY}).encode()
    with InProcessServer(app) as base:
        done = threading.Event()
        result: dict = {}

        def upload() -> None:
            result["response"] = httpx.post(f"{base}/batches", content=line, timeout=120,
                                            headers={"Authorization": f"Bearer {key}",
                                                     "content-type": "application/jsonl"})
            done.set()

        threading.Thread(target=upload).start()
        slowest = 0.0
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{base}/healthz", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
    assert result["response"].status_code == 201, result["response"].text
    assert slowest < 1.0, f"/healthz took {slowest:.2f} s during the upload"


def test_an_upload_that_stalls_holds_no_transaction_open(database: str, make_key) -> None:  # type: ignore[no-untyped-def]
    """An upload's requests were written a chunk at a time as its lines came, in one transaction committed at
    its end: a client that sent some lines and then stalled held that transaction open (on SQLite the one write
    lock: every other write of every key failed; on PostgreSQL a pooled connection each). Now the upload is
    received whole first."""
    key, _ = make_key()
    app = create_app()
    app.dependency_overrides[get_api_settings] = lambda: Settings(batch_chunk_rows=2)
    stalled, go_on = threading.Event(), threading.Event()

    def body():  # type: ignore[no-untyped-def]
        for i in range(6):
            yield (json.dumps({"custom_id": f"line-{i}", **BODY}) + "\n").encode()
        stalled.set()
        go_on.wait(30)
        yield json.dumps({"custom_id": "line-6", **BODY}).encode()

    in_transaction = text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                          "AND state LIKE 'idle in transaction%'")
    with InProcessServer(app) as base:
        result: dict = {}
        uploading = threading.Thread(target=lambda: result.update(response=httpx.post(
            f"{base}/batches", content=body(), timeout=60,
            headers={"Authorization": f"Bearer {key}", "content-type": "application/jsonl"})))
        uploading.start()
        assert stalled.wait(30)
        time.sleep(1.0)  # the server has read the six lines
        with session_scope() as session:
            held = session.scalar(in_transaction)
        go_on.set()
        uploading.join(60)
    assert held == 0, f"{held} transaction(s) held open while the upload stalled"
    assert result["response"].status_code == 201, result["response"].text
    assert result["response"].json()["counts"]["total"] == 7


def test_authentication_gives_its_connection_back(make_key) -> None:  # type: ignore[no-untyped-def]
    """The key lookup (on a cache miss) runs in a thread of its own, before the route's, and gives its connection
    back at once: holding it until the route's step let a burst of 256 calls hold every pooled connection while
    the threads that could use them waited for one."""
    from api.deps import _read_api_key

    key, _ = make_key()
    pool = get_engine().pool
    held = pool.checkedout()
    assert _read_api_key(key).name == "test"
    assert pool.checkedout() == held


def test_pool_replaces_connections_a_database_restart_killed(database, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A pooled connection idle past PING_IDLE_SECONDS is pinged at checkout and replaced if its server process
    is gone (a database restart), so its request does not fail. One used more recently is not pinged (no round
    trip per request): its statement fails once, and that disconnect replaces the pool's connections."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from store import db

    engine = get_engine(f"{database}?application_name=ping_test")  # a pool of its own
    killer = create_engine(database)

    def kill_pooled_connection() -> int:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with killer.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
        return pid

    def backend_pid() -> int:
        with engine.connect() as conn:
            return conn.execute(text("SELECT pg_backend_pid()")).scalar_one()

    try:
        monkeypatch.setattr(db, "PING_IDLE_SECONDS", 0.0)
        killed = kill_pooled_connection()
        assert backend_pid() != killed
        monkeypatch.setattr(db, "PING_IDLE_SECONDS", 60.0)
        killed = kill_pooled_connection()
        with pytest.raises(OperationalError):
            backend_pid()
        assert backend_pid() != killed
    finally:
        engine.dispose()
        killer.dispose()


def test_light_traffic_after_a_burst_keeps_to_the_connection_used_last(database) -> None:  # type: ignore[no-untyped-def]
    """The pool hands out the connection checked in last (LIFO): after a burst opened several, one request at a
    time reuses one of them, not each in turn, so only its caches fill (issue 47: a worker's SQLite page caches
    grew 1.5 MB every 10 minutes as its pooled connections came round) and it is never idle long enough to be pinged."""
    from sqlalchemy import text

    engine = get_engine(f"{database}?application_name=lifo_test")  # a pool of its own
    try:
        burst = [engine.connect() for _ in range(6)]
        for conn in burst:
            conn.close()
        assert engine.pool.checkedin() == 6
        backends = set()
        for _ in range(5):
            with engine.connect() as conn:
                backends.add(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        assert len(backends) == 1, backends
    finally:
        engine.dispose()


MALFORMED_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo-Colon-Here\r\n\r\n",
    b"GET /a\x00b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
]


def test_malformed_http_is_400(database: str) -> None:
    """The API runs uvicorn's C parser (httptools, pinned in pyproject.toml: uvicorn falls back to the pure-Python
    h11 without a word when it is missing), and a request it cannot parse gets a 400, as under h11."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    server = InProcessServer(create_app())
    with server as base:
        # The same "auto" choice as `packscore serve` (uvicorn.run with its defaults).
        assert server.server.config.http_protocol_class is HttpToolsProtocol
        host, port = base.removeprefix("http://").split(":")
        for raw in MALFORMED_REQUESTS:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(raw)
                assert sock.recv(65536).startswith(b"HTTP/1.1 400 "), raw
