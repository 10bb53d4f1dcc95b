"""Scoring benchmark: `python -m benchmarks.bench [--query-tokens P --items N --item-tokens L ...]`.

Prints one JSON object: items/s and tokens/s for packed mode (query computed in the run,
and again with the query's keys/values already in the prefix cache), single mode (one pass
per query+item) and transformers' PyTorch model reusing the query's KV cache per item; model
FLOPs/s of the packed run and its fraction of a matmul peak measured in the same run.
Inputs are random token ids (seeded), so tokenization is not measured.

`--mix`: the service's traffic instead of one big request: 16 requests of 3 to 100 items (5 to 40
tokens each), each with its own query of 50 to 500 tokens, scored together as a worker's claimed
jobs are (`Scorer.iter_passes` on all of them: coalesced into shared passes). `--requests R`: the same
with R requests of the P/N/L shape (a backfill's short lines: `-R 17 -P 40 -N 2 -L 13`).

The check of a host before serving (scores against the CPU's float32, items/s, the attention path,
memory) is `packscore check` (core/check.py).
"""

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from core.check import cpu_flags, timed, transformers_model
from core.requests import ModelSource
from core.scorer import Scorer


def model_flops(config, query_tokens: int, item_lengths: list[int]) -> float:
    """FLOPs the model needs for one packed request (padding and masked work not counted)."""
    per_token = 2 * config.num_layers * (config.hidden_size * (config.q_size + 2 * config.kv_size)
                                         + config.q_size * config.hidden_size
                                         + 3 * config.hidden_size * config.intermediate_size)
    tokens = query_tokens + sum(item_lengths)
    # Each token attends to `context` keys: QK^T and PV, 2 FLOPs per multiply-add each.
    attn_per_key = 4 * config.num_layers * config.q_size
    contexts = query_tokens * (query_tokens + 1) / 2 + sum(query_tokens * n + n * (n + 1) / 2 for n in item_lengths)
    head = 2 * config.hidden_size * config.vocab_size * len(item_lengths)
    return per_token * tokens + attn_per_key * contexts + head


def matmul_peak(n: int = 2048, repeats: int = 5) -> dict:
    """The best of `repeats` n x n matmuls: NumPy's (the host's CPU) and JAX's float32 and bfloat16 (its device;
    an accelerator's with n = 8192, and no NumPy: 2048 is too small to fill one)."""
    accelerator = jax.default_backend() != "cpu"
    n = 8192 if accelerator else n
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    flops = 2 * n ** 3

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return flops / min(times)

    ja = jnp.asarray(a)
    jmm = jax.jit(lambda x: x @ x)
    # bfloat16 inputs, float32 accumulation: what the engine's bfloat16 linear layers ask of XLA.
    jb = ja.astype(jnp.bfloat16)
    jmm_bf16 = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    peaks = {"jax": best(lambda: jmm(ja).block_until_ready()),
             "jax_bfloat16": best(lambda: jmm_bf16(jb).block_until_ready())}
    if not accelerator:
        peaks["numpy"] = best(lambda: a @ a)
    return peaks


def transformers_prefix_cache(query: list[int], items: list[list[int]], labels: list[int]) -> tuple[float, np.ndarray]:
    """What a user would write with transformers: prefill the query once, then each item on its KV cache."""
    import torch

    model = transformers_model(ModelSource.resolve("smollm2-135m"), "float32")

    def run():
        out = np.zeros((len(items), len(labels)))
        with torch.inference_mode():
            cache = model(torch.tensor([query]), use_cache=True).past_key_values
            for i, item in enumerate(items):
                logits = model(torch.tensor([item]), past_key_values=cache, use_cache=True).logits[0, -1]
                cache.crop(-len(item))  # back to the query's keys/values for the next item
                out[i] = torch.log_softmax(logits.double(), -1)[labels].numpy()
        return out

    run()  # warm-up
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def mix_requests(scorer: Scorer, rng: np.random.Generator, n: int = 16) -> list:
    """`--mix`'s requests: n queries of 50-500 tokens, each with 3-100 items of 5-40 tokens, 1-4 labels."""
    vocab = scorer.vocab_size
    token_ids = lambda lo, hi: rng.integers(10, vocab, int(rng.integers(lo, hi + 1))).tolist()
    return [scorer.tokenize(token_ids(50, 500), [token_ids(5, 40) for _ in range(int(rng.integers(3, 101)))],
                            rng.integers(10, vocab, int(rng.integers(1, 5))).tolist()) for _ in range(n)]


def shaped_requests(scorer: Scorer, rng: np.random.Generator, args: argparse.Namespace) -> list:
    """`--requests R`: R requests of the P/N/L shape, each with its own query (a backfill's lines)."""
    vocab = scorer.vocab_size
    token_ids = lambda n: rng.integers(10, vocab, n).tolist()
    return [scorer.tokenize(token_ids(args.query_tokens), [token_ids(args.item_tokens) for _ in range(args.items)],
                            token_ids(2)) for _ in range(args.requests)]


