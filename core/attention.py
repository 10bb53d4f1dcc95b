"""Packed multi-item attention.

Every token of a pass carries metadata (sequence id, item id, position). The rule of
docs/score-semantics.md: query token q sees key k iff both belong to the same sequence,
k is in that sequence's shared prefix (item id -1) or in q's own item, and
pos(k) <= pos(q); in a layer with a sliding window W, also pos(q) - pos(k) < W (positions
within the item's own sequence, query + item, as the single-sequence model counts them).
Padding uses sequence ids that never match (-1 for queries, -2 for keys).

Every implementation takes the layer's `scale` on q.k (None: head_dim ** -0.5), its
`softcap` (Gemma 2: scores -> cap * tanh(scores / cap)) and its `window` (0: none) as
static values: a model has one program per distinct window, not one per layer.

Like splash attention, the mask's block structure is computed on the host into
small tables, and the implementations read only what those list, so cost follows
the visible keys, never T x T:
- `cascade_attention`: plain XLA, the default on CPU. A shared-prefix split (as
  Hydragen and FlashInfer's cascade attention): all of a tile's query rows against
  windows of their sequence's prefix keys as dense matmuls, plus a small
  block-diagonal part for each item's own keys (`cascade_tables`).
- `blocksparse_attention`: plain XLA over `block_tables` (for each query tile, the
  ids of the key tiles it can see and their count); the Pallas path's fallback.
- `pallas_attention`: the accelerator path, chosen per platform when the program is
  lowered (`lax.platform_dependent`): on TPU `tpu_attention` (splash-attention form:
  tables as scalar prefetch in SMEM, grid (query tiles, KV heads, table slots), K/V
  tiles fetched by index maps that read the table); on CUDA `gpu_attention` (Mosaic
  GPU: the tables drive `plgpu.emit_pipeline`); elsewhere the block-sparse XLA path. A kernel that
  does not compile on the device at hand is logged once and replaced by the XLA path
  (`attention_path` tells which is in use). `interpret=True` (or a
  `pltpu.InterpretParams`) runs the TPU kernel on the CPU.
`dense_attention` is the O(T^2) reference the tests compare against.
"""

import logging
import math
import os
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

QUERY_PAD_SEQ = -1
KEY_PAD_SEQ = -2
_MASKED = -1e30


@dataclass(frozen=True)
class TokenMeta:
    """Per-token metadata of one side of the attention (queries or keys); int32 arrays [T]."""

    seq: np.ndarray
    item: np.ndarray
    pos: np.ndarray


def visible(q_seq, q_item, q_pos, k_seq, k_item, k_pos, window: int = 0):
    """The packing rule, broadcast over whatever shapes are given (jnp or np)."""
    rule = (q_seq == k_seq) & ((k_item < 0) | (k_item == q_item)) & (k_pos <= q_pos)
    return rule & (q_pos - k_pos < window) if window else rule


def _scores(s, softcap: float | None):
    """Scaled scores after the soft-cap, if any (float32)."""
    return jnp.tanh(s / softcap) * softcap if softcap else s


def _tile_ranges(values: np.ndarray, include: np.ndarray, tile: int, empty_low: int, empty_high: int):
    v = values.reshape(-1, tile)
    inc = include.reshape(-1, tile)
    low = np.where(inc, v, empty_high).min(axis=1)
    high = np.where(inc, v, empty_low).max(axis=1)
    return low, high


