"""The process's C allocator: glibc's, or jemalloc where `packscore worker` preloads it (WORKER_ALLOCATOR).
Handing the pages it keeps free back to the system, and what jemalloc holds, for the worker's memory log."""

import ctypes
import os
import sys

_PROCESS = ctypes.CDLL(None)
_JEMALLOC = hasattr(_PROCESS, "mallctl")
# glibc keeps the memory a pass frees in its heaps for reuse, and passes of varying sizes (prefix-cache entries
# of every length, cache inputs, outputs) fragment them: a long-lived engine's RSS grew by about 100 MB every
# 10 requests of random shapes with nothing live behind it. None where the C library has no malloc_trim (musl,
# macOS), and under jemalloc, which hands freed pages back on its own: glibc's heaps are unused there.
_MALLOC_TRIM = None if _JEMALLOC else getattr(_PROCESS, "malloc_trim", None)


def trim_after_pass() -> None:
    """Returns glibc's free heap pages to the system after a pass (nothing to do under jemalloc)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def hand_back_freed_memory() -> str:
    """Hands the pages the C allocator keeps free back to the system; says which allocator, and for jemalloc what
    it holds. glibc's malloc_trim: the first log, after the warm-up, hands back about 100 MB (what compiling the
    ladder used), later ones little. jemalloc hands its freed pages back on its own within seconds; a purge of
    every arena makes the log's figure the same measure, and its statistics tell memory in use
    (`stats.allocated`) from what it keeps mapped (`stats.resident`) and, of that, its own bookkeeping
    (`stats.metadata`): after the purge the rest is slabs partly in use, what a burst of small objects leaves."""
    if _JEMALLOC:
        _PROCESS.mallctl(b"arena.4096.purge", None, None, None, 0)  # 4096: MALLCTL_ARENAS_ALL
        epoch = ctypes.c_uint64(1)  # writing the epoch refreshes the statistics read below
        _PROCESS.mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(ctypes.sizeof(epoch)))
        stats = {}
        for name in ("allocated", "resident", "metadata"):
            value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
            _PROCESS.mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, 0)
            stats[name] = value.value / 2**20
        return (f"jemalloc ({stats['allocated']:.1f} MB in use, {stats['resident']:.1f} MB resident, "
                f"{stats['metadata']:.1f} MB of it metadata)")
    if _MALLOC_TRIM is not None:
        trim_after_pass()
        return "glibc"
    return "an allocator that cannot be asked (not glibc, not jemalloc)"


def python_objects() -> str:
    """Where Python's small objects live, for the memory log: its own arenas (pymalloc, the blocks they hold) or,
    under PYTHONMALLOC=malloc (what `packscore worker` gives with jemalloc), the C allocator's figures above."""
    if os.environ.get("PYTHONMALLOC", "").startswith("malloc"):
        return "objects from the C allocator"
    return f"{sys.getallocatedblocks()} blocks allocated"
