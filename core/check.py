"""`packscore check`'s engine side: what a host's devices are, and for each model whether it fits a worker's
chips, which attention path its programs get, whether its scores match a float32 run on this host's CPU, and
how fast it scores. No service imports: the CLI (packscore/cli.py) adds the worker plan and the job through
a service, and passes the settings in.

`python -m core.check --cpu-reference OUT ...` is the float32 CPU reference the scores are compared with (a
subprocess: JAX takes one platform per process).
"""

import argparse
import dataclasses
import functools
import glob
import gzip
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field

import jax
import numpy as np

from core import aot, sharding
from core.attention import selection
from core.dtype import (BF16_TOLERANCE, DTYPES, cpu_feature, cpu_flags, resolve, seeded_request,
                        without_table_flags)
from core.requests import ModelSource
from core.scorer import Scorer, program_texts

# The accelerators' contract request (core.aot), and the smaller one timed on a CPU by default: the contract
# shape takes minutes there, and the check is meant to take two.
CONTRACT = (aot.CONTRACT["query_tokens"], aot.CONTRACT["items"], aot.CONTRACT["item_tokens"])
CPU_SHAPE = (500, 100, 20)
# The request whose scores are compared with the CPU's float32 ones, unless a shape is given: small, because the
# reference runs on the host's CPU even for a model meant for accelerators, and with it transformers' bfloat16
# model, one sequence per item (a 300-token query: BF16_TOLERANCE's measurements were of such queries).
SCORE_SHAPE = (300, 16, 20)

def transformers_file(reference: str) -> str:
    return reference.removesuffix(".npy") + "-transformers-bfloat16.npy"


def transformers_logprobs(model, query: list[int], items: list[list[int]],  # type: ignore[no-untyped-def]
                          labels: list[int]) -> np.ndarray:
    """log P(label | query + item) from transformers' model. The check's items have one length: no padding."""
    import torch

    out = np.zeros((len(items), len(labels)))
    with torch.inference_mode():
        for start in range(0, len(items), 8):
            batch = torch.tensor([query + item for item in items[start: start + 8]])
            logits = model(batch, logits_to_keep=1).logits[:, -1].double()
            out[start: start + len(batch)] = torch.log_softmax(logits, -1)[:, labels].numpy()
    return out


