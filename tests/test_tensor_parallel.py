"""Tensor parallelism (core.sharding) on 4 CPU host devices standing in for chips.

One subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX starts) scores a
tiny Llama (the bundled "tiny-random", through `Scorer.from_pretrained(..., tensor_parallel=N)`; 2 kv heads),
Qwen3 (2 kv heads: copied on 4 chips) and Gemma 2 (4 kv heads: split; a window, soft-caps) for N = 1, 2, 4:
packed, single mode and with the query's keys/values from the prefix cache. It reports each device's share
of the live arrays, the prefix cache's split, the refused N, and the engine's pass with the TPU kernel on each
chip's heads under shard_map (TPU interpret mode); this module's test checks the report. (The families' math against
transformers is tests/test_engine_families.py's.)
"""

import collections
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 4)


def _device_bytes() -> dict[int, int]:
    """Bytes each device holds of the process's live arrays."""
    import jax

    out: collections.Counter = collections.Counter()
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return dict(out)


# Tiny Qwen3 (2 kv heads: copied on 4 chips) and Gemma 2 (4 kv heads: split; a window shorter than the query,
# soft-caps, sandwich norms) from config.json fields; Llama is the bundled "tiny-random" (2 kv heads).
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, max_position_embeddings=512)
CONFIGS = {
    "qwen3": dict(TINY, model_type="qwen3", num_key_value_heads=2, tie_word_embeddings=False),
    "gemma2": dict(TINY, model_type="gemma2", num_key_value_heads=4, sliding_window=24, query_pre_attn_scalar=24,
                   attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
}


def scorers(family: str, n: int):  # type: ignore[no-untyped-def]
    from core import Scorer
    from core.config import ModelConfig
    from core.requests import ModelSource
    from core.weights import random_weights

    if family == "llama":
        return Scorer.from_pretrained("tiny-random", tensor_parallel=n, pass_tokens=256)
    config = ModelConfig.from_hf(CONFIGS[family])
    return Scorer(config, random_weights(config, seed=3), ModelSource.resolve("tiny-random").tokenizer(),
                  name=family, tensor_parallel=n, pass_tokens=256)


def report() -> dict:
    """Runs every case on this process's devices (4 host devices) and returns what the test checks."""
    import jax
    import numpy as np

    from core import Scorer, sharding
    from core.aot import MODELS

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    query = rng.integers(5, 49152, 40).tolist()  # longer than Gemma 2's window (24)
    items = [rng.integers(5, 49152, int(n)).tolist() for n in (0, 1, 3, 9)]  # one 64-token pass
    labels = [1, 77, 4000]
    out: dict = {"devices": len(jax.devices()), "families": {}}
    start = time.perf_counter()
    for family in ("llama", "qwen3", "gemma2"):
        runs: dict = {}
        for n in SIZES:
            gc.collect()
            scorer = scorers(family, n)
            packed = scorer.logprobs(query, items, labels)
            scorer.logprobs(query, items, labels)  # the query comes again: now kept
            request = scorer.tokenize(query, items, labels)
            cached_before = scorer.is_cached(request.query)
            from_cache = scorer.logprobs(query, items, labels)
            single = scorer.logprobs(query, items, labels, mode="single")
            k, v = next(iter(scorer._prefix_cache.values()))
            runs[n] = {
                "packed": packed.tolist(), "from_cache": from_cache.tolist(), "single": single.tolist(),
                "query_was_cached": cached_before,
                "device_bytes": _device_bytes(),
                # one device: the CPU's host cache (NumPy); several: the device cache, split
                "cache_shard_heads": sorted({s.data.shape[2] for s in k.addressable_shards}) if n > 1 else [k.shape[2]],
                "cache_devices": len(k.sharding.device_set) if n > 1 else 1,
                "kv_heads": scorer.model.config.num_kv_heads,
                "wqkv_shard": list(scorer.model.layers.attn.wqkv[...].addressable_shards[0].data.shape),
            }
            del scorer, k, v
            print(f"{family} N={n}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        out["families"][family] = runs
    try:
        Scorer.from_pretrained("tiny-random", tensor_parallel=3)
        out["bad_n"] = None
    except ValueError as exc:
        out["bad_n"] = str(exc)
    try:  # a model that splits in 8, on this process's 4 devices
        sharding.check(MODELS["qwen3-0.6b"], 8, len(jax.devices()))
        out["too_many"] = None
    except ValueError as exc:
        out["too_many"] = str(exc)
    out["valid_qwen3_0_6b"] = sharding.valid_sizes(MODELS["qwen3-0.6b"], 16)
    # The TPU kernel (TPU interpret mode) on each of 2 chips' heads, in the engine's pass: packed and from the cache
    scorer = Scorer.from_pretrained("tiny-random", tensor_parallel=2, pass_tokens=256, attention="pallas-interpret")
    out["tpu_kernel"] = [scorer.logprobs(query, items, labels).tolist() for _ in range(2)]
    out["tpu_kernel_path"] = scorer.attention_path
    print(f"all: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return out


def test_tensor_parallel_scores_match_and_weights_split():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.test_tensor_parallel"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(lines[-1])
    assert out["devices"] == 4
    for family, runs in out["families"].items():
        one = runs["1"]
        for n in map(str, SIZES):
            run = runs[n]
            assert run["query_was_cached"], (family, n)
            for case in ("packed", "from_cache", "single"):
                diff = max(abs(a - b) for row, ref in zip(run[case], one[case]) for a, b in zip(row, ref))
                assert diff <= 1e-5, (family, n, case, diff)
            # the prefix cache holds each chip's kv heads only (copies where the model has fewer than N)
            assert run["cache_devices"] == int(n) and run["cache_shard_heads"] == [run["kv_heads"] // int(n)]
        # kv heads split where N divides them (Gemma 2: 4), copied where the model has fewer (Llama, Qwen3: 2)
        assert [runs[n]["kv_heads"] for n in ("1", "2", "4")] == ([4, 4, 4] if family == "gemma2" else [2, 2, 4])
        for n in SIZES:  # each chip's q heads, then its k and v heads (4 heads of 16)
            assert runs[str(n)]["wqkv_shard"][-1] == (4 // n + 2 * runs[str(n)]["kv_heads"] // n) * 16
        # each device's share of the live arrays (weights, prefix cache) at N=4 against N=1's arrays
        single_device = sum(one["device_bytes"].values())
        shares = [b / single_device for b in runs["4"]["device_bytes"].values()]
        assert len(shares) == 4 and max(shares) <= 0.55, (family, shares)
    assert out["bad_n"] and "tensor_parallel=3" in out["bad_n"] and "values that work: 1, 2, 4" in out["bad_n"]
    assert out["too_many"] and "needs 8 devices" in out["too_many"]
    assert out["valid_qwen3_0_6b"] == [1, 2, 4, 8, 16]
    assert out["tpu_kernel_path"] == "pallas-interpret"
    for run in out["tpu_kernel"]:
        diff = max(abs(a - b) for row, ref in zip(run, out["families"]["llama"]["1"]["packed"])
                   for a, b in zip(row, ref))
        assert diff <= 1e-5, diff


if __name__ == "__main__":
    print(json.dumps(report()), flush=True)
