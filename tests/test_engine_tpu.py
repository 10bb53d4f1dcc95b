"""The accelerator attention kernels against the dense reference, on the CPU.

- The TPU kernel (core.attention.tpu) runs in TPU interpret mode, which simulates HBM, VMEM,
  SMEM and the pipeline's DMAs, with the race detector on and out-of-bounds reads raising; memory is
  filled with NaN, so an output block the kernel never writes shows up.
- The Mosaic GPU kernel (core.attention.gpu) runs in GPU interpret mode, which runs one block
  of its grid and has no WGMMA on register or transposed operands: the tables, the pipeline's index maps,
  the masking and the online softmax are checked, the WGMMA calls are not (see tests/test_aot.py for
  its lowering).
Layouts are random: several sequences, cached prefixes, 0 to 300 items of lengths 0, 1 and long, padding.
"""

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental.pallas import tpu as pltpu

from core.attention import device_tables, gpu, host_tables, rule, selection, tpu, xla as xla_paths
from core.packing import PackedSequence, PassPlan, build_pass
from tests.request_layouts import reference, request_layouts, request_rows

STRICT = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")


def layout(rng, sequences: int, max_items: int, lengths=(0, 1, 1, 2, 5, 33), prefix=(1, 300)) -> PassPlan:
    seqs = []
    for r in range(sequences):
        n = int(rng.integers(0, max_items + 1))
        sizes = rng.choice(lengths, size=n)
        items = [(r, i, tuple(range(int(s)))) for i, s in enumerate(sizes) if s]
        empty = [(r, i) for i, s in enumerate(sizes) if not s]
        cached = bool(rng.integers(0, 2)) and n > 0  # (the engine runs no pass for a cached prefix alone)
        seqs.append(PackedSequence(tuple(range(int(rng.integers(*prefix)))), cached, items=items,
                                   scored_at_prefix_end=empty))
    return PassPlan(seqs)


def inputs(arrays, heads, kv_heads, dim, dtype, seed):
    rng = np.random.default_rng(seed)
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
               for shape in ((T, heads, dim), (Tk, kv_heads, dim), (Tk, kv_heads, dim)))
    meta = lambda m: (jnp.asarray(m.seq), jnp.asarray(m.item), jnp.asarray(m.pos))
    return q, k, v, meta(arrays.q_meta), meta(arrays.kv_meta), jnp.asarray(arrays.tile_ids), jnp.asarray(
        arrays.tile_counts)


def run_tpu(arrays, tile=128, heads=4, kv_heads=2, dim=64, dtype=jnp.float32, seed=0, **layer):
    args = inputs(arrays, heads, kv_heads, dim, dtype, seed)
    if layer.get("window"):  # the window's own tables
        args = (*args[:5], *(jnp.asarray(t) for t in host_tables.block_tables(arrays.q_meta, arrays.kv_meta, 128,
                                                                                64, window=layer["window"])))
    tpu_interpreter.reset_tpu_interpret_mode_state()
    out = tpu.tpu_attention(*args, 128, 64, tile_q=tile, tile_k=tile, interpret=STRICT, **layer)
    out = np.asarray(out.astype(jnp.float32))
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    return out, reference(*args[:5], **layer)


def check(arrays, out, ref, tol):
    real = arrays.q_meta.seq >= 0
    assert np.isfinite(out).all()  # every output block was written (memory starts as NaN)
    assert np.abs(out[real] - ref[real]).max() < tol
    assert (out[~real] == 0).all()  # padding rows see nothing: zeros, not garbage


# (seed, sequences, max items, item lengths, prefix lengths)
LAYOUTS = [
    (0, 1, 0, (0, 1, 33), (1, 300)),  # no items (a query scored alone)
    (1, 3, 20, (0, 1, 1, 2, 5, 33), (1, 300)),
    (2, 2, 60, (0, 1, 1, 2, 5, 33), (100, 400)),
    (3, 1, 4, (150, 400), (130, 260)),  # long items, longer than a tile
    (4, 3, 40, (1, 20), (200, 600)),
]


@pytest.mark.parametrize("seed,sequences,max_items,lengths,prefix", LAYOUTS)
def test_tpu_kernel_random_layouts_match_dense(seed, sequences, max_items, lengths, prefix):
    arrays = build_pass(layout(np.random.default_rng(seed), sequences, max_items, lengths, prefix), 128, 64)
    out, ref = run_tpu(arrays, seed=seed)
    check(arrays, out, ref, 2e-5)


