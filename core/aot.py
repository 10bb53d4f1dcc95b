"""Ahead-of-time build of the engine's pass program for an accelerator, from shapes alone.

    python -m core.aot --target tpu-v6e|tpu-v5e|cuda-h100 \
        --model qwen3-0.6b|smollm2-135m|gemma2-2b|mistral-7b|qwen3-8b|gemma2-9b \
        --pass-tokens 16384 --dtype bfloat16|float32 --tensor-parallel 1|2|4|8

Builds the program one pass runs (the whole model forward with the Pallas attention kernel, as
`core.scorer` jits it) with no weights materialized: every argument is a `jax.ShapeDtypeStruct`.
- TPU: compiled by the real TPU compiler (XLA and Mosaic) on the compile-only devices of the
  `libtpu` package (`jax.experimental.topologies`); no TPU is needed. Stage "compiled".
- CUDA (H100): `jax.export` for platform "cuda", which runs Mosaic GPU's lowering and its checks
  (shared memory among them); compiling needs a GPU. Stage "lowered".
With --tensor-parallel N the program is the sharded one (core.sharding): weights split over N chips, the
attention kernels on each chip's heads under shard_map, XLA's all-reduces after o and down; TPU on the
compile-only devices of a v5e/v6e 2x2 (N <= 4) or 2x4 (N = 8) slice, its memory analysis per chip; CUDA
lowered for N devices (host devices stand in for them while lowering).
Prints one JSON line and exits 0, or prints the error and exits 1.

The pass laid out is the seeds' accelerator contract (a 2,000-token query, 500 items of 20 tokens),
padded to the accelerators' ladder of --pass-tokens (core.packing: 12,288 tokens on the ladder of
16,384). `items_per_second_roofline` is an estimate: the contract's items per second that the chip's
published peak FLOP/s and HBM bandwidth allow for this program's work (no overlap losses, no host time);
the peaks used are printed with it. With N chips the estimate
splits the work over them and adds the all-reduces' time at the published inter-chip bandwidth;
`--roofline-only` prints the estimate without building anything.
"""

import os

# libtpu takes a lockfile per process; a compile-only client needs no exclusive TPU access.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from core import sharding as sharding_rules  # noqa: E402
from core.attention import device_tables, gpu, selection, tpu  # noqa: E402
from core.attention.host_tables import pick_tile  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from core.model import CausalLM  # noqa: E402
from core.packing import ACCELERATOR_STEPS_PER_OCTAVE, PassArrays, build_pass, plan_passes  # noqa: E402
from core.requests import TokenizedRequest  # noqa: E402

# Published figures per chip: dense bf16 FLOP/s, HBM bytes/s (shared/model-notes.md), HBM capacity, and the
# bidirectional inter-chip bandwidth (Cloud TPU v5e/v6e documents: ICI 400 / 800 GB/s; NVIDIA: NVLink 4 on
# H100 SXM, 900 GB/s). `topology`: the compile-only slice per chip count.
TARGETS = {
    "tpu-v6e": {"platform": "tpu", "topology": {4: "v6e:2x2", 8: "v6e:2x4"}, "chip": "TPU v6e",
                "peak_flops": 918e12, "peak_hbm_bytes_per_s": 1640e9, "hbm_bytes": 32e9,
                "interconnect_bytes_per_s": 800e9},
    "tpu-v5e": {"platform": "tpu", "topology": {4: "v5e:2x2", 8: "v5e:2x4"}, "chip": "TPU v5e",
                "peak_flops": 197e12, "peak_hbm_bytes_per_s": 819e9, "hbm_bytes": 16e9,
                "interconnect_bytes_per_s": 400e9},
    "cuda-h100": {"platform": "cuda", "chip": "H100 SXM", "peak_flops": 989e12, "peak_hbm_bytes_per_s": 3350e9,
                  "hbm_bytes": 80e9, "interconnect_bytes_per_s": 900e9},
}
CHIPS_PER_HOST = 8  # v5e-8, v6e-8, an 8-GPU server: the hosts the per-host estimate is for

