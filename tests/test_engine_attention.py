"""The packed-attention implementations (cascade and block-sparse XLA, Pallas kernel in interpret mode)
against the dense reference on randomized pass layouts."""

import jax.numpy as jnp
import numpy as np
import pytest

from core.attention import host_tables, rule, selection, xla
from core.packing import PackedSequence, PassPlan, build_pass


def random_plan(rng, max_items: int) -> PassPlan:
    """Several sequences in one pass: random prefix lengths (some cached), items of length 0, 1 and long."""
    sequences = []
    for r in range(int(rng.integers(1, 4))):
        prefix = tuple(range(int(rng.integers(1, 120))))
        n = int(rng.integers(0, max_items + 1))
        lengths = rng.choice([0, 1, 1, 2, 5, 33], size=n)
        items = [(r, i, tuple(range(int(L)))) for i, L in enumerate(lengths) if L]
        empty = [(r, i) for i, L in enumerate(lengths) if not L]
        sequences.append(PackedSequence(prefix, bool(rng.integers(0, 2)), items=items, scored_at_prefix_end=empty))
    return PassPlan(sequences)


def run_all(arrays, heads=4, kv_heads=2, dim=16, seed=0, block_q=32, block_k=16, pallas=True, **layer):
    """Every implementation's output and the dense reference's, for a layer's `scale`, `softcap`, `window`."""
    rng = np.random.default_rng(seed)
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q = jnp.asarray(rng.normal(size=(T, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(Tk, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(Tk, kv_heads, dim)), jnp.float32)
    meta = lambda m: (jnp.asarray(m.seq), jnp.asarray(m.item), jnp.asarray(m.pos))
    qm, km = meta(arrays.q_meta), meta(arrays.kv_meta)
    window = layer.get("window", 0)
    ids, counts = (jnp.asarray(t) for t in host_tables.block_tables(arrays.q_meta, arrays.kv_meta, block_q,
                                                                    block_k, window=window))
    real = arrays.q_meta.seq >= 0
    ref = np.asarray(xla.dense_attention(q, k, v, qm, km, **layer))[real]
    tables = host_tables.cascade_tables(arrays.q_meta, arrays.kv_meta, window).as_tuple()
    outs = {"xla": xla.blocksparse_attention(q, k, v, qm, km, ids, counts, block_q, block_k, **layer),
            "cascade": xla.cascade_attention(q, k, v, qm, km, *tables, **layer)}
    if pallas:
        outs["pallas"] = selection.pallas_attention(q, k, v, qm, km, ids, counts, block_q=block_q,
                                                    block_k=block_k, interpret=True, **layer)
    return ref, {name: np.asarray(o)[real] for name, o in outs.items()}


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_match_dense(seed):
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, max_items=[0, 3, 20, 60, 120, 300][seed])
    arrays = build_pass(plan, 32, 16)
    ref, outs = run_all(arrays, seed=seed, pallas=seed < 4)  # interpret mode is slow: a few layouts suffice
    for name, out in outs.items():
        assert np.abs(out - ref).max() < 2e-5, name


def test_three_hundred_one_token_items_with_padding():
    items = [(0, i, (7,)) for i in range(300)]
    plan = PassPlan([PackedSequence(tuple(range(45)), items=items), PackedSequence((1, 2, 3), items=[(1, 0, (4, 5))])])
    arrays = build_pass(plan, 32, 16)
    assert len(arrays.tokens) > arrays.real_tokens  # padded to its bucket
    ref, outs = run_all(arrays, seed=9)
    for name, out in outs.items():
        assert np.abs(out - ref).max() < 2e-5, name


def test_tables_skip_invisible_tiles():
    """Cost follows the visible tiles: items never list other items' tiles, so the tiles per query tile
    stay at about prefix + own item, far below all tiles."""
    items = [(0, i, tuple(range(20))) for i in range(100)]
    plan = PassPlan([PackedSequence(tuple(range(500)), items=items)])
    arrays = build_pass(plan, 128, 64)
    n_key_tiles = len(arrays.kv_meta.seq) // 64
    prefix_tiles = -(-500 // 64)
    assert arrays.tile_counts.max() <= prefix_tiles + 3
    assert arrays.tile_counts.sum() < 0.4 * n_key_tiles * len(arrays.tile_counts)
    # and the tables never drop a visible pair (checked exactly against the token-level rule)
    q, kv = arrays.q_meta, arrays.kv_meta
    mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None])
    for i in range(len(arrays.tile_counts)):
        listed = set(arrays.tile_ids[i, : arrays.tile_counts[i]].tolist())
        needed = set(np.flatnonzero(mask[i * 128:(i + 1) * 128].reshape(128, -1, 64).any(axis=(0, 2))).tolist())
        assert needed <= listed


