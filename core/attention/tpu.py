"""The TPU kernel, in the form of splash attention: the tables as scalar prefetch in SMEM, grid (query tiles,
KV heads, table slots), K/V tiles fetched by index maps that read the table, online softmax in VMEM scratch.
`interpret=True` (or a `pltpu.InterpretParams`) runs it on the CPU.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from core.attention.device_tables import (full_tiles, full_windows, kernel_tables, padded_inputs, round_up,
                                   window_kernel_tables)
from core.attention.rule import MASKED, NN, NT, q_scale, softcapped, visible
from core.attention.host_tables import part_starts, pick_tile

_LANES, _SUBLANES = 128, 8
# On v5e and v6e alike (docs/engine.md, "The TPU kernel's tiles"): a grid step costs ~0.35 us, so the tiles that
# visit fewer masked pairs (256x256: 1.24x the visible pairs against 1.48x) pay more in steps than they save.
TPU_TILE_Q, TPU_TILE_K = 512, 512


def kernel_for(q, k, block_q: int, block_k: int, **layer):
    """The TPU kernel for these inputs: it serves every dtype and head size."""
    return partial(tpu_attention, block_q=block_q, block_k=block_k, **layer)


def _tpu_kernel(ids_ref, counts_ref, full_ref, *refs, groups: int, width: int, scale: float,
                softcap: float | None = None, window: int = 0, aligned: bool = False):
    """One (query tile, KV head, table slot) step. q_ref [G, tq, D] (the G query heads of this KV head),
    k_ref/v_ref [tk, D] (the slot's key tile), q_*_ref [tq, 128] (ids broadcast over lanes),
    k_meta_ref [8, tk] (rows: seq, item, pos). Scratch m/l [G, tq, 128], acc [G, tq, D] in float32.
    `aligned`: the slot's window (tk keys from its first key, ids_ref) spans two key tiles, so each of
    k_meta_ref, k_ref and v_ref is a pair (the tiles), rotated here so that the window's first key comes first;
    its meta has a fourth row, the keys' parts, and parts_ref (first in refs) holds each slot's window's part."""
    parts_ref, refs = (refs[0], refs[1:]) if aligned else (None, refs)
    q_seq_ref, q_item_ref, q_pos_ref = refs[:3]
    if aligned:
        *key_tiles, q_ref, k_lo, k_hi, v_lo, v_hi, o_ref, m_ref, l_ref, acc_ref = refs[3:]
    else:
        k_meta_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs[3:]
    i, j = pl.program_id(0), pl.program_id(2)
    tq, d = q_ref.shape[1], q_ref.shape[2]
    tk = k_lo.shape[0] if aligned else k_ref.shape[0]
    reps = tk // _LANES
    if aligned:
        keys_of = partial(_window_of_tiles, shift=(2 * tk - ids_ref[i * width + j] % tk) % (2 * tk))
        load_meta, load_k, load_v = (lambda: keys_of(*key_tiles, axis=1), lambda: keys_of(k_lo, k_hi, axis=0),
                                     lambda: keys_of(v_lo, v_hi, axis=0))
    else:
        load_meta, load_k, load_v = (lambda: k_meta_ref[...], lambda: k_ref[...], lambda: v_ref[...])

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(mask):
        k = load_k()
        v = load_v()
        for g in range(groups):
            s = jax.lax.dot_general(q_ref[g], k, NT, preferred_element_type=jnp.float32) * scale  # [tq, tk]
            s = softcapped(s, softcap)
            if mask is not None:
                s = jnp.where(mask, s, MASKED)
            m_prev, l_prev = m_ref[g], l_ref[g]  # [tq, 128], every lane the same
            m_next = jnp.maximum(m_prev, s.max(axis=1)[:, None])
            p = jnp.exp(s - jnp.tile(m_next, (1, reps)))
            if mask is not None:  # a row with nothing visible yet has m = MASKED and exp(0) = 1 here
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[g] = alpha * l_prev + jax.lax.broadcast_in_dim(p.sum(axis=1), (tq, _LANES), (0,))
            m_ref[g] = m_next
            pv = jax.lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=jnp.float32)  # [tq, D]
            alpha_d = jnp.tile(alpha, (1, pl.cdiv(d, _LANES)))[:, :d]
            acc_ref[g] = alpha_d * acc_ref[g] + pv

    run = j < counts_ref[i]
    full = full_ref[i * width + j] != 0

    @pl.when(run & full)
    def _unmasked():
        update(None)

    @pl.when(run & jnp.logical_not(full))
    def _masked():
        km = load_meta()
        k_seq, k_item, k_pos = km[0:1, :], km[1:2, :], km[2:3, :]  # [1, tk]
        q_seq, q_item, q_pos = (jnp.tile(r[...], (1, reps)) for r in (q_seq_ref, q_item_ref, q_pos_ref))  # [tq, tk]
        mask = visible(q_seq, q_item, q_pos, k_seq, k_item, k_pos, window)
        if aligned:  # the window's own part: the keys after it are another part's (or another sequence's)
            mask &= km[3:4, :] == parts_ref[i * width + j]
        update(mask)

    @pl.when(j == pl.num_programs(2) - 1)
    def _write():  # also for a query tile that sees nothing (padding): zeros
        for g in range(groups):
            l = l_ref[g]
            inv = 1.0 / jnp.where(l == 0.0, 1.0, l)
            o_ref[g] = (acc_ref[g] * jnp.tile(inv, (1, pl.cdiv(d, _LANES)))[:, :d]).astype(o_ref.dtype)