def packed_mix(scorer: Scorer, requests: list, repeats: int) -> dict:
    """Scores the requests together, as a worker scores its claimed jobs; every query computed in the run."""
    def run():
        scorer.clear_prefix_cache()
        return [(p.tokens, p.padded_tokens) for p in scorer.iter_passes(requests)]

    seconds, passes = timed(run, repeats)
    items = sum(r.n_items for r in requests)
    flops = sum(model_flops(scorer.config, len(r.query), [len(i) for i in r.items]) for r in requests)
    return {"requests": len(requests), "items": items, "seconds": round(seconds, 4),
            "items_per_s": round(items / seconds, 3), "passes": len(passes),
            "real_tokens": sum(p[0] for p in passes), "padded_tokens": sum(p[1] for p in passes),
            "model_gflops": round(flops / 1e9, 1), "model_gflops_per_s": round(flops / seconds / 1e9, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--query-tokens", "-P", type=int, default=500)
    parser.add_argument("--items", "-N", type=int, default=100)
    parser.add_argument("--item-tokens", "-L", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-items", type=int, default=10, help="items timed in single mode (it is slow)")
    parser.add_argument("--transformers-items", type=int, default=20, help="items timed with transformers (0: skip)")
    parser.add_argument("--mix", action="store_true", help="mixed traffic: 16 requests coalesced (see above)")
    parser.add_argument("--requests", "-R", type=int, default=1,
                        help="R requests of the P/N/L shape, each with its own query, scored together as --mix's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-size", type=int, default=2048, help="n of the CPU's n x n matmul peak")
    args = parser.parse_args(argv)
    scorer = Scorer.from_pretrained(args.model, dtype=args.dtype, attention=args.attention)
    rng = np.random.default_rng(args.seed)
    report = {
        "machine": {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                    "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags()},
        "config": {"model": args.model, "dtype": args.dtype, "attention": scorer.attention, "P": args.query_tokens,
                   "N": args.items, "L": args.item_tokens, "pass_tokens": scorer.pass_tokens},
    }
    # The peak is measured before and after the timed runs and the better kept: one measurement taken at a
    # slow moment would flatter the fraction.
    peaks = [matmul_peak(args.peak_size)]
    if args.mix or args.requests > 1:
        if args.mix:
            del report["config"]["P"], report["config"]["N"], report["config"]["L"]
        requests = mix_requests(scorer, rng) if args.mix else shaped_requests(scorer, rng, args)
        report["packed_mix"] = packed_mix(scorer, requests, args.repeats)
        flops_per_s = report["packed_mix"]["model_gflops_per_s"] * 1e9
    else:
        flops_per_s = one_request(scorer, rng, args, report)
    peaks.append(matmul_peak(args.peak_size))
    # The run's dtype's peak: float32 (NumPy's or JAX's), or JAX's bfloat16 matmul.
    peak = max(p["jax_bfloat16"] if args.dtype == "bfloat16" else max(p.get("numpy", 0), p["jax"]) for p in peaks)
    report["matmul_peak_gflops"] = [{k: round(v / 1e9, 1) for k, v in p.items()} for p in peaks]
    report["fraction_of_matmul_peak"] = round(flops_per_s / peak, 3)
    report["goal"] = ("model FLOPs at least 0.70 of the float32 matmul peak" if args.dtype == "float32" else
                      "model FLOPs at least 0.30 of the bfloat16 matmul peak; packed items/s at least 2.5x a "
                      "float32 run's on the same host (AMX); no slower than float32 without AMX")
    report["compiled_programs"] = scorer.compiled_programs
    print(json.dumps(report, indent=2))
    return report


def one_request(scorer: Scorer, rng: np.random.Generator, args: argparse.Namespace, report: dict) -> float:
    """The P/N/L request: packed (cold and with the query cached), single mode, transformers; fills `report`
    and returns the packed run's model FLOPs/s."""
    vocab = scorer.vocab_size
    query = rng.integers(10, vocab, args.query_tokens).tolist()
    items = [rng.integers(10, vocab, args.item_tokens).tolist() for _ in range(args.items)]
    labels = rng.integers(10, vocab, 4).tolist()

    def packed_cold():  # the query's keys/values are not reused from an earlier run
        scorer.clear_prefix_cache()
        return scorer.logprobs(query, items, labels)

    packed_s, packed_lp = timed(packed_cold, args.repeats)
    cached_s, cached_lp = timed(lambda: scorer.logprobs(query, items, labels), args.repeats)
    flops = model_flops(scorer.config, args.query_tokens, [args.item_tokens] * args.items)
    single_items = items[: args.single_items]
    single_s, single_lp = timed(lambda: scorer.logprobs(query, single_items, labels, mode="single"), 1)

    def rates(seconds: float, n_items: int, tokens: int) -> dict:
        return {"seconds": round(seconds, 4), "items": n_items, "items_per_s": round(n_items / seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1)}

    report["packed"] = rates(packed_s, args.items, args.query_tokens + args.items * args.item_tokens)
    report["single"] = rates(single_s, len(single_items), len(single_items) * (args.query_tokens + args.item_tokens))
    report["packed_query_cached"] = rates(cached_s, args.items, args.items * args.item_tokens)
    report["packed"]["model_gflops_per_s"] = round(flops / packed_s / 1e9, 1)
    report["packed_vs_single"] = round(report["packed"]["items_per_s"] / report["single"]["items_per_s"], 2)
    single_diff = np.abs(packed_lp[: len(single_items)] - single_lp).max()
    # docs/score-semantics.md: a query's keys/values from the prefix cache give the scores computing it gives.
    report["max_abs_logprob_diff"] = {"packed_vs_single": float(single_diff),
                                      "query_cached_vs_computed": float(np.abs(cached_lp - packed_lp).max())}
    if args.transformers_items and args.model == "smollm2-135m":
        hf_items = items[: args.transformers_items]
        hf_s, hf_lp = transformers_prefix_cache(query, hf_items, labels)
        hf_tokens = args.query_tokens + len(hf_items) * args.item_tokens
        report["transformers_prefix_cache"] = rates(hf_s, len(hf_items), hf_tokens)
        report["packed_vs_transformers"] = round(
            report["packed"]["items_per_s"] / report["transformers_prefix_cache"]["items_per_s"], 2)
        hf_diff = np.abs(packed_lp[: len(hf_items)] - hf_lp).max()
        report["max_abs_logprob_diff"]["packed_vs_transformers"] = float(hf_diff)
    return flops / packed_s


if __name__ == "__main__":
    main()
