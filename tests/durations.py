"""The suite's time against its budget, and the durations table of docs/testing.md, from the JUnit XML files
that `make test` writes (one per phase): each test file, its tests, its seconds (set-up, call and tear-down
together, on whichever process ran it), its slowest test, and what dominates it (NOTES, by hand).

    python -m tests.durations .test-results/*.xml --total               # the run's wall time against the budget
    python -m tests.durations .test-results/*.xml                       # prints the table
    python -m tests.durations .test-results/*.xml --write docs/testing.md
    python -m tests.durations AFTER.xml ... --before BEFORE.xml ... --write docs/testing.md   # two runs side by side

`make test` runs the first form at its end; `make test-durations` the third, on the last `make test`'s files, and
writes each file's seconds to tests/file_seconds.json (`--write-seconds`): tests/conftest.py hands the pytest-xdist
processes the longest files first, so that no long file starts last and holds the run up alone."""

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# The suite's time budget on the CI machine type (2 cores, nothing else running): `make test` prints the run's
# test time against it (tests/conftest.py).
SUITE_BUDGET_SECONDS = 15 * 60

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
START, END = "<!-- durations:start -->", "<!-- durations:end -->"

# What a file's time goes to, as read off its tests (kept by hand: a new slow file gets a line here).
NOTES = {
    "test_aot.py": "the real TPU compiler (libtpu) and Mosaic GPU lowering, a process per target",
    "test_engine_parity.py": "the bundled model's load and compiles; transformers' PyTorch reference",
    "test_engine_families.py": "compiles per family and config; transformers' references",
    "test_engine_tiny.py": "compiles of the tiny model's shapes",
    "test_engine_attention.py": "compiles of randomized layouts",
    "test_engine_tpu.py": "the kernels in TPU and GPU interpret mode",
    "test_reliability_soak.py": "a deployment, its traffic and faults (benchmarks/soak.py, PACKSCORE_SOAK_MINUTES)",
    "test_reliability_chaos.py":
        "real work under load (PACKSCORE_CHAOS_SECONDS per fault), a private Postgres and Redis",
    "test_security_fuzz.py": "schemathesis' cases against a live service",
    "test_security_inputs.py": "a live service; many small requests",
    "test_worker_stop.py": "real work: a 1,000-line batch through three workers",
    "test_models.py": "two worker processes (two models), the judge's transformers build",
    "test_continuous_batching.py": "a service start-up; a long job beside small calls",
    "test_lake_service.py": "both deployments (Postgres, embedded): service and worker start-ups, workers killed",
    "test_device_check.py": "benchmarks/device_check.sh's dry run: every step on the CPU, the embedded service",
    "test_ui_browser.py": "Chromium against a live service; a long job watched and cancelled",
    "test_engine_gpu_ws.py": "the warp-specialized kernel in GPU interpret mode, race detector on",
    "test_pass_cost.py": "the pass lowered for CUDA and compiled by libtpu for v5e",
    "test_third_hour.py": "two embedded services from two folders",
    "test_lake_cancel.py": "reference batches run by in-process workers, cancelled and resumed",
    "test_lake.py": "reference batches run by in-process workers",
    "test_latency_bundled_model.py": "the embedded service with the bundled model: start-up, warm-up, a backfill",
    "test_readme.py": "the embedded service with the bundled model; README's examples",
    "test_e2e_embedded.py": "embedded service start-ups (SQLite, file broker, worker child)",
    "test_e2e_service.py": "service start-ups; a worker SIGKILLed mid-job",
    "test_batches_service.py": "a service start-up; a 100,000-line upload; latency beside a backfill",
    "test_cli_backfill.py": "the CLI against a live service; a SIGKILLed backfill resumed",
    "test_worker_drain.py": "in-process pass loops on the tiny model",
    "test_webhook_dns_live.py": "a live worker and a DNS server of the test",
    "test_first_hour.py": "the bundled model's tokenizer; a subprocess start",
    "test_lake_turns.py": "reference and uploaded batches run by in-process workers",
    "test_check.py": "one subprocess on 4 host devices: packscore check four times (compiles, a CPU reference)",
    "test_tensor_parallel.py": "one subprocess on 4 host devices: compiles at N = 1, 2, 4 for three families",
    "test_worker_supervisor.py": "a supervisor's two worker processes: start-ups, a kill and a restart",
}


