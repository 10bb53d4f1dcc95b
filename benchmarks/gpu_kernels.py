"""The Mosaic GPU attention kernel on the GPU at hand, today's and the aligned one (issue 45, item 4):
`python -m benchmarks.gpu_kernels`. One request is laid out four ways (its query in the pass or cached, alone or
packed between other requests); for each kernel: whether that request's output rows are bitwise the same in
every layout, and their largest distance from the dense float32 reference. A kernel that fails to compile or run
prints its whole traceback (the engine's probe logs only the exception's first line). tests/test_engine_tpu.py
runs the same comparison in interpret mode on a CPU.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from core import attention as A
from core.packing import PackedSequence, PassPlan, build_pass

BLOCK_Q, BLOCK_K = 128, 64  # the engine's tables
HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-0.6B's attention


def layouts(query: int, items: tuple[int, ...], others: list[tuple[int, tuple[int, ...], bool]]):
    """(plan, the request's sequence index) with its query in the pass and cached, alone and between `others`."""
    def sequence(length, sizes, cached, tag):
        return PackedSequence(tuple(range(length)), cached, items=[(tag, i, tuple(range(n)))
                                                                   for i, n in enumerate(sizes) if n],
                              scored_at_prefix_end=[(tag, i) for i, n in enumerate(sizes) if not n])
    half = len(others) // 2
    out = []
    for cached, packed in ((False, False), (True, False), (False, True), (True, True)):
        around = [sequence(*o, tag=t + 1) for t, o in enumerate(others)] if packed else []
        out.append((PassPlan(around[:half] + [sequence(query, items, cached, 0)] + around[half:]),
                    half if packed else 0))
    return out


def vectors(meta, mine: int, heads: int, table: np.ndarray) -> np.ndarray:
    """Per token, a vector that depends on its request, item and position only (so the request's rows must not
    move with the layout); padding 0."""
    tag = np.where(meta.seq == mine, 0, 1 + meta.seq % (table.shape[0] - 1))
    out = table[tag, meta.item + 1, meta.pos].reshape(-1, heads, DIM)
    return np.where((meta.seq >= 0)[:, None, None], out, 0.0)


def request_rows(aligned: bool, plans) -> tuple[list[np.ndarray], float]:
    rng = np.random.default_rng(0)
    tables = [rng.normal(size=(4, 16, 640, h * DIM)).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS)]
    rows, distance = [], 0.0
    for plan, mine in plans:
        arrays = build_pass(plan, BLOCK_Q, BLOCK_K)
        metas = (arrays.q_meta, arrays.kv_meta, arrays.kv_meta)
        q, k, v = (jnp.asarray(vectors(m, mine, h, t), jnp.bfloat16)
                   for m, h, t in zip(metas, (HEADS, KV_HEADS, KV_HEADS), tables))
        qm, km = ((jnp.asarray(m.seq), jnp.asarray(m.item), jnp.asarray(m.pos)) for m in metas[:2])
        tables_of = A.window_tables if aligned else A.block_tables
        ids, counts = tables_of(arrays.q_meta, arrays.kv_meta, BLOCK_Q, BLOCK_K)
        kernel = jax.jit(lambda *a: A.gpu_attention(*a, BLOCK_Q, BLOCK_K, aligned=aligned))
        out = np.asarray(kernel(q, k, v, qm, km, jnp.asarray(ids), jnp.asarray(counts)).astype(jnp.float32))
        f32 = lambda x: x.astype(jnp.float32)
        ref = np.asarray(A.dense_attention(f32(q), f32(k), f32(v), qm, km))
        real = arrays.q_meta.seq >= 0
        distance = max(distance, float(np.abs(out[real] - ref[real]).max()))
        keep = (arrays.q_meta.seq == mine) & (arrays.q_meta.item >= 0)
        order = np.lexsort((arrays.q_meta.pos[keep], arrays.q_meta.item[keep]))
        rows.append(out[np.flatnonzero(keep)[order]])
    return rows, distance


def main() -> None:
    print(f"devices: {jax.devices()}; jax {jax.__version__}")
    plans = layouts(300, (20,) * 12 + (7, 0, 33), [(130, (7, 9), False), (200, (3, 4), True), (61, (5,), False)])
    for aligned in (False, True):
        try:
            rows, distance = request_rows(aligned, plans)
            moved = [float(np.abs(r - rows[0]).max()) for r in rows[1:]]
            print(f"aligned={aligned}: rows bitwise in every layout: {all(m == 0 for m in moved)} (largest move per "
                  f"layout {moved}); largest distance from float32 dense {distance:.3e}", flush=True)
        except Exception:  # noqa: BLE001 - the point is to see why
            print(f"aligned={aligned}: FAILED\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
