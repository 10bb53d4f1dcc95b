"""Two versions of the CPU's attention path in one process, run by run: `python -m benchmarks.attention_ab OTHER.py
[--mix | -R R -P P -N N -L L] [--rounds 6]` (OTHER.py: a module with cascade_tables, cascade_table_shapes and
cascade_attention, e.g. `git show f6ba1d5:core/attention.py > /tmp/a.py`).

benchmarks.bench's packed timings (its requests and seed: the one request by default, `--mix`, `--requests`),
the query computed in each run, with this tree's attention and with OTHER.py's, alternating (AB, BA, ...). Where
only the attention differs between two commits, this compares them on a loaded host: both run under the same
load, where separate processes a minute apart do not (on a shared host wall time moves several-fold with the
load, CPU time far less). Prints each version's best wall and median process CPU time, and the other version's
CPU time over this tree's, per round.
"""

import argparse
import dataclasses
import importlib.util
import json
import time

import numpy as np

from benchmarks.bench import mix_requests, shaped_requests
from core.attention import selection
from core.scorer import Scorer


def attention_module(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("other_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def xla_path(module) -> selection.Path:  # type: ignore[no-untyped-def]
    """The selection table's "xla" row with `module`'s cascade tables and attention."""
    def attend(q, k, v, q_meta, kv_meta, tables, block_q, block_k, **layer):  # type: ignore[no-untyped-def]
        return module.cascade_attention(q, k, v, q_meta, kv_meta, *tables, **layer)
    return dataclasses.replace(
        selection.PATHS["xla"], attend=attend,
        tables=lambda arrays, window, *_: module.cascade_tables(arrays.q_meta, arrays.kv_meta, window).as_tuple(),
        table_shapes=lambda tokens, keys, *_: module.cascade_table_shapes(tokens, keys))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="another version's cascade attention (a core/attention.py)")
    parser.add_argument("--mix", action="store_true")
    parser.add_argument("--requests", "-R", type=int, default=1)
    parser.add_argument("--query-tokens", "-P", type=int, default=500)
    parser.add_argument("--items", "-N", type=int, default=100)
    parser.add_argument("--item-tokens", "-L", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    scorer = Scorer.from_pretrained("smollm2-135m")
    rng = np.random.default_rng(0)
    if args.mix:
        requests = mix_requests(scorer, rng)
    elif args.requests > 1:
        requests = shaped_requests(scorer, rng, args)
    else:  # benchmarks.bench's one request (its labels: 4)
        vocab = scorer.vocab_size
        query = rng.integers(10, vocab, args.query_tokens).tolist()
        items = [rng.integers(10, vocab, args.item_tokens).tolist() for _ in range(args.items)]
        requests = [scorer.tokenize(query, items, rng.integers(10, vocab, 4).tolist())]
    this_tree = selection.PATHS["xla"]
    versions = {"this tree": this_tree, "other": xla_path(attention_module(args.other))}

    def run(path: selection.Path) -> list[int]:
        # The scorer reads its attention from this row: tables and programs (the tables' shapes differ
        # between versions, so each version compiles its own programs).
        selection.PATHS["xla"] = path
        scorer.clear_prefix_cache()
        return [p.padded_tokens for p in scorer.iter_passes(requests)]

    passes = {name: run(module) for name, module in versions.items()}  # compiles both
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
    for i in range(args.rounds):
        for name in list(versions)[:: 1 if i % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            run(versions[name])
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    selection.PATHS["xla"] = this_tree
    report = {"passes": passes, "load": open("/proc/loadavg").read().split()[0]}
    for name, runs in times.items():
        report[name] = {"best_wall_s": round(min(w for w, _ in runs), 3),
                        "median_cpu_s": round(float(np.median([c for _, c in runs])), 3)}
    report["other_cpu_over_this_per_round"] = [round(o[1] / t[1], 3)
                                               for t, o in zip(times["this tree"], times["other"])]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
