"""The host tables: the mask's block structure, computed on the host from the pass's token metadata.

As splash attention does, every path reads only the tiles (or windows) these tables list, so its cost follows
the visible keys, never T x T. The lists are conservative per tile pair (a listed tile may be partly masked:
the paths mask exactly inside tiles) and never miss a visible pair.
- `block_tables`: per query tile, the key tiles it can see (the kernels' tables, and the block-sparse XLA path's).
- `cascade_tables`: the cascade XLA path's prefix windows and item tiles.
- `window_tables`: with ALIGNED_KEY_TILES, the kernels' windows aligned to each part's own first key.
"""

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from core.attention.rule import TokenMeta

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


# ---- The cascade path's tables ----------------------------------------------------------------------------
#
# Query rows per tile of both parts (fewer where the pass length needs it), and prefix keys per step. A window
# runs all of its tile's rows against its keys, though only its own sequence's rows see them: 128-row tiles and
# 64-key windows keep short requests cheap and long ones no slower (docs/performance.md).
PREFIX_TILE_Q = 128
PREFIX_WINDOW = 64
# A long prefix is read in windows of PREFIX_WIDE keys, its tail (under 193 keys) in windows of PREFIX_WINDOW:
# a 500-token query takes 2 steps per tile, not 8. A wide window is never more keys than the narrow ones it
# replaces, and a prefix's windows depend on its length alone, wherever it sits and whatever shares its tile.
PREFIX_WIDE = 256
ITEM_TILE = 16  # query rows and keys per item-part sub-tile: a sub-tile of short items reaches back few keys


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
    tile = pick_tile(T, PREFIX_TILE_Q, 64)
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



def pick_tile(n: int, preferred: int, quantum: int) -> int:
    """The largest multiple of `quantum` that is at most `preferred` (and n) and divides n."""
    tile = max(min(preferred, n) // quantum * quantum, quantum)
    while n % tile:
        tile -= quantum
    return tile


# ---- Key tiles aligned to each sequence's own positions (ALIGNED_KEY_TILES) ---------------------
#
# The default kernels tile the key axis by absolute position in the pass, so a query's keys fall into different
# tiles (a different online-softmax order and partial sums) when its prefix is cached rather than in the pass,
# or when another request before it moves it. The aligned kernels read windows instead, as the cascade path's
# prefix windows (`prefix_windows`): a "part" is one sequence's prefix or its items' span, contiguous in the keys
# (the cache or the pass), and its windows start at its first key and every tile after it, each masked to the
# part's own keys. A row's windows, each window's keys at the same lanes, and their order are then the same
# wherever the sequence sits and whatever shares the pass. The cost: a part's windows are read apart from its
# neighbours' (one more window per part a query tile sees, at most), the TPU kernel fetches the two tiles a
# window spans and rotates them, the GPU kernel reads 8 shifted copies of K and V (docs/performance.md has the
# device figures). A kernel change stays behind a setting until a device run measures it: off by default,
# PACKSCORE_ALIGNED_KEY_TILES=1 turns it on; the interpret-mode tests run it.
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

