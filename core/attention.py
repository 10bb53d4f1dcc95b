"""Packed multi-item attention.

Every token of a pass carries metadata (sequence id, item id, position). The rule of
score-semantics.md: query token q sees key k iff both belong to the same sequence,
k is in that sequence's shared prefix (item id -1) or in q's own item, and
pos(k) <= pos(q). Padding uses sequence ids that never match (-1 for queries, -2 for keys).

Like splash attention, the mask's block structure is computed on the host
(`block_tables`) into two small tables: for each query tile, the ids of the key
tiles it can see and their count. Both implementations below read only those
tiles, so cost follows the visible tiles, never T x T:
- `blocksparse_attention`: plain XLA (gathers the visible key tiles per query tile);
  the default on CPU.
- `pallas_attention`: a Pallas kernel that loops over the visible key tiles of its
  query tile and never loads the others; the default on GPU, `interpret=True` on CPU.
`dense_attention` is the O(T^2) reference the tests compare against.
"""

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


def visible(q_seq, q_item, q_pos, k_seq, k_item, k_pos):
    """The packing rule, broadcast over whatever shapes are given (jnp or np)."""
    return (q_seq == k_seq) & ((k_item < 0) | (k_item == q_item)) & (k_pos <= q_pos)


def _tile_ranges(values: np.ndarray, include: np.ndarray, tile: int, empty_low: int, empty_high: int):
    v = values.reshape(-1, tile)
    inc = include.reshape(-1, tile)
    low = np.where(inc, v, empty_high).min(axis=1)
    high = np.where(inc, v, empty_low).max(axis=1)
    return low, high


