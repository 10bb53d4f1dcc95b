"""A worker stopped in the middle of a backfill (SIGTERM, as `serve`, docker and process managers send;
SIGINT, as Ctrl-C): it finishes the pass in flight, hands its other claimed requests back to the queue at once
and exits within 10 s, with none of its jobs left `running`; a new worker finishes the batch, each request
once (PostgreSQL, Redis, the real worker)."""

import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from packscore.client import Client
from tests.service_harness import running_service


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_worker_stopped_mid_batch_exits_promptly(redis_url: str, run_id: str, database_factory,
                                                    tmp_path: Path, stop: signal.Signals) -> None:  # type: ignore[no-untyped-def]
    name = f"packscore_stop_{run_id}_{stop.name.lower()}"
    with database_factory(name) as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:{name}:", "BATCH_ROUND_TOKENS": "2048",
             "LEASE_SECONDS": "60"}, tmp_path, workers=1) as service:
        lines = [{"custom_id": f"r{i}", "query": f"Rank the answers to question {i // 10}.",
                  "items": [f"candidate {i} " * 8, f"other {i % 7} " * 8], "label_token_ids": [5, 17]}
                 for i in range(2000)]
        engine = create_engine(url)

        def running() -> int:
            with engine.connect() as db:
                return db.execute(text("SELECT count(*) FROM jobs WHERE status = 'running'")).scalar_one()

        with Client(service.base_url, service.key) as client:
            batch = client.create_batch(lines)
            deadline = time.monotonic() + 120
            while client.get_batch(batch["id"])["counts"]["succeeded"] < 20 or not running():
                assert time.monotonic() < deadline, service.tail()
                time.sleep(0.05)
            worker = service.workers[0]
            signalled = time.monotonic()
            worker.send_signal(stop)
            worker.wait(timeout=60)
            took = time.monotonic() - signalled
            assert took < 10, f"the worker took {took:.1f} s to stop\n{service.tail()}"
            assert running() == 0, "the stopped worker left jobs running"
            done = client.get_batch(batch["id"])["counts"]["succeeded"]
            assert done < len(lines), "the batch finished before the stop"

            service.start_worker()
            finished = client.wait_batch(batch["id"], poll=0.5, timeout=300)
            assert finished["status"] == "completed"
            assert finished["counts"] == {"total": len(lines), "succeeded": len(lines), "failed": 0, "cancelled": 0}
            ids = [line["custom_id"] for line in client.iter_batch_results(batch["id"])]
            assert sorted(ids) == sorted(line["custom_id"] for line in lines)
        engine.dispose()
