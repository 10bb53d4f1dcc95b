"""Short soak (issue 47): benchmarks/soak.py for PACKSCORE_SOAK_MINUTES (default 1.25: about two minutes with the
start and the checks; 20 s of the load runner alone before) on the Postgres deployment (a PostgreSQL cluster, a
redis-server and a SeaweedFS of its own, `packscore serve`, `packscore worker --devices` and a plain worker,
tiny-random under two model names). Its traffic: POST /jobs with webhooks to a receiver that fails some and is
down for a while, cancels and idempotent resends; /v1/score and /v1/rerank; uploaded batches in both line formats;
reference batches (Parquet, CSV, JSONL pair tables, local and s3://). Its faults, scaled to the run: a worker
SIGKILLed every 30 s (the plain one, then the supervisor's child), the API restarted, PostgreSQL and Redis
stopped, the object store down, a batch's result folder filling its disk (a tmpfs: root, as this suite's DNS test).

Asserted: the soak's own checks (every job, batch line and lake row answered exactly once, every webhook delivered
once or failed after its retries, nothing stuck, retention deleting what is due, the full disk a clear failure
with nothing half-committed), and what the 20-second soak asserted: no errors, every succeeded job's scores the
engine's, every process sampled, both ways in used, /healthz answered, one job per request. The bounds are counts,
not latencies (the run shares 2 cores with its own faults); the hour-long run's figures are in docs/soak.md."""

import ctypes.util
import json
import os
from pathlib import Path

import pytest

from benchmarks.soak import ALL_FAULTS, Postgres, Soak, when_store_is_up
from tests.service_harness import assert_exactly_once

pytestmark = pytest.mark.alone  # a whole deployment and its faults: nothing runs beside it (Makefile: test)

MINUTES = float(os.environ.get("PACKSCORE_SOAK_MINUTES", 1.25))


def test_soak(tmp_path: Path) -> None:
    # Programs compiled when first needed, as the suite's other services do (WARMUP=none): the worker under
    # `--devices` has XLA flags of its own, so none of the run's cached programs is its, and a warm-up of the
    # whole ladder held the start for a minute or more.
    deployment = Postgres(tmp_path / "home", MINUTES, Path(os.environ["COMPILE_CACHE_DIR"]), {"WARMUP": "none"})
    try:
        deployment.start()
        soak = Soak(deployment, MINUTES, ALL_FAULTS, tmp_path / "report", seed=5)
        report = soak.run()
        print(f"\nsoak report ({tmp_path / 'report'}):\n" + json.dumps(
            {"faults": report["faults"], "load": report["load"], "failed": report["failed"],
             "checks": {k: v for k, v in report["checks"].items() if k != "jobs_gone"}}, indent=1, default=str))
        assert report["failed"] == [], report["failed"]
        assert [f["fault"].split(" ")[0] for f in report["faults"]].count("SIGKILL") >= 2
        summary, runner = report["load"], soak.runner
        assert summary["requests"] > 0
        assert summary["errors"] == 0, summary["errors_by_kind"]
        assert summary["verified"] == summary["ok"] == summary["requests"] - summary["cancelled"]
        # The workers' memory is told apart: programs compiled after start (here every one: WARMUP=none) and the
        # prefix cache's size, from their logs (worker/tasks.py), beside RSS.
        assert sum(w["programs_compiled"] for w in report["windows"]) > 0
        assert any(w["prefix_cache_mb"] for w in report["windows"]), report["windows"]
        # Every worker, the plain one and the supervisor's child, on the allocator WORKER_ALLOCATOR gives them:
        # jemalloc where the host has it (in the no-kill hour its workers grew 18-27 MB/h, under glibc 39-92:
        # docs/soak.md).
        expected = "jemalloc" if ctypes.util.find_library("jemalloc") else "glibc"
        allocators = report["worker_allocators"]
        assert len(allocators) >= 2 and set(allocators.values()) == {expected}, allocators
        # Each worker life's memory log, read apart (a killed worker's successor is a life of its own), with
        # jemalloc's figures where the workers run on it; and their fits beside the RSS samples'.
        lives = deployment.worker_memory_logs()
        assert sum(map(bool, lives.values())) >= 2, lives
        assert all((entry.jemalloc_in_use is not None) == (entry.jemalloc_metadata is not None)
                   == (expected == "jemalloc") and entry.threads > 1
                   and 0 < entry.anonymous + entry.file_backed <= entry.rss + 1
                   and entry.huge_pages is not None and entry.huge_pages <= entry.anonymous
                   for logs in lives.values() for entry in logs)
        fits = report["memory_logged_mb_per_hour"]
        assert fits and all(f["logs"] >= 3 and "rss_mb_per_hour" in f and ("jemalloc_slabs_beside_in_use_mb_per_hour"
                                                                           in f) == (expected == "jemalloc")
                            for f in fits.values()), fits
        sampled = {name.split(":")[0] for _, name, *_ in soak.samples}
        written = json.loads((tmp_path / "report" / "memory_samples.json").read_text())
        assert len(written) == len(soak.samples) and {s["process"].split(":")[0] for s in written} == sampled
        assert {"api", "supervisor", "worker-plain"} <= sampled and len(sampled) >= 3, sampled
        assert 0 < summary["sync_ok"] < summary["ok"], "both ways in were used"
        assert summary["healthz_ms"]["samples"] > 10, summary["healthz_ms"]
        # Every POST /jobs request made one job, terminal, with a result exactly if it succeeded and at most one
        # webhook message; those retention may have deleted by now (ended RESULT_TTL_DAYS ago, less the client's
        # polling) excepted: retention goes on while the checks run.
        ttl_s = float(deployment.env["RESULT_TTL_DAYS"]) * 86400
        due = {r.job_id for r in runner.records if r.finished_s is not None and soak.now() - r.finished_s > ttl_s - 10}
        assert_exactly_once(deployment.database_url, [r.job_id for r in runner.records if not r.sync],
                            runner.cfg.tag, due)
        assert report["checks"]["jobs_deleted_by_retention"] > 0, "retention deleted nothing"
        sync_ids = [r.job_id for r in runner.records if r.sync]
        assert len(set(sync_ids)) == len(sync_ids)
        deployment.wait_ready(120)
    finally:
        deployment.close()


