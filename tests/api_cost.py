"""API cost per submitted job: `python -m tests.api_cost [--jobs 2000] [--clients 16] [--route /jobs]`.

Starts the API alone (one uvicorn process, no worker: this measures submission, not scoring) on a fresh
database (PostgreSQL at PACKSCORE_ADMIN_URL's server, REDIS_URL), creates a key and submits small jobs (a
50-token query, 10 items of 10 tokens, labels [9805, 787], the bundled smollm2-135m's tokenizer) from
persistent keep-alive clients. Reports jobs/s, the API process's CPU per job and the CPU per job of the
`postgres` backends of its database, and apart that of the server's shared processes (WAL writer...; other
load on the server counts there), from /proc. `--profile FILE` records the API process with py-spy meanwhile
(samples of the thread holding the GIL) (`--py-spy` names its binary; flame-graph input, not for figures:
sampling costs CPU). Prints JSON.
"""

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import redis
from sqlalchemy import make_url

from tests.service_harness import fresh_database, running_service

TICKS = os.sysconf("SC_CLK_TCK")
# Each of these words is one token of SmolLM2's tokenizer after a space.
QUERY = "Is" + " the" * 48 + " ok"  # 50 tokens
ITEMS = ["\n" + " the" * 8 + " yes" for _ in range(10)]  # 10 tokens each


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def postgres_cpu_seconds(database: str) -> tuple[float, float]:
    """CPU of the `postgres` processes serving `database`, and of the server's shared ones (WAL writer,
    checkpointer...: other databases' load counts there too). Backends of other databases are left out."""
    backends = shared = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() != "postgres":
                    continue
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if f" {database} " in title:
                    backends += cpu_seconds(int(entry.name))
                elif "(" not in title and "[local]" not in title:  # not a client's backend
                    shared += cpu_seconds(int(entry.name))
            except OSError:  # exited meanwhile
                pass
    return backends, shared


def submit(base_url: str, key: str, route: str, n: int, failures: list) -> None:
    body = {"query": QUERY, "items": ITEMS, "label_token_ids": [9805, 787]}
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        for _ in range(n):
            r = client.post(route, json=body)
            if r.status_code != 202:
                failures.append(r.status_code)


def run_clients(base_url: str, key: str, route: str, jobs: int, clients: int) -> list:
    failures: list = []
    threads = [threading.Thread(target=submit, args=(base_url, key, route, jobs // clients, failures))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warmup-jobs", type=int, default=200)
    parser.add_argument("--profile", help="record the API process with py-spy into this file (raw, with idle)")
    parser.add_argument("--py-spy", default="/tmp/pyspy/bin/py-spy")
    args = parser.parse_args(argv)
    admin = os.environ.get("PACKSCORE_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"api_cost_{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp, fresh_database(admin, f"packscore_{prefix[:-1]}") as url:
        env = {"DATABASE_URL": url, "REDIS_URL": redis_url, "BROKER_KEY_PREFIX": prefix, "MODEL": "smollm2-135m"}
        logs = Path(tmp) / "logs"
        logs.mkdir()
        with running_service(env, logs) as service:
            with service.http() as client:
                first = client.post("/jobs", json={"query": QUERY, "items": ITEMS, "label_token_ids": [9805, 787]})
                assert first.status_code == 202, first.text
            run_clients(service.base_url, service.key, "/jobs", args.warmup_jobs, args.clients)
            spy = subprocess.Popen([args.py_spy, "record", "--gil", "-r", "400", "-f", "raw", "-o", args.profile, "-p",
                                    str(service.api.pid)]) if args.profile else None
            database = make_url(url).database
            api0, pg0, t0 = cpu_times(service.api.pid), postgres_cpu_seconds(database), time.monotonic()
            failures = run_clients(service.base_url, service.key, "/jobs", args.jobs, args.clients)
            api1, pg1, t1 = cpu_times(service.api.pid), postgres_cpu_seconds(database), time.monotonic()
            n = args.jobs // args.clients * args.clients
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
        client = redis.Redis.from_url(redis_url)
        for k in client.scan_iter(f"{prefix}*"):
            client.delete(k)
    report = {"jobs": n, "clients": args.clients, "prompt_tokens": first.json()["usage"]["prompt_tokens"],
              "failures": len(failures), "jobs_per_s": round(n / (t1 - t0), 1),
              "api_cpu_ms_per_job": round(1000 * (sum(api1) - sum(api0)) / n, 2),
              "api_system_cpu_ms_per_job": round(1000 * (api1[1] - api0[1]) / n, 2),
              "postgres_cpu_ms_per_job": round(1000 * (pg1[0] - pg0[0]) / n, 2),
              "postgres_shared_cpu_ms_per_job": round(1000 * (pg1[1] - pg0[1]) / n, 2),
              "loadavg": os.getloadavg()}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
