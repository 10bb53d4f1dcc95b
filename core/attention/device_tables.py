"""The kernels' tables, made on the device from the host tables at the kernel's own tile sizes.

A kernel tile pair is listed when any of the host table's smaller tile pairs inside it is, so nothing visible
is ever dropped, and the kernels mask exactly inside a tile. The TPU and the GPU kernel both read these.
"""

import jax.numpy as jnp

from core.attention.rule import KEY_PAD_SEQ, QUERY_PAD_SEQ


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


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


def padded_inputs(q, k, v, q_meta, kv_meta, q_len: int, kv_len: int):
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