def test_the_soak_reads_a_batch_s_objects_again_once_the_store_is_back() -> None:
    """A 16-minute soak failed in its own client: it read a completed batch's manifest from s3:// while the store
    was down (the fault). Reads and writes of the store are tried again until it is back; a failed check is not."""
    calls = []

    def read() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("the store is down")
        return "manifest"

    assert when_store_is_up(read, pause_s=0.01) == "manifest" and len(calls) == 3

    def check() -> None:
        calls.append(1)
        raise RuntimeError("objects differ from the manifest")

    with pytest.raises(RuntimeError):
        when_store_is_up(check, pause_s=0.01)
    assert len(calls) == 4


def test_ten_minute_fits_of_a_long_life_are_reported_with_their_scatter() -> None:
    """The soak reports how 10-minute fits (a killed worker's whole measured span) scatter within a longer life:
    a steady line reads its own slope in every window; a worker growing slowly but holding a chunk's rows for a
    few minutes now and then reads over the goal in some windows though its whole fit is well under it."""
    import numpy as np

    from benchmarks.soak import GOAL_MB_PER_HOUR, window_fits

    hours = np.arange(0, 50 * 60, 5) / 3600  # a sample every 5 s for 50 minutes: windows start at minutes 0-39
    steady = window_fits(hours, 800 + 6 * hours)
    assert steady is not None and steady["windows"] == 40 and steady["over_goal"] == 0
    assert steady["min"] == steady["max"] == 6.0
    bursts = 800 + 6 * hours + 8 * ((hours * 60) % 12 > 9)  # 8 MB held for 3 minutes of every 12
    scattered = window_fits(hours, bursts)
    assert np.polyfit(hours, bursts, 1)[0] < GOAL_MB_PER_HOUR < scattered["max"] and scattered["over_goal"] > 0
    assert scattered["min"] < 0 and window_fits(hours[hours < 1 / 3 - 1e-9], bursts[hours < 1 / 3 - 1e-9]) is None
    logs = np.arange(8) * 301 / 3600  # memory logs a little over 5 minutes apart: no window holds three
    assert window_fits(logs, 800 + 6 * logs) is None