def wall_seconds(junits: list[Path]) -> list[float]:
    """Each file's wall time (its pytest run's, with parallel workers: not the sum of its tests)."""
    return [sum(float(suite.get("time", 0)) for suite in ET.parse(junit).iter("testsuite")) for junit in junits]


def per_file(junits: list[Path]) -> dict[str, tuple[int, float, str, float]]:
    """file -> (tests, seconds, slowest test, its seconds)."""
    tests: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    slowest: dict[str, tuple[float, str]] = {}
    cases = [case for junit in junits for case in ET.parse(junit).iter("testcase")]
    for case in cases:
        name = case.get("classname", "").split(".")[-1] + ".py"
        took = float(case.get("time", 0))
        tests[name] += 1
        seconds[name] += took
        if took >= slowest.get(name, (-1.0, ""))[0]:
            slowest[name] = (took, case.get("name", ""))
    return {f: (tests[f], seconds[f], slowest[f][1], slowest[f][0]) for f in tests}


def table(after: list[Path], before: list[Path] | None = None) -> str:
    now = per_file(after)
    then = per_file(before) if before else {}
    head = "| file | tests | seconds |" + (" before |" if before else "") + " slowest test | what dominates |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, (n, took, slow, slow_took) in sorted(now.items(), key=lambda kv: -kv[1][1]):
        earlier = f" {then[name][1]:.0f} ({then[name][0]}) |" if name in then else (" |" if before else "")
        rows.append(f"| `{name}` | {n} | {took:.0f} |{earlier} `{slow}` {slow_took:.0f} s | {NOTES.get(name, '')} |")
    total_tests, total = sum(v[0] for v in now.values()), sum(v[1] for v in now.values())
    footer = f"| **all** | {total_tests} | **{total:.0f}** |"
    if before:
        footer += f" {sum(v[1] for v in then.values()):.0f} ({sum(v[0] for v in then.values())}) |"
    rows.append(footer + f" wall time {sum(wall_seconds(after)):.0f} s; budget {SUITE_BUDGET_SECONDS} s | |")
    return "\n".join(rows)


def total(junits: list[Path], cached_programs: int | None = None) -> str:
    walls = wall_seconds(junits)
    verdict = "within" if sum(walls) <= SUITE_BUDGET_SECONDS else "OVER"
    phases = " + ".join(f"{w:.0f}" for w in walls)
    # A run that found compiled programs from earlier runs is faster than a first one: say which this was.
    cache = "" if cached_programs is None else (
        f"; {cached_programs} compiled programs cached at the start" if cached_programs else "; a cold compile cache")
    return (f"suite time: {sum(walls):.0f} s of tests ({phases}){cache}, {verdict} the budget of "
            f"{SUITE_BUDGET_SECONDS} s (tests/durations.py); where it goes: `make test-durations`, docs/testing.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, nargs="+")
    parser.add_argument("--total", action="store_true", help="print the run's time against the budget, no table")
    parser.add_argument("--cached-programs", type=int, help="with --total: the compile cache's programs at the start")
    parser.add_argument("--before", type=Path, nargs="+",
                        help="an earlier run's JUnit XML files (both phases), shown beside (seconds (tests))")
    parser.add_argument("--write", type=Path, help=f"replace the table between {START} and {END} in this file")
    parser.add_argument("--write-seconds", action="store_true", help=f"write each file's seconds to {FILE_SECONDS}")
    args = parser.parse_args()
    if args.total:
        print(total(args.junit, args.cached_programs))
        return
    if args.write_seconds:
        seconds = {name: round(took) for name, (_, took, _, _) in sorted(per_file(args.junit).items())}
        FILE_SECONDS.write_text(json.dumps(seconds, indent=1) + "\n")
    text = table(args.junit, args.before)
    if args.write is None:
        print(text)
        return
    doc = args.write.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{args.write} has no {START} ... {END} section")
    args.write.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{text}\n{END}", doc,
                                 flags=re.S))
    print(f"wrote the durations table of {' '.join(map(str, args.junit))} into {args.write}")


if __name__ == "__main__":
    main()