def _window_of_tiles(lo_ref, hi_ref, shift, axis: int):
    """The window of lo_ref.shape[axis] keys along `axis` that starts `shift` keys before the end of the two
    tiles lo_ref, hi_ref put together (its first key moved to the front by a rotation, in 32 bits)."""
    from jax.experimental.pallas import tpu as pltpu

    both = jnp.concatenate([lo_ref[...], hi_ref[...]], axis=axis)
    rotated = pltpu.roll(both.astype(jnp.float32) if both.dtype.itemsize < 4 else both, shift, axis)
    return jax.lax.slice_in_dim(rotated, 0, lo_ref.shape[axis], axis=axis).astype(both.dtype)


def tpu_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                  tile_q: int = TPU_TILE_Q, tile_k: int = TPU_TILE_K, interpret=False, scale: float | None = None,
                  softcap: float | None = None, window: int = 0, aligned: bool = False):
    """The TPU kernel, in the form of splash attention: tables in SMEM (scalar prefetch), grid
    (query tiles, KV heads, table slots), the slot's K/V tiles fetched by index maps that read the
    table, online softmax in VMEM scratch. Same arguments and result as `blocksparse_attention`;
    `interpret`: False (compile for a TPU), True or a `pltpu.InterpretParams` (run on the CPU).
    `aligned`: the tables are `window_tables`, and each slot reads the window of tile_k keys at its first key
    (see ALIGNED_KEY_TILES): Mosaic's DMAs start at whole tiles only (an element offset does not compile:
    "Couldn't prove that tiling (128) divides index"), so it fetches the two tiles the window spans and rotates."""
    from jax.experimental.pallas import tpu as pltpu

    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    G = H // Hkv
    quantum_q, quantum_k = math.lcm(block_q, _LANES), math.lcm(block_k, _LANES)
    q_len, kv_len = round_up(T, quantum_q), round_up(Tk, quantum_k)
    tq, tk = pick_tile(q_len, tile_q, quantum_q), pick_tile(kv_len, tile_k, quantum_k)
    if aligned:  # windows of tile_k keys whatever the pass's length; the last one's second tile is padding
        assert tile_k % quantum_k == 0, f"tile_k {tile_k} is not a multiple of {quantum_k}"
        tk, kv_len = tile_k, round_up(Tk, tile_k) + tile_k
    q, k, v, q_meta, kv_meta = padded_inputs(q, k, v, tuple(q_meta), tuple(kv_meta), q_len, kv_len)
    if aligned:
        parts = part_starts(kv_meta[0], kv_meta[1])
        ids, counts, window_parts = window_kernel_tables(tile_ids, tile_counts, parts, block_q, block_k, tq, tk, q_len)
        full = full_windows(ids, q_meta, kv_meta, parts, tq, tk, window)
        k_rows = jnp.stack([*kv_meta, parts]).astype(jnp.int32)
        window_parts = (window_parts.reshape(-1),)
        halves = (0, 1)  # a window is read as the two key tiles it spans (a DMA's offset must be a whole tile)
        tile_of = lambda first: first // tk
    else:
        ids, counts = kernel_tables(tile_ids, tile_counts, block_q, block_k, tq, tk, q_len, kv_len)
        full = full_tiles(ids, q_meta, kv_meta, tq, tk, window)
        k_rows, window_parts = jnp.stack(kv_meta).astype(jnp.int32), ()
        halves, tile_of = (0,), lambda tile: tile
    nq, width = ids.shape
    # The grid runs the slots of the longest row only (a traced bound): a row is padded to the tables' static
    # width, mostly far more than any row lists, and each grid step costs ~0.35 us even when it skips.
    slots = jnp.maximum(counts.max(), 1)

    q_lanes = [jax.lax.broadcast_in_dim(m.astype(jnp.int32), (q_len, _LANES), (0,)) for m in q_meta]
    k_rows = jnp.zeros((_SUBLANES, kv_len), jnp.int32).at[:len(k_rows)].set(k_rows)
    qh = q.transpose(1, 0, 2)  # [H, T, D]: heads h*G .. h*G+G-1 share KV head h
    kh = k.transpose(1, 0, 2)  # [Hkv, Tk, D]
    vh = v.transpose(1, 0, 2)

    def key_specs(block, index):
        return [pl.BlockSpec(block, lambda i, h, j, ids_ref, *_, half=half: index(h, tile_of(ids_ref[i * width + j])
                                                                                 + half)) for half in halves]

    q_meta_spec = pl.BlockSpec((tq, _LANES), lambda i, h, j, *_: (i, 0))
    kernel = partial(_tpu_kernel, groups=G, width=width, scale=q_scale(scale, D), softcap=softcap, window=window,
                     aligned=aligned)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3 + len(window_parts),
            grid=(nq, Hkv, slots),
            in_specs=[
                q_meta_spec, q_meta_spec, q_meta_spec,
                *key_specs((_SUBLANES, tk), lambda h, tile: (0, tile)),
                pl.BlockSpec((G, tq, D), lambda i, h, j, *_: (h, i, 0)),
                *key_specs((None, tk, D), lambda h, tile: (h, tile, 0)),
                *key_specs((None, tk, D), lambda h, tile: (h, tile, 0)),
            ],
            out_specs=pl.BlockSpec((G, tq, D), lambda i, h, j, *_: (h, i, 0)),
            scratch_shapes=[
                pltpu.VMEM((G, tq, _LANES), jnp.float32),
                pltpu.VMEM((G, tq, _LANES), jnp.float32),
                pltpu.VMEM((G, tq, D), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((H, q_len, D), q.dtype),
        interpret=interpret,
        name="packed_attention_tpu",
    )(ids.reshape(-1), counts, full.reshape(-1), *window_parts, *q_lanes, *(k_rows,) * len(halves), qh,
      *(kh,) * len(halves), *(vh,) * len(halves))
    return out.transpose(1, 0, 2)[:T]

