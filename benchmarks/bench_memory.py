"""Memory of a long-lived engine: `python -m benchmarks.bench_memory [--requests 80 --warmup]`.

Scores requests of random shapes one after another (queries of 5-1,200 tokens, 1-300 items of 1-60 tokens,
random token ids, a query repeated now and then so the prefix cache fills and is read) and prints, as JSON,
the process's RSS after chosen requests, the programs compiled and resident and the prefix cache's size.
The bound it checks: RSS grows at most 150 MB from request 20 to request 80.
"""

import argparse
import json
import resource
import time

import numpy as np

from core.scorer import Scorer


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--every", type=int, default=10, help="print RSS after every this many requests")
    parser.add_argument("--warmup", action="store_true", help="compile the shape ladder first (WARMUP=ladder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-programs", type=int, default=24,
                        help="MAX_PROGRAMS: fewer than the shapes met makes programs evicted and compiled again")
    args = parser.parse_args(argv)

    scorer = Scorer.from_pretrained(args.model, dtype="float32", max_programs=args.max_programs)
    rng = np.random.default_rng(args.seed)
    random_tokens = lambda n: rng.integers(10, scorer.vocab_size, int(n)).tolist()
    start = time.perf_counter()
    samples = {0: rss_mb()}
    if args.warmup:
        programs = scorer.warm_up()
        print(json.dumps({"warm_up_programs": programs, "seconds": round(time.perf_counter() - start, 1),
                          "rss_mb": round(rss_mb(), 1)}), flush=True)
    queries: list[list[int]] = []
    for n in range(1, args.requests + 1):
        if queries and rng.random() < 0.3:
            query = queries[int(rng.integers(len(queries)))]
        else:
            query = random_tokens(rng.integers(5, 1201))
            queries.append(query)
        items = [random_tokens(rng.integers(1, 61)) for _ in range(int(rng.integers(1, 301)))]
        scorer.logprobs(query, items, random_tokens(rng.integers(1, 5)))
        if n % args.every == 0 or n in (1, 20):
            samples[n] = rss_mb()
            print(json.dumps({"request": n, "rss_mb": round(samples[n], 1), "compiled": scorer.compiled_programs,
                              "resident": scorer.resident_programs,
                              "prefix_cache_mb": round(scorer.cached_prefix_bytes / 2**20, 1),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    report = {"model": args.model, "requests": args.requests, "warmup": args.warmup,
              "rss_mb": {str(k): round(v, 1) for k, v in samples.items()},
              "compiled_programs": scorer.compiled_programs, "max_programs": scorer.max_programs}
    if 20 in samples and args.requests in samples:
        report["growth_20_to_last_mb"] = round(samples[args.requests] - samples[20], 1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