@pytest.mark.parametrize("seed,window,softcap", [(1, 5, None), (3, 128, 2.0), (4, 300, 30.0)])
def test_tpu_kernel_sliding_windows_and_softcaps(seed, window, softcap):
    """Windows shorter than a tile, a tile long and longer than the prefixes; the unmasked fast path must
    respect the window too (full tiles under a short window are not full)."""
    _, sequences, max_items, lengths, prefix = LAYOUTS[seed]
    arrays = build_pass(layout(np.random.default_rng(seed), sequences, max_items, lengths, prefix), 128, 64)
    out, ref = run_tpu(arrays, seed=seed, window=window, softcap=softcap, scale=0.2)
    check(arrays, out, ref, 2e-5)


def test_tpu_kernel_three_hundred_one_token_items_and_padding():
    items = [(0, i, (7,)) for i in range(300)]
    plan = PassPlan([PackedSequence(tuple(range(290)), items=items, prefix_cached=True),
                     PackedSequence((1, 2, 3), items=[(1, 0, (4, 5))])])
    arrays = build_pass(plan, 128, 64)
    assert arrays.cache_len > 0 and len(arrays.tokens) > arrays.real_tokens
    out, ref = run_tpu(arrays, seed=9)
    check(arrays, out, ref, 2e-5)


def test_tpu_kernel_default_tiles_bfloat16_and_the_unmasked_fast_path():
    """The kernel's own tile size (512) over the engine's tables, bf16 as on a TPU, GQA 3:1 with head_dim 64
    (SmolLM2) ; the layout has tiles that need no mask (prefix keys under one sequence's items)."""
    rng = np.random.default_rng(5)
    items = [(0, i, tuple(range(int(n)))) for i, n in enumerate(rng.integers(0, 25, 90))]
    arrays = build_pass(PassPlan([PackedSequence(tuple(range(1100)), items=items)]), 128, 64)
    args = inputs(arrays, 6, 2, 64, jnp.bfloat16, 5)
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q_len, kv_len = device_tables.round_up(T, 512), device_tables.round_up(Tk, 512)
    ids, counts = device_tables.kernel_tables(args[5], args[6], 128, 64, 512, 512, q_len, kv_len)
    qm, km = device_tables.padded_inputs(*args[:5], q_len, kv_len)[3:]
    full = np.asarray(device_tables.full_tiles(ids, qm, km, 512, 512))
    listed = np.arange(ids.shape[1])[None] < np.asarray(counts)[:, None]
    assert (full & listed).any() and (~full & listed).any()  # both paths of the kernel run
    tpu_interpreter.reset_tpu_interpret_mode_state()
    out = np.asarray(tpu.tpu_attention(*args, 128, 64, interpret=STRICT).astype(jnp.float32))
    assert not tpu_interpreter.races.races_found
    check(arrays, out, reference(*args[:5]), 3e-2)


