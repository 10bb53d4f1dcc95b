"""Which attention path serves which setting and device: the one place that decides it.

`PATHS`: each ATTENTION setting's path. The engine (core.scorer) reads from it everything that differs between
paths: the function its pass program calls, the host tables it reads and their shapes, its query tile, and
whether its tables' width is a compile key. "auto" is `AUTO[backend]`.

`KERNELS`: the device kernels that the "pallas" path puts into a program, per lowering platform
(`lax.platform_dependent`): the first row of the platform whose kernel applies to the inputs and, on this
host's own platform, compiles here. Elsewhere (and on CPU), or where none does, the block-sparse XLA path runs;
a kernel that does not compile is logged once (`attention_path` tells which path is in use). A new kernel is
a module of this package with a `kernel_for` (as `gpu.kernel_for`) and one row of KERNELS.
"""

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import numpy as np

from core.attention import gpu, gpu_ws, host_tables, tpu
from core.attention.device_tables import tiles_of_windows
from core.attention.host_tables import block_tables, cascade_table_shapes, cascade_tables, pad_tables
from core.attention.xla import blocksparse_attention, cascade_attention, dense_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernel:
    """A device kernel of the "pallas" path."""

    platform: str  # the lowering platform it serves: "tpu", "cuda"
    name: str  # the attention path it reports (`attention_path`)
    kernel_for: Callable  # (q, k, block_q, block_k, **layer) -> the kernel, or None where it does not apply


KERNELS = (
    Kernel("tpu", "pallas-tpu", tpu.kernel_for),
    Kernel("cuda", "pallas-mosaic-gpu-ws", gpu_ws.kernel_for),  # PACKSCORE_GPU_KERNEL=ws only
    Kernel("cuda", "pallas-mosaic-gpu", gpu.kernel_for),
)

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


def kernel_applies(platform: str, q, k, block_q: int, block_k: int) -> bool:
    """Whether some kernel of `platform` serves inputs like q and k (shapes and dtypes; compiling aside)."""
    return any(row.kernel_for(q, k, block_q, block_k) is not None for row in KERNELS if row.platform == platform)


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


def _choose(platform: str, fallback, args, block_q: int, block_k: int, layer: dict):
    """The first kernel of `platform` that applies, unless this host is that platform and it fails to compile
    here; else `fallback`. Lowering for another platform (ahead-of-time, core.aot) always keeps the kernel, so
    a kernel that cannot compile fails there loudly."""
    on_this_host = _HOST_PLATFORM.get(jax.default_backend()) == platform
    for row in KERNELS:
        if row.platform != platform:
            continue
        kernel = row.kernel_for(args[0], args[1], block_q, block_k, **layer)
        if kernel is not None and (not on_this_host or _compiles_here(row.name, kernel, args)):
            _paths[platform] = row.name
            return kernel
    _paths[platform] = "xla"
    return fallback


@partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "scale", "softcap", "window", "aligned"))
def pallas_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q: int, block_k: int,
                     interpret=False, scale: float | None = None, softcap: float | None = None, window: int = 0,
                     aligned: bool | None = None):
    """Pallas block-sparse attention; same arguments and result as `blocksparse_attention`.

    interpret=False: the kernel of the platform the program is lowered for (see KERNELS), else (and on CPU)
    the XLA block-sparse path. interpret=True or a `pltpu.InterpretParams`: the TPU kernel run on the CPU in
    interpret mode. q is rounded to the keys' dtype: the kernels' matmuls take one dtype.
    `aligned` (None: ALIGNED_KEY_TILES, as `block_tables` made the tables): the tables are `window_tables`
    and the kernels read windows; the XLA path reads the tiles those windows touch.
    """
    aligned = host_tables.ALIGNED_KEY_TILES if aligned is None else aligned
    q = q.astype(k.dtype)
    args = (q, k, v, tuple(q_meta), tuple(kv_meta), tile_ids, tile_counts)
    layer = {"scale": scale, "softcap": softcap, "window": window}
    if interpret:
        return tpu.tpu_attention(*args, block_q, block_k, interpret=interpret, aligned=aligned, **layer)
    xla = partial(blocksparse_attention, block_q=block_q, block_k=block_k, **layer)
    if aligned:
        xla = partial(_on_tiles_of_windows, xla, block_k)
        layer["aligned"] = True
    kernels = {platform: _choose(platform, xla, args, block_q, block_k, layer)
               for platform in dict.fromkeys(row.platform for row in KERNELS)}
    return jax.lax.platform_dependent(*args, default=xla, **kernels)


