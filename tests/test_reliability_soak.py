"""Short soak: the load runner against a real service (uvicorn, two Celery workers, Postgres, Redis, tiny-random)
for PACKSCORE_SOAK_SECONDS (default 120) at concurrency PACKSCORE_SOAK_CONCURRENCY (default 16). No errors,
every job terminal exactly once with the engine's scores, and the memory trend printed. The long soak is the
same runner from the command line (README_reliability.md)."""

import json
import os
from collections.abc import Iterator

import pytest

from core import Scorer
from tests.load_runner import LoadConfig, Runner
from tests.service_harness import Service, assert_exactly_once, running_service


@pytest.fixture(scope="module")
def service(redis_url: str, run_id: str, database_factory,  # type: ignore[no-untyped-def]
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with database_factory(f"packscore_soak_{run_id}") as url:
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:soak:"}
        with running_service(env, tmp_path_factory.mktemp("soak-logs"), workers=2) as service:
            yield service


def test_soak(service: Service, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = LoadConfig(duration_s=float(os.environ.get("PACKSCORE_SOAK_SECONDS", 120)), seed=5,
                     concurrency=int(os.environ.get("PACKSCORE_SOAK_CONCURRENCY", 16)),
                     rate=float(os.environ.get("PACKSCORE_SOAK_RATE", 0)), sample_interval_s=2)
    runner = Runner(cfg, service.base_url, service.key, service.pids)
    runner.run()
    runner.verify(Scorer.from_pretrained("tiny-random"))
    summary = runner.write(tmp_path)
    print(f"\nsoak summary ({tmp_path}):\n" + json.dumps({k: v for k, v in summary.items() if k != "config"},
                                                        indent=2))
    assert summary["requests"] > 0
    assert summary["errors"] == 0, summary["errors_by_kind"]
    assert summary["verified"] == summary["ok"] == summary["requests"]
    assert len(summary["memory"]) >= 3, "API and both workers sampled"
    assert_exactly_once(service.env["DATABASE_URL"], [r.job_id for r in runner.records], cfg.tag)
    service.wait_ready()
