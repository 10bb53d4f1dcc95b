"""The Hopper-shaped Mosaic GPU kernel (PACKSCORE_GPU_KERNEL=ws), in the form of FlashAttention 3 and jax's
`attention_mgpu`: warp-specialized, a producer warpgroup that only issues the TMA copies of the visible K/V tiles
(`plgpu.emit_pipeline_warp_specialized` over the kernel tables) and two consumer warpgroups that share each
tile, taking turns on the tensor cores (FlashAttention 3's ping-pong: one's softmax runs under the other's
matmuls), QK^T and PV on WGMMA, the online softmax in registers in base 2 with the scale folded in.

The two consumers are two query heads of one KV head, so the kernel serves models whose KV heads have an even
number of query heads (GQA: Qwen3, Gemma 2, Mistral): a K/V tile is loaded once for both, and the CTA's query
tile stays 64 rows, so its table lists only what those 64 rows see. Other models (SmolLM2's 3 heads a KV head,
MHA) take today's kernel (core.attention.gpu).
Masks are computed only on the tiles that `full_tiles` does not flag. q, k, v and the output stay [T, H, D]
(TMA copies a [rows, D] box of one head out of them), so no transposes surround the kernel.
"""

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from core.attention.device_tables import full_tiles, kernel_tables, padded_inputs, round_up
from core.attention.gpu import wgmma_setup
from core.attention.rule import MASKED, NN, NT, q_scale, visible

# "ws": this kernel serves the "pallas" path on CUDA; "wgmma" (the default until a device run measures this one):
# core.attention.gpu's.
GPU_KERNEL = os.environ.get("PACKSCORE_GPU_KERNEL", "wgmma")
CONSUMER_ROWS = 64  # query rows per consumer warpgroup: one WGMMA's M
WS_TILE_K = 128  # keys per K/V tile; 64 for head_dim 256, whose double-buffered 128-key tiles overflow shared memory
_LOG2E = math.log2(math.e)


