"""The Mosaic GPU attention kernels on the GPU at hand, the default, the aligned one and the warp-specialized one
(core.attention.gpu_ws): `python -m benchmarks.gpu_kernels`. One request is laid out four ways (its query in the
pass or cached, alone or packed between other requests; tests/request_layouts.py, which tests/test_engine_tpu.py
runs in interpret mode on a CPU); for each kernel: whether that request's output rows are bitwise the same in every
layout, and their largest distance from the dense float32 reference. Then the default and the warp-specialized
kernel's time on the contract's largest pass (one layer's attention, Qwen3-0.6B's heads). A kernel that fails to
compile or run prints its whole traceback (the engine's probe logs only the exception's first line). On a CPU (the
device check's dry run): each kernel lowered for CUDA, nothing run.
"""

import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from core.aot import contract_passes
from core.attention import gpu, gpu_ws, host_tables
from core.packing import build_pass
from tests.request_layouts import request_layouts, request_rows

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-0.6B's attention
BLOCK_Q, BLOCK_K = 128, 64  # the engine's tables
KERNELS = {"default": gpu.gpu_attention, "aligned": partial(gpu.gpu_attention, aligned=True),
           "ws": gpu_ws.ws_attention}


def lower_for_cuda(kernels: dict) -> None:
    """Each kernel lowered for CUDA on one layout (`jax.export`: Mosaic GPU's lowering and its checks), a line each.
    On a CPU the kernels' rows run in GPU interpret mode in tests/test_engine_tpu.py and test_engine_gpu_ws.py, not
    here: a step with a time limit, where the interpreter's threads have stalled for minutes."""
    from jax import export

    (plan, _), *_ = request_layouts(20, (3, 1, 0, 11), [(7, (5,), False), (30, (2, 0), True)])
    arrays = build_pass(plan, BLOCK_Q, BLOCK_K)
    T, Tk = len(arrays.q_meta.seq), len(arrays.kv_meta.seq)
    q, k, v = (jax.ShapeDtypeStruct((n, h, DIM), jnp.bfloat16) for n, h in ((T, HEADS), (Tk, KV_HEADS),
                                                                          (Tk, KV_HEADS)))
    meta = lambda m: tuple(jnp.asarray(x) for x in (m.seq, m.item, m.pos))
    for name, kernel in kernels.items():
        tables = host_tables.window_tables if name == "aligned" else host_tables.block_tables
        ids, counts = tables(arrays.q_meta, arrays.kv_meta, BLOCK_Q, BLOCK_K, window=0)
        try:
            exported = export.export(jax.jit(kernel, static_argnums=(7, 8)), platforms=["cuda"])(
                q, k, v, meta(arrays.q_meta), meta(arrays.kv_meta), jnp.asarray(ids), jnp.asarray(counts), BLOCK_Q,
                BLOCK_K)
            print(f"{name}: lowered for CUDA ({len(exported.mlir_module())} characters of MLIR; not run: no GPU)",
                  flush=True)
        except Exception:  # noqa: BLE001 - the point is to see why
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)


def main() -> None:
    print(f"devices: {jax.devices()}; jax {jax.__version__}")
    if jax.default_backend() == "cpu":  # a dry run of the device check
        lower_for_cuda(KERNELS)
        return
    plans = request_layouts(300, (20,) * 12 + (7, 0, 33), [(130, (7, 9), False), (200, (3, 4), True),
                                                           (61, (5,), False)])
    for name, kernel in KERNELS.items():
        try:
            tables = host_tables.window_tables if name == "aligned" else host_tables.block_tables
            rows, distances = request_rows(jax.jit(kernel, static_argnums=(7, 8)), plans, HEADS, KV_HEADS,
                                           DIM, jnp.bfloat16, BLOCK_Q, BLOCK_K, host_tables=tables)
            moved = [float(np.abs(r - rows[0][1]).max()) for keys, r in rows[1:]]
            print(f"{name}: rows bitwise in every layout: {all(m == 0 for m in moved)} (largest move per "
                  f"layout {moved}); largest distance from float32 dense {max(distances):.3e}", flush=True)
        except Exception:  # noqa: BLE001 - the point is to see why
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    arrays = max(contract_passes(16384), key=lambda a: len(a.tokens))
    rng = np.random.default_rng(0)
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q, k, v = (jnp.asarray(rng.normal(size=(n, h, DIM)), jnp.bfloat16) for n, h in ((T, HEADS), (Tk, KV_HEADS),
                                                                                     (Tk, KV_HEADS)))
    meta = lambda m: tuple(jnp.asarray(x) for x in (m.seq, m.item, m.pos))
    args = (q, k, v, meta(arrays.q_meta), meta(arrays.kv_meta), jnp.asarray(arrays.tile_ids),
            jnp.asarray(arrays.tile_counts), BLOCK_Q, BLOCK_K)
    for name in ("default", "ws"):
        try:
            kernel = jax.jit(KERNELS[name], static_argnums=(7, 8))
            jax.block_until_ready(kernel(*args))
            start = time.perf_counter()
            for _ in range(20):
                out = kernel(*args)
            jax.block_until_ready(out)
            print(f"{name}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms a layer's attention ({T} queries, "
                  f"{Tk} keys)", flush=True)
        except Exception:  # noqa: BLE001 - the point is to see why
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