def _on_tiles_of_windows(attention, block_k: int, q, k, v, q_meta, kv_meta, firsts, counts):
    """`attention` (the XLA path) over the tiles that `window_tables`' windows touch."""
    return attention(q, k, v, q_meta, kv_meta, *tiles_of_windows(firsts, counts, block_k, k.shape[0]))


# ---- the ATTENTION settings ---------------------------------------------------------------------------------

def _block_tables(arrays, window: int, width: int, block_q: int, block_k: int) -> tuple[np.ndarray, ...]:
    """The block tables `width` wide: the pass's own, or a windowed layer's (which skip the tiles outside it)."""
    if not window:
        return pad_tables(arrays.tile_ids, width), arrays.tile_counts
    ids, counts = block_tables(arrays.q_meta, arrays.kv_meta, block_q, block_k, window=window)
    return pad_tables(ids, width), counts


def _block_table_shapes(tokens: int, keys: int, width: int, block_q: int) -> tuple[tuple[int, ...], ...]:
    return (tokens // block_q, width), (tokens // block_q,)


def _cascade_tables(arrays, window: int, width: int, block_q: int, block_k: int) -> tuple[np.ndarray, ...]:
    return cascade_tables(arrays.q_meta, arrays.kv_meta, window).as_tuple()


def _cascade_table_shapes(tokens: int, keys: int, width: int, block_q: int) -> tuple[tuple[int, ...], ...]:
    return cascade_table_shapes(tokens, keys)


def _dense(q, k, v, q_meta, kv_meta, host_tables, block_q: int, block_k: int, **layer):
    return dense_attention(q, k, v, q_meta, kv_meta, **layer)


def _cascade(q, k, v, q_meta, kv_meta, host_tables, block_q: int, block_k: int, **layer):
    return cascade_attention(q, k, v, q_meta, kv_meta, *host_tables, **layer)


def _pallas(q, k, v, q_meta, kv_meta, host_tables, block_q: int, block_k: int, interpret: bool = False, **layer):
    return pallas_attention(q, k, v, q_meta, kv_meta, *host_tables, block_q=block_q, block_k=block_k,
                            interpret=interpret, **layer)


@dataclass(frozen=True)
class Path:
    """What the engine does for one ATTENTION setting."""

    attend: Callable  # (q, k, v, q_meta, kv_meta, host tables, block_q, block_k, **layer) -> output [T, H, D]
    tables: Callable  # (pass arrays, window, width, block_q, block_k) -> the host tables it reads
    table_shapes: Callable  # (tokens, keys, width, block_q) -> the shapes of those tables
    block_q: int  # the block tables' query rows per tile where the Scorer is given none
    # The tables take the widest width a pass can need: the width is then no compile key, and the warm-up
    # compiles the shape ladder ahead. A kernel's grid spans its table, so its tables stay as narrow as a pass
    # needs (a compile key that depends on the traffic).
    wide_tables: bool
    lowers_kernels: bool = False  # its programs get `KERNELS`: it reports the one lowered (`attention_path`)


# The XLA path and the dense reference read no block tables: a 64-row tile lets the ladder reach 64 tokens.
PATHS = {
    "xla": Path(_cascade, _cascade_tables, _cascade_table_shapes, block_q=64, wide_tables=True),
    "pallas": Path(_pallas, _block_tables, _block_table_shapes, block_q=128, wide_tables=False, lowers_kernels=True),
    "pallas-interpret": Path(partial(_pallas, interpret=True), _block_tables, _block_table_shapes, block_q=128,
                             wide_tables=False),
    "dense": Path(_dense, _block_tables, _block_table_shapes, block_q=64, wide_tables=True),
}
SETTINGS = ("auto", *PATHS)
AUTO = {"cpu": "xla"}  # jax.default_backend() -> the path "auto" takes; "pallas" on any other


def setting_for(attention: str, backend: str) -> str:
    """The path ATTENTION=`attention` takes on `backend`; raises ValueError for an unknown setting."""
    if attention not in SETTINGS:
        raise ValueError(f"attention must be one of {SETTINGS}")
    return AUTO.get(backend, "pallas") if attention == "auto" else attention


def path_in_use(attention: str) -> str:
    """The attention that runs for a resolved setting: the setting itself, or for a path that lowers kernels,
    the kernel in the programs compiled so far ("pallas" before the first pass)."""
    if not PATHS[attention].lowers_kernels:
        return attention
    path = attention_path()
    return attention if path == "none" else path