MODELS = {
    # Qwen3-0.6B's shape (random weights stand in for it on accelerators).
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                              head_dim=128, intermediate_size=3072, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                              qk_norm=True, tie_word_embeddings=True, max_position_embeddings=40960,
                              family="qwen3"),
    # The bundled SmolLM2-135M-Instruct (the GGUF's metadata; tests/test_aot.py checks they agree).
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                head_dim=64, intermediate_size=1536, rope_theta=100000.0,
                                rms_norm_eps=float(np.float32(1e-5)),  # as the GGUF stores it
                                qk_norm=False, tie_word_embeddings=True, max_position_embeddings=8192),
    # Windowed families, from their published config.json's fields: Gemma 2 2B (a 4,096-token window on
    # alternate layers, soft-caps, head_dim 256) and Mistral 7B v0.1 (a 4,096-token window on every layer).
    "gemma2-2b": ModelConfig.from_hf({
        "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 8192}),
    "mistral-7b": ModelConfig.from_hf({
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "sliding_window": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False}),
    # Shapes only (no weights), from their published config.json's fields: Qwen3-8B (Qwen3-Reranker-8B's
    # shape, 16.4 GB in bfloat16) and Gemma 2 9B (18.5 GB): more than a v5e chip's 16 GB.
    "qwen3-8b": ModelConfig.from_hf({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False}),
    "gemma2-9b": ModelConfig.from_hf({
        "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 8192}),
}

# The seeds' accelerator contract: one request = a 2,000-token query and 500 items of 20 tokens.
CONTRACT = {"query_tokens": 2000, "items": 500, "item_tokens": 20}
BLOCK_Q, BLOCK_K = 128, 64  # the engine's table tiles (Scorer defaults)


def model_specs(config: ModelConfig, dtype, shards: int = 1) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters as shapes, as the engine builds it (nothing is allocated);
    `shards`: laid out for that many chips (`config` then `core.sharding.sharded_config`'s)."""
    return nnx.split(nnx.eval_shape(lambda: CausalLM(config, dtype, shards)))


def contract_request(index: int = 0) -> TokenizedRequest:
    q, n, m = CONTRACT["query_tokens"], CONTRACT["items"], CONTRACT["item_tokens"]
    query = tuple(1000 + index * q + t for t in range(q))  # distinct queries: requests do not share a prefix
    return TokenizedRequest(query, tuple(tuple(range(5, 5 + m)) for _ in range(n)), (1,))


def contract_passes(pass_tokens: int, steps_per_octave: int = ACCELERATOR_STEPS_PER_OCTAVE) -> list[PassArrays]:
    """The passes an accelerator's engine runs for one contract request at this pass size (lengths from its
    ladder; `steps_per_octave` 1: a halving ladder)."""
    return [build_pass(p, BLOCK_Q, BLOCK_K, pass_tokens, steps_per_octave=steps_per_octave, row_buckets=True)
            for p in plan_passes([contract_request()], pass_tokens)]


def program_args(config: ModelConfig, arrays: PassArrays, dtype, sharding=None, mesh=None) -> tuple:
    """The pass program's arguments as shapes (with `sharding` where given). With a tensor-parallel `mesh`,
    the weights and the cache split as core.sharding says and the rest is on every chip."""
    if mesh is not None:
        sharding = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    i32 = lambda a: spec(np.shape(a), jnp.int32)
    meta = lambda m: (i32(m.seq), i32(m.item), i32(m.pos))
    cache_shape = (config.num_layers, arrays.cache_len, config.num_kv_heads, config.head_dim)
    state = model_specs(config, dtype, mesh.size if mesh is not None else 1)[1]
    if mesh is None:
        cache = spec(cache_shape, dtype)
        weights = jax.tree.map(lambda s: spec(s.shape, s.dtype), state)
    else:
        cache = jax.ShapeDtypeStruct(cache_shape, dtype, sharding=NamedSharding(mesh, sharding_rules.KV_CACHE))
        weights = jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), state,
                               sharding_rules.state_shardings(mesh, state))
    from core.scorer import MIN_LABEL_WIDTH

    labels = spec((len(arrays.score_rows), MIN_LABEL_WIDTH), jnp.int32)
    return (weights, i32(arrays.tokens), meta(arrays.q_meta), meta(arrays.kv_meta), i32(arrays.tile_ids),
            i32(arrays.tile_counts), cache, cache, i32(arrays.score_rows), labels, spec((), jnp.int32),
            spec((), jnp.int32))


def pass_program(config: ModelConfig, dtype, mesh=None):
    """The function one pass runs: `core.scorer`'s jitted pass with the Pallas attention path (split over
    a tensor-parallel `mesh` where given)."""
    from core.scorer import run_pass

    model_def = model_specs(config, dtype, mesh.size if mesh is not None else 1)[0]

    def run(weights, tokens, q_meta, kv_meta, tile_ids, tile_counts, cache_k, cache_v, score_rows, score_labels,
            n_rows, n_tokens):
        # The contract's request fits one pass and keeps no prefix: no keys/values come out.
        tables = ((tile_ids, tile_counts),) * len(config.attention_windows)  # one set per window (same shapes)
        return run_pass(weights, tokens, q_meta, kv_meta, tables, cache_k, cache_v, score_rows,
                        score_labels, n_rows, n_tokens, model_def=model_def, impl="pallas", block_q=BLOCK_Q,
                        block_k=BLOCK_K, keep_kv=False, mesh=mesh)
    return run


def count_kernels(text: str, platform: str) -> int:
    """Mosaic custom calls in a program's StableHLO text (a kernel inside the layer loop appears once)."""
    target = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
    return len(re.findall(rf"custom_call @{target}\w*\(", text))


def kernel_tiles(arrays: PassArrays, platform: str) -> tuple[int, int, int, int]:
    """The attention kernel's query and key tile sizes for this pass on `platform`, its padded query length,
    and the (query tile, key tile) pairs it visits per query head (masked work included)."""
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    if platform == "tpu":
        tq, tk = (pick_tile(device_tables.round_up(n, 128), t, 128)
                  for n, t in ((T, tpu.TPU_TILE_Q), (Tk, tpu.TPU_TILE_K)))
    else:
        tq, tk = gpu.GPU_TILE_Q, gpu.GPU_TILE_K
    q_len, kv_len = device_tables.round_up(T, max(tq, 128)), device_tables.round_up(Tk, max(tk, 128))
    ids, counts = device_tables.kernel_tables(jnp.asarray(arrays.tile_ids), jnp.asarray(arrays.tile_counts),
                                              BLOCK_Q, BLOCK_K, tq, tk, q_len, kv_len)
    return tq, tk, q_len, int(np.asarray(counts).sum())


def work_estimate(config: ModelConfig, passes: list[PassArrays], dtype, platform: str, chips: int = 1) -> dict:
    """FLOPs and HBM bytes one contract request needs in these passes, per chip of a group of `chips`
    (tensor parallel), counted from the program's shapes and the attention tables (what the kernel visits,
    masked work included): an estimate for a roofline.

    FLOPs: every projection and MLP matmul for every token of the padded pass (the last layer's output
    projection and MLP for the score rows only), the attention tile pairs
    the kernel visits (QK^T and PV), the LM head at the score rows; split evenly over the chips. Bytes: every
    weight read once per pass (each chip its share), per layer the activations a fused XLA program reads and
    writes (residual, q/k/v, attention output, MLP input/hidden/output; the float32 residual on every chip,
    the rest split), and the kernel's Q/K/V/O tile traffic (split by heads). `allreduce_bytes`: the float32
    [tokens, hidden] sums after o and down, two per layer per pass (none on one chip).
    """
    c, item = config, jnp.dtype(dtype).itemsize
    flops = hbm = allreduce = 0.0
    for arrays in passes:
        T, S = len(arrays.tokens), len(arrays.score_rows)  # the LM head's rows (bucketed)
        qkv = 2 * c.hidden_size * (c.q_size + 2 * c.kv_size)
        rest = 2 * (c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)  # o and the MLP
        tq, tk, q_len, pairs = kernel_tiles(arrays, platform)
        attn_flops = c.num_layers * c.num_heads * pairs * 4 * tq * tk * c.head_dim
        # The last layer's o and MLP run on the score rows only.
        layers = c.num_layers * qkv * T + rest * ((c.num_layers - 1) * T + S)
        flops += (layers + attn_flops + 2 * c.hidden_size * c.vocab_size * S) / chips
        weights = sum(np.prod(s.shape) for s in jax.tree.leaves(model_specs(c, dtype)[1])) * item
        residual = 2 * 4 * c.hidden_size  # residual in/out (float32), twice per layer: on every chip
        split = (2 * (c.q_size + 2 * c.kv_size) * item + 2 * c.q_size * item  # qkv, attention out
                 + (2 * c.intermediate_size * 2 + c.intermediate_size) * 4)  # gate/up out, hidden
        # The TPU kernel reads a K/V tile once for the query heads that share it; the GPU kernel once per query head.
        kv_reads = c.num_kv_heads if platform == "tpu" else c.num_heads
        kernel_bytes = (kv_reads * pairs * 2 * tk * c.head_dim * item  # K and V tiles of each visited pair
                        + c.num_heads * (q_len // tq) * 2 * tq * c.head_dim * item)  # Q in, O out
        hbm += weights / chips + c.num_layers * ((residual + split / chips) * T + kernel_bytes / chips)
        allreduce += 2 * c.num_layers * T * c.hidden_size * 4 if chips > 1 else 0
    return {"flops": flops, "hbm_bytes": hbm, "allreduce_bytes": allreduce}


def roofline(config: ModelConfig, target: dict, passes: list[PassArrays], dtype, chips: int = 1,
             model: str = "qwen3-0.6b") -> dict:
    """The estimate for a group of `chips` (tensor parallel): compute or HBM time per chip, whichever is
    longer, plus the all-reduces' time (a ring all-reduce sends and receives 2 (N-1)/N of the data per chip;
    counted at the published bidirectional bandwidth, not overlapped with compute)."""
    work = work_estimate(config, passes, dtype, target["platform"], chips)
    compute_s = work["flops"] / target["peak_flops"]
    memory_s = work["hbm_bytes"] / target["peak_hbm_bytes_per_s"]
    link_s = work["allreduce_bytes"] * 2 * (chips - 1) / chips / target["interconnect_bytes_per_s"]
    seconds = max(compute_s, memory_s) + link_s
    replicas = CHIPS_PER_HOST // chips
    return {
        "items_per_second_roofline": round(CONTRACT["items"] / seconds, 1),
        "roofline": {
            "estimate": True,
            "contract": dict(CONTRACT, model=model, dtype=jnp.dtype(dtype).name),
            "chip": target["chip"],
            "peak_flops": target["peak_flops"],
            "peak_hbm_bytes_per_s": target["peak_hbm_bytes_per_s"],
            "tensor_parallel": chips,
            "passes_per_request": len(passes),
            "flops_per_request": work["flops"],
            "hbm_bytes_per_request": work["hbm_bytes"],
            "allreduce_seconds_per_request": link_s,
            "bound": "compute" if compute_s >= memory_s else "memory",
            "seconds_per_request": seconds,
            "items_per_second_per_8_chip_host": round(replicas * CONTRACT["items"] / seconds, 1),
            "replicas_per_8_chip_host": replicas,
            "note": "an estimate from published peaks, not a measurement (the seeds measured sglang-jax on "
                    "one TPU v6e: 506.6 items/s)",
        },
    }


def topology_name(target: dict, chips: int) -> str:
    """The compile-only slice that holds `chips` chips (2x2 up to 4, 2x4 for 8)."""
    fits = [n for n in target["topology"] if n >= chips]
    if not fits:
        raise ValueError(f"no compile-only topology for {chips} chips (up to {max(target['topology'])})")
    return target["topology"][min(fits)]


def build(target_name: str, model: str, pass_tokens: int, dtype_name: str, tensor_parallel: int = 1,
          roofline_only: bool = False) -> dict:
    target = TARGETS[target_name]
    sharding_rules.check(MODELS[model], tensor_parallel, tensor_parallel)
    config = sharding_rules.sharded_config(MODELS[model], tensor_parallel)
    dtype = jnp.dtype(dtype_name)
    passes = contract_passes(pass_tokens)
    main = max(passes, key=lambda a: len(a.tokens))
    start = time.perf_counter()
    out = {"target": target_name, "model": model, "pass_tokens": len(main.tokens), "dtype": dtype_name,
           "tensor_parallel": tensor_parallel}
    if roofline_only:
        out["stage"] = "estimated"
    elif target["platform"] == "tpu":
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name(target, tensor_parallel), "tpu")
        if tensor_parallel > 1:
            mesh = sharding_rules.make_mesh(tensor_parallel, topology.devices)
            args = program_args(config, main, dtype, mesh=mesh)
        else:
            mesh = Mesh(np.asarray(topology.devices[:1]), ("chip",))
            args = program_args(config, main, dtype, NamedSharding(mesh, PartitionSpec()))
        program = pass_program(config, dtype, mesh if tensor_parallel > 1 else None)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = jax.jit(program).trace(*args).lower(lowering_platforms=("tpu",))
            compiled = lowered.compile()
        text = lowered.as_text()
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        mem = compiled.memory_analysis()
        out.update(stage="compiled", device_kind=topology.devices[0].device_kind,
                   pallas_kernels=count_kernels(text, "tpu"),
                   all_reduces=len(re.findall(r"all[-_]reduce", compiled.as_text())),
                   flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))
        if mem is not None:  # per chip: an SPMD program's analysis is one chip's
            peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                    - mem.alias_size_in_bytes)
            out["memory"] = {
                "per_chip": True, "argument_bytes": mem.argument_size_in_bytes,
                "output_bytes": mem.output_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
                "alias_bytes": mem.alias_size_in_bytes, "generated_code_bytes": mem.generated_code_size_in_bytes,
                "peak_bytes": peak, "chip_hbm_bytes": target["hbm_bytes"], "fits": peak < target["hbm_bytes"]}
    else:
        from jax import export

        mesh = sharding_rules.make_mesh(tensor_parallel) if tensor_parallel > 1 else None
        program = pass_program(config, dtype, mesh)
        exported = export.export(jax.jit(program), platforms=[target["platform"]])(
            *program_args(config, main, dtype, mesh=mesh))
        text = exported.mlir_module()
        out.update(stage="lowered", pallas_kernels=count_kernels(text, "cuda"), flops=None, bytes_accessed=None,
                   attention_path=selection.attention_path("cuda"), devices=exported.nr_devices)
    out["seconds"] = round(time.perf_counter() - start, 1)
    kernel_expected = selection.kernel_applies(target["platform"], jax.ShapeDtypeStruct((1, 1, config.head_dim), dtype),
                                               None, BLOCK_Q, BLOCK_K)
    if not roofline_only and kernel_expected and out["pallas_kernels"] < 1:
        raise RuntimeError(f"the {target_name} program has no Pallas kernel: {out}")
    if out.get("flops") is not None:
        out["xla_cost_note"] = ("XLA's cost analysis counts the layer loop's body once and a Pallas kernel as "
                                "nothing; the roofline uses the estimate below")
    out.update(roofline(MODELS["qwen3-0.6b"], target, passes, jnp.bfloat16))
    if (model, dtype_name, tensor_parallel) != ("qwen3-0.6b", "bfloat16", 1):
        own = roofline(config, target, passes, dtype, tensor_parallel, model)
        out["items_per_second_roofline_this_model"] = own["items_per_second_roofline"]
        out["roofline_this_model"] = own["roofline"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--pass-tokens", type=int, default=16384)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="chips the model is split over")
    parser.add_argument("--roofline-only", action="store_true", help="print the estimate; build nothing")
    args = parser.parse_args(argv)
    if args.tensor_parallel > 1 and TARGETS[args.target]["platform"] == "cuda":
        _host_devices(args.tensor_parallel)
    try:
        result = build(args.target, args.model, args.pass_tokens, args.dtype, args.tensor_parallel,
                       args.roofline_only)
    except Exception as exc:  # noqa: BLE001 - report any failure as a failed build
        print(json.dumps({"target": args.target, "model": args.model, "pass_tokens": args.pass_tokens,
                          "stage": "failed", "error": f"{type(exc).__name__}: {exc}"[:4000]}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


def _host_devices(n: int) -> None:
    """Lowering for n GPUs takes a mesh of n devices: n CPU host devices stand in (set before JAX starts)."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"


if __name__ == "__main__":
    sys.exit(main())