def test_cascade_prefix_windows_read_each_prefix_key_once():
    """The prefix part's windows start at each prefix's first key and stop at its end: sequences whose
    prefixes sit side by side in the cache (where one window reaches into the next prefix) count no key
    twice, and a window past a query tile's last position is not listed."""
    sequences = [PackedSequence(tuple(range(n)), cached, items=[(r, 0, (1, 2, 3))])
                 for r, (n, cached) in enumerate([(50, True), (700, True), (30, False)])]
    arrays = build_pass(PassPlan(sequences), 128, 64)
    tables = host_tables.cascade_tables(arrays.q_meta, arrays.kv_meta)
    q, kv = arrays.q_meta, arrays.kv_meta
    tile = len(q.seq) // len(tables.prefix_counts)
    for i, count in enumerate(tables.prefix_counts.sum(axis=1)):
        read = np.zeros(len(kv.seq) + host_tables.PREFIX_WIDE, int)
        for start, size in zip(tables.prefix_starts[i, :count], tables.prefix_sizes[i, :count]):
            read[start:start + size] += 1
        rows = slice(i * tile, (i + 1) * tile)
        mask = rule.visible(q.seq[rows, None], q.item[rows, None], q.pos[rows, None], kv.seq[None], kv.item[None],
                         kv.pos[None])
        needed = (mask & (kv.item[None] < 0)).any(axis=0)
        assert read.max() <= 1 and (read[: len(kv.seq)][needed] == 1).all()


@pytest.mark.parametrize("seed,window", [(0, 1), (1, 7), (2, 40), (3, 100), (4, 300)])
def test_sliding_windows_and_softcaps_match_dense(seed, window):
    """A window by position within each item's own sequence (query + item), a soft-cap and a scale of the
    layer's own, on random layouts (cached prefixes, long items, prefixes longer than the window)."""
    rng = np.random.default_rng(seed)
    arrays = build_pass(random_plan(rng, max_items=[20, 60, 120, 40, 300][seed]), 32, 16)
    layer = {"window": window, "softcap": [None, 1.5][seed % 2], "scale": 0.3}
    ref, outs = run_all(arrays, seed=seed, pallas=seed < 3, **layer)
    for name, out in outs.items():
        assert np.abs(out - ref).max() < 2e-5, name


