"""The warp-specialized Mosaic GPU kernel (core.attention.gpu_ws) against the dense reference, on the CPU.

GPU interpret mode runs its whole grid with its three warpgroups as threads (the producer's TMA copies, the
barriers between them, the race detector on), but has no WGMMA on register or transposed operands: the tables,
the pipeline's index maps, the full-tile flags, the masking and the online softmax are checked, the WGMMA calls
are not (tests/test_aot.py lowers them for CUDA). Layouts are small: interpret mode is slow.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpreter
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from core.attention import device_tables, gpu, gpu_ws, host_tables, selection
from core.packing import PackedSequence, PassPlan, build_pass
from tests.request_layouts import reference
from tests.test_engine_tpu import check, inputs


def sequence(tag: int, prefix: int, sizes, cached: bool = False) -> PackedSequence:
    items = [(tag, i, tuple(range(n))) for i, n in enumerate(sizes) if n]
    return PackedSequence(tuple(range(prefix)), cached, items=items,
                          scored_at_prefix_end=[(tag, i) for i, n in enumerate(sizes) if not n])


# The contract's layout in small (a cached query, items of 20 tokens: the first key tile is all prefix, seen
# whole by every row of the query tiles: the unmasked fast path), several sequences in a tile with padding, long
# items, and Gemma 2's window and soft-cap (head_dim 256: 64-key tiles).
LAYOUTS = {
    "contract": [sequence(0, 150, (20, 20, 0, 20, 20, 20, 20), cached=True)],
    "packed": [sequence(0, 9, (3, 1, 0, 11)), sequence(1, 40, (5, 2), cached=True), sequence(2, 3, (1,))],
    "long items": [sequence(0, 40, (80,), cached=True), sequence(1, 5, (2, 0))],
}


@pytest.mark.parametrize("name,heads,kv_heads,dim,layer", [
    ("contract", 2, 1, 128, {}),  # Qwen3's 2 heads per KV head: the consumers are the two heads
    ("packed", 4, 2, 64, {}),  # two KV heads
    ("long items", 2, 1, 64, {"scale": 0.2}),
    ("contract", 2, 1, 256, {"window": 30, "softcap": 2.0}),  # Gemma 2
    ("packed", 2, 1, 64, {"window": 5, "softcap": 30.0}),
])
def test_ws_kernel_in_gpu_interpret_mode_matches_dense(name, heads, kv_heads, dim, layer):
    arrays = build_pass(PassPlan(LAYOUTS[name]), 128, 64)
    args = inputs(arrays, heads, kv_heads, dim, jnp.bfloat16, len(name))
    if layer.get("window"):  # the window's own tables
        args = (*args[:5], *(jnp.asarray(t) for t in host_tables.block_tables(
            arrays.q_meta, arrays.kv_meta, 128, 64, window=layer["window"])))
    gpu_interpreter.reset_gpu_interpret_mode_state()
    out = gpu_ws.ws_attention(*args, 128, 64, interpret=InterpretGPUParams(detect_races=True), **layer)
    out = np.asarray(out.astype(jnp.float32))
    assert not gpu_interpreter.get_races().races_found
    check(arrays, out, reference(*args[:5], **layer), 3e-2)


def test_the_contract_layout_has_full_and_partial_tiles():
    """The layout above runs both branches of the kernel's step: unmasked tiles and masked ones."""
    arrays = build_pass(PassPlan(LAYOUTS["contract"]), 128, 64)
    args = inputs(arrays, 2, 1, 64, jnp.bfloat16, 0)
    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q_len, kv_len = device_tables.round_up(T, 128), device_tables.round_up(Tk, 128)
    ids, counts = device_tables.kernel_tables(args[5], args[6], 128, 64, gpu_ws.CONSUMER_ROWS, gpu_ws.WS_TILE_K,
                                              q_len, kv_len)
    qm, km = device_tables.padded_inputs(*args[:5], q_len, kv_len)[3:]
    full = np.asarray(device_tables.full_tiles(ids, qm, km, gpu_ws.CONSUMER_ROWS, gpu_ws.WS_TILE_K))
    listed = np.arange(ids.shape[1])[None] < np.asarray(counts)[:, None]
    assert (full & listed).any() and (~full & listed).any()


def test_the_setting_picks_the_ws_kernel_where_it_applies(monkeypatch):
    """PACKSCORE_GPU_KERNEL=ws: the CUDA programs get this kernel where it applies, else today's; by default
    today's."""
    arrays = build_pass(PassPlan(LAYOUTS["packed"]), 128, 64)
    monkeypatch.setattr(selection, "_paths", {})

    def chosen(dtype, dim=64, heads=2, **layer):
        args = inputs(arrays, heads, 1, dim, dtype, 0)
        kernel = selection._choose("cuda", None, (*args[:3], tuple(args[3]), tuple(args[4]), *args[5:]), 128, 64,
                                   layer)
        return kernel.func, selection.attention_path("cuda")

    assert chosen(jnp.bfloat16) == (gpu.gpu_attention, "pallas-mosaic-gpu")
    monkeypatch.setattr(gpu_ws, "GPU_KERNEL", "ws")
    assert chosen(jnp.bfloat16) == (gpu_ws.ws_attention, "pallas-mosaic-gpu-ws")
    assert chosen(jnp.float16, 128) == (gpu_ws.ws_attention, "pallas-mosaic-gpu-ws")
    # The aligned key tiles (PACKSCORE_ALIGNED_KEY_TILES=1): today's kernel reads their windows, this one does not.
    assert chosen(jnp.bfloat16, aligned=True) == (gpu.gpu_attention, "pallas-mosaic-gpu")
    # Its consumers are two query heads of one KV head: SmolLM2's 3 take today's kernel.
    assert chosen(jnp.bfloat16, heads=3) == (gpu.gpu_attention, "pallas-mosaic-gpu")
