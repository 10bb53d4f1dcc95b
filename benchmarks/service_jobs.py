"""The embedded service on this machine's device, through POST /jobs:

    python -m benchmarks.service_jobs [--jobs 24 -P 2000 -N 500 -L 20] [--model M]

Starts `packscore serve --embedded` in a folder of its own (MODEL from --model, DTYPE and the rest from the
environment), posts --jobs jobs of the P/N/L shape at once (random token ids, each job its own query), waits for
each to end and prints one JSON object: items/s from the first POST to the last job's end (the client's wall
clock), and from the first claim to the last finish (the jobs' own timestamps), with the jobs' statuses.
`benchmarks.bench` on the same shape gives the engine's items/s to set beside it.
"""

import argparse
import json
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from benchmarks.latency import EmbeddedService
from tests.service_harness import wait_until


def job_bodies(jobs: int, query_tokens: int, items: int, item_tokens: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(10, 30000, n).tolist()  # below every bundled or contract model's vocabulary
    return [{"query": ids(query_tokens), "items": [ids(item_tokens) for _ in range(items)],
             "label_token_ids": ids(2)} for _ in range(jobs)]


def run(service: EmbeddedService, bodies: list[dict], seconds: float) -> dict:
    start = time.perf_counter()
    ids = []
    for body in bodies:
        response = service.http.post("/jobs", json=body)
        if response.status_code != 202:
            raise RuntimeError(f"POST /jobs: {response.status_code} {response.text[:500]}")
        ids.append(response.json()["id"])
    ended: dict[str, dict] = {}

    def all_ended() -> bool:
        for job_id in ids:
            if job_id not in ended:
                job = service.http.get(f"/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    ended[job_id] = job
        return len(ended) == len(ids)

    wait_until(all_ended, seconds, "the jobs", interval=0.2)
    wall = time.perf_counter() - start
    jobs = list(ended.values())
    items = sum(len(body["items"]) for body in bodies)
    when = lambda key: [datetime.fromisoformat(j[key]) for j in jobs if j[key]]
    claimed = (max(when("finished_at")) - min(when("started_at"))).total_seconds() if when("started_at") else None
    return {"jobs": len(jobs), "items": items, "statuses": sorted({j["status"] for j in jobs}),
            "seconds": round(wall, 3), "items_per_s": round(items / wall, 1),
            "claim_to_finish_seconds": claimed, "items_per_s_claimed": round(items / claimed, 1) if claimed else None,
            "dtype": sorted({str(j.get("dtype")) for j in jobs})}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", "-J", type=int, default=24)
    parser.add_argument("--query-tokens", "-P", type=int, default=2000)
    parser.add_argument("--items", "-N", type=int, default=500)
    parser.add_argument("--item-tokens", "-L", type=int, default=20)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seconds", type=float, default=600, help="how long to wait for the jobs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="packscore-service-jobs-") as home:
        service = EmbeddedService(Path(home), args.model, {})
        try:
            report = {"ready_seconds": round(service.ready_seconds, 1), "warm_up": service.warm_up(),
                      "shape": {"P": args.query_tokens, "N": args.items, "L": args.item_tokens}}
            report.update(run(service, job_bodies(args.jobs, args.query_tokens, args.items, args.item_tokens),
                              args.seconds))
        finally:
            report_stop = service.stop()
    report["stop"] = report_stop
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