def test_window_tables_skip_tiles_outside_the_window():
    """A 600-token query under a 64-token window: each query tile lists only the key tiles its window
    reaches, never one it needs (checked against the token-level rule), and far fewer than without it."""
    plan = PassPlan([PackedSequence(tuple(range(600)), items=[(0, i, tuple(range(20))) for i in range(10)])])
    arrays = build_pass(plan, 128, 64)
    q, kv = arrays.q_meta, arrays.kv_meta
    ids, counts = host_tables.block_tables(q, kv, 128, 64, window=64)
    assert counts.max() <= 4 and counts.sum() < arrays.tile_counts.sum() / 2
    mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None], 64)
    for i in range(len(counts)):
        needed = set(np.flatnonzero(mask[i * 128:(i + 1) * 128].reshape(128, -1, 64).any(axis=(0, 2))).tolist())
        assert needed <= set(ids[i, : counts[i]].tolist())
    tables = host_tables.cascade_tables(q, kv, window=64)
    # A tile's rows span at most PREFIX_TILE_Q positions and the window reaches 64 before them.
    reach = -(-(host_tables.PREFIX_TILE_Q + 64) // host_tables.PREFIX_WINDOW) + 1
    # of the query's windows:
    assert tables.prefix_counts.sum(axis=1).max() <= reach < -(-600 // host_tables.PREFIX_WINDOW)


def prefix_work(tables, tile: int) -> int:
    """The prefix part's (row, key) pairs: every row of a tile against each window listed for it."""
    wide, narrow = tables.prefix_counts.sum(axis=0)
    return int(wide * host_tables.PREFIX_WIDE + narrow * host_tables.PREFIX_WINDOW) * tile


@pytest.mark.parametrize("window", [0, 100])
def test_long_prefixes_in_wide_and_narrow_windows_match_dense(window):
    """Prefixes a wide window or longer (a partial wide one, several, a narrow tail), some cached, side by side
    with short ones and a sliding window: the cascade's two kinds of windows against the dense reference."""
    lengths = [(193, False), (256, True), (300, False), (449, True), (700, False), (40, False), (12, True)]
    sequences = [PackedSequence(tuple(range(n)), cached, items=[(r, i, tuple(range(1 + 7 * i))) for i in range(3)])
                 for r, (n, cached) in enumerate(lengths)]
    arrays = build_pass(PassPlan(sequences), 32, 16)
    assert host_tables.cascade_tables(arrays.q_meta, arrays.kv_meta, window).prefix_counts[:, 0].any()  # wide ones ran
    ref, outs = run_all(arrays, seed=3, pallas=False, window=window)
    assert np.abs(outs["cascade"] - ref).max() < 2e-5


def test_prefix_windows_depend_on_the_length_alone():
    """A prefix's windows (the order its keys' sums are added in) are a function of its length: whatever shares
    the pass, its wide windows first, then its tail's narrow ones, covering each key once, no wide window
    wider than the narrow ones it replaces."""
    for length in [1, 64, 65, 192, 193, 255, 256, 257, 449, 450, 500, 1000]:
        offsets, sizes, wide = host_tables.prefix_windows(length)
        assert (np.diff(offsets) == sizes[:-1]).all() and offsets[0] == 0 and offsets[-1] + sizes[-1] == length
        assert (sizes[wide] <= host_tables.PREFIX_WIDE).all() and (sizes[~wide] <= host_tables.PREFIX_WINDOW).all()
        assert not (wide[1:] & ~wide[:-1]).any()  # the wide ones first
        narrow_only = -(-length // host_tables.PREFIX_WINDOW) * host_tables.PREFIX_WINDOW
        assert wide.sum() * host_tables.PREFIX_WIDE + (~wide).sum() * host_tables.PREFIX_WINDOW <= narrow_only
        assert (~wide).sum() <= 3  # a tail of 4 narrow windows is one wide window
    for length in (40, 500):
        alone = PassPlan([PackedSequence(tuple(range(length)), items=[(0, 0, (1, 2))])])
        shared = PassPlan([PackedSequence(tuple(range(n)), items=[(r, 0, (1, 2))])
                           for r, n in enumerate([300, length, 70])])
        read = []
        for plan, seq in ((alone, 0), (shared, 1)):
            arrays = build_pass(plan, 32, 16)
            tables = host_tables.cascade_tables(arrays.q_meta, arrays.kv_meta)
            first = np.flatnonzero(arrays.kv_meta.seq == seq)[0]
            row = int(np.flatnonzero((arrays.q_meta.seq == seq) & (arrays.q_meta.item >= 0))[0])
            i = row // (len(arrays.q_meta.seq) // len(tables.prefix_counts))
            count = tables.prefix_counts[i].sum()
            listed = zip(tables.prefix_starts[i, :count], tables.prefix_sizes[i, :count])
            read.append([(int(start - first), int(size)) for start, size in listed
                         if arrays.kv_meta.seq[start] == seq])
        assert read[0] == read[1] == [(int(o), int(n)) for o, n in zip(*host_tables.prefix_windows(length)[:2])]


def test_cascade_prefix_work_for_a_long_query():
    """One request of a 500-token query and 100 items of 20 tokens (benchmarks.bench's default): its items' tiles read
    the query in 2 wide windows a step each (64-key windows took 8 steps, 5-11% slower, docs/performance.md), and
    the prefix part's work stays within 1.5x the (row, prefix key) pairs that see each other."""
    plan = PassPlan([PackedSequence(tuple(range(500)), items=[(0, i, tuple(range(20))) for i in range(100)])])
    arrays = build_pass(plan, 64, 64)
    q, kv = arrays.q_meta, arrays.kv_meta
    tables = host_tables.cascade_tables(q, kv)
    assert tables.prefix_counts.sum(axis=1).max() == 2 and (tables.prefix_counts[:, 1] == 0).all()
    tile = len(q.seq) // len(tables.prefix_counts)
    mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None])
    visible = int((mask & (kv.item[None] < 0)).sum())
    assert prefix_work(tables, tile) <= 1.5 * visible, (prefix_work(tables, tile), visible)


def test_cascade_prefix_work_stays_near_the_visible_keys_for_short_requests():
    """A pass of 17 short lines (a 40-token query and 2 items of 13 tokens each): the prefix part runs every row
    of a tile against each window listed for it, so its work is rows x keys per window. With 512-row tiles and
    256-key windows that was about 60 times the (row, prefix key) pairs that see each other, and the pass took
    1.6x the time of 3 lines of 20 items (docs/performance.md, "Short requests"); now it stays within 8 times."""
    sequences = [PackedSequence(tuple(range(1, 41)), items=[(r, i, tuple(range(50, 63))) for i in range(2)])
                 for r in range(17)]
    arrays = build_pass(PassPlan(sequences), 64, 64)
    q, kv = arrays.q_meta, arrays.kv_meta
    tables = host_tables.cascade_tables(q, kv)
    tile = len(q.seq) // len(tables.prefix_counts)
    work = prefix_work(tables, tile)
    mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None])
    visible = int((mask & (kv.item[None] < 0)).sum())
    assert visible > 0 and work <= 8 * visible, (work, visible)