def test_tpu_kernel_grid_runs_the_longest_rows_slots():
    """The grid's slot dimension is traced (the longest row's count), not the tables' static width: on the
    contract pass at 512x512 the width is 24 slots and no row lists more than 6, each skipped step ~0.35 us."""
    arrays = build_pass(layout(np.random.default_rng(1), 3, 20), 128, 64)
    args = inputs(arrays, 4, 2, 64, jnp.float32, 1)
    jaxpr = jax.make_jaxpr(partial(tpu.tpu_attention, block_q=128, block_k=64, tile_q=128, tile_k=128,
                                   interpret=True))(*args)
    (grid,) = [e.params["grid_mapping"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert grid.num_dynamic_grid_bounds == 1 and isinstance(grid.grid[0], int) and isinstance(grid.grid[1], int)


def test_tpu_kernel_tables_from_smaller_host_tiles():
    """The engine's tables may use tiles smaller than the kernel's (here 32 x 16, and T not a multiple of
    128): the kernel regrids them and pads the pass, dropping nothing."""
    arrays = build_pass(layout(np.random.default_rng(7), 2, 30), 32, 16)
    args = inputs(arrays, 4, 2, 64, jnp.float32, 7)
    tpu_interpreter.reset_tpu_interpret_mode_state()
    out = np.asarray(tpu.tpu_attention(*args, 32, 16, tile_q=128, tile_k=128, interpret=STRICT))
    check(arrays, out, reference(*args[:5]), 2e-5)


def test_kernel_tables_never_drop_a_visible_pair():
    regrid = jax.jit(device_tables.kernel_tables, static_argnums=(2, 3, 4, 5, 6, 7))
    for seed in range(3):
        arrays = build_pass(layout(np.random.default_rng(seed), 3, 80), 128, 64)
        q, kv = arrays.q_meta, arrays.kv_meta
        mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None])
        T, Tk = mask.shape
        for tq, tk in ((128, 128), (512, 512), (64, 64), (256, 128)):
            q_len, kv_len = device_tables.round_up(T, max(tq, 128)), device_tables.round_up(Tk, max(tk, 128))
            ids, counts = regrid(jnp.asarray(arrays.tile_ids), jnp.asarray(arrays.tile_counts), 128, 64,
                                 tq, tk, q_len, kv_len)
            ids, counts = np.asarray(ids), np.asarray(counts)
            padded = np.zeros((q_len, kv_len), bool)
            padded[:T, :Tk] = mask
            tiles = padded.reshape(q_len // tq, tq, kv_len // tk, tk).any(axis=(1, 3))
            for i in range(len(counts)):
                listed = ids[i, : counts[i]]
                assert set(np.flatnonzero(tiles[i])) <= set(listed.tolist())
                assert (np.diff(listed) > 0).all()  # ascending, no repeats
                assert (ids[i, counts[i]:] == (listed[-1] if counts[i] else 0)).all()  # padded: no new fetch


def test_interpret_mode_catches_a_bad_table(monkeypatch):
    """The checks are live: a kernel table entry past the last key tile is an out-of-bounds read, not a
    silent clamp. (The host tables cannot carry one through: regridding drops ids out of range.)"""
    regrid = device_tables.kernel_tables

    def corrupted(*a, **kw):
        ids, counts = regrid(*a, **kw)
        return ids.at[0, 0].set(a[-1] // a[5] + 3), counts  # kv_len // tile_k + 3
    monkeypatch.setattr(tpu, "kernel_tables", corrupted)
    arrays = build_pass(layout(np.random.default_rng(1), 1, 5), 128, 64)
    args = inputs(arrays, 2, 1, 64, jnp.float32, 1)
    tpu_interpreter.reset_tpu_interpret_mode_state()
    with pytest.raises(Exception, match="(?i)out.of.bounds|bounds"):
        jax.block_until_ready(tpu.tpu_attention(*args, 128, 64, tile_q=128, tile_k=128, interpret=STRICT))
    tpu_interpreter.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("dim,seed,cached,layer", [(64, 0, True, {}), (128, 1, False, {}), (64, 2, False, {}),
                                                   (64, 3, True, {"window": 9, "softcap": 2.0, "scale": 0.2}),
                                                   (256, 4, False, {"window": 30})])
def test_gpu_kernel_in_gpu_interpret_mode(dim, seed, cached, layer):
    """One block (GPU interpret mode runs one): a 64-token query tile over a cached prefix and/or its own."""
    rng = np.random.default_rng(seed)
    prefix = tuple(range(int(rng.integers(20, 200) if cached else rng.integers(5, 25))))
    budget = 64 - (0 if cached else len(prefix))
    items, used = [], 0
    while used < budget - 12:
        n = int(rng.choice([0, 1, 3, 11]))
        items.append((0, len(items), tuple(range(n))))
        used += n
    plan = PassPlan([PackedSequence(prefix, cached, items=[it for it in items if it[2]],
                                    scored_at_prefix_end=[(0, it[1]) for it in items if not it[2]])])
    arrays = build_pass(plan, 64, 64)
    assert len(arrays.tokens) == 64
    args = inputs(arrays, 1, 1, dim, jnp.bfloat16, seed)
    out = gpu.gpu_attention(*args, 64, 64, interpret=InterpretGPUParams(detect_races=True), **layer)
    out = np.asarray(out.astype(jnp.float32))
    check(arrays, out, reference(*args[:5], **layer), 3e-2)


def test_engine_pallas_on_cpu_is_the_xla_path(caplog):
    """attention="pallas" lowered for the CPU runs the XLA block-sparse path (lax.platform_dependent)."""
    arrays = build_pass(layout(np.random.default_rng(3), 2, 10), 128, 64)
    args = inputs(arrays, 4, 2, 16, jnp.float32, 3)
    out = np.asarray(selection.pallas_attention(*args, block_q=128, block_k=64))
    xla = np.asarray(xla_paths.blocksparse_attention(*args, 128, 64))
    assert np.array_equal(out, xla)
    assert selection.attention_path() == "xla"


def test_a_new_kernel_is_one_row_of_the_selection_table(monkeypatch):
    """A row of selection.KERNELS is all a kernel needs: the programs lowered for its platform get it (here a
    stand-in kernel for the CPU, twice the XLA path's output), and attention_path names it."""
    def kernel_for(q, k, block_q, block_k, **layer):
        return lambda *args: 2 * xla_paths.blocksparse_attention(*args, block_q, block_k, **layer)
    monkeypatch.setattr(selection, "KERNELS", (*selection.KERNELS, selection.Kernel("cpu", "stand-in", kernel_for)))
    monkeypatch.setattr(selection, "_paths", {})
    selection.pallas_attention.clear_cache()
    arrays = build_pass(layout(np.random.default_rng(3), 2, 10), 128, 64)
    args = inputs(arrays, 4, 2, 16, jnp.float32, 3)
    out = np.asarray(selection.pallas_attention(*args, block_q=128, block_k=64))
    assert np.array_equal(out, 2 * np.asarray(xla_paths.blocksparse_attention(*args, 128, 64)))
    assert selection.attention_path() == "stand-in"
    selection.pallas_attention.clear_cache()


def test_a_kernel_that_does_not_compile_here_falls_back_once(monkeypatch, caplog):
    """On a device whose compiler rejects the kernel, the program gets the XLA path and one warning."""
    monkeypatch.setattr(selection, "_HOST_PLATFORM", {"cpu": "tpu"})  # pretend this CPU is a TPU: Mosaic cannot compile
    monkeypatch.setattr(selection, "_kernel_ok", {})
    selection.pallas_attention.clear_cache()  # trace again: the choice is made when a program is traced
    arrays = build_pass(layout(np.random.default_rng(4), 2, 10), 128, 64)
    with caplog.at_level(logging.WARNING, logger="core.attention"):
        for heads in (4, 6):  # two shapes: two probes, one warning
            args = inputs(arrays, heads, 2, 16, jnp.float32, 4)
            out = np.asarray(selection.pallas_attention(*args, block_q=128, block_k=64))
            assert np.abs(out - reference(*args[:5]))[arrays.q_meta.seq >= 0].max() < 2e-5
    warnings = [r for r in caplog.records if "does not compile" in r.getMessage()]
    assert len(warnings) == 1 and "pallas-tpu" in warnings[0].getMessage()
    assert selection.attention_path("tpu") == "xla"
    selection.pallas_attention.clear_cache()


# ---- The same request's rows, bitwise, wherever it sits (issue 45, item 4) ----------------------------------
# One request (a query, items of other lengths, an empty one) laid out with its query in the pass, with its query
# cached, and packed between other requests of other lengths (their queries in the pass or cached): each key and
# query vector is a function of its request, item and position only, so the request's rows must come out
# bitwise the same. The aligned kernels (ALIGNED_KEY_TILES) read windows that start at each part's own first key.

def tpu_aligned(*args, **layer):
    tpu_interpreter.reset_tpu_interpret_mode_state()
    out = tpu.tpu_attention(*args, tile_q=128, tile_k=128, interpret=STRICT, aligned=True, **layer)
    assert not tpu_interpreter.races.races_found
    return out


@pytest.mark.parametrize("query,items,others,layer", [
    (150, (40, 1, 0, 97, 3), [(90, (5, 0, 60), True), (7, (2, 130), False), (300, (1,) * 9, False)], {}),
    (300, (20,) * 12 + (0,), [(13, (129,), False), (200, (3, 4), True)], {"window": 70, "softcap": 5.0}),
])
def test_tpu_kernel_rows_do_not_move_with_the_cache_or_the_pass(query, items, others, layer):
    # Two query heads on a KV head (GQA): each KV head more is as many grid steps again.
    rows, distances = request_rows(tpu_aligned, request_layouts(query, items, others), 2, 1, 64, jnp.float32,
                                   128, 64, **layer)
    (keys, first), *rest = rows
    for other_keys, other in rest:
        assert other_keys == keys and np.array_equal(other, first)
    assert max(distances) < 2e-5


def test_gpu_kernel_rows_do_not_move_with_the_cache_or_the_pass():
    """GPU interpret mode runs one block: every layout fits one 64-token query tile."""
    run = partial(gpu.gpu_attention, interpret=InterpretGPUParams(detect_races=True), aligned=True)
    for query, items, others, layer in ((20, (3, 1, 0, 11), [(7, (5,), False), (30, (2, 0), True)], {}),
                                        (9, (17, 0, 6), [(40, (1, 1), True), (3, (4,), False)], {"window": 12})):
        rows, distances = request_rows(run, request_layouts(query, items, others), 1, 1, 64, jnp.bfloat16, 64, 64,
                                       **layer)
        (keys, first), *rest = rows
        for other_keys, other in rest:
            assert other_keys == keys and np.array_equal(other, first)
        assert max(distances) < 3e-2


def test_engine_scores_do_not_move_with_the_cache_or_the_pass(monkeypatch):
    """The engine on CPU with the aligned TPU kernel in interpret mode inside the whole pass program, bitwise: a
    request's log-probs with its query in the pass, read from the prefix cache, and packed between other
    requests (their queries new or cached). The passes differ in cache length; the cached one runs in a pass of
    256 tokens, the others in passes of 512: bitwise among the 512-token passes; between the lengths within 2e-6,
    since XLA's CPU programs for the two lengths need not give a row the same bits (the same on an AMD EPYC with
    AVX512-BF16; 9.5e-7 apart on an Intel Xeon without it, 2026-11-28: docs/score-semantics.md)."""
    from core import Scorer
    from core import scorer as engine

    monkeypatch.setattr(host_tables, "ALIGNED_KEY_TILES", True)  # block_tables and pallas_attention read it, tracing
    monkeypatch.setattr(engine, "_PROGRAMS", engine._Programs())
    jax.clear_caches()
    scorer = Scorer.from_pretrained("tiny-random", pass_tokens=512, attention="pallas-interpret")
    rng = np.random.default_rng(12)
    tokens = lambda n: rng.integers(5, 49152, n).tolist()
    mine = scorer.tokenize(tokens(150), [tokens(n) for n in (40, 1, 0, 97, 3)], [1, 7, 400])
    others = [scorer.tokenize(tokens(q), [tokens(n) for n in sizes], [2, 3])
              for q, sizes in ((90, (5, 0, 60)), (7, (2, 130)), (33, (1,) * 9))]

    def logprobs(requests: list, index: int, engine=scorer) -> np.ndarray:
        out = np.full((mine.n_items, len(mine.label_token_ids)), np.nan)
        for p in engine.iter_passes(requests):
            for part in p.scores:
                if part.request == index:
                    out[part.items] = part.logprobs
        return out

    in_pass = logprobs([mine], 0)
    cached = logprobs([mine], 0)  # its query is in the prefix cache now
    scorer.clear_prefix_cache()
    list(scorer.iter_passes([others[0]]))  # that one's query cached
    packed = logprobs([others[0], mine, others[1]], 1)
    packed_cached = logprobs([others[2], others[1], mine], 2)
    xla = Scorer(scorer.config, scorer.model, scorer.tokenizer, name="tiny", pass_tokens=512, attention="xla")
    assert np.abs(logprobs([mine], 0, xla) - in_pass).max() <= 1e-5
    for other in (packed, packed_cached):
        assert np.array_equal(other, in_pass)
    assert np.abs(cached - in_pass).max() <= 2e-6
    jax.clear_caches()


def test_window_tables_never_drop_a_visible_pair():
    """Every visible (query, key) pair lies in a window listed for the query's kernel tile, of the key's own part,
    and the windows start at multiples of the kernel's tile from their part's first key; the XLA path's tiles
    from the windows give the dense result."""
    for seed in range(3):
        arrays = build_pass(layout(np.random.default_rng(seed), 3, 80), 128, 64)
        q, kv = arrays.q_meta, arrays.kv_meta
        mask = rule.visible(q.seq[:, None], q.item[:, None], q.pos[:, None], kv.seq[None], kv.item[None], kv.pos[None])
        parts = host_tables.part_starts(kv.seq, kv.item)
        host = host_tables.window_tables(q, kv, 128, 64)
        for tq, tk in ((128, 128), (256, 512), (64, 64)):
            q_len = device_tables.round_up(len(q.seq), max(tq, 128))
            ids, counts, window_parts = (np.asarray(t) for t in device_tables.window_kernel_tables(
                *(jnp.asarray(t) for t in host), jnp.asarray(parts), 128, 64, tq, tk, q_len))
            padded = np.pad(parts, (0, tk))
            for i in range(len(counts)):
                firsts = ids[i, : counts[i]]
                assert (np.diff(firsts) > 0).all() and ((firsts - parts[firsts]) % tk == 0).all()
                assert (window_parts[i, : counts[i]] == parts[firsts]).all()
                covered = np.zeros(len(parts) + tk, bool)  # keys of the listed windows' own parts
                for first in firsts:
                    covered[first:first + tk] |= padded[first:first + tk] == parts[first]
                assert covered[np.flatnonzero(mask[i * tq:(i + 1) * tq].any(axis=0))].all()
    args = inputs(arrays, 4, 2, 16, jnp.float32, 2)
    out = np.asarray(selection.pallas_attention(*args[:5], *(jnp.asarray(t) for t in host), block_q=128, block_k=64,
                                        aligned=True))
    real = arrays.q_meta.seq >= 0  # (the XLA path leaves padding rows that share a tile with real ones unset)
    assert np.abs(out[real] - reference(*args[:5])[real]).max() < 2e-5
