"""`packscore serve --embedded` (what `make run` starts): SQLite, a filesystem broker and a worker child,
no Postgres or Redis involved."""

import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from core import Scorer
from tests.load_runner import SCORE_RTOL
from tests.service_harness import free_port, wait_ready
from benchmarks.latency import EmbeddedService


def running_jobs(folder: Path) -> list[str]:
    with sqlite3.connect(folder / ".packscore" / "packscore.db") as db:
        return [row[0] for row in db.execute("SELECT id FROM jobs WHERE status = 'running'")]


# Ctrl-C, and what `kill` and process managers send.
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_embedded_service_scores(tmp_path: Path, stop: signal.Signals) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "BROKER_URL", "BROKER_DIR")}
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    # As `make run &` from a script starts it: SIGINT ignored (a background job's lot), in a process group of its
    # own here so that the whole group can be sent the signal, as Ctrl-C in a terminal does.
    # (A shell sets SIGINT ignored and execs the service: no preexec_fn, which forks a multithreaded JAX process.)
    proc = subprocess.Popen(["bash", "-c", 'trap "" INT; exec "$0" -m packscore.cli serve --embedded --port "$1"',
                             sys.executable, str(port)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, (tmp_path / "serve.log"), 120)
        assert (tmp_path / ".packscore" / "packscore.db").exists()
        key = (tmp_path / ".packscore" / "api_key").read_text().split()[0]
        body = {"query": "Is the sky blue?", "items": ["yes", "no"], "label_token_ids": [1, 2], "apply_softmax": True}
        response = httpx.post(f"{base}/v1/score", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert response.status_code == 200, response.text
        expected = Scorer.from_pretrained("tiny-random").score(**body)
        np.testing.assert_allclose(response.json()["scores"], expected, rtol=SCORE_RTOL, atol=0)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".packscore", "serve.log"]  # nothing else left here
        # Work in flight when the signal comes: the worker must finish its pass, hand the rest back and exit.
        many = {**body, "items": [f"candidate {i} " * 20 for i in range(300)]}
        for _ in range(20):
            assert httpx.post(f"{base}/jobs", json=many, headers={"Authorization": f"Bearer {key}"},
                              timeout=60).status_code == 202
        deadline = time.monotonic() + 60
        while not running_jobs(tmp_path):
            assert time.monotonic() < deadline, "no job started"
            time.sleep(0.1)
        # And a /v1/score call waiting for its job when the signal comes: uvicorn waited for it to end (its
        # SCORE_TIMEOUT_SECONDS, a minute) before stopping.
        longer = {**many, "items": many["items"] * 2}  # passes for seconds: still waiting at the signal
        waiting = threading.Thread(target=_answer_or_none, args=(f"{base}/v1/score", longer, key), daemon=True)
        waiting.start()
        time.sleep(0.5)
    finally:
        signalled = time.monotonic()
        if stop == signal.SIGINT:
            os.killpg(proc.pid, stop)  # Ctrl-C: the server and its worker both get it
        else:
            proc.send_signal(stop)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    logged = (tmp_path / "serve.log").read_text(errors="replace")
    assert time.monotonic() - signalled < 10, logged[-3000:]
    # The worker's warm stop runs beside the API's; the API answers the waiting call 503 `stopping` at once, so it
    # needs no cut of a connection still open.
    assert "Warm shutdown" in logged and "timeout graceful shutdown exceeded" not in logged, logged[-3000:]
    assert proc.returncode == 0, logged[-3000:]  # a stop asked for ends cleanly: no "Error 130" from `make run`
    assert not running_jobs(tmp_path), "a clean stop left jobs running"
    # Quiet: the readiness polls (wait_ready's, every 0.5 s) leave no access-log line, the requests do; nor does
    # Celery warn about root (these tests run as root in the project's containers).
    assert '"POST /v1/score HTTP/1.1" 200' in logged and '"POST /jobs HTTP/1.1" 202' in logged, logged[-3000:]
    assert "GET /readyz" not in logged and "superuser privileges" not in logged, logged[-3000:]
    # The worker child went away with the server.
    marker = f"packscore-{proc.pid}@".encode()
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes():
                leftovers.append(cmdline.parent.name)
        except OSError:
            pass
    assert not leftovers


def test_a_worker_that_dies_is_started_again(tmp_path: Path) -> None:
    """A crashed worker child (here SIGKILL) is started again by `serve --embedded`: jobs sent afterwards run."""
    service = EmbeddedService(tmp_path, "tiny-random", {})
    try:
        marker = f"packscore-{service.proc.pid}@".encode()
        (worker,) = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline") if marker in _read(p)]
        os.kill(worker, signal.SIGKILL)
        body = {"query": "Is the sky blue?", "items": ["yes", "no"], "label_token_ids": [1, 2]}
        response = service.http.post("/v1/score", json=body, timeout=120)
        assert response.status_code == 200, response.text + service.log_path.read_text(errors="replace")[-3000:]
        assert "worker embedded failed (exit code -9)" in service.log_path.read_text(errors="replace")
    finally:
        assert service.stop()["seconds"] < 10


def _answer_or_none(url: str, body: dict, key: str) -> httpx.Response | None:
    try:
        return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    except httpx.HTTPError:  # the service stopped under it
        return None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_embedded_broker_messages_are_never_read_half_written(tmp_path: Path) -> None:
    """kombu's filesystem transport created a message's file before writing it; a worker looking in between
    read it empty and stopped for good ("Unrecoverable error: JSONDecodeError"). A reader looking all the time
    gets every message whole."""
    from kombu import Connection

    from store.broker import AtomicFilesystemTransport

    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "control_folder": str(tmp_path)}
    with Connection(transport=AtomicFilesystemTransport, transport_options=options) as connection:
        channel = connection.default_channel
        read, errors, done = [], [], threading.Event()

        def reader() -> None:
            while not done.is_set() or len(read) < 300:
                try:
                    read.append(channel._get("q"))
                except queue.Empty:
                    pass
                except Exception as exc:  # a half-written message
                    errors.append(exc)
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        for i in range(300):
            channel._put("q", {"body": "x" * 2000, "n": i})
        done.set()
        thread.join(timeout=60)
    assert not errors and sorted(m["n"] for m in read) == list(range(300))