def block_tables(q: TokenMeta, kv: TokenMeta, block_q: int, block_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Which key tiles each query tile can see: (ids [nq, max_count], counts [nq]).

    Conservative per tile pair (a listed tile may be partly masked: the kernels mask
    exactly inside tiles), never missing a visible pair. Rows are padded by repeating
    the last visible id so a padded entry is a harmless reload, not a fault.
    """
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
    _, qp_hi = _tile_ranges(q.pos.astype(np.int64), q_real, block_q, small, big)
    kp_seq_lo, kp_seq_hi = _tile_ranges(kv.seq.astype(np.int64), k_is_prefix, block_k, small, big)
    kg_lo, kg_hi = _tile_ranges(k_group, k_is_item, block_k, small, big)
    kp_lo, _ = _tile_ranges(kv.pos.astype(np.int64), k_real, block_k, small, big)

    def overlap(a_lo, a_hi, b_lo, b_hi):
        return (a_lo[:, None] <= b_hi[None, :]) & (b_lo[None, :] <= a_hi[:, None])

    sees_prefix = overlap(qs_lo, qs_hi, kp_seq_lo, kp_seq_hi)
    sees_item = overlap(qg_lo, qg_hi, kg_lo, kg_hi)
    causal = kp_lo[None, :] <= qp_hi[:, None]
    # Keys are laid out as [cached prefix, this pass's tokens] in causal order, so a key
    # tile that starts after a query tile's last token is invisible to it.
    cache_len = len(kv.seq) - len(q.seq)
    k_start = np.arange(len(kv.seq) // block_k) * block_k
    q_end = cache_len + (np.arange(len(q.seq) // block_q) + 1) * block_q - 1
    vis = (sees_prefix | sees_item) & causal & (k_start[None, :] <= q_end[:, None])

    counts = vis.sum(axis=1).astype(np.int32)
    width = max(int(counts.max(initial=0)), 1)
    ids = np.zeros((vis.shape[0], width), np.int32)
    for i in range(vis.shape[0]):
        cols = np.flatnonzero(vis[i])
        if len(cols):
            ids[i, : len(cols)] = cols
            ids[i, len(cols):] = cols[-1]
    return ids, counts


def pad_tables(ids: np.ndarray, width: int) -> np.ndarray:
    """Widen `ids` to a bucketed width (a static shape), repeating each row's last id."""
    if ids.shape[1] >= width:
        return ids[:, :width]
    return np.concatenate([ids, np.repeat(ids[:, -1:], width - ids.shape[1], axis=1)], axis=1)


def dense_attention(q, k, v, q_meta, kv_meta):
    """Reference: materializes the full [T, Tk] mask. q [T, H, D], k/v [Tk, Hkv, D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(T, Hkv, H // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("thgd,khd->hgtk", qg, k.astype(jnp.float32)) / np.sqrt(D)
    mask = visible(q_meta[0][:, None], q_meta[1][:, None], q_meta[2][:, None],
                   kv_meta[0][None, :], kv_meta[1][None, :], kv_meta[2][None, :])
    s = jnp.where(mask, s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("hgtk,khd->thgd", p, v.astype(jnp.float32))
    return o.reshape(T, H, D).astype(q.dtype)


def blocksparse_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int):
    """Plain-XLA attention over the visible tiles only (see module doc).

    Query tiles are processed one at a time (`lax.map`) so each tile's scores stay in
    cache; materializing all tiles' scores at once is memory-bound and ~3x slower on CPU.
    """
    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    nq, width = tile_ids.shape
    G = H // Hkv
    k_tiles = k.reshape(Tk // block_k, block_k, Hkv, D)
    v_tiles = v.reshape(Tk // block_k, block_k, Hkv, D)
    k_meta_tiles = [m.reshape(Tk // block_k, block_k) for m in kv_meta]
    slots = jnp.arange(width)

    def one_tile(args):
        q_tile, ids, count, q_seq, q_item, q_pos = args
        kt = k_tiles[ids].reshape(width * block_k, Hkv, D)
        vt = v_tiles[ids].reshape(width * block_k, Hkv, D)
        k_seq, k_item, k_pos = (m[ids].reshape(width * block_k) for m in k_meta_tiles)
        mask = visible(q_seq[:, None], q_item[:, None], q_pos[:, None], k_seq[None, :], k_item[None, :], k_pos[None, :])
        mask &= jnp.repeat(slots < count, block_k)[None, :]
        s = jnp.einsum("ihgd,jhd->hgij", q_tile, kt, preferred_element_type=jnp.float32) / np.sqrt(D)
        s = jnp.where(mask, s, _MASKED)
        p = jnp.exp(s - s.max(axis=-1, keepdims=True))
        # The row sums come out of the same matmul as p @ v (ones appended to v): a matmul adds
        # its terms in key order, so an item's result does not depend on where other items sit
        # in the pass. A plain reduction's rounding does, by enough to break the 1e-5 isolation rule.
        # The ones are as wide as v: a single ones column (half the work) changed the CPU matmul's blocking
        # and broke the isolation rule again (tests/test_engine_parity.py, 2026-11-21).
        o = jnp.einsum("hgij,jhd->hgid", p.astype(v.dtype), jnp.concatenate([vt, jnp.ones_like(vt)], axis=-1),
                       preferred_element_type=jnp.float32)
        o = o[..., :D] / o[..., D:D + 1]
        return o.transpose(2, 0, 1, 3).astype(q.dtype)

    q_tiles = q.reshape(nq, block_q, Hkv, G, D)
    q_meta_tiles = [m.reshape(nq, block_q) for m in q_meta]
    out = jax.lax.map(one_tile, (q_tiles, tile_ids, tile_counts, *q_meta_tiles))
    return out.reshape(T, H, D)


def _pallas_kernel(ids_ref, counts_ref, q_seq_ref, q_item_ref, q_pos_ref, k_seq_ref, k_item_ref, k_pos_ref,
                   q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float):
    i = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32) * scale  # [bq, D]
    q_seq, q_item, q_pos = q_seq_ref[...], q_item_ref[...], q_pos_ref[...]
    bq, d = q.shape

    def visit_tile(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(ids_ref[i, j] * block_k, block_k)
        span = pl.ds(start, block_k)
        k = k_ref[span, :].astype(jnp.float32)
        v = v_ref[span, :].astype(jnp.float32)
        mask = visible(q_seq[:, None], q_item[:, None], q_pos[:, None],
                       k_seq_ref[span][None, :], k_item_ref[span][None, :], k_pos_ref[span][None, :])
        s = jnp.where(mask, jnp.dot(q, k.T), _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + jnp.dot(p, v)

    init = (jnp.full((bq,), _MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    # Only the tiles listed for this query tile are loaded: the loop bound is their count.
    _, l, acc = jax.lax.fori_loop(0, counts_ref[i], visit_tile, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


@partial(jax.jit, static_argnames=("block_q", "block_k", "interpret"))
def pallas_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                     interpret: bool = False):
    """Pallas block-sparse attention; same arguments and result as `blocksparse_attention`."""
    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    G = H // Hkv
    nq = T // block_q
    qh = q.transpose(1, 0, 2)  # [H, T, D]
    kh = k.transpose(1, 0, 2)  # [Hkv, Tk, D]
    vh = v.transpose(1, 0, 2)
    whole = lambda shape: pl.BlockSpec(shape, lambda h, i: (0,) * len(shape))
    q_tile_meta = pl.BlockSpec((block_q,), lambda h, i: (i,))
    kernel = partial(_pallas_kernel, block_k=block_k, scale=1.0 / float(np.sqrt(D)))
    out = pl.pallas_call(
        kernel,
        grid=(H, nq),
        in_specs=[
            whole(tile_ids.shape), whole(tile_counts.shape),
            q_tile_meta, q_tile_meta, q_tile_meta,
            whole((Tk,)), whole((Tk,)), whole((Tk,)),
            pl.BlockSpec((None, block_q, D), lambda h, i: (h, i, 0)),
            pl.BlockSpec((None, Tk, D), lambda h, i: (h // G, 0, 0)),
            pl.BlockSpec((None, Tk, D), lambda h, i: (h // G, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, D), lambda h, i: (h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((H, T, D), q.dtype),
        interpret=interpret,
    )(tile_ids, tile_counts, *q_meta, *kv_meta, qh, kh, vh)
    return out.transpose(1, 0, 2)
