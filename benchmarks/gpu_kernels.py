"""The Mosaic GPU attention kernel on the GPU at hand, the default and the aligned one:
`python -m benchmarks.gpu_kernels`. One request is laid out four ways (its query in the pass or cached, alone or
packed between other requests; tests/request_layouts.py, which tests/test_engine_tpu.py runs in interpret mode on a
CPU); for each kernel: whether that request's output rows are bitwise the same in every layout, and their largest
distance from the dense float32 reference. A kernel that fails to compile or run prints its whole traceback (the
engine's probe logs only the exception's first line).
"""

import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from core.attention import gpu, host_tables
from tests.request_layouts import request_layouts, request_rows

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-0.6B's attention
BLOCK_Q, BLOCK_K = 128, 64  # the engine's tables


def main() -> None:
    print(f"devices: {jax.devices()}; jax {jax.__version__}")
    if jax.default_backend() == "cpu":  # a dry run of the device check: GPU interpret mode, a small layout
        plans = request_layouts(20, (3, 1, 0, 11), [(7, (5,), False), (30, (2, 0), True)])
        heads, blocks = (1, 1), (64, 64)
        interpret = InterpretGPUParams()
    else:
        plans = request_layouts(300, (20,) * 12 + (7, 0, 33), [(130, (7, 9), False), (200, (3, 4), True),
                                                               (61, (5,), False)])
        heads, blocks, interpret = (HEADS, KV_HEADS), (BLOCK_Q, BLOCK_K), None
    for aligned in (False, True):
        kernel = jax.jit(partial(gpu.gpu_attention, aligned=aligned, interpret=interpret), static_argnums=(7, 8))
        try:
            tables = host_tables.window_tables if aligned else host_tables.block_tables
            rows, distances = request_rows(kernel, plans, *heads, DIM, jnp.bfloat16, *blocks, host_tables=tables)
            moved = [float(np.abs(r - rows[0][1]).max()) for keys, r in rows[1:]]
            print(f"aligned={aligned}: rows bitwise in every layout: {all(m == 0 for m in moved)} (largest move per "
                  f"layout {moved}); largest distance from float32 dense {max(distances):.3e}", flush=True)
        except Exception:  # noqa: BLE001 - the point is to see why
            print(f"aligned={aligned}: FAILED\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
