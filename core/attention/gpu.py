"""The Mosaic GPU kernel (H100 and later): the host tables drive `plgpu.emit_pipeline`, which streams the
visible K/V tiles of a query tile through shared memory, with QK^T and PV on WGMMA.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from core.attention.device_tables import kernel_tables, padded_inputs, round_up, window_kernel_tables
from core.attention.rule import MASKED, NN, NT, q_scale, softcapped
from core.attention.host_tables import part_starts

GPU_KERNEL = True  # False: attention="auto" uses the XLA path on GPU
GPU_TILE_Q, GPU_TILE_K = 64, 64  # one warpgroup's WGMMA rows; key tiles as the engine's tables
_GPU_ROW_TILE = 8  # rows of a tile of K/V in shared memory (WGMMA's 8 x 128-byte core matrices)


def kernel_for(q, k, block_q: int, block_k: int, **layer):
    """The Mosaic GPU kernel where it applies (16-bit floats, head_dim a multiple of 64), else None (XLA)."""
    if not GPU_KERNEL or q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 64:
        return None
    return partial(gpu_attention, block_q=block_q, block_k=block_k, **layer)


def wgmma_setup(dtype, interpret) -> tuple:
    """What both GPU kernels' WGMMA tiles share: (K/V tiling, swizzle, the layouts of one value per query row
    and per key column, a register load and a layout cast). GPU interpret mode (tests) runs neither plgpu.load
    nor layout casts (both only fix register layouts): there they are a plain read and nothing."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tiling = plgpu.TilingTransform((_GPU_ROW_TILE, 64 * 2 // jnp.dtype(dtype).itemsize))
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    load = (lambda ref, layout: ref[...]) if interpret else (lambda ref, layout: plgpu.load(ref, (), layout=layout))
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
    return tiling, plgpu.SwizzleTransform(128), row, col, load, cast


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
    q_len, kv_len = round_up(T, quantum_q), round_up(Tk, quantum_k) + (tile_k if aligned else 0)
    q, k, v, q_meta, kv_meta = padded_inputs(q, k, v, tuple(q_meta), tuple(kv_meta), q_len, kv_len)
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
        # at a 16-byte boundary, and a window's first key at any position (int32 rows read from an odd key are
        # an illegal instruction). The cost: 8 times K and V written per layer.
        shifted = lambda x: jnp.concatenate([jnp.roll(x, -r, axis=1) for r in range(_GPU_ROW_TILE)])
        k_rows = [shifted(m[None]) for m in k_rows]  # [8, Tk] each: copy r at row r
    else:
        ids, counts = kernel_tables(tile_ids, tile_counts, block_q, block_k, tile_q, tile_k, q_len, kv_len)
        k_rows = [m.astype(jnp.int32) for m in kv_meta]
        window_parts = ()
        keys = tile_k
    nq, width = ids.shape
    scale = q_scale(scale, D)
    q_rows = jnp.stack(q_meta).astype(jnp.int32)  # [3, T]: seq, item, pos
    qh = q.transpose(1, 0, 2)  # [H, T, D]
    kh = k.transpose(1, 0, 2)  # [Hkv, Tk, D]
    vh = v.transpose(1, 0, 2)
    if aligned:
        kh, vh = shifted(kh), shifted(vh)  # [8 * Hkv, Tk, D]: copy r of KV head h at r * Hkv + h
    tiling, swizzle, row, col, load, cast = wgmma_setup(dtype, interpret)

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
                s = jax.lax.dot_general(qo_smem[...], k_smem[...], NT, preferred_element_type=jnp.float32) * scale
            else:
                s = pl.run_scoped(qk, plgpu.ACC((tile_q, tile_k), jnp.float32)) * scale
            s = softcapped(s, softcap)
            k_seq, k_item, k_pos = (load(r, col) for r in k_meta_smem[:3])
            mask = ((by_row(q_seq) == by_col(k_seq)) & ((by_col(k_item) < 0) | (by_col(k_item) == by_row(q_item)))
                    & (by_col(k_pos) <= by_row(q_pos)))
            if window:
                mask &= by_row(q_pos) - by_col(k_pos) < window
            if aligned:  # the window's own part: the keys after it are another part's (or another sequence's)
                mask &= by_col(load(k_meta_smem[3], col)) == parts_ref[i * width + step_index[0]]
            s = jnp.where(mask, s, MASKED)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.where(mask, jnp.exp(s - by_row(m_new)), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem)
                return acc_ref[...]
            if interpret:  # nor a register operand
                pv_out = jax.lax.dot_general(p.astype(dtype), v_smem[...], NN, preferred_element_type=jnp.float32)
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
                cast(jnp.full((tile_q,), MASKED, jnp.float32), row), cast(jnp.zeros((tile_q,), jnp.float32), row))
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
