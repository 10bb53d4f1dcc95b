"""One request laid out several ways (its query in the pass or cached, alone or packed between other requests),
and its attention rows in each: the kernels must give that request's rows the same bits wherever it sits
(issue 45). Used by tests/test_engine_tpu.py (interpret mode) and benchmarks/gpu_kernels.py (a GPU)."""

import jax.numpy as jnp
import numpy as np

from core.attention import host_tables, xla
from core.packing import PackedSequence, PassPlan, build_pass


def reference(q, k, v, qm, km, **layer):
    f32 = lambda x: x.astype(jnp.float32)
    return np.asarray(xla.dense_attention(f32(q), f32(k), f32(v), qm, km, **layer))


def request_layouts(query: int, items: tuple[int, ...], others: list[tuple[int, tuple[int, ...], bool]]):
    """(plan, the request's sequence id) for: its query in the pass, cached, and packed between `others`
    ((query length, item lengths, cached)), once with its query in the pass and once cached."""
    def sequence(length, sizes, cached, tag):
        items = [(tag, i, tuple(range(n))) for i, n in enumerate(sizes) if n]
        return PackedSequence(tuple(range(length)), cached, items=items,
                              scored_at_prefix_end=[(tag, i) for i, n in enumerate(sizes) if not n])
    before, after = others[: len(others) // 2], others[len(others) // 2:]
    plans = []
    for cached, packed in ((False, False), (True, False), (False, True), (True, True)):
        around = [sequence(*o, tag=t + 1) for t, o in enumerate(others)] if packed else []
        mine = sequence(query, items, cached, tag=0)
        plans.append((PassPlan(around[: len(before)] + [mine] + around[len(before):]), len(before) if packed else 0))
    return plans


def token_vectors(meta, mine: int, heads: int, dim: int, table: np.ndarray) -> np.ndarray:
    """Per token, table[request, item + 1, position] (heads x dim); the request is 0 for sequence `mine`, else
    1 + the sequence id (the others' vectors need only differ from the request's); padding and hidden keys 0."""
    tag = np.where(meta.seq == mine, 0, 1 + meta.seq % (table.shape[0] - 1))
    out = table[tag, meta.item + 1, meta.pos].reshape(-1, heads, dim)
    return np.where((meta.seq >= 0)[:, None, None], out, 0.0)


def request_rows(kernel, plans, heads: int, kv_heads: int, dim: int, dtype, block_q: int, block_k: int,
                 host_tables=host_tables.window_tables, **layer):
    """The request's output rows (its items' tokens, and the row scoring its query alone), keyed by (item,
    position), per layout; and each layout's largest distance from the dense reference over its real rows.
    `host_tables`: the kernel's tables (`window_tables` for the aligned kernels, `block_tables` for today's)."""
    rng = np.random.default_rng(11)
    tables = [rng.normal(size=(4, 16, 640, h * dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads)]
    rows, distances = [], []
    for plan, mine in plans:
        arrays = build_pass(plan, block_q, block_k)
        q, k, v = (jnp.asarray(token_vectors(m, mine, h, dim, t), dtype)
                   for m, h, t in zip((arrays.q_meta, arrays.kv_meta, arrays.kv_meta), (heads, kv_heads, kv_heads),
                                      tables))
        qm, km = ((jnp.asarray(m.seq), jnp.asarray(m.item), jnp.asarray(m.pos))
                  for m in (arrays.q_meta, arrays.kv_meta))
        ids, counts = host_tables(arrays.q_meta, arrays.kv_meta, block_q, block_k, window=layer.get("window", 0))
        out = np.asarray(kernel(q, k, v, qm, km, jnp.asarray(ids), jnp.asarray(counts), block_q, block_k,
                                **layer).astype(jnp.float32))
        ref = reference(q, k, v, qm, km, **layer)
        real = arrays.q_meta.seq >= 0
        distances.append(np.abs(out[real] - ref[real]).max())
        query_end = int(np.max(arrays.q_meta.pos[(arrays.q_meta.seq == mine) & (arrays.q_meta.item < 0)]))
        keep = (arrays.q_meta.seq == mine) & ((arrays.q_meta.item >= 0) | (arrays.q_meta.pos == query_end))
        keys = sorted(zip(arrays.q_meta.item[keep].tolist(), arrays.q_meta.pos[keep].tolist(), np.flatnonzero(keep)))
        rows.append(({(item, pos) for item, pos, _ in keys}, out[[row for *_, row in keys]]))
    return rows, distances