def kernel_for(q, k, block_q: int, block_k: int, **layer):
    """This kernel where PACKSCORE_GPU_KERNEL=ws and it applies (16-bit floats, head_dim a multiple of 64, an even
    number of query heads a KV head, not the aligned key tiles), else None (the next row of selection.KERNELS)."""
    if GPU_KERNEL != "ws" or q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 64 or layer.get("aligned"):
        return None
    if k is not None and (q.shape[1] // k.shape[1]) % 2:  # (k None: whether a kernel applies to a head size)
        return None
    return partial(ws_attention, block_q=block_q, block_k=block_k, **layer)


def ws_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                 tile_k: int | None = None, max_concurrent_steps: int = 2, interpret=None,
                 scale: float | None = None, softcap: float | None = None, window: int = 0):
    """Same arguments and result as `blocksparse_attention` (bf16/f16, head_dim a multiple of 64). A CTA per
    (pair of query heads or one query head, query tile): see the module's doc."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    T, H, D = q.shape
    Tk, Hkv, _ = k.shape
    G = H // Hkv
    dtype = q.dtype
    assert G % 2 == 0, "the consumers are two query heads of one KV head (kernel_for)"
    tile_q = CONSUMER_ROWS
    tile_k = tile_k or (WS_TILE_K if D <= 128 else WS_TILE_K // 2)
    quantum_q, quantum_k = math.lcm(block_q, tile_q), math.lcm(block_k, tile_k)
    q_len, kv_len = round_up(T, quantum_q), round_up(Tk, quantum_k)
    q, k, v, q_meta, kv_meta = padded_inputs(q, k, v, tuple(q_meta), tuple(kv_meta), q_len, kv_len)
    ids, counts = kernel_tables(tile_ids, tile_counts, block_q, block_k, tile_q, tile_k, q_len, kv_len)
    full = full_tiles(ids, q_meta, kv_meta, tile_q, tile_k, window)
    nq, width = ids.shape
    q_rows = jnp.stack(q_meta).astype(jnp.int32)  # [3, q_len]: seq, item, pos
    k_rows = [m.astype(jnp.int32) for m in kv_meta]
    scale = q_scale(scale, D)
    # Scores in base 2: exp(s - m) = exp2(s * log2(e) - m'), the factor folded into the scale (or the soft-cap's).
    to_base2 = (lambda s: s * (scale * _LOG2E)) if not softcap else (
        lambda s: jnp.tanh(s * (scale / softcap)) * (softcap * _LOG2E))

    tiling, swizzle, row, col, load, cast = wgmma_setup(dtype, interpret)
    # Interpret mode runs no WGMMA on a transposed or a register operand either: there the matmuls are
    # dot_generals on the same operands.
    rows_by = lambda x, n: jax.lax.broadcast_in_dim(x, (CONSUMER_ROWS, n), [0])
    cols_by = lambda x: jax.lax.broadcast_in_dim(x, (CONSUMER_ROWS, tile_k), [1])

    def qk(q_smem, k_smem, take_turn):
        """q @ k.T, with a turn taken while the WGMMA runs."""
        if interpret:
            take_turn()
            return jax.lax.dot_general(q_smem[...], k_smem[...], NT, preferred_element_type=jnp.float32)

        def wgmma(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            take_turn()
            return acc_ref[...]
        return pl.run_scoped(wgmma, plgpu.ACC((CONSUMER_ROWS, tile_k), jnp.float32))

    def pv(acc, p, v_smem):
        """acc + p @ v, accumulated in place by the WGMMA."""
        if interpret:
            return acc + jax.lax.dot_general(p, v_smem[...], NN, preferred_element_type=jnp.float32)

        def wgmma(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem)
        return pl.run_state(wgmma)(plgpu.ACC.init(acc))

    def body(ids_ref, counts_ref, full_ref, qm_ref, k_seq_ref, k_item_ref, k_pos_ref, q_ref, k_ref, v_ref, o_ref,
             qo_smem, qm_smem, barriers, schedule):
        c, i = jax.lax.axis_index("heads"), jax.lax.axis_index("q_tiles")

        def take_turn():
            """The consumers take turns on the tensor cores (FlashAttention 3's ping-pong): one's softmax runs
            while the other's matmuls do. Each takes 2 turns a step; the second starts one turn late and the first
            takes one more at the end, so both arrive equally often."""
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        first_head = c * 2
        kv_head = jax.lax.div(first_head, jnp.int32(G))

        def consumer_rows(wg):
            """The consumer's query head and first query row."""
            return first_head + wg, i * tile_q

        def consumer(pipeline):
            wg = jax.lax.axis_index("wg")
            head, first_row = consumer_rows(wg)
            q_smem, meta = qo_smem.at[wg], qm_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first_row, CONSUMER_ROWS), head], q_smem, barriers.at[wg])
            for r in range(3):
                plgpu.copy_gmem_to_smem(qm_ref.at[r, pl.ds(first_row, CONSUMER_ROWS)], meta.at[r], barriers.at[wg])
            plgpu.barrier_wait(barriers.at[wg])
            init = (cast(jnp.zeros((CONSUMER_ROWS, D), jnp.float32), plgpu.Layout.WGMMA),
                    cast(jnp.full((CONSUMER_ROWS,), MASKED, jnp.float32), row),
                    cast(jnp.zeros((CONSUMER_ROWS,), jnp.float32), row))
            pl.when(wg == 1)(take_turn)
            acc, m_i, l_i = pipeline(init)
            pl.when(wg == 0)(take_turn)
            # A row that saw no key (padding) still has m = MASKED: zeros. (It summed exp2(0) over masked keys.)
            inv = jnp.where(m_i == MASKED, 0.0, 1.0 / l_i)
            q_smem[...] = (acc * rows_by(inv, D)).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(first_row, CONSUMER_ROWS), head])
            plgpu.wait_smem_to_gmem(0)

        def step(indices, k_smem, v_smem, k_seq_smem, k_item_smem, k_pos_smem, carry):
            acc, m_i, l_i = carry
            wg = jax.lax.axis_index("wg")
            t = to_base2(qk(qo_smem.at[wg], k_smem, take_turn))

            def masked(t):
                q_seq, q_item, q_pos = (rows_by(load(qm_smem.at[wg, r], row), tile_k) for r in range(3))
                k_seq, k_item, k_pos = (cols_by(load(ref, col)) for ref in (k_seq_smem, k_item_smem, k_pos_smem))
                return jnp.where(visible(q_seq, q_item, q_pos, k_seq, k_item, k_pos, window), t, MASKED)
            t = jax.lax.cond(full_ref[i * width + indices[0]] != 0, lambda t: t, masked, t)
            # A row whose keys so far are all masked has m = MASKED and sums exp2(0) = 1 per key: its first visible
            # key's alpha, exp2(MASKED - m), is 0 and clears that.
            m_new = jnp.maximum(m_i, t.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(t - rows_by(m_new, tile_k))
            l_i = l_i * alpha + p.sum(axis=1)
            take_turn()
            acc = pv(acc * rows_by(alpha, D), p.astype(dtype), v_smem)
            return acc, m_new, l_i

        kv_spec = plgpu.BlockSpec((tile_k, D), lambda j: (ids_ref[i * width + j], 0), transforms=(tiling, swizzle))
        meta_spec = plgpu.BlockSpec((tile_k,), lambda j: (ids_ref[i * width + j],))
        plgpu.emit_pipeline_warp_specialized(
            step, grid=(counts_ref[i],), in_specs=[kv_spec, kv_spec, meta_spec, meta_spec, meta_spec],
            max_concurrent_steps=max_concurrent_steps, num_compute_wgs=2, memory_registers=40, wg_axis="wg",
            compute_context=consumer,
        )(k_ref.at[:, kv_head], v_ref.at[:, kv_head], k_seq_ref, k_item_ref, k_pos_ref)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((q_len, H, D), dtype),
        scratch_types=[
            plgpu.SMEM((2, CONSUMER_ROWS, D), dtype, transforms=(tiling, swizzle)),  # each consumer's Q, then O
            plgpu.SMEM((2, 3, CONSUMER_ROWS), jnp.int32),  # each consumer's query rows: seq, item, pos
            plgpu.Barrier(num_arrivals=4, num_barriers=2),  # each consumer's 4 copies of them
            plgpu.Barrier(num_arrivals=2),  # the consumers' turns
        ],
        grid=(H // 2, nq),
        grid_names=("heads", "q_tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(ids.reshape(-1), counts, full.reshape(-1), q_rows, *k_rows, q, k, v)
    return out[:T]
