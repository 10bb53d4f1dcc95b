"""The plain-XLA attention paths: the dense reference, the block-sparse path and the cascade path.

- `dense_attention`: the O(T^2) reference the tests compare against.
- `blocksparse_attention`: over `block_tables` (for each query tile, the key tiles it can see); the
  kernels' fallback where none runs.
- `cascade_attention`: the default on CPU. A shared-prefix split (as Hydragen and FlashInfer's cascade
  attention): all of a tile's query rows against windows of their sequence's prefix keys as dense matmuls,
  plus a small block-diagonal part for each item's own keys (`cascade_tables`).
Each takes the layer's `scale` on q.k (None: head_dim ** -0.5), its `softcap` and its `window` (0: none) as
static values: a model has one program per distinct window, not one per layer.
"""

from functools import partial

import jax
import jax.numpy as jnp

from core.attention.rule import KEY_PAD_SEQ, MASKED, q_scale, softcapped, visible
from core.attention.host_tables import ITEM_TILE, PREFIX_WIDE, PREFIX_WINDOW


def dense_attention(q, k, v, q_meta, kv_meta, scale: float | None = None, softcap: float | None = None,
                    window: int = 0):
    """Reference: materializes the full [T, Tk] mask. q [T, H, D], k/v [Tk, Hkv, D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(T, Hkv, H // Hkv, D).astype(jnp.float32)
    s = softcapped(jnp.einsum("thgd,khd->hgtk", qg, k.astype(jnp.float32)) * q_scale(scale, D), softcap)
    mask = visible(q_meta[0][:, None], q_meta[1][:, None], q_meta[2][:, None],
                   kv_meta[0][None, :], kv_meta[1][None, :], kv_meta[2][None, :], window)
    s = jnp.where(mask, s, MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("hgtk,khd->thgd", p, v.astype(jnp.float32))
    return o.reshape(T, H, D).astype(q.dtype)



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
    m, acc, l = _tile_loop(q * q_scale(scale, D), k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q, block_k,
                           SLOT_GROUP, softcap, window)
    # A query row that sees nothing (padding) has zero sums: its output is zeros.
    return (acc / jnp.where(l > 0, l, 1.0)).reshape(T, H, D).astype(q.dtype)


def _tile_loop(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int, group: int,
               softcap: float | None = None, window: int = 0):
    """The online-softmax state of every query row over the key tiles its tile lists (`group` tiles a step):
    (max [T, Hkv, G, 1], unnormalized output [T, Hkv, G, D], row sum [T, Hkv, G, 1]), float32. q comes scaled.
    A row that saw nothing has max MASKED."""
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
    # rounding does, by enough to break the 1e-5 isolation rule. The ones are as wide as v: a single column
    # changes the CPU matmul's blocking, and that breaks the isolation rule too (tests/test_engine_parity.py).
    # v and p are float32 (as they are anyway with float32 weights, the CPU default): p rounded to bfloat16
    # for the matmul, as the accelerators' kernels do, moves bfloat16 log-probs of SmolLM2 by about 0.015.
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
            s = softcapped(jnp.einsum("ihgd,jhd->hgij", q_tile, kt, preferred_element_type=jnp.float32), softcap)
            s = jnp.where(mask, s, MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
            p = jnp.exp(s - m_new)
            pv = jnp.einsum("hgij,jhd->hgid", p, vt, preferred_element_type=jnp.float32)
            return m_new, acc * jnp.exp(m - m_new) + pv

        init = (jnp.full((Hkv, G, block_q, 1), MASKED, jnp.float32), jnp.zeros((Hkv, G, block_q, 2 * D), jnp.float32))
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

ITEM_SLOTS = 4  # key tiles per step: a sub-tile's short items are read in one step (see cascade_attention)
# Columns of ones after v in the item part's PV matmul, whose first gives the row sums (see cascade_attention).
# One would do; 16 keep the columns a multiple of the vector width (80 instead of v's width doubled, 128).
SUM_COLUMNS = 16


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
        q_tile = q_tile * q_scale(scale, D)
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
            s = softcapped(jnp.matmul(q_tile, kt.transpose(0, 1, 3, 2), preferred_element_type=jnp.float32), softcap)
            ones = jnp.ones((*vt.shape[:-1], SUM_COLUMNS), vt.dtype)
            return _online_softmax_step(carry, s, mask[None], jnp.concatenate([vt, ones], axis=-1),
                                        sums_from_matmul=True)

        state = lambda d, fill=0.0: jnp.full((Hkv, n, G * sub, d), fill, jnp.float32)
        # As many steps as the tile's longest list: none for padding rows, which list nothing.
        carry = jax.lax.fori_loop(0, (counts.max() + slots - 1) // slots, item_step,
                                  (state(1, MASKED), state(D), state(1)))
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
            s = softcapped(jnp.matmul(q_rows, kt.transpose(0, 2, 1), preferred_element_type=jnp.float32), softcap)
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
    s = jnp.where(mask, s, MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m - m_new)
    pv = jnp.matmul(p, v, preferred_element_type=jnp.float32)
    if sums_from_matmul:
        D = acc.shape[-1]
        return m_new, acc * scale + pv[..., :D], l * scale + pv[..., D:D + 1]
    return m_new, acc * scale + pv, l * scale + p.sum(axis=-1, keepdims=True)