def test_health_polls_leave_no_access_log_line() -> None:
    import logging

    from api.main import HealthPollFilter

    def line(method: str, path: str, status: int) -> logging.LogRecord:  # as uvicorn logs a request
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5000", method, path, "1.1", status), None)

    kept = [r.getMessage() for r in [line("GET", "/readyz", 503), line("GET", "/readyz?verbose=1", 200),
                                     line("GET", "/healthz", 200), line("GET", "/readyzz", 404),
                                     line("POST", "/readyz", 405), line("GET", "/jobs/job_1", 200)]
            if HealthPollFilter().filter(r)]
    assert kept == ['127.0.0.1:5000 - "GET /readyzz HTTP/1.1" 404', '127.0.0.1:5000 - "POST /readyz HTTP/1.1" 405',
                    '127.0.0.1:5000 - "GET /jobs/job_1 HTTP/1.1" 200']


@pytest.mark.parametrize(("given", "platform", "expected"), [(None, "cpu", "cpu"), (None, "cuda", None),
                                                              (None, "tpu", None), ("tpu", "cpu", "tpu")])
def test_embedded_jax_platforms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None, platform: str,
                                expected: str | None) -> None:
    """On a host with no accelerator the embedded worker's JAX starts on the CPU without trying a TPU backend;
    on a GPU or TPU host, or with JAX_PLATFORMS given, JAX chooses as it would."""
    from packscore import cli, supervisor

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "EMBEDDED_DIR", tmp_path / ".packscore")
    monkeypatch.setattr(supervisor, "detect", lambda: supervisor.Chips(platform, ("0",)))
    # _embedded_environment fills in what is unset, here in a copy of the environment that the test's end puts
    # back (monkeypatch.delenv of an unset name restores nothing: BROKER_URL=filesystem:// leaked into the later
    # tests of this process, and the chaos test's service ran on no Redis).
    unset = ("DATABASE_URL", "BROKER_URL", "BROKER_DIR", "COMPILE_CACHE_DIR", "MODEL_CACHE_DIR", "BATCH_LOCAL_ROOT",
             "JAX_PLATFORMS")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in unset})
    if given:
        os.environ["JAX_PLATFORMS"] = given
    cli._embedded_environment()
    assert os.environ.get("JAX_PLATFORMS") == expected