def block_tables(q: TokenMeta, kv: TokenMeta, block_q: int, block_k: int,
                 items_only: bool = False, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Which key tiles each query tile can see: (ids [nq, max_count], counts [nq]); with `items_only`, only
    the tiles holding keys of the query tile's own items (the item part of `cascade_attention`); with a
    `window`, not the tiles whose keys are all a window or more before the tile's earliest query.

    Conservative per tile pair (a listed tile may be partly masked: the kernels mask
    exactly inside tiles), never missing a visible pair. Rows are padded by repeating
    the last visible id so a padded entry is a harmless reload, not a fault.

    With ALIGNED_KEY_TILES (and not `items_only`), the kernels' tables instead: `window_tables`.
    """
    if ALIGNED_KEY_TILES and not items_only:
        return window_tables(q, kv, block_q, block_k, window)
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    q_real = q.seq >= 0
    k_real = kv.seq >= 0
    q_is_item = q_real & (q.item >= 0)
    k_is_item = k_real & (kv.item >= 0)
    k_is_prefix = k_real & (kv.item < 0)
    # Items are laid out contiguously, so (seq, item) ranges per tile are tight.
    q_group = q.seq.astype(np.int64) * (1 << 32) + q.item
    k_group = kv.seq.astype(np.int64) * (1 << 32) + kv.item

    qs_lo, qs_hi = _tile_ranges(q.seq.astype(np.int64), q_real, block_q, small, big)
    qg_lo, qg_hi = _tile_ranges(q_group, q_is_item, block_q, small, big)
    qp_lo, qp_hi = _tile_ranges(q.pos.astype(np.int64), q_real, block_q, small, big)
    kp_seq_lo, kp_seq_hi = _tile_ranges(kv.seq.astype(np.int64), k_is_prefix, block_k, small, big)
    kg_lo, kg_hi = _tile_ranges(k_group, k_is_item, block_k, small, big)
    kp_lo, kp_hi = _tile_ranges(kv.pos.astype(np.int64), k_real, block_k, small, big)

    def overlap(a_lo, a_hi, b_lo, b_hi):
        return (a_lo[:, None] <= b_hi[None, :]) & (b_lo[None, :] <= a_hi[:, None])

    sees_prefix = False if items_only else overlap(qs_lo, qs_hi, kp_seq_lo, kp_seq_hi)
    sees_item = overlap(qg_lo, qg_hi, kg_lo, kg_hi)
    causal = kp_lo[None, :] <= qp_hi[:, None]
    # Keys are laid out as [cached prefix, this pass's tokens] in causal order, so a key
    # tile that starts after a query tile's last token is invisible to it.
    cache_len = len(kv.seq) - len(q.seq)
    k_start = np.arange(len(kv.seq) // block_k) * block_k
    q_end = cache_len + (np.arange(len(q.seq) // block_q) + 1) * block_q - 1
    vis = (sees_prefix | sees_item) & causal & (k_start[None, :] <= q_end[:, None])
    if window:
        vis &= kp_hi[None, :] > qp_lo[:, None] - window

    return _listed_columns(vis)


def _listed_columns(vis: np.ndarray, names: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's visible columns in order (their `names`, default their indices), then its last one repeated
    (a padded entry is a harmless reload); rows seeing none list 0. Returns (ids, counts), int32."""
    counts = vis.sum(axis=1).astype(np.int32)
    width = max(int(counts.max(initial=0)), 1)
    visible = np.argsort(~vis, axis=1, kind="stable")[:, :width]  # a stable sort puts them first, in order
    visible = (visible if names is None else names[visible]).astype(np.int32)
    last = visible[np.arange(len(counts)), np.maximum(counts - 1, 0)]
    ids = np.where(np.arange(width)[None, :] < counts[:, None], visible, last[:, None])
    ids[counts == 0] = 0
    return ids, counts


def pad_tables(ids: np.ndarray, width: int) -> np.ndarray:
    """Widen `ids` to a bucketed width (a static shape), repeating each row's last id."""
    if ids.shape[1] >= width:
        return ids[:, :width]
    return np.concatenate([ids, np.repeat(ids[:, -1:], width - ids.shape[1], axis=1)], axis=1)


def dense_attention(q, k, v, q_meta, kv_meta, scale: float | None = None, softcap: float | None = None,
                    window: int = 0):
    """Reference: materializes the full [T, Tk] mask. q [T, H, D], k/v [Tk, Hkv, D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(T, Hkv, H // Hkv, D).astype(jnp.float32)
    s = _scores(jnp.einsum("thgd,khd->hgtk", qg, k.astype(jnp.float32)) * _scale(scale, D), softcap)
    mask = visible(q_meta[0][:, None], q_meta[1][:, None], q_meta[2][:, None],
                   kv_meta[0][None, :], kv_meta[1][None, :], kv_meta[2][None, :], window)
    s = jnp.where(mask, s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("hgtk,khd->thgd", p, v.astype(jnp.float32))
    return o.reshape(T, H, D).astype(q.dtype)


def _scale(scale: float | None, head_dim: int) -> float:
    return scale if scale is not None else 1.0 / float(np.sqrt(head_dim))


SLOT_GROUP = 4  # key tiles per step of the XLA path's loop (4 x 64 keys: big enough matmuls, little waste)


def blocksparse_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                          scale: float | None = None, softcap: float | None = None, window: int = 0):
    """Plain-XLA attention over the visible tiles only (see module doc); the Pallas path's fallback.

    Query tiles are processed one at a time (`lax.map`) so each tile's scores stay in cache; materializing all
    tiles' scores at once is memory-bound and ~3x slower on CPU. Each query tile loops over its own visible key
    tiles, SLOT_GROUP at a time (online softmax), for as many steps as its count needs: the table's width is
    only an upper bound, so a worker can use one width per pass size and the width is not a compile key.
    """
    T, H, D = q.shape
    m, acc, l = _tile_loop(q * _scale(scale, D), k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q, block_k,
                           SLOT_GROUP, softcap, window)
    # A query row that sees nothing (padding) has zero sums: its output is zeros.
    return (acc / jnp.where(l > 0, l, 1.0)).reshape(T, H, D).astype(q.dtype)


def _tile_loop(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int, group: int,
               softcap: float | None = None, window: int = 0):
    """The online-softmax state of every query row over the key tiles its tile lists (`group` tiles a step):
    (max [T, Hkv, G, 1], unnormalized output [T, Hkv, G, D], row sum [T, Hkv, G, 1]), float32. q comes scaled.
    A row that saw nothing has max _MASKED."""
    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    nq, width = tile_ids.shape
    G = H // Hkv
    tile_ids = jnp.asarray(tile_ids)
    if width % group:  # repeat each row's last id, as pad_tables does
        tile_ids = jnp.concatenate([tile_ids, jnp.repeat(tile_ids[:, -1:], -width % group, axis=1)], axis=1)
    k_tiles = k.reshape(Tk // block_k, block_k, Hkv, D)
    # The row sums come out of the same matmul as p @ v (ones appended to v): a matmul adds its terms in key
    # order, so an item's result does not depend on where other items sit in the pass. A plain reduction's
    # rounding does, by enough to break the 1e-5 isolation rule. The ones are as wide as v: a single ones
    # column (half the work) changed the CPU matmul's blocking and broke the isolation rule again
    # (tests/test_engine_parity.py, 2026-11-21).
    # v and p are float32 (as they are anyway with float32 weights, the CPU default): rounding p to bfloat16
    # for the matmul, as the accelerators' kernels do, moved bfloat16 log-probs of SmolLM2 by about 0.015.
    v = v.astype(jnp.float32)
    v_tiles = jnp.concatenate([v, jnp.ones_like(v)], axis=-1).reshape(Tk // block_k, block_k, Hkv, 2 * D)
    k_meta_tiles = [m.reshape(Tk // block_k, block_k) for m in kv_meta]

    def one_tile(args):
        q_tile, ids, count, q_seq, q_item, q_pos = args

        def step(g, carry):
            m, acc = carry
            group_ids = jax.lax.dynamic_slice_in_dim(ids, g * group, group)
            kt = k_tiles[group_ids].reshape(group * block_k, Hkv, D)
            vt = v_tiles[group_ids].reshape(group * block_k, Hkv, 2 * D)
            k_seq, k_item, k_pos = (t[group_ids].reshape(group * block_k) for t in k_meta_tiles)
            mask = visible(q_seq[:, None], q_item[:, None], q_pos[:, None], k_seq[None, :], k_item[None, :],
                           k_pos[None, :], window)
            mask &= jnp.repeat(g * group + jnp.arange(group) < count, block_k)[None, :]
            s = _scores(jnp.einsum("ihgd,jhd->hgij", q_tile, kt, preferred_element_type=jnp.float32), softcap)
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
            p = jnp.exp(s - m_new)
            pv = jnp.einsum("hgij,jhd->hgid", p, vt, preferred_element_type=jnp.float32)
            return m_new, acc * jnp.exp(m - m_new) + pv

        init = (jnp.full((Hkv, G, block_q, 1), _MASKED, jnp.float32), jnp.zeros((Hkv, G, block_q, 2 * D), jnp.float32))
        m, acc = jax.lax.fori_loop(0, (count + group - 1) // group, step, init)
        rows_first = lambda x: x.transpose(2, 0, 1, 3)  # [block_q, Hkv, G, ...]: tiles stack into rows
        return rows_first(m), rows_first(acc[..., :D]), rows_first(acc[..., D:D + 1])

    q_tiles = q.reshape(nq, block_q, Hkv, G, D)
    q_meta_tiles = [m.reshape(nq, block_q) for m in q_meta]
    out = jax.lax.map(one_tile, (q_tiles, tile_ids, tile_counts, *q_meta_tiles))
    return tuple(x.reshape(T, *x.shape[2:]) for x in out)


# ---- Cascade (shared-prefix) attention: the CPU path ---------------------------------------
#
# As Hydragen (arXiv 2402.05099) and FlashInfer's cascade attention: a token's keys are its sequence's
# prefix and its own item's earlier tokens. The prefix part is dense: many query rows at once against
# windows of the prefix's keys. The item part is small and block-diagonal: the tile loop above over the
# tiles holding the items' keys. The two merge exactly through their maxima and row sums.
#
# The prefix windows start at the prefix's first key, wherever the prefix sits in the pass, so a row's
# sums over them are added in the same order whatever the other items are: a plain row sum keeps the 1e-5
# isolation rule there, and only the item part needs the sums out of its matmul.

# Query rows per tile of both parts (fewer where the pass length needs it), and prefix keys per step. A window
# runs all of its tile's rows against its keys, though only its own sequence's rows see them: with short
# requests (a 1,024-token pass of 17 lines of a 40-token query and 2 items) 512-row tiles and 256-key windows
# made the pass 1.6x slower than 3 lines of 20 items. 128 and 64: that pass 2.4-2.8 -> 1.35-1.9 s, and none of
# five other shapes (long queries, 4,096-token passes, a 64-token call) slower (docs/performance.md, "Short
# requests": 512/256, 256/128, 128/128 and 64/64 measured too).
PREFIX_TILE_Q = 128
PREFIX_WINDOW = 64
# A long prefix is read in windows of PREFIX_WIDE keys, its tail (under 193 keys) in windows of PREFIX_WINDOW:
# a 500-token query takes 2 steps per tile, not 8 (64-key windows only made one long request 5-11% slower).
# A wide window is never more keys than the narrow ones it replaces (a partial one only where they would be 4),
# and a prefix's windows depend on its length alone, wherever it sits and whatever shares its tile.
PREFIX_WIDE = 256
ITEM_TILE = 16  # query rows and keys per item-part sub-tile: a sub-tile of short items reaches back few keys
ITEM_SLOTS = 4  # key tiles per step: a sub-tile's short items are read in one step (see cascade_attention)
# Columns of ones after v in the item part's PV matmul, whose first gives the row sums (see cascade_attention).
# One would do; 16 keep the columns a multiple of the vector width: 80 instead of v's width doubled (128). The
# N=100 pass: 3.99-4.08 s against 4.19-5.26 s (medians of 4, three alternating rounds; fastest runs 3.97 s
# against 4.02 s): a few per cent at most, within this machine's noise, but never slower.
SUM_COLUMNS = 16


@dataclass(frozen=True)
class CascadeTables:
    """Host tables of `cascade_attention` (int32)."""

    prefix_starts: np.ndarray  # [T / prefix tile, width]: each window's first key, per query tile
    prefix_sizes: np.ndarray  # [T / prefix tile, width]: each window's keys of its prefix (other keys follow)
    prefix_counts: np.ndarray  # [T / prefix tile, 2]: windows in use, of PREFIX_WIDE keys, then of PREFIX_WINDOW
    item_ids: np.ndarray  # [T / ITEM_TILE, width]: key tiles (of ITEM_TILE) holding the tile's items' keys
    item_counts: np.ndarray  # [T / ITEM_TILE]

    def as_tuple(self) -> tuple[np.ndarray, ...]:
        return self.prefix_starts, self.prefix_sizes, self.prefix_counts, self.item_ids, self.item_counts


def cascade_table_shapes(T: int, Tk: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of `CascadeTables.as_tuple()` for T queries and Tk keys: they depend on nothing else, so
    the tables are no compile key. A prefix tile holds at most `tile` sequences, each with its windows
    (no more than ceil(len / PREFIX_WINDOW) <= len / PREFIX_WINDOW + 1)."""
    tile = _pick_tile(T, PREFIX_TILE_Q, 64)
    windows = (T // tile, Tk // PREFIX_WINDOW + tile + 1)
    return windows, windows, (T // tile, 2), (T // ITEM_TILE, T // ITEM_TILE), (T // ITEM_TILE,)


def prefix_windows(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prefix's windows: offsets from its first key, sizes (its keys in each), and which are wide (PREFIX_WIDE
    keys; the rest PREFIX_WINDOW), the wide ones first."""
    n_wide = (length + PREFIX_WINDOW - 1) // PREFIX_WIDE
    offsets = np.concatenate([np.arange(n_wide) * PREFIX_WIDE, np.arange(n_wide * PREFIX_WIDE, length, PREFIX_WINDOW)])
    wide = np.arange(len(offsets)) < n_wide
    return offsets, np.minimum(length - offsets, np.where(wide, PREFIX_WIDE, PREFIX_WINDOW)), wide


def cascade_tables(q: TokenMeta, kv: TokenMeta, window: int = 0) -> CascadeTables:
    """The tables of `cascade_attention` for a pass; with a `window`, a prefix window whose keys are all a
    window or more before every row of its sequence in the tile is not listed."""
    T, Tk = len(q.seq), len(kv.seq)
    shape = cascade_table_shapes(T, Tk)[0]
    tile = T // shape[0]
    # Each sequence's prefix keys are contiguous: in the cache, or at the start of its span of the pass.
    prefix_keys = np.flatnonzero((kv.seq >= 0) & (kv.item < 0))
    seqs, first, lengths = np.unique(kv.seq[prefix_keys], return_index=True, return_counts=True)
    prefix = {int(seq): (int(start), prefix_windows(int(n)))
              for seq, start, n in zip(seqs, prefix_keys[first], lengths)}
    starts = np.zeros(shape, np.int32)
    sizes = np.zeros_like(starts)
    counts = np.zeros((T // tile, 2), np.int32)
    for i in range(T // tile):
        rows = slice(i * tile, (i + 1) * tile)
        real = q.seq[rows] >= 0
        tile_seqs, where = np.unique(q.seq[rows][real], return_inverse=True)
        last_pos = np.zeros(len(tile_seqs), np.int64)
        np.maximum.at(last_pos, where, q.pos[rows][real])
        first_pos = np.full(len(tile_seqs), np.iinfo(np.int64).max)
        np.minimum.at(first_pos, where, q.pos[rows][real])
        listed = []  # (wide, start, size) of each window that some row of the tile sees
        for seq, last, earliest in zip(tile_seqs.tolist(), last_pos, first_pos):
            if seq not in prefix:
                continue
            start, (offsets, window_sizes, wide) = prefix[seq]
            # Windows that start past every row's position are causally masked, and with a sliding window those
            # whose keys are all a window or more before every row: not listed.
            keep = offsets <= last
            if window:
                keep &= offsets + window_sizes > earliest - window + 1
            listed += zip(wide[keep], start + offsets[keep], window_sizes[keep])
        listed.sort(key=lambda w: not w[0])  # stable: the wide windows first, each prefix's in key order
        n_wide = sum(w[0] for w in listed)
        counts[i] = n_wide, len(listed) - n_wide
        if listed:
            starts[i, :len(listed)], sizes[i, :len(listed)] = np.array([w[1:] for w in listed]).T
    ids, item_counts = block_tables(q, kv, ITEM_TILE, ITEM_TILE, items_only=True, window=window)
    return CascadeTables(starts, sizes, counts, pad_tables(ids, T // ITEM_TILE), item_counts)


def cascade_attention(q, k, v, q_meta, kv_meta, prefix_starts, prefix_sizes, prefix_counts, item_ids, item_counts,
                      scale: float | None = None, softcap: float | None = None, window: int = 0):
    """Packed attention as an item part and a prefix part (see above); same result as `dense_attention`.

    One loop over query tiles does both parts. A tile's rows are laid out heads first, [Hkv, sub-tile,
    G * ITEM_TILE, D] (each KV head's G query heads as one block of rows): the item part runs each sub-tile
    against its items' key tiles as a batched matmul; the prefix part runs all of a head's rows at once
    against a window of prefix keys (row order does not matter there), so the layout changes once per tile,
    in and out. The item part's online-softmax state is where the prefix part's starts: they merge with no
    extra pass (a separate merge cost a quarter of the attention's time). Items are read in steps of
    ITEM_SLOTS key tiles, so a sub-tile whose items are short (up to about 3 tiles) is read in one step: an
    item read over two steps gets its sums rescaled in between, and where its keys fall between steps
    depends on the items before it, which moved other items' log-probs by 1.7e-5 (the isolation rule is
    1e-5). For the same reason the item part's row sums come out of its PV matmul (SUM_COLUMNS of ones after v).
    """
    T, H, D = q.shape
    Tk, Hkv = k.shape[:2]
    G = H // Hkv
    nq = prefix_starts.shape[0]
    tile, sub, slots = T // nq, ITEM_TILE, ITEM_SLOTS
    n = tile // sub
    # Keys/values heads first, padded by a wide window: windows may run past the last key, and the padding's first
    # key tile is where an item table's unused slots point (padding keys match no query's sequence).
    k_h, v_h = (jnp.pad(x.astype(jnp.float32), ((0, PREFIX_WIDE), (0, 0), (0, 0))).transpose(1, 0, 2) for x in (k, v))
    k_seq, k_item, k_pos = (jnp.pad(m, (0, PREFIX_WIDE), constant_values=c)
                            for m, c in ((kv_meta[0], KEY_PAD_SEQ), (kv_meta[1], -1), (kv_meta[2], 0)))
    k_item = jnp.where(k_item >= 0, k_item, -3)  # prefix keys: no row of the item part sees them
    k_sub, v_sub = (x.reshape(Hkv, -1, sub, D) for x in (k_h, v_h))  # [Hkv, key tiles, sub, D]
    k_meta_sub = [m.reshape(-1, sub) for m in (k_seq, k_item, k_pos)]
    padding_tile = Tk // sub

    def one_tile(args):
        q_tile, q_seq, q_item, q_pos, starts, sizes, count, ids, counts = args
        q_tile = q_tile.reshape(n, sub, Hkv, G, D).transpose(2, 0, 3, 1, 4).reshape(Hkv, n, G * sub, D)
        q_tile = q_tile * _scale(scale, D)
        rows = lambda m: jnp.broadcast_to(m.reshape(n, 1, sub), (n, G, sub)).reshape(n, G * sub, 1)
        q_seq, q_item, q_pos = rows(q_seq), rows(q_item), rows(q_pos)

        def item_step(j, carry):
            slot = j * slots + jnp.arange(slots)[None, :]
            key_tiles = jnp.where(slot < counts[:, None], jax.lax.dynamic_slice_in_dim(ids, j * slots, slots, axis=1),
                                  padding_tile)  # [n, slots]
            ks, ki, kp = (m[key_tiles].reshape(n, 1, slots * sub) for m in k_meta_sub)
            mask = (q_seq == ks) & (q_item == ki) & (kp <= q_pos)
            if window:
                mask &= q_pos - kp < window
            kt, vt = (x[:, key_tiles].reshape(Hkv, n, slots * sub, D) for x in (k_sub, v_sub))
            s = _scores(jnp.matmul(q_tile, kt.transpose(0, 1, 3, 2), preferred_element_type=jnp.float32), softcap)
            ones = jnp.ones((*vt.shape[:-1], SUM_COLUMNS), vt.dtype)
            return _online_softmax_step(carry, s, mask[None], jnp.concatenate([vt, ones], axis=-1),
                                        sums_from_matmul=True)

        state = lambda d, fill=0.0: jnp.full((Hkv, n, G * sub, d), fill, jnp.float32)
        # As many steps as the tile's longest list: none for padding rows, which list nothing.
        carry = jax.lax.fori_loop(0, (counts.max() + slots - 1) // slots, item_step,
                                  (state(1, _MASKED), state(D), state(1)))
        carry = tuple(x.reshape(Hkv, n * G * sub, -1) for x in carry)
        q_rows = q_tile.reshape(Hkv, n * G * sub, D)
        q_seq, q_pos = q_seq.reshape(-1, 1), q_pos.reshape(-1, 1)

        def prefix_step(keys, j, carry):
            lo = starts[j]
            kt, vt = (jax.lax.dynamic_slice_in_dim(x, lo, keys, axis=1) for x in (k_h, v_h))
            ks, kp = (jax.lax.dynamic_slice_in_dim(x, lo, keys)[None, :] for x in (k_seq, k_pos))
            # The window's own prefix only: the keys after it (items, other sequences) are someone else's.
            mask = (q_seq == ks) & (jnp.arange(keys) < sizes[j])[None, :] & (kp <= q_pos)
            if window:
                mask &= q_pos - kp < window
            s = _scores(jnp.matmul(q_rows, kt.transpose(0, 2, 1), preferred_element_type=jnp.float32), softcap)
            return _online_softmax_step(carry, s, mask, vt, sums_from_matmul=False)

        carry = jax.lax.fori_loop(0, count[0], partial(prefix_step, PREFIX_WIDE), carry)
        _, acc, l = jax.lax.fori_loop(count[0], count[0] + count[1], partial(prefix_step, PREFIX_WINDOW), carry)
        out = acc / jnp.where(l > 0, l, 1.0)  # a row that sees nothing (padding) comes out as zeros
        return out.reshape(Hkv, n, G, sub, D).transpose(1, 3, 0, 2, 4).reshape(tile, H, D)

    by_tile = lambda x: x.reshape(nq, -1, *x.shape[1:])
    out = jax.lax.map(one_tile, (by_tile(q.astype(jnp.float32)), *(by_tile(m) for m in q_meta),
                                 jnp.asarray(prefix_starts), jnp.asarray(prefix_sizes), prefix_counts,
                                 by_tile(jnp.asarray(item_ids)), by_tile(item_counts)))
    return out.reshape(T, H, D)


def _online_softmax_step(carry, s, mask, v, sums_from_matmul: bool):
    """One step of the online softmax: scores s [..., rows, keys] (masked by `mask`), values v [..., keys, D]
    (with columns of ones after them when `sums_from_matmul`: the row sums come out of the matmul, see
    cascade_attention). carry: (max, output [..., rows, D], row sum)."""
    m, acc, l = carry
    s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m - m_new)
    pv = jnp.matmul(p, v, preferred_element_type=jnp.float32)
    if sums_from_matmul:
        D = acc.shape[-1]
        return m_new, acc * scale + pv[..., :D], l * scale + pv[..., D:D + 1]
    return m_new, acc * scale + pv, l * scale + p.sum(axis=-1, keepdims=True)


# ---- Pallas kernels -----------------------------------------------------------------------
#
# Both kernels read the same host tables (`block_tables`), regridded on the device to the
# kernel's own tile sizes (`kernel_tables`): a tile pair is listed when any of the table's
# smaller tile pairs inside it is, so nothing visible is ever dropped, and the kernels mask
# exactly inside a tile.

_LANES, _SUBLANES = 128, 8
TPU_TILE_Q, TPU_TILE_K = 512, 512  # a grid step costs ~0.35 us on a TPU: large tiles amortize it
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b

log = logging.getLogger(__name__)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pick_tile(n: int, preferred: int, quantum: int) -> int:
    """The largest multiple of `quantum` that is at most `preferred` (and n) and divides n."""
    tile = max(min(preferred, n) // quantum * quantum, quantum)
    while n % tile:
        tile -= quantum
    return tile


def kernel_tables(tile_ids, tile_counts, block_q: int, block_k: int, tile_q: int, tile_k: int,
                  q_len: int, kv_len: int):
    """Regrids the host tables (tiles block_q x block_k) to the kernel's tiles tile_q x tile_k (a multiple or
    a divisor of them each way).

    q_len / kv_len are the padded lengths the kernel runs over (multiples of both tile sizes); rows of
    padding query tiles see nothing. Returns (ids [q_len/tile_q, width], counts): per kernel query tile,
    the visible kernel key tiles in ascending order, the row padded with its last id (a padded slot is
    then the same block as the slot before it, which the pipeline does not fetch again).
    """
    rows, width = tile_ids.shape
    nq_f, nk_f = q_len // block_q, kv_len // block_k
    if rows < nq_f:
        tile_ids = jnp.pad(tile_ids, ((0, nq_f - rows), (0, 0)))
        tile_counts = jnp.pad(tile_counts, (0, nq_f - rows))
    listed = jnp.arange(width)[None, :] < tile_counts[:, None]
    cols = jnp.where(listed, tile_ids, nk_f)  # unlisted slots land in a dropped column
    vis = jnp.zeros((nq_f, nk_f + 1), jnp.bool_).at[jnp.arange(nq_f)[:, None], cols].set(True)[:, :nk_f]
    if tile_k >= block_k:
        vis = vis.reshape(nq_f, kv_len // tile_k, tile_k // block_k).any(axis=2)
    else:
        vis = jnp.repeat(vis, block_k // tile_k, axis=1)
    if tile_q >= block_q:
        vis = vis.reshape(q_len // tile_q, tile_q // block_q, -1).any(axis=1)
    else:
        vis = jnp.repeat(vis, block_q // tile_q, axis=0)
    nk = kv_len // tile_k
    counts = vis.sum(axis=1, dtype=jnp.int32)
    width_c = min(max(tile_q // block_q, 1) * width * max(block_k // tile_k, 1), nk)
    order = jnp.argsort(jnp.logical_not(vis).astype(jnp.int32), axis=1, stable=True)[:, :width_c].astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=1)
    ids = jnp.where(jnp.arange(width_c)[None, :] < counts[:, None], order, last)
    return ids, counts


def full_tiles(ids, q_meta, kv_meta, tile_q: int, tile_k: int, window: int = 0):
    """Per table slot: 1 where every query of the tile sees every key of the listed tile (a shared-prefix
    tile under a tile of one sequence's later tokens, within the window if any), so the kernel can skip the
    mask there."""
    q_seq, q_item, q_pos = (m.reshape(-1, tile_q) for m in q_meta)
    k_seq, k_item, k_pos = (m.reshape(-1, tile_k) for m in kv_meta)
    q_one_seq = (q_seq.min(axis=1) == q_seq.max(axis=1)) & (q_seq.min(axis=1) >= 0)
    k_one_seq = (k_seq.min(axis=1) == k_seq.max(axis=1)) & (k_seq.min(axis=1) >= 0) & (k_item.max(axis=1) < 0)
    full = (q_one_seq[:, None] & k_one_seq[None, :] & (q_seq[:, :1] == k_seq[:, 0][None, :])
            & (k_pos.max(axis=1)[None, :] <= q_pos.min(axis=1)[:, None]))
    if window:
        full &= q_pos.max(axis=1)[:, None] - k_pos.min(axis=1)[None, :] < window
    return jnp.take_along_axis(full, ids, axis=1).astype(jnp.int32)


def _padded_inputs(q, k, v, q_meta, kv_meta, q_len: int, kv_len: int):
    """Pads queries (never visible to anyone) and keys (visible to no one) to the kernel's lengths."""
    T, Tk = q.shape[0], k.shape[0]
    if q_len > T:
        q = jnp.pad(q, ((0, q_len - T), (0, 0), (0, 0)))
        q_meta = tuple(jnp.pad(m, (0, q_len - T), constant_values=c) for m, c in zip(q_meta, (QUERY_PAD_SEQ, -1, 0)))
    if kv_len > Tk:
        k = jnp.pad(k, ((0, kv_len - Tk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, kv_len - Tk), (0, 0), (0, 0)))
        kv_meta = tuple(jnp.pad(m, (0, kv_len - Tk), constant_values=c) for m, c in zip(kv_meta, (KEY_PAD_SEQ, -1, 0)))
    return q, k, v, q_meta, kv_meta


# ---- Key tiles aligned to each sequence's own positions (ALIGNED_KEY_TILES) ---------------------
#
# Today's kernels tile the key axis by absolute position in the pass, so a query's keys fall into different
# tiles (a different online-softmax order and partial sums) when its prefix is cached rather than in the
# pass, or when another request before it moves it: an H200 gave one request 0.070 apart (Pallas). The
# aligned kernels read windows instead, as the CPU path's prefix windows (`prefix_windows`): a "part" is
# one sequence's prefix or its items' span, contiguous in the keys (the cache or the pass), and its windows
# start at its first key and every tile after it, each masked to the part's own keys. A row's windows, each
# window's keys at the same lanes, and their order (its prefix's windows, then its items' ones) are then the
# same wherever the sequence sits and whatever shares the pass; a window that holds none of a row's keys
# leaves that row's sums exactly as they were. The cost: a part's windows are read apart from its
# neighbours' (one more window per part a query tile sees, at most), the TPU kernel fetches the two tiles a
# window spans and rotates them, the GPU kernel reads 8 shifted copies of K and V. On an H200 (2026-11-28, JAX
# 0.11.2) the GPU kernel gave the contract's scores bitwise the same with the query cached and computed (0.0097
# apart with today's kernel) at 0.79 of its speed, and stopped with an illegal instruction on parts that start
# at keys not a multiple of 4 (its keys' rows read from there); that fix is lowered, not yet run on a device.
# The TPU kernel has not run on a TPU. Off by default (issue 45: a kernel change stays behind a setting until a
# device run measures it), PACKSCORE_ALIGNED_KEY_TILES=1 turns it on; the interpret-mode tests run it.
ALIGNED_KEY_TILES = os.environ.get("PACKSCORE_ALIGNED_KEY_TILES", "0") == "1"


def part_starts(seq, item):
    """Per key, the index of the first key of its part (its sequence's prefix, or its sequence's items),
    jnp or np; padding keys and hidden ones make parts of their own, which no query sees."""
    xp = jnp if isinstance(seq, jax.Array) else np
    index = xp.arange(seq.shape[0], dtype=xp.int32)
    new = xp.concatenate([xp.ones(1, bool), (seq[1:] != seq[:-1]) | ((item[1:] < 0) != (item[:-1] < 0))])
    starts = xp.where(new, index, 0)
    return jax.lax.cummax(starts) if xp is jnp else np.maximum.accumulate(starts)


def window_tables(q: TokenMeta, kv: TokenMeta, block_q: int, block_k: int,
                  window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The aligned kernels' host tables: per query tile of block_q rows, the first keys of the windows of
    block_k keys it may see (ascending), padded as `block_tables`' rows are; the same shapes as those.
    A part's windows start at its first key and every block_k keys after it; a window listed is one of a
    part some row of the tile sees and holds a key no later than that row (conservative, as block_tables)."""
    Tk = len(kv.seq)
    keys = np.arange(Tk)
    part = part_starts(kv.seq, kv.item)
    firsts = keys[(kv.seq >= 0) & ((keys - part) % block_k == 0)]  # each window's first key
    window_keys = np.minimum(firsts[:, None] + np.arange(block_k)[None, :], Tk - 1)
    inside = (firsts[:, None] + np.arange(block_k)[None, :] < Tk) & (part[window_keys] == part[firsts][:, None])
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    low = lambda v: np.where(inside, v, big).min(axis=1)
    high = lambda v: np.where(inside, v, small).max(axis=1)
    k_group = kv.seq.astype(np.int64)[window_keys] * (1 << 32) + kv.item[window_keys]
    k_pos = kv.pos.astype(np.int64)[window_keys]
    w_seq, is_prefix = kv.seq[firsts].astype(np.int64), kv.item[firsts] < 0

    q_real = q.seq >= 0
    q_group = q.seq.astype(np.int64) * (1 << 32) + q.item
    qs_lo, qs_hi = _tile_ranges(q.seq.astype(np.int64), q_real, block_q, small, big)
    qg_lo, qg_hi = _tile_ranges(q_group, q_real & (q.item >= 0), block_q, small, big)
    qp_lo, qp_hi = _tile_ranges(q.pos.astype(np.int64), q_real, block_q, small, big)
    sees_prefix = is_prefix[None, :] & (qs_lo[:, None] <= w_seq[None, :]) & (w_seq[None, :] <= qs_hi[:, None])
    sees_items = ~is_prefix[None, :] & (qg_lo[:, None] <= high(k_group)[None, :]) & (
        low(k_group)[None, :] <= qg_hi[:, None])
    vis = (sees_prefix | sees_items) & (low(k_pos)[None, :] <= qp_hi[:, None])
    if window:
        vis &= high(k_pos)[None, :] > qp_lo[:, None] - window
    return _listed_columns(vis, firsts)


def _compacted(keep, values):
    """Per row, the `values` where `keep` (in order), then the row's last kept one repeated; (ids, counts)."""
    counts = keep.sum(axis=1, dtype=jnp.int32)
    order = jnp.argsort(jnp.logical_not(keep).astype(jnp.int32), axis=1, stable=True)
    kept = jnp.take_along_axis(values, order, axis=1)
    last = jnp.take_along_axis(kept, jnp.maximum(counts - 1, 0)[:, None], axis=1)
    ids = jnp.where(jnp.arange(values.shape[1])[None, :] < counts[:, None], kept, last)
    return jnp.where(counts[:, None] > 0, ids, 0).astype(jnp.int32), counts


def window_kernel_tables(starts, counts, parts, block_q: int, block_k: int, tile_q: int, tile_k: int, q_len: int):
    """Regrids `window_tables` (windows of block_k keys, query tiles of block_q rows) to the kernel's windows
    of tile_k keys (a multiple of block_k) and query tiles of tile_q rows (a multiple or a divisor of block_q):
    a host window at offset m * block_k in its part lies in the kernel window at m * block_k // tile_k *
    tile_k. `parts`: `part_starts` of the keys. Returns (first keys [q_len / tile_q, width], counts, the
    windows' parts [same shape]): ascending, duplicates dropped, padded with the last."""
    rows, width = starts.shape
    if rows < q_len // block_q:
        starts = jnp.pad(starts, ((0, q_len // block_q - rows), (0, 0)))
        counts = jnp.pad(counts, (0, q_len // block_q - rows))
    part = parts[starts]
    unlisted = jnp.iinfo(jnp.int32).max
    firsts = jnp.where(jnp.arange(width)[None, :] < counts[:, None], part + (starts - part) // tile_k * tile_k,
                       unlisted)
    if tile_q >= block_q:  # the tile's host rows' windows, merged: each row's list is ascending already
        firsts = jnp.sort(firsts.reshape(q_len // tile_q, -1), axis=1)
    else:
        firsts = jnp.repeat(firsts, block_q // tile_q, axis=0)
    keep = (firsts != unlisted) & jnp.concatenate(
        [jnp.ones((firsts.shape[0], 1), bool), firsts[:, 1:] != firsts[:, :-1]], axis=1)
    ids, counts = _compacted(keep, firsts)
    return ids, counts, parts[ids]


def full_windows(firsts, q_meta, kv_meta, parts, tile_q: int, tile_k: int, window: int = 0):
    """`full_tiles` for the aligned kernels' windows: 1 where the window is tile_k keys of one prefix (whose
    positions run on from its first key's) that every query of the tile sees."""
    q_seq, _, q_pos = (m.reshape(-1, tile_q) for m in q_meta)
    k_seq, k_item, k_pos = kv_meta
    last = jnp.minimum(firsts + tile_k - 1, k_seq.shape[0] - 1)
    one_prefix = (parts[last] == parts[firsts]) & (last == firsts + tile_k - 1) & (k_item[firsts] < 0)
    q_one_seq = (q_seq.min(axis=1) == q_seq.max(axis=1)) & (q_seq.min(axis=1) >= 0)
    full = (one_prefix & (k_seq[firsts] >= 0) & q_one_seq[:, None] & (k_seq[firsts] == q_seq[:, :1])
            & (k_pos[firsts] + tile_k - 1 <= q_pos.min(axis=1)[:, None]))
    if window:
        full &= q_pos.max(axis=1)[:, None] - k_pos[firsts] < window
    return full.astype(jnp.int32)


def tiles_of_windows(firsts, counts, block_k: int, kv_len: int):
    """The key tiles (of block_k, ascending) that `window_tables`' windows touch, as `block_tables` lists
    them: the XLA path's tables where the kernels' are windows."""
    rows, width = firsts.shape
    n_tiles = kv_len // block_k
    listed = jnp.arange(width)[None, :] < counts[:, None]
    touched = jnp.concatenate([firsts // block_k, jnp.minimum((firsts + block_k - 1) // block_k, n_tiles - 1)], 1)
    cols = jnp.where(jnp.concatenate([listed, listed], axis=1), touched, n_tiles)
    vis = jnp.zeros((rows, n_tiles + 1), bool).at[jnp.arange(rows)[:, None], cols].set(True)[:, :n_tiles]
    ids, counts = _compacted(vis, jnp.broadcast_to(jnp.arange(n_tiles, dtype=jnp.int32), vis.shape))
    return ids[:, :min(2 * width, n_tiles)], counts


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
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(mask):
        k = load_k()
        v = load_v()
        for g in range(groups):
            s = jax.lax.dot_general(q_ref[g], k, _NT, preferred_element_type=jnp.float32) * scale  # [tq, tk]
            s = _scores(s, softcap)
            if mask is not None:
                s = jnp.where(mask, s, _MASKED)
            m_prev, l_prev = m_ref[g], l_ref[g]  # [tq, 128], every lane the same
            m_next = jnp.maximum(m_prev, s.max(axis=1)[:, None])
            p = jnp.exp(s - jnp.tile(m_next, (1, reps)))
            if mask is not None:  # a row with nothing visible yet has m = _MASKED and exp(0) = 1 here
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[g] = alpha * l_prev + jax.lax.broadcast_in_dim(p.sum(axis=1), (tq, _LANES), (0,))
            m_ref[g] = m_next
            pv = jax.lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)  # [tq, D]
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

    @pl.when(j == width - 1)
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
    q_len, kv_len = _round_up(T, quantum_q), _round_up(Tk, quantum_k)
    tq, tk = _pick_tile(q_len, tile_q, quantum_q), _pick_tile(kv_len, tile_k, quantum_k)
    if aligned:  # windows of tile_k keys whatever the pass's length; the last one's second tile is padding
        assert tile_k % quantum_k == 0, f"tile_k {tile_k} is not a multiple of {quantum_k}"
        tk, kv_len = tile_k, _round_up(Tk, tile_k) + tile_k
    q, k, v, q_meta, kv_meta = _padded_inputs(q, k, v, tuple(q_meta), tuple(kv_meta), q_len, kv_len)
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

    q_lanes = [jax.lax.broadcast_in_dim(m.astype(jnp.int32), (q_len, _LANES), (0,)) for m in q_meta]
    k_rows = jnp.zeros((_SUBLANES, kv_len), jnp.int32).at[:len(k_rows)].set(k_rows)
    qh = q.transpose(1, 0, 2)  # [H, T, D]: heads h*G .. h*G+G-1 share KV head h
    kh = k.transpose(1, 0, 2)  # [Hkv, Tk, D]
    vh = v.transpose(1, 0, 2)

    def key_specs(block, index):
        return [pl.BlockSpec(block, lambda i, h, j, ids_ref, *_, half=half: index(h, tile_of(ids_ref[i * width + j])
                                                                                 + half)) for half in halves]

    q_meta_spec = pl.BlockSpec((tq, _LANES), lambda i, h, j, *_: (i, 0))
    kernel = partial(_tpu_kernel, groups=G, width=width, scale=_scale(scale, D), softcap=softcap, window=window,
                     aligned=aligned)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3 + len(window_parts),
            grid=(nq, Hkv, width),
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


# ---- which kernel runs where --------------------------------------------------------------

_HOST_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}  # jax.default_backend() -> lowering platform
_kernel_ok: dict[tuple, bool] = {}
_paths: dict[str, str] = {}  # lowering platform -> the attention path its programs use


def attention_path(platform: str | None = None) -> str:
    """The attention path that `pallas_attention` put into programs for `platform` (default: this host's),
    e.g. for a worker's heartbeat or metrics: "pallas-tpu", "pallas-mosaic-gpu", "xla" (a kernel that
    failed to compile here, or no kernel for this platform), or "none" before any pass was traced."""
    backend = jax.default_backend()
    platform = platform or _HOST_PLATFORM.get(backend, backend)
    return _paths.get(platform, "xla" if _paths else "none")


def _compiles_here(name: str, kernel, args) -> bool:
    """Whether `kernel` compiles on this host's device for these shapes (probed once per shape, outside
    the program being traced); a failure is logged once and the caller falls back to the XLA path."""
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    key = (name, str(jax.tree.structure(specs)), tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves(specs)))
    if key not in _kernel_ok:
        try:
            jax.jit(kernel).lower(*specs).compile()
            _kernel_ok[key] = True
        except Exception as exc:  # noqa: BLE001 - any compile failure means: serve with the XLA path
            if not any(k[0] == name and not ok for k, ok in _kernel_ok.items()):
                log.warning("attention kernel %s does not compile on this %s device (%s: %s); using the XLA "
                            "block-sparse path", name, jax.default_backend(), type(exc).__name__, str(exc)[:2000])
            _kernel_ok[key] = False
    return _kernel_ok[key]


def _choose(platform: str, name: str, kernel, fallback, args):
    """The kernel for `platform`, unless this host is that platform and the kernel fails to compile here.
    Lowering for another platform (ahead-of-time, core.aot) always keeps the kernel, so a kernel that
    cannot compile fails there loudly."""
    use_kernel = kernel is not None
    if use_kernel and _HOST_PLATFORM.get(jax.default_backend()) == platform:
        use_kernel = _compiles_here(name, kernel, args)
    _paths[platform] = name if use_kernel else "xla"
    return kernel if use_kernel else fallback


@partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "scale", "softcap", "window", "aligned"))
def pallas_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                     interpret=False, scale: float | None = None, softcap: float | None = None, window: int = 0,
                     aligned: bool | None = None):
    """Pallas block-sparse attention; same arguments and result as `blocksparse_attention`.

    interpret=False: the kernel of the platform the program is lowered for (`lax.platform_dependent`):
    the TPU kernel on TPU, the Mosaic GPU kernel on CUDA where it lowers (see `GPU_KERNEL`), else (and
    on CPU) the XLA block-sparse path. interpret=True or a `pltpu.InterpretParams`: the TPU kernel run
    on the CPU in interpret mode. q is rounded to the keys' dtype: the kernels' matmuls take one dtype.
    `aligned` (None: ALIGNED_KEY_TILES, as `block_tables` made the tables): the tables are `window_tables`
    and the kernels read windows; the XLA path reads the tiles those windows touch.
    """
    aligned = ALIGNED_KEY_TILES if aligned is None else aligned
    q = q.astype(k.dtype)
    args = (q, k, v, tuple(q_meta), tuple(kv_meta), tile_ids, tile_counts)
    layer = {"scale": scale, "softcap": softcap, "window": window}
    if interpret:
        return tpu_attention(*args, block_q, block_k, interpret=interpret, aligned=aligned, **layer)
    xla = partial(blocksparse_attention, block_q=block_q, block_k=block_k, **layer)
    if aligned:
        xla = partial(_on_tiles_of_windows, xla, block_k)
        layer["aligned"] = True
    tpu = _choose("tpu", "pallas-tpu", partial(tpu_attention, block_q=block_q, block_k=block_k, **layer), xla, args)
    gpu = _choose("cuda", "pallas-mosaic-gpu", _gpu_kernel_for(q, k, block_q, block_k, **layer), xla, args)
    return jax.lax.platform_dependent(*args, tpu=tpu, cuda=gpu, default=xla)


def _on_tiles_of_windows(attention, block_k: int, q, k, v, q_meta, kv_meta, firsts, counts):
    """`attention` (the XLA path) over the tiles that `window_tables`' windows touch."""
    return attention(q, k, v, q_meta, kv_meta, *tiles_of_windows(firsts, counts, block_k, k.shape[0]))


def _gpu_kernel_for(q, k, block_q: int, block_k: int, **layer):
    """The Mosaic GPU kernel where it applies (16-bit floats, head_dim a multiple of 64), else None (XLA)."""
    if not GPU_KERNEL or q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 64:
        return None
    return partial(gpu_attention, block_q=block_q, block_k=block_k, **layer)


# ---- the Mosaic GPU kernel (H100) -----------------------------------------------------------

GPU_KERNEL = True  # False: attention="auto" uses the XLA path on GPU
GPU_TILE_Q, GPU_TILE_K = 64, 64  # one warpgroup's WGMMA rows; key tiles as the engine's tables
_GPU_ROW_TILE = 8  # rows of a tile of K/V in shared memory (WGMMA's 8 x 128-byte core matrices)


def gpu_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                  tile_q: int = GPU_TILE_Q, tile_k: int = GPU_TILE_K, max_concurrent_steps: int = 2,
                  interpret=None, scale: float | None = None, softcap: float | None = None, window: int = 0,
                  aligned: bool = False):
    """The same tables driving a Mosaic GPU pipeline (bf16/f16, head_dim a multiple of 64): a CTA per
    (query head, query tile) holds its Q tile in shared memory, and `plgpu.emit_pipeline` streams the
    visible K/V tiles (its grid is the tile's count; the index maps read the table in global memory),
    QK^T and PV on WGMMA, the online softmax in registers. `aligned`: the tables are `window_tables`, and
    each step reads the window of tile_k keys at its first key (see ALIGNED_KEY_TILES)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    G = H // Hkv
    dtype = q.dtype
    quantum_q, quantum_k = math.lcm(block_q, tile_q), math.lcm(block_k, tile_k)
    q_len, kv_len = _round_up(T, quantum_q), _round_up(Tk, quantum_k) + (tile_k if aligned else 0)
    q, k, v, q_meta, kv_meta = _padded_inputs(q, k, v, tuple(q_meta), tuple(kv_meta), q_len, kv_len)
    if aligned:
        parts = part_starts(kv_meta[0], kv_meta[1])
        ids, counts, window_parts = window_kernel_tables(tile_ids, tile_counts, parts, block_q, block_k, tile_q,
                                                         tile_k, q_len)
        k_rows = [m.astype(jnp.int32) for m in (*kv_meta, parts)]
        window_parts = (window_parts.reshape(-1),)
        keys = pl.Element(tile_k)  # element offsets: the window's first key
        # A K/V copy into tiled shared memory starts at a whole tile of _GPU_ROW_TILE rows (its TMA index is
        # split into tile and row), so K and V come in _GPU_ROW_TILE copies, copy r moved up by r rows: a
        # window starting at key s is copy s % 8's rows from s - s % 8. The keys' rows too: a TMA copy starts
        # at a 16-byte boundary, and a window's first key at any position (on the H200, int32 rows read from
        # an odd key stopped the kernel with an illegal instruction). The cost: 8 times K and V written per
        # layer (on the H200, the contract ran 0.79 as fast as the default kernel).
        shifted = lambda x: jnp.concatenate([jnp.roll(x, -r, axis=1) for r in range(_GPU_ROW_TILE)])
        k_rows = [shifted(m[None]) for m in k_rows]  # [8, Tk] each: copy r at row r
    else:
        ids, counts = kernel_tables(tile_ids, tile_counts, block_q, block_k, tile_q, tile_k, q_len, kv_len)
        k_rows = [m.astype(jnp.int32) for m in kv_meta]
        window_parts = ()
        keys = tile_k
    nq, width = ids.shape
    scale = _scale(scale, D)
    q_rows = jnp.stack(q_meta).astype(jnp.int32)  # [3, T]: seq, item, pos
    qh = q.transpose(1, 0, 2)  # [H, T, D]
    kh = k.transpose(1, 0, 2)  # [Hkv, Tk, D]
    vh = v.transpose(1, 0, 2)
    if aligned:
        kh, vh = shifted(kh), shifted(vh)  # [8 * Hkv, Tk, D]: copy r of KV head h at r * Hkv + h
    tiling = plgpu.TilingTransform((_GPU_ROW_TILE, 64 * 2 // jnp.dtype(dtype).itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per query row
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per key column
    # GPU interpret mode (tests) runs neither plgpu.load nor layout casts; both only fix register layouts.
    load = (lambda ref, layout: ref[...]) if interpret else (lambda ref, layout: plgpu.load(ref, (), layout=layout))
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast

    def body(ids_ref, counts_ref, *refs):
        parts_ref, refs = (refs[0], refs[1:]) if aligned else (None, refs)
        qm_ref, *k_meta_refs, q_ref, k_ref, v_ref, o_ref, qo_smem, qm_smem, barriers = refs
        h, i = jax.lax.axis_index("heads"), jax.lax.axis_index("q_tiles")
        kv_head = jax.lax.div(h, jnp.int32(G))
        plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(i * tile_q, tile_q)], qo_smem, barriers.at[0])
        for r in range(3):
            plgpu.copy_gmem_to_smem(qm_ref.at[r, pl.ds(i * tile_q, tile_q)], qm_smem.at[r], barriers.at[1 + r])
        for r in range(4):
            plgpu.barrier_wait(barriers.at[r])
        q_seq, q_item, q_pos = (load(qm_smem.at[r], row) for r in range(3))
        by_row = lambda x: jax.lax.broadcast_in_dim(x, (tile_q, tile_k), [0])
        by_col = lambda x: jax.lax.broadcast_in_dim(x, (tile_q, tile_k), [1])

        def step(step_index, k_smem, v_smem, *k_meta_smem_and_carry):
            *k_meta_smem, (acc, m_i, l_i) = k_meta_smem_and_carry

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.transpose((1, 0)))
                return acc_ref[...]
            if interpret:  # GPU interpret mode's wgmma takes no transposed operand
                s = jax.lax.dot_general(qo_smem[...], k_smem[...], _NT, preferred_element_type=jnp.float32) * scale
            else:
                s = pl.run_scoped(qk, plgpu.ACC((tile_q, tile_k), jnp.float32)) * scale
            s = _scores(s, softcap)
            k_seq, k_item, k_pos = (load(r, col) for r in k_meta_smem[:3])
            mask = ((by_row(q_seq) == by_col(k_seq)) & ((by_col(k_item) < 0) | (by_col(k_item) == by_row(q_item)))
                    & (by_col(k_pos) <= by_row(q_pos)))
            if window:
                mask &= by_row(q_pos) - by_col(k_pos) < window
            if aligned:  # the window's own part: the keys after it are another part's (or another sequence's)
                mask &= by_col(load(k_meta_smem[3], col)) == parts_ref[i * width + step_index[0]]
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.where(mask, jnp.exp(s - by_row(m_new)), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem)
                return acc_ref[...]
            if interpret:  # nor a register operand
                pv_out = jax.lax.dot_general(p.astype(dtype), v_smem[...], _NN, preferred_element_type=jnp.float32)
            else:
                pv_out = pl.run_scoped(pv, plgpu.ACC((tile_q, D), jnp.float32))
            acc = acc * jax.lax.broadcast_in_dim(alpha, (tile_q, D), [0]) + pv_out
            return acc, m_new, l_i

        key_tile = lambda j: ids_ref[i * width + j]
        if aligned:
            copy = lambda j: key_tile(j) % _GPU_ROW_TILE
            # (multiple_of: JAX 0.11's Mosaic GPU must be shown that the copy starts at a whole tile of rows)
            kv_spec = plgpu.BlockSpec((None, keys, D), lambda j: (
                copy(j) * Hkv + kv_head, pl.multiple_of(key_tile(j) - copy(j), _GPU_ROW_TILE), 0),
                transforms=(tiling, swizzle))
            meta_spec = plgpu.BlockSpec((None, keys), lambda j: (
                copy(j), pl.multiple_of(key_tile(j) - copy(j), _GPU_ROW_TILE)))
            kv_refs = (k_ref, v_ref)
        else:
            kv_spec = plgpu.BlockSpec((keys, D), lambda j: (key_tile(j), 0), transforms=(tiling, swizzle))
            meta_spec = plgpu.BlockSpec((keys,), lambda j: (key_tile(j),))
            kv_refs = (k_ref.at[kv_head], v_ref.at[kv_head])
        init = (cast(jnp.zeros((tile_q, D), jnp.float32), plgpu.Layout.WGMMA),
                cast(jnp.full((tile_q,), _MASKED, jnp.float32), row), cast(jnp.zeros((tile_q,), jnp.float32), row))
        acc, _, l_i = plgpu.emit_pipeline(
            step, grid=(counts_ref[i],), in_specs=[kv_spec, kv_spec] + [meta_spec] * len(k_meta_refs),
            max_concurrent_steps=max_concurrent_steps, init_carry=init,
        )(*kv_refs, *k_meta_refs)
        l_i = jnp.where(l_i == 0.0, 1.0, l_i)  # a row that sees nothing (padding) gets zeros
        qo_smem[...] = (acc / jax.lax.broadcast_in_dim(l_i, (tile_q, D), [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[h, pl.ds(i * tile_q, tile_q)])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((H, q_len, D), dtype),
        scratch_types=[
            plgpu.SMEM((tile_q, D), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((3, tile_q), jnp.int32),
            plgpu.Barrier(num_barriers=4),
        ],
        grid=(H, nq),
        grid_names=("heads", "q_tiles"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(ids.reshape(-1), counts, *window_parts, q_rows, *k_rows, qh, kh, vh)
    return out.transpose(1, 0, 2)[:T]