# JAX device kinds -> core.aot's targets, for the Pallas kernels' roofline estimate (the cost of a fallback).
AOT_TARGETS = (("v6", "tpu-v6e"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("h100", "cuda-h100"))


@dataclass
class Finding:
    section: str
    status: str  # ok, warn, fail, skip, info
    text: str
    data: dict = field(default_factory=dict)


class Report:
    """The check's findings in order; any "fail" makes the check fail. `echo`: prints each line as it comes
    (the check takes a minute or two)."""

    def __init__(self, echo: bool = False) -> None:
        self.findings: list[Finding] = []
        self.echo = echo

    def add(self, section: str, status: str, text: str, **data: object) -> None:
        self.findings.append(Finding(section, status, text, data))
        if self.echo:
            print(f"[{status:>4}] {section}: {text}", flush=True)

    @property
    def ok(self) -> bool:
        return not any(f.status == "fail" for f in self.findings)

    def summary(self) -> str:
        failed = [f.section for f in self.findings if f.status == "fail"]
        return "check passed" if self.ok else f"check FAILED: {', '.join(dict.fromkeys(failed))}"

    def as_json(self) -> dict:
        return {"ok": self.ok, "findings": [f.__dict__ for f in self.findings]}


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls after one warm-up call (compilation)."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def transformers_model(source: ModelSource, dtype: str):  # type: ignore[no-untyped-def]
    """transformers' PyTorch model of a GGUF file or a Hugging Face folder, in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=getattr(torch, dtype))
    return model.eval()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_bytes(device: jax.Device) -> int | None:
    """What the device says it can hold (`memory_stats()["bytes_limit"]`); None where it says nothing (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return (stats or {}).get("bytes_limit")


def check_devices(report: Report) -> None:
    """What JAX sees here: platform, kind, count and memory (the host's RAM on a CPU), and the CPU's flags."""
    devices = jax.devices()
    memory = device_memory_bytes(devices[0])
    where = f"{_gb(memory)} each" if memory else f"host RAM {_gb(host_ram_bytes())}"
    flags = cpu_flags()
    report.add("devices", "ok", f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), {where}; "
               f"host CPU flags: {' '.join(flags) or 'none of amx_bf16, avx512_bf16, avx512f'}",
               platform=jax.default_backend(), kind=devices[0].device_kind, count=len(devices),
               memory_bytes=memory, host_ram_bytes=host_ram_bytes(), cpu_flags=flags)


def check_plan_platform(report: Report, plan_platform: str) -> None:
    """The worker plan counts chips from the drivers' device files; JAX must see the same platform, or the
    workers would run on the CPU (JAX installed without the accelerator's plugin)."""
    backend = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    if backend != plan_platform:
        report.add("devices", "fail", f"this host has {plan_platform} chips but JAX runs on {backend}: install JAX "
                   f"for the device (README, Accelerators)", plan_platform=plan_platform, jax_platform=backend)


def _writable(folder: str) -> bool:
    """Whether a worker could write into `folder` (made if missing, as JAX and the model cache do)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_caches(report: Report, compile_cache_dir: str | None, model_cache_dir: str | None,
                 sources: list[str]) -> None:
    """A restarted worker loads its programs and converted model from these folders; without them it compiles
    and converts again (minutes on a big model)."""
    if not compile_cache_dir:
        report.add("caches", "warn", "COMPILE_CACHE_DIR is empty: a restarted worker compiles every program again")
    elif not _writable(compile_cache_dir):
        report.add("caches", "warn", f"COMPILE_CACHE_DIR={compile_cache_dir} is not writable: a restarted worker "
                   "compiles every program again")
    else:
        report.add("caches", "ok", f"COMPILE_CACHE_DIR={compile_cache_dir} (writable)")
        # As a worker does (worker/scorer.py): the check's programs are the workers', so they start warm.
        jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    ggufs = []
    for source in sources:
        try:
            if ModelSource.resolve(source).kind == "gguf":
                ggufs.append(source)
        except Exception:  # noqa: BLE001 - a source that cannot be read fails in its model's check
            pass
    if not ggufs:
        report.add("caches", "ok", "MODEL_CACHE_DIR: no GGUF model, nothing to convert")
    elif not model_cache_dir:
        report.add("caches", "warn", f"MODEL_CACHE_DIR is unset: a restarted worker converts {', '.join(ggufs)} "
                   "(GGUF) again")
    elif not _writable(model_cache_dir):
        report.add("caches", "warn", f"MODEL_CACHE_DIR={model_cache_dir} is not writable: a restarted worker "
                   f"converts {', '.join(ggufs)} again")
    else:
        report.add("caches", "ok", f"MODEL_CACHE_DIR={model_cache_dir} (writable)")


@functools.lru_cache
def cpu_reference(source: str, cache_dir: str | None, shape: tuple[int, int, int], seed: int,
                  transformers: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The seeded request's log-probabilities in float32 on this host's CPU (one device), in a subprocess; and
    with `transformers`, transformers' own bfloat16 model's on the same request where PyTorch is installed
    (docs/score-semantics.md's bfloat16 rule: no further from float32 than that), else None."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reference.npy")
        env = dict(os.environ, JAX_PLATFORMS="cpu", DTYPE="float32")
        command = [sys.executable, "-m", "core.check", "--cpu-reference", out, "--source", source, "--seed",
                   str(seed), "--shape", ",".join(map(str, shape))] + (["--cache-dir", cache_dir] if cache_dir else [])
        done = subprocess.run(command + (["--transformers"] if transformers else []), env=env, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"the CPU reference failed: {done.stderr.strip()[-2000:]}")
        measured = transformers_file(out)
        return np.load(out), np.load(measured) if os.path.exists(measured) else None


class _Warnings(logging.Handler):
    """Keeps core.attention's warnings: a kernel that does not compile says why there, once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class ModelCheck:
    """One model as a worker would serve it (the worker's settings)."""

    name: str
    source: str
    cache_dir: str | None = None
    dtype: str = "float32"
    attention: str = "auto"
    tensor_parallel: int = 1
    pass_tokens: int | None = None
    prefix_cache_bytes: int | None = None
    max_programs: int = 24


@dataclass
class CheckOptions:
    workers_per_host: int = 1  # the plan's groups: on a CPU they share the host's RAM
    memory_bytes: int | None = None  # a group's memory, instead of what the devices (or the host) say
    tolerance: float | None = None  # None: docs/score-semantics.md's bfloat16 rule (see cpu_reference)
    shape: tuple[int, int, int] | None = None  # a request shape timed besides the contract's
    full_contract: bool = False  # the contract shape on a CPU too
    seed: int = 0
    profile: bool = False
    profile_dir: str | None = None  # where the profile's trace and the programs' HLO are kept (None: not kept)


def check_model(report: Report, model: ModelCheck, options: CheckOptions) -> None:
    """The model on the first TENSOR_PARALLEL devices, as a worker would load it: its fit, attention path,
    scores and speed (and profile), as findings of its own section."""
    section = f"model {model.name}"
    warnings = _Warnings()
    logging.getLogger("core.attention").addHandler(warnings)
    try:
        _check_model(report, section, model, options, warnings)
    except Exception as exc:  # noqa: BLE001 - a model that cannot load or run here is this host's failure
        report.add(section, "fail", f"{type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        logging.getLogger("core.attention").removeHandler(warnings)


def _check_model(report: Report, section: str, model: ModelCheck, options: CheckOptions, warnings: _Warnings) -> None:
    config = ModelSource.resolve(model.source, model.cache_dir).config()
    model = dataclasses.replace(model, dtype=resolve(model.dtype, jax.default_backend(), cpu_flags()))  # auto
    n = model.tensor_parallel
    devices = jax.devices()
    try:
        sharding.check(config, n, len(devices))
    except ValueError as exc:
        report.add(section, "fail", f"TENSOR_PARALLEL={n}: {exc}")
        return
    on_cpu = jax.default_backend() == "cpu"
    per_device = device_memory_bytes(devices[0])
    if options.memory_bytes:
        budget, where = options.memory_bytes, "the given budget"
    elif per_device and not on_cpu:
        budget, where = per_device * n, f"{n} x {_gb(per_device)} of device memory"
    else:
        budget = host_ram_bytes() // max(options.workers_per_host, 1)
        where = f"host RAM / {options.workers_per_host} workers" if options.workers_per_host > 1 else "host RAM"
    specs = aot.model_specs(sharding.sharded_config(config, n), jax.numpy.dtype(model.dtype), n)[1]
    weight_bytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(specs))
    if weight_bytes > budget:
        report.add(section, "fail", f"does not fit: the weights alone ({_gb(weight_bytes)}, {model.dtype}) are more "
                   f"than {_gb(budget)} ({where}); a larger TENSOR_PARALLEL splits them "
                   f"({', '.join(map(str, sharding.valid_sizes(config)))} split this model)",
                   weight_bytes=weight_bytes, budget_bytes=budget)
        return

    score_shape = options.shape or SCORE_SHAPE
    reference, transformers = cpu_reference(model.source, model.cache_dir, score_shape, options.seed,
                                            options.tolerance is None and model.dtype == "bfloat16")
    scorer = Scorer.from_pretrained(model.source, model.cache_dir, name=model.name, dtype=model.dtype,
                                    attention=model.attention, tensor_parallel=n, pass_tokens=model.pass_tokens,
                                    prefix_cache_bytes=model.prefix_cache_bytes, max_programs=model.max_programs)
    _fit(report, section, scorer, weight_bytes, budget, where)
    logprobs = scorer.logprobs(*seeded_request(scorer.vocab_size, score_shape, options.seed))
    fallback = _path(report, section, scorer, warnings.messages, model.attention)
    diff = float(np.abs(logprobs - reference).max())
    if options.tolerance is not None:
        tolerance, rule = options.tolerance, "--tolerance"
    elif transformers is not None:
        tolerance, rule = float(np.abs(transformers - reference).max()), "transformers' bfloat16 on this request"
    else:
        tolerance, rule = BF16_TOLERANCE, "the bfloat16 bound of docs/score-semantics.md"
    report.add(section, "ok" if diff <= tolerance else "fail",
               f"scores: max |log-prob - CPU float32| {diff:.2e} on a seeded request (P,N,L = "
               f"{','.join(map(str, score_shape))}; {model.dtype}), tolerance {tolerance:.2e} ({rule})",
               max_abs_diff=diff, tolerance=tolerance, tolerance_from=rule, shape=score_shape)
    if on_cpu:
        bound = float(np.abs(transformers - reference).max()) if transformers is not None else BF16_TOLERANCE
        _bfloat16_advice(report, section, model, score_shape, options.seed, reference,
                         diff if model.dtype == "bfloat16" else None, bound)
    contract = CONTRACT if options.full_contract or not on_cpu else CPU_SHAPE
    shapes = [("contract", contract)] + ([("given", options.shape)] if options.shape else [])
    for label, shape in shapes:
        _speed(report, section, scorer, label, shape, options, on_cpu)
    if fallback:
        _fallback_cost(report, section, config, model, contract)
    if options.profile:
        profile(report, section, scorer, seeded_request(scorer.vocab_size, contract, options.seed),
                options.profile_dir)


def matmul_gflops(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """This host's n^3 matmul rate in `dtype`; bfloat16 inputs accumulate to float32, as the engine's layers ask."""
    a = jax.numpy.ones((n, n), dtype)
    matmul = jax.jit(lambda x: jax.numpy.matmul(x, x, preferred_element_type=jax.numpy.float32))
    seconds, _ = timed(lambda: matmul(a).block_until_ready(), repeats)
    return 2 * n ** 3 / seconds / 1e9


def _bfloat16_env() -> dict[str, str]:
    """The bfloat16 subprocess's environment: XLA flags of its own choosing (not its parent's float32 ones), and
    the check's compile cache, so that a second check on the host loads its program instead of compiling it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=without_table_flags(os.environ.get("XLA_FLAGS", "")))
    if cache := jax.config.jax_compilation_cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def _bfloat16_advice(report: Report, section: str, model: ModelCheck, shape: tuple[int, int, int], seed: int,
                     reference: np.ndarray, distance: float | None, bound: float) -> None:
    """What bfloat16 gives on this CPU: its matmul rate against float32's, and its scores' distance from the float32
    reference under the bfloat16 rule (`bound`); recommends a DTYPE. A float32 check measures bfloat16 in a
    subprocess, with bfloat16's XLA flags (core.dtype), as a bfloat16 worker would run. `distance`: known already
    (the model checked in bfloat16)."""
    rates = {"float32": matmul_gflops("float32")}
    if distance is None:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bfloat16.npy")
            command = [sys.executable, "-m", "core.check", "--cpu-reference", out, "--dtype", "bfloat16", "--source",
                       model.source, "--seed", str(seed), "--shape", ",".join(map(str, shape))]
            done = subprocess.run(command + (["--cache-dir", model.cache_dir] if model.cache_dir else []),
                                  env=_bfloat16_env(), capture_output=True, text=True)
            if done.returncode:
                report.add(section, "warn", f"bfloat16: not measured ({done.stderr.strip()[-500:]})")
                return
            distance = float(np.abs(np.load(out) - reference).max())
            with open(out + ".json") as f:
                rates["bfloat16"] = json.load(f)["matmul_gflops"]
    else:
        rates["bfloat16"] = matmul_gflops("bfloat16")
    speedup = rates["bfloat16"] / rates["float32"]
    # bfloat16 is worth its distance only where it is clearly faster; a matmul gain shrinks in the whole pass.
    choice = "bfloat16" if distance <= bound and speedup >= 1.5 else "float32"
    report.add(section, "info", f"bfloat16 on this host ({cpu_feature(cpu_flags())}): matmul "
               f"{rates['bfloat16']:.0f} GFLOP/s against float32's {rates['float32']:.0f} ({speedup:.2f}x); scores "
               f"{distance:.2e} from float32 (the bfloat16 rule's bound {bound:.2e}"
               f"{', broken' if distance > bound else ''}): DTYPE={choice} recommended",
               matmul_gflops=rates, speedup=round(speedup, 3), bfloat16_distance=distance, bound=bound,
               recommended=choice)


def _fit(report: Report, section: str, scorer: Scorer, weight_bytes: int, budget: int, where: str) -> None:
    """Weights, the prefix cache and the largest pass's buffers against the group's memory. Each chip of a
    split model is counted the whole pass's buffers (Scorer.pass_bytes): not all of them split."""
    n = scorer.tensor_parallel
    cache, pass_bytes = scorer.prefix_cache_bytes, scorer.pass_bytes()
    total = weight_bytes + cache + n * pass_bytes
    fits = total <= budget
    report.add(section, "ok" if fits else "fail",
               f"{'fits' if fits else 'does not fit'}: weights {_gb(weight_bytes)} + prefix cache {_gb(cache)} + "
               f"largest pass {_gb(pass_bytes)} ({scorer.pass_tokens} tokens){f' x {n} chips' if n > 1 else ''} = "
               f"{_gb(total)} of {_gb(budget)} ({where}); TENSOR_PARALLEL={n}, {scorer.dtype.name}",
               fits=fits, weight_bytes=weight_bytes, prefix_cache_bytes=cache, pass_bytes=pass_bytes,
               total_bytes=total, budget_bytes=budget)


def _path(report: Report, section: str, scorer: Scorer, warnings: list[str], setting: str = "auto") -> bool:
    """The attention its programs got: where a Pallas kernel was asked for (ATTENTION=auto on TPU and GPU, or
    pallas) and the XLA path runs instead, the check fails with the compiler's reason. Whether it fell back.
    `setting`: ATTENTION as set, named beside what `auto` chose on this backend."""
    path = scorer.attention_path
    if not selection.PATHS[scorer.attention].lowers_kernels or path != "xla":
        chose = f", {scorer.attention} on {jax.default_backend()}" if setting == "auto" else ""
        report.add(section, "ok", f"attention: {path} (ATTENTION={setting}{chose})", attention_path=path)
        return False
    reasons = [m for m in warnings if "does not compile" in m]
    reason = reasons[0] if reasons else (f"no Pallas kernel for {jax.default_backend()} with {scorer.dtype.name} "
                                         f"and head_dim {scorer.config.head_dim} (core.attention)")
    report.add(section, "fail", f"attention: the XLA block-sparse fallback runs, not a Pallas kernel: {reason}",
               attention_path=path, fallback=True, reason=reason)
    return True


def _speed(report: Report, section: str, scorer: Scorer, label: str, shape: tuple[int, int, int],
           options: CheckOptions, on_cpu: bool) -> None:
    query, items, labels = seeded_request(scorer.vocab_size, shape, options.seed)

    def cold():  # the query computed in each run, as a new request's is
        scorer.clear_prefix_cache()
        return scorer.logprobs(query, items, labels)

    seconds, _ = timed(cold, 1 if on_cpu else 3)
    note = ""
    if label == "contract" and shape != CONTRACT:
        note = (f"; a smaller shape than the contract's {','.join(map(str, CONTRACT))} on a CPU, to stay within two "
                "minutes (--full-contract for it)")
    report.add(section, "ok", f"speed ({label}, P,N,L = {','.join(map(str, shape))}): "
               f"{shape[1] / seconds:.1f} items/s ({seconds:.2f} s a request, query computed){note}",
               shape=shape, items_per_s=round(shape[1] / seconds, 2), seconds=round(seconds, 4), label=label)


def _fallback_cost(report: Report, section: str, config, model: ModelCheck, contract: tuple) -> None:
    """What the fallback costs: the contract's items/s measured on it against core.aot's roofline estimate
    for the kernel on this chip, where core.aot knows the chip."""
    kind = jax.devices()[0].device_kind.lower()
    target = next((t for key, t in AOT_TARGETS if key in kind), None)
    measured = next(f.data["items_per_s"] for f in report.findings
                    if f.section == section and f.data.get("label") == "contract")
    if target is None:
        report.add(section, "info", f"fallback cost: {measured:.1f} items/s on the fallback (P,N,L = "
                   f"{','.join(map(str, contract))}); core.aot has no kernel estimate for {kind}",
                   fallback_items_per_s=measured)
        return
    estimate = aot.roofline(config, aot.TARGETS[target], aot.contract_passes(model.pass_tokens or 16384),
                            jax.numpy.dtype(model.dtype), model.tensor_parallel, model.name)
    report.add(section, "info", f"fallback cost: {measured:.1f} items/s on the fallback against "
               f"{estimate['items_per_second_roofline']:.0f} estimated for the kernel on {target} (core.aot "
               "roofline, an estimate)", fallback_items_per_s=measured,
               kernel_roofline_items_per_s=estimate["items_per_second_roofline"])


# Op kinds of the profile's table, by the HLO instructions' opcodes (a fusion by what it calls).
_MATMUL = {"dot", "convolution"}
# Collectives count as copies: data moved, not computed.
_COPY = {"copy", "copy-start", "copy-done", "transpose", "dynamic-slice", "dynamic-update-slice", "slice",
         "concatenate", "pad", "gather", "scatter", "bitcast", "reshape", "broadcast", "all-reduce", "all-gather",
         "reduce-scatter", "collective-permute", "all-reduce-start", "all-reduce-done", "send", "recv", "iota",
         "parameter", "tuple", "get-tuple-element", "constant"}
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S.*?\s([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _op_kinds(hlo_texts: list[str]) -> dict[str, str]:
    """Each instruction's kind in the compiled programs' HLO: matmuls, attention kernel (a Mosaic custom
    call), copies, element-wise (the rest), or control flow (whose time is its body's)."""
    computations: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for text in hlo_texts:
        current = None
        for line in text.splitlines():
            if (m := _INSTRUCTION.match(line)) and current is not None:
                computations[current].append(m.groups())
            elif m := _COMPUTATION.match(line):
                current = m.group(1)

    def kind(opcode: str, rest: str, depth: int = 0) -> str:
        if opcode in _CONTAINERS:
            return "control"
        if opcode == "custom-call":  # a Pallas kernel, a cuBLAS/cuDNN matmul, or another library call
            if re.search(r"mosaic|tpu_custom_call|pallas|attention", rest):
                return "attention kernel"
            return "matmuls" if re.search(r"cublas|gemm|matmul|cudnn\$conv", rest) else "element-wise"
        if opcode in _MATMUL:
            return "matmuls"
        if opcode == "fusion" and depth < 4 and (called := re.search(r"calls=%?([\w.\-]+)", rest)):
            inner = {kind(o, r, depth + 1) for _, o, r in computations.get(called.group(1), [])}
            for k in ("attention kernel", "matmuls", "element-wise"):
                if k in inner:
                    return k
            return "copies"
        return "copies" if opcode in _COPY else "element-wise"

    return {name: kind(opcode, rest) for body in computations.values() for name, opcode, rest in body}


def _kernel_kind(name: str) -> str:
    """An op's kind by the name of the kernel that ran it, where its HLO op says nothing (on a GPU, kernels run
    inside CUDA graphs report the graph's command buffer as their op): cuBLAS's Hopper kernels are nvjet_*."""
    if re.search(r"mosaic|attention", name):
        return "attention kernel"
    if re.search(r"nvjet|gemm|xmma|cutlass|cublas|matmul|\bdot|convolution", name, re.IGNORECASE):
        return "matmuls"
    return "copies" if re.search(r"copy|memcpy|transpose|slice|concatenate", name, re.IGNORECASE) else "element-wise"


def _intervals_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def op_times(events: list[dict], kinds: dict[str, str]) -> tuple[dict[str, float], list[tuple[float, float]], str]:
    """A trace's op time per kind (microseconds), the ops' spans, and where the ops came from: the device's op
    lines (TPU, GPU), else XLA's CPU ops on the host's threads. `kinds`: `_op_kinds` of the programs' HLO."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops = [e for e in events if e.get("ph") == "X" and e.get("dur")
           and (e.get("args", {}).get("hlo_op") or processes.get(e["pid"], "").startswith("/device:"))]
    # A device's module and step lines span its ops: only the op lines count.
    on_device = [e for e in ops if processes.get(e["pid"], "").startswith("/device:")
                 and not re.search(r"Module|Step|Framework|TraceMe|Source", threads.get((e["pid"], e.get("tid")), ""))]
    source = "trace: device ops" if on_device else "trace: XLA's CPU ops on the host's threads (no device ops)"
    per_kind: dict[str, float] = defaultdict(float)
    spans = []
    for e in on_device or ops:
        hlo_op = e.get("args", {}).get("hlo_op") or ""
        k = kinds.get(hlo_op) or kinds.get(hlo_op.split(":")[0]) or _kernel_kind(e["name"])
        if k == "control":
            continue
        per_kind[k] += e["dur"]
        spans.append((e["ts"], e["ts"] + e["dur"]))
    return per_kind, spans, source


def profile(report: Report, section: str, scorer: Scorer, request: tuple, keep: str | None = None) -> None:
    """Device time per op kind over one run of the request, from JAX's profiler: the device's op events
    (TPU, GPU); on a CPU, which has no device, XLA's ops as its CPU runtime runs them on the host's threads.
    Host gaps: the run's time with no op running (the request's tokenizing not counted). Beside them, the
    passes' host and device seconds as a worker exports them (core.scorer.PassResult). `keep`: a folder to copy
    the trace (for Perfetto or TensorBoard) and the programs' HLO into."""
    texts = program_texts()
    kinds = _op_kinds(texts)
    tokens = scorer.tokenize(*request)  # (not the pass's host work)
    with tempfile.TemporaryDirectory() as folder:
        scorer.clear_prefix_cache()
        with jax.profiler.trace(folder):
            start = time.perf_counter()
            passes = list(scorer.iter_passes([tokens]))
            wall_us = (time.perf_counter() - start) * 1e6
        files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        events = json.load(gzip.open(files[0]))["traceEvents"] if files else []
        if keep:
            os.makedirs(keep, exist_ok=True)
            for file in files[:1]:
                shutil.copy(file, os.path.join(keep, "trace.json.gz"))
            with gzip.open(os.path.join(keep, "programs.hlo.txt.gz"), "wt") as f:
                f.write("\n".join(texts))
    per_kind, spans, source = op_times(events, kinds)
    if not spans:
        report.add(section, "warn", "profile: the trace holds no op events")
        return
    busy = _intervals_length(spans)
    per_kind["host gaps"] = max(wall_us - busy, 0.0)
    table = {k: round(per_kind.get(k, 0.0) / 1e3, 2)
             for k in ("matmuls", "attention kernel", "element-wise", "copies", "host gaps")}
    total = sum(table.values()) or 1.0
    rows = "".join(f"\n         {k:<18}{v:>12.1f} ms {100 * v / total:>6.1f}%" for k, v in table.items())
    host_ms = [round(p.host_seconds * 1e3, 2) for p in passes]
    device_ms = [round(p.device_seconds * 1e3, 2) for p in passes]
    rows += (f"\n         {'pass host, device':<18}{sum(host_ms):>12.1f} ms {sum(device_ms):>9.1f} ms ({len(passes)} "
             "pass(es); host: packing and launch; device: its start to the results on the host)")
    report.add(section, "info", f"profile ({source}; one request, {wall_us / 1e3:.0f} ms; ops on parallel threads "
               f"add up):{rows}", profile_ms=table, source=source, wall_ms=round(wall_us / 1e3, 2),
               pass_host_ms=host_ms, pass_device_ms=device_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[-1])
    parser.add_argument("--cpu-reference", required=True, help=".npy to write the log-probabilities to")
    parser.add_argument("--source", required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--shape", required=True, help="P,N,L")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformers", action="store_true", help="also transformers' bfloat16, where installed")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="bfloat16: its scores, and its matmul rate in OUT.json (packscore check's advice)")
    args = parser.parse_args(argv)
    scorer = Scorer.from_pretrained(args.source, args.cache_dir, dtype=args.dtype)
    request = seeded_request(scorer.vocab_size, tuple(int(x) for x in args.shape.split(",")), args.seed)
    np.save(args.cpu_reference, scorer.logprobs(*request))
    if args.dtype == "bfloat16":
        with open(args.cpu_reference + ".json", "w") as f:
            json.dump({"matmul_gflops": matmul_gflops("bfloat16")}, f)
    del scorer  # its weights go before transformers' model loads
    source = ModelSource.resolve(args.source, args.cache_dir)
    if args.transformers and source.kind != "tiny-random" and importlib.util.find_spec("torch") is not None:
        np.save(transformers_file(args.cpu_reference),
                transformers_logprobs(transformers_model(source, "bfloat16"), *request))


if __name__ == "__main__":
    main()
