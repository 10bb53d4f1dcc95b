"""Workers stopped in the middle of a backfill (SIGTERM, as `serve`, docker and process managers send; SIGINT,
as Ctrl-C): each finishes the pass in flight, hands its other claimed requests back to the queue at once and
exits within 10 s, with none of its jobs left `running`; the next worker goes on with the batch, and the last
one finishes it, each request once (PostgreSQL, Redis, the real worker).

One batch and one service for both signals: a worker is stopped with SIGTERM, its replacement with SIGINT once
it has scored more of the batch, and a third worker finishes it. The batch is 50 times what a worker scores
before it is stopped, so it is unfinished at each stop on any host."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from packscore.client import Client
from tests.service_harness import REPO, free_port, running_service

LINES = 1000
SCORED_BEFORE_EACH_STOP = 20


def test_workers_stopped_mid_batch_by_sigterm_then_sigint_exit_promptly(redis_url: str, run_id: str,  # type: ignore[no-untyped-def]
                                                                         database_factory, tmp_path: Path) -> None:
    name = f"packscore_stop_{run_id}"
    with database_factory(name) as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:{name}:", "BATCH_ROUND_TOKENS": "2048",
             "LEASE_SECONDS": "60"}, tmp_path, workers=1) as service:
        lines = [{"custom_id": f"r{i}", "query": f"Rank the answers to question {i // 10}.",
                  "items": [f"candidate {i} " * 8, f"other {i % 7} " * 8], "label_token_ids": [5, 17]}
                 for i in range(LINES)]
        engine = create_engine(url)

        def running() -> int:
            with engine.connect() as db:
                return db.execute(text("SELECT count(*) FROM jobs WHERE status = 'running'")).scalar_one()

        with Client(service.base_url, service.key) as client:
            batch = client.create_batch(lines)
            done = 0
            for stop in (signal.SIGTERM, signal.SIGINT):
                deadline = time.monotonic() + 120
                while client.get_batch(batch["id"])["counts"]["succeeded"] < done + SCORED_BEFORE_EACH_STOP \
                        or not running():
                    assert time.monotonic() < deadline, service.tail()
                    time.sleep(0.05)
                [worker] = service.live_workers()
                signalled = time.monotonic()
                worker.send_signal(stop)
                worker.wait(timeout=60)
                took = time.monotonic() - signalled
                assert took < 10, f"the worker took {took:.1f} s to stop on {stop.name}\n{service.tail()}"
                assert running() == 0, f"the worker stopped by {stop.name} left jobs running"
                done = client.get_batch(batch["id"])["counts"]["succeeded"]
                assert done < len(lines), f"the batch finished before the {stop.name} stop"
                service.start_worker()

            finished = client.wait_batch(batch["id"], poll=0.5, timeout=300)
            assert finished["status"] == "completed"
            assert finished["counts"] == {"total": len(lines), "succeeded": len(lines), "failed": 0, "cancelled": 0}
            ids = [line["custom_id"] for line in client.iter_batch_results(batch["id"])]
            assert sorted(ids) == sorted(line["custom_id"] for line in lines)
        engine.dispose()


@pytest.mark.parametrize("fault", ["model", "database", "storage prefix"])
def test_a_worker_that_cannot_start_exits_non_zero(fault: str, tmp_path: Path) -> None:
    """A worker whose start fails (its model does not load, the database is unreachable at its first heartbeat,
    BATCH_STORAGE_PREFIXES names no storage prefix) exits 1 at once instead of consuming half-started, so that
    its supervisor, systemd or compose starts it again (Celery itself only logs a failing worker_ready
    handler)."""
    env = {**os.environ, "BROKER_URL": "filesystem://", "BROKER_DIR": str(tmp_path / "broker"), "MODEL": "tiny-random",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'jobs.db'}", "WARMUP": "none"}
    if fault == "model":
        env["MODEL"] = str(tmp_path / "no-model-here")
    elif fault == "storage prefix":
        env["BATCH_STORAGE_PREFIXES"] = "bucket/no-scheme/"
    else:
        env["DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/packscore"
    result = subprocess.run([sys.executable, "-m", "packscore.cli", "worker"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    reason = {"model": "unknown model", "database": "connection", "storage prefix": "BATCH_STORAGE_PREFIXES"}[fault]
    assert re.search(rf"could not start: .*{reason}.*; exiting \(code 1\)", result.stderr, re.IGNORECASE | re.DOTALL), \
        result.stderr[-3000:]
    assert " ready." not in result.stderr  # Celery's own line: it never began consuming
