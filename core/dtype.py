"""Which dtype the engine computes in, and what goes with it: `DTYPE=auto`'s choice by platform and CPU features,
XLA's CPU flags per dtype and CPU feature, and the bfloat16 rule (docs/score-semantics.md) checked on a fixed
request before a worker serves a model in bfloat16."""

import gc
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")

# docs/score-semantics.md's bfloat16 rule where PyTorch is not at hand to measure transformers' bfloat16 on the
# request itself: the least distance from float32 that transformers' bfloat16 showed on the bundled model for the
# 300-token queries measured there (0.145 to 0.219).
BF16_TOLERANCE = 0.145
# The request a worker scores in both dtypes before it serves a model in bfloat16: a 300-token query, as
# BF16_TOLERANCE was measured on, and few items, so that it costs a pass or two.
WARM_UP_SHAPE = (300, 8, 20)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The host's matmul features of those the dtype choice and XLA's flags depend on (empty where the file is
    unreadable, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ("amx_bf16", "avx512_bf16", "avx512f") if flag in flags]


def cpu_feature(flags: Iterable[str]) -> str:
    """The host's best bfloat16 matmul path: "amx" (AMX tiles), "avx512_bf16", or "other"."""
    flags = set(flags)
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "other"


def resolve(setting: str, platform: str, flags: Iterable[str]) -> str:
    """DTYPE as the engine runs it. `auto`: bfloat16 on accelerators (what their workers are set to) and on CPUs
    with AMX (its bfloat16 matmuls are several times float32's), float32 on other CPUs (bfloat16 gains little or
    loses there). `platform`: JAX's backend ("cpu", "tpu", "gpu"); `flags`: cpu_flags()."""
    if setting != "auto":
        return setting
    if platform != "cpu":
        return "bfloat16"
    return "bfloat16" if cpu_feature(flags) == "amx" else "float32"


# XLA's CPU flags by (dtype, CPU feature); a pair not listed gets none. XLA's CPU compiler hands matmuls to
# YNNPACK; handing it the element-wise ops and reductions too made the float32 pass about 5% faster, with the same
# results to the contract's tolerances. For bfloat16 XLA's default path is the fastest measured on every CPU, AMX
# included (its dots reach AMX there; each value of the flag tried made the pass 37-50% slower,
# docs/performance.md "bfloat16 on CPU"): no bfloat16 row.
YNN_FUSION = "--xla_cpu_experimental_ynn_fusion_type"
XLA_CPU_FLAGS: dict[tuple[str, str], tuple[str, ...]] = {
    ("float32", "amx"): (f"{YNN_FUSION}=dot,eltwise,reduce",),
    ("float32", "avx512_bf16"): (f"{YNN_FUSION}=dot,eltwise,reduce",),
    ("float32", "other"): (f"{YNN_FUSION}=dot,eltwise,reduce",),
}


def xla_cpu_flags(setting: str, flags: Iterable[str]) -> tuple[str, ...]:
    """The XLA flags for DTYPE `setting` on a CPU with `flags` (XLA reads them before it knows the platform; they
    matter only to its CPU backend, so `auto` is resolved as on a CPU)."""
    flags = list(flags)
    return XLA_CPU_FLAGS.get((resolve(setting, "cpu", flags), cpu_feature(flags)), ())


def without_table_flags(xla_flags: str) -> str:
    """XLA_FLAGS less the flags the table sets: for a process that is to choose its own (a subprocess of another
    dtype inherits its parent's choice)."""
    chosen = {flag for flags in XLA_CPU_FLAGS.values() for flag in flags}
    return " ".join(flag for flag in xla_flags.split() if flag not in chosen)


def seeded_request(vocab: int, shape: tuple[int, int, int], seed: int) -> tuple[list, list, list]:
    """A request of random token ids (seeded): a query of P tokens, N items of L tokens, 4 labels."""
    rng = np.random.default_rng(seed)
    query = rng.integers(10, vocab, shape[0]).tolist()
    items = [rng.integers(10, vocab, shape[2]).tolist() for _ in range(shape[1])]
    return query, items, rng.integers(10, vocab, 4).tolist()


def checked_bfloat16(engine: Any, load: Callable[[str], Any], name: str,
                     tolerance: float = BF16_TOLERANCE) -> Any:
    """The engine to serve `name` with: `engine` itself unless it runs bfloat16 and its scores of a fixed request
    are further from float32's than the bfloat16 rule allows; then the model in float32 (logged with the figures),
    so that a model whose weights bfloat16 rounds too coarsely is not served. `load(dtype)` builds the engine
    (core.scorer.Scorer) again; one model is held at a time (a worker's memory is sized for one)."""
    if str(engine.dtype) != "bfloat16":
        return engine
    request = seeded_request(engine.vocab_size, WARM_UP_SHAPE, 0)
    low = np.asarray(engine.logprobs(*request))
    del engine
    gc.collect()
    reference = load("float32")
    distance = float(np.abs(low - np.asarray(reference.logprobs(*request))).max())
    if distance > tolerance:
        log.warning("model %s: bfloat16 is %.3g from float32 on the warm-up request (P,N,L = %s), more than the "
                    "bfloat16 rule's %.3g (docs/score-semantics.md): serving float32 instead", name, distance,
                    ",".join(map(str, WARM_UP_SHAPE)), tolerance)
        return reference
    log.info("model %s: bfloat16 is %.3g from float32 on the warm-up request (the rule's bound %.3g): serving "
             "bfloat16", name, distance, tolerance)
    del reference
    gc.collect()
    return load("bfloat16")
