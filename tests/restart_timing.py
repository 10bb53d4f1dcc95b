"""Worker start to first result, with cold and with warm caches: `python -m tests.restart_timing`.

Starts an API on a fresh database (PostgreSQL at PACKSCORE_ADMIN_URL's server, REDIS_URL) and, for each
round, queues one job, starts a worker and times how long until that job has succeeded. The first round runs
with empty COMPILE_CACHE_DIR and MODEL_CACHE_DIR (a first start: GGUF conversion, compilation), the later
rounds with the caches the first one filled (a restart, or a replacement worker). Prints JSON.
"""

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

from tests.service_harness import running_service, wait_until

QUERY = {"query": "Is the city in France? Answer yes or no.", "label_token_ids": [9805, 787]}


def first_result_seconds(service, n: int, env: dict[str, str]) -> float:  # type: ignore[no-untyped-def]
    with service.http() as client:
        job = client.post("/jobs", json=QUERY | {"items": [f"\nCity number {n}\nAnswer:"]}).json()["id"]
        start = time.monotonic()
        worker = service.start_worker(env)
        wait_until(lambda: client.get(f"/jobs/{job}").json()["status"] == "succeeded", 600, "the first result",
                   interval=0.05)
        seconds = time.monotonic() - start
    worker.terminate()
    worker.wait(timeout=60)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--warm-rounds", type=int, default=2)
    parser.add_argument("--warmup", default="ladder", choices=["ladder", "none"])
    args = parser.parse_args(argv)
    from tests.service_harness import fresh_database

    admin = os.environ.get("PACKSCORE_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    with tempfile.TemporaryDirectory() as tmp, \
            fresh_database(admin, f"packscore_restart_{uuid.uuid4().hex[:8]}") as url:
        env = {"DATABASE_URL": url, "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
               "BROKER_KEY_PREFIX": f"restart_{uuid.uuid4().hex[:8]}:", "MODEL": args.model, "WARMUP": args.warmup,
               "MODEL_CACHE_DIR": f"{tmp}/api-model-cache"}  # the API's tokenizer: not the worker's cache
        worker_env = {"COMPILE_CACHE_DIR": f"{tmp}/compile-cache", "MODEL_CACHE_DIR": f"{tmp}/model-cache"}
        logs = Path(tmp) / "logs"
        logs.mkdir()
        with running_service(env, logs) as service:
            cold = first_result_seconds(service, 0, worker_env)
            warm = [first_result_seconds(service, n, worker_env) for n in range(1, args.warm_rounds + 1)]
            warmed = [line for line in service.tail().splitlines() if "warmed" in line]
    report = {"model": args.model, "warmup": args.warmup, "cold_seconds": round(cold, 2),
              "warm_seconds": [round(w, 2) for w in warm], "cold_over_warm": round(cold / max(warm), 2),
              "warm_up_log": warmed}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
