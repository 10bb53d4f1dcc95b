"""The contract pass's cost per op kind, from its accelerator programs.

    python -m benchmarks.pass_cost [--model qwen3-0.6b] [--ladder old|new|both] [--target ...] [--json]
    python -m benchmarks.pass_cost --tiles [--target tpu-v5e|tpu-v6e|both] [--json]

Builds core.aot's contract pass (a 2,000-token query and 500 items of 20 tokens, bfloat16, shapes only: nothing
big is allocated) at the length each ladder pads it to: "old", the halving ladder (16,384 tokens
for the contract's 12,000), and "new", the accelerators' ladder (core.packing.ACCELERATOR_STEPS_PER_OCTAVE). Per
op kind it reports FLOPs and bytes accessed:
- tpu-v5e: the program XLA and Mosaic compiled on libtpu's compile-only devices, walked op by op in its optimized
  HLO (fusions as XLA runs them: a fusion's bytes are its operands and results).
- cuda-h100: the program lowered for CUDA with the Mosaic GPU kernel, as HLO. No CUDA compiler runs here, so
  it is the program before XLA's fusion: its FLOPs are the model's, its bytes count every unfused op's operands
  and results (an upper bound of the traffic).
Loops count their trips: every loop of an accelerator's pass has a constant count (the layer loop's, the LM head's
steps over the bucketed score rows); one that had not (its count read back by the host at each trip) would be
counted once and listed in `host_reads`, with any branch (each branch counted an equal share).
XLA's own cost analysis counts each loop body once and a Pallas kernel as nothing; the kernel's FLOPs here are
core.aot's count of the tiles it visits (masked work included), its bytes its operands and results. The walk,
counted as XLA counts, is checked against `compiled.cost_analysis()` (printed beside each TPU table).

--tiles compares the TPU kernel's tile sizes (TILE_CANDIDATES) on the contract pass, one layer's attention
compiled alone per chip generation (tpu_tile_costs): whether it compiles, XLA's cost analysis and the TPU
compiler's estimated cycles of the XLA work around the kernel (tables, layouts; libtpu reports no estimate for a
Mosaic kernel, nor an `optimal_seconds`), the tile pairs the kernel visits against the visible pairs, its grid
steps, and a modelled kernel time: the visited pairs' FLOPs at the chip's peak times the MXU's fill (head_dim and
tile_k against its edge) plus GRID_STEP_SECONDS per grid step.

The padding share: the part of the matmul FLOPs spent on the rows past the pass's real tokens (a matmul over
the pass's T rows costs T rows whatever is in them; the LM head runs on score rows and does not count).
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as core.aot: compile-only, no exclusive TPU

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from core import aot  # noqa: E402
from core.config import TINY_CONFIG, ModelConfig  # noqa: E402
from core.packing import PassArrays  # noqa: E402

KINDS = ("matmul", "attention kernel", "element-wise", "transpose", "copy/zero fill", "gather/slice/pad",
         "async move (HBM<->VMEM)", "other")
LADDERS = {"old": 1, "new": aot.ACCELERATOR_STEPS_PER_OCTAVE}  # rungs per octave
MODELS = {**aot.MODELS, "tiny": TINY_CONFIG}  # tiny: the tests' model, for a fast run

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")
# Ops that move no data of their own (views, control flow, the loops' bookkeeping).
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape", "while", "conditional", "call",
        "after-all", "copy-start", "slice-start", "partition-id", "replica-id", "opt-barrier"}
FREE_CUSTOM_CALLS = {"ConcatBitcast", "AssumeGatherIndicesInBound"}  # TPU bookkeeping: bitcasts
KERNEL_TARGETS = re.compile(r"tpu_custom_call|mosaic_gpu|triton")  # Pallas' kernels on TPU and GPU
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select", "negate", "abs",
               "and", "or", "xor", "not", "clamp", "exponential", "log", "rsqrt", "sqrt", "tanh", "sine", "cosine",
               "power", "logistic", "remainder", "sign", "floor", "ceil", "round-nearest-even", "is-finite",
               "shift-left", "shift-right-logical", "shift-right-arithmetic", "exponential-minus-one", "log-plus-one"}
MOVES = {"copy", "transpose"}
SELECTS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice", "slice", "pad", "concatenate"}
ASYNC_MOVES = {"copy-done", "slice-done"}
READS_PART = {"slice", "dynamic-slice", "gather"}  # read only what they return of their first operand


@dataclass
class Op:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    literal: str = ""  # a constant's value


def _close(text: str, start: int) -> int:
    """The index of the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += 1 if text[i] in "({[" else -1 if text[i] in ")}]" else 0
        if depth == 0:
            return i
    raise ValueError(f"unbalanced: {text[start:start + 80]}")


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "({[" else -1 if ch in ")}]" else 0
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def parse_hlo(text: str) -> tuple[dict[str, list[Op]], str]:
    """An HLO module's text as {computation: its ops} and the entry computation's name."""
    computations: dict[str, list[Op]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
            header = line.split()
            is_entry = header[0] == "ENTRY"
            current = header[1 if is_entry else 0].lstrip("%")
            computations[current] = []
            entry = current if is_entry else entry
        elif current is not None and " = " in line and line.startswith("  "):
            name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
            end = _close(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
            shape, rest = rest[:end], rest[end:].lstrip()
            opcode, rest = rest.split("(", 1)
            close = _close("(" + rest, 0) - 1
            inside = rest[:close]
            operands = [] if opcode == "constant" else [
                part.split()[-1].lstrip("%") for part in _split_top(inside) if part.strip()]
            literal = inside if opcode == "constant" else ""
            computations[current].append(Op(name.lstrip("%"), shape, opcode, operands, rest[close + 1:], literal))
    return computations, entry


def arrays_of(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays_of(shape))


def _attr(op: Op, key: str) -> str:
    found = re.search(rf"\b{key}=\"?%?([\w.\-]+)", op.attrs)
    return found.group(1) if found else ""


def _op_name(op: Op) -> str:
    found = re.search(r'op_name="([^"]*)"', op.attrs)
    return found.group(1) if found else ""


def _branches(op: Op) -> list[str]:
    """A conditional's branch computations, in branch index order."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", op.attrs).group(1)
    return [branch.strip().lstrip("%") for branch in listed.split(",")]


def _dims(op: Op, key: str) -> list[int]:
    found = re.search(rf"\b{key}=\{{([\d,]*)\}}", op.attrs)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


class Program:
    """An HLO module with each computation's run count for one pass (see the module's docstring)."""

    def __init__(self, text: str):
        self.computations, self.entry = parse_hlo(text)
        self.shapes = {op.name: op.shape for ops in self.computations.values() for op in ops}
        self.runs: dict[str, float] = defaultdict(float)
        self._visit(self.entry, 1.0)

    def _constant_trips(self, condition: str) -> int | None:
        """The trip count of a loop whose condition compares its counter with a constant (a scan's)."""
        ops = {op.name: op for op in self.computations[condition]}
        root = self.computations[condition][-1]
        for name in root.operands if root.opcode == "compare" else []:
            if name in ops and ops[name].opcode == "constant" and ops[name].literal.lstrip("-").isdigit():
                return int(ops[name].literal)
        return None

    def _visit(self, name: str, runs: float) -> None:
        self.runs[name] += runs
        for op in self.computations[name]:
            if op.opcode == "while":
                body = _attr(op, "body")
                trips = self._constant_trips(_attr(op, "condition"))
                self._visit(body, runs * (1 if trips is None else trips))
            elif op.opcode == "conditional":
                branches = _branches(op)
                for branch in branches:
                    self._visit(branch, runs / len(branches))
            elif op.opcode == "call":
                self._visit(_attr(op, "to_apply"), runs)

    def flops(self, op: Op) -> float:
        """FLOPs of one op: 2 per multiply-add of a dot or convolution, 1 per element of an element-wise op or of
        a reduction's input; a fusion's are its ops'."""
        out = sum(math.prod(dims) for _, dims in arrays_of(op.shape))
        if op.opcode == "dot":
            lhs = arrays_of(self.shapes[op.operands[0]])[0][1]
            return 2.0 * out * math.prod(lhs[d] for d in _dims(op, "lhs_contracting_dims"))
        if op.opcode == "convolution":
            return self._convolution_flops(op)
        if op.opcode == "fusion":
            return sum(self.flops(inner) for inner in self.computations[_attr(op, "calls")])
        if op.opcode in ELEMENTWISE:
            return float(out)
        if op.opcode == "reduce":
            return float(sum(math.prod(dims) for _, dims in arrays_of(self.shapes[op.operands[0]])))
        return 0.0

    def _convolution_flops(self, op: Op) -> float:
        """2 per multiply-add of the taps that land on the input: a matmul the TPU compiler writes as a
        convolution over a padded window (the gate and up projections: window 2, padding 1 each side) has half
        its window on padding."""
        lhs_labels, _, out_labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.attrs).groups()
        lhs = arrays_of(self.shapes[op.operands[0]])[0][1]
        out = arrays_of(op.shape)[0][1]
        spatial = sorted(label for label in lhs_labels if label.isdigit())
        window = re.search(r"window=\{([^}]*)\}", op.attrs)
        field = lambda key: re.search(rf"\b{key}=([\w_]+)", window.group(1)) if window else None
        sizes = [int(x) for x in field("size").group(1).split("x")] if field("size") else [1] * len(spatial)
        pads = [tuple(int(p) for p in pad.split("_")) for pad in field("pad").group(1).split("x")] \
            if field("pad") else [(0, 0)] * len(spatial)
        strides = [int(x) for x in field("stride").group(1).split("x")] if field("stride") else [1] * len(spatial)
        taps = 1
        for label, size, (low, _), stride in zip(spatial, sizes, pads, strides):
            n_in, n_out = lhs[lhs_labels.index(label)], out[out_labels.index(label)]
            taps *= sum(0 <= o * stride + k - low < n_in for o in range(n_out) for k in range(size))
        groups = int(_attr(op, "feature_group_count") or 1)
        return (2.0 * out[out_labels.index("b")] * out[out_labels.index("f")] * taps * lhs[lhs_labels.index("f")]
                / groups)

    def as_xla_counts(self, name: str = "") -> np.ndarray:
        """[FLOPs, bytes] as XLA's cost analysis counts them (each loop body once, a conditional's costliest
        branch, a custom call's FLOPs as nothing): `compiled.cost_analysis()` to compare with, a check of this
        walk."""
        total = np.zeros(2)
        for op in self.computations[name or self.entry]:
            if op.opcode == "while":
                total += self.as_xla_counts(_attr(op, "body"))
            elif op.opcode == "conditional":
                total += max((self.as_xla_counts(branch) for branch in _branches(op)), key=lambda counts: counts[0])
            elif op.opcode == "call":
                total += self.as_xla_counts(_attr(op, "to_apply"))
            else:
                total += (self.flops(op), self.bytes_accessed(op))
        return total

    def _opcodes(self, op: Op) -> set[str]:
        """The ops a fusion runs (nested fusions opened), or the op itself."""
        if op.opcode != "fusion":
            return {op.opcode}
        return set().union(*(self._opcodes(inner) for inner in self.computations[_attr(op, "calls")]))

    def kind(self, op: Op) -> str:
        if op.opcode == "custom-call":
            return "attention kernel" if KERNEL_TARGETS.search(_attr(op, "custom_call_target")) else "other"
        if op.opcode in ASYNC_MOVES | {"copy-start", "slice-start"}:
            return "async move (HBM<->VMEM)"
        opcodes = self._opcodes(op) - {"parameter", "constant", "bitcast", "reshape", "broadcast", "tuple",
                                      "get-tuple-element"}
        if opcodes & {"dot", "convolution"}:
            return "matmul"
        if opcodes & {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
            return "gather/slice/pad"
        if opcodes and opcodes <= MOVES | SELECTS:
            return ("transpose" if "transpose" in opcodes else "copy/zero fill") if opcodes & MOVES \
                else "gather/slice/pad"
        if not opcodes and "broadcast" in self._opcodes(op):  # a value broadcast into a buffer: zeros, say
            return "copy/zero fill"
        if opcodes & (ELEMENTWISE | {"reduce", "convert", "select", "iota", "sort", "reduce-window", "map"}):
            return "element-wise"
        return "other"

    def bytes_accessed(self, op: Op) -> int:
        if op.opcode in FREE or (op.opcode == "custom-call" and _attr(op, "custom_call_target") in FREE_CUSTOM_CALLS):
            return 0
        if op.opcode in ASYNC_MOVES:  # read where it is, written where it goes
            return 2 * nbytes(op.shape)
        size = lambda name: nbytes(self.shapes.get(name, ""))
        if op.opcode in READS_PART:  # reads what it returns of its first operand, and its indices
            return 2 * nbytes(op.shape) + sum(size(name) for name in op.operands[1:])
        if op.opcode == "dynamic-update-slice":  # in place: the update is read and written
            return 2 * size(op.operands[1]) + sum(size(name) for name in op.operands[2:])
        if op.opcode != "fusion":
            return nbytes(op.shape) + sum(size(name) for name in op.operands)
        fused = self.computations[_attr(op, "calls")]
        root = fused[-1]
        total = size(root.operands[1]) if root.opcode == "dynamic-update-slice" else nbytes(op.shape)
        for param in (o for o in fused if o.opcode == "parameter"):
            users = [o for o in fused if param.name in o.operands]
            if users and all(u.opcode in READS_PART and u.operands[0] == param.name for u in users):
                total += sum(nbytes(u.shape) for u in users)  # the parts read of a stacked weight, say
            elif not any(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name for u in users):
                total += nbytes(param.shape)  # a buffer updated in place is not read whole
        return total

    def rows(self, op: Op) -> int:
        """The rows (tokens) of a matmul's result: its first dimension, or a convolution's batch dimension."""
        dims = arrays_of(op.shape)[0][1] if arrays_of(op.shape) else ()
        if op.opcode == "fusion":
            inner = [o for o in self.computations[_attr(op, "calls")] if o.opcode in ("dot", "convolution", "fusion")]
            matmuls = [o for o in inner if self.kind(o) == "matmul"]
            return self.rows(matmuls[-1]) if matmuls else (dims[0] if dims else 0)
        if op.opcode == "convolution":
            out_labels = re.search(r"dim_labels=\w+_\w+->(\w+)", op.attrs).group(1)
            return dims[out_labels.index("b")]
        return dims[0] if dims else 0

    def host_reads(self) -> dict[str, list[str]]:
        """The loops whose trip count is not a compile-time constant and the branches (`conditional`) of the
        program: on an accelerator the host reads each such loop's predicate back at every trip, and each
        branch's index, with the device idle meanwhile."""
        ops = [op for name in self.runs for op in self.computations[name]]
        return {"loops": [op.name for op in ops if op.opcode == "while"
                          and self._constant_trips(_attr(op, "condition")) is None],
                "branches": [op.name for op in ops if op.opcode == "conditional"]}

    def ops(self):
        """(op, runs per pass) for every op the pass runs outside fusions."""
        for name, runs in self.runs.items():
            for op in self.computations[name]:
                yield op, runs


def breakdown(program: Program, arrays: PassArrays, config: ModelConfig, target: str, xla_cost: dict,
              top_ops: int = 12) -> dict:
    """FLOPs and bytes per op kind of one pass, its padding share, the kernel's layout copies, and a roofline
    **estimate**: each op at max(its FLOPs at the chip's peak, its bytes at the HBM bandwidth), one after another
    (no overlap between ops; on an unfused program the element-wise ops' bytes make it an upper bound)."""
    chip = aot.TARGETS[target]
    platform, peak, bandwidth = chip["platform"], chip["peak_flops"], chip["peak_hbm_bytes_per_s"]
    T, real = len(arrays.tokens), arrays.real_tokens
    tq, tk, _, pairs = aot.kernel_tiles(arrays, platform)
    kernel_flops = config.num_heads * pairs * 4 * tq * tk * config.head_dim  # per call: one layer
    kinds = {kind: {"ops": 0.0, "flops": 0.0, "bytes": 0.0, "seconds": 0.0} for kind in KINDS}
    padding_flops = 0.0
    layout = {"ops": 0.0, "bytes": 0.0}
    for op, runs in program.ops():
        kind = program.kind(op)
        flops = kernel_flops if kind == "attention kernel" else program.flops(op)
        row, nbytes_op = kinds[kind], program.bytes_accessed(op)
        row["ops"] += runs
        row["flops"] += runs * flops
        row["bytes"] += runs * nbytes_op
        row["seconds"] += runs * max(flops / peak, nbytes_op / bandwidth)  # each op at its own roofline
        if kind == "matmul" and program.rows(op) == T:
            padding_flops += runs * flops * (T - real) / T
        shape = arrays_of(op.shape)
        # [T, heads, head_dim] <-> [heads, T, head_dim]: the layout the kernel takes and gives back.
        if program._opcodes(op) & MOVES and len(shape) == 1 and len(shape[0][1]) == 3 and T in shape[0][1] \
                and shape[0][1][-1] == config.head_dim:
            layout["ops"] += runs
            layout["bytes"] += runs * program.bytes_accessed(op)
    total = {key: sum(row[key] for row in kinds.values()) for key in ("flops", "bytes", "seconds")}
    per_op = sorted(((runs * program.bytes_accessed(op), runs, program.kind(op), op) for op, runs in program.ops()),
                    key=lambda entry: -entry[0])[:top_ops]
    top = [{"bytes": b, "runs": runs, "kind": kind, "op": op.name, "shape": re.sub(r"\{[^}]*\}", "", op.shape)[:80],
            "source": _op_name(op).removeprefix("jit(run)/jit(run_pass)/")[-90:]} for b, runs, kind, op in per_op]
    matmul = kinds["matmul"]["flops"]
    return {
        "pass_tokens": T, "real_tokens": real, "padded_tokens": T - real,
        "kinds": {kind: {"ops": round(row["ops"], 1), "flops": row["flops"], "bytes": row["bytes"],
                         "flops_share": row["flops"] / total["flops"] if total["flops"] else 0.0,
                         "bytes_share": row["bytes"] / total["bytes"] if total["bytes"] else 0.0,
                         "roofline_ms": row["seconds"] * 1e3}
                  for kind, row in kinds.items()},
        "total_flops": total["flops"], "total_bytes": total["bytes"],
        "roofline": {"estimate": True, "chip": chip["chip"], "peak_flops": peak, "peak_hbm_bytes_per_s": bandwidth,
                     "ms": total["seconds"] * 1e3,
                     "matmul_and_kernel_ms": (kinds["matmul"]["seconds"] + kinds["attention kernel"]["seconds"]) * 1e3},
        "padding_share_of_matmul_flops": padding_flops / matmul if matmul else 0.0,
        "padding_flops": padding_flops,
        "kernel_layout_copies": layout,
        "kernel_tiles": {"q": tq, "k": tk, "pairs_per_head": pairs},
        "check_as_xla_counts": dict(zip(("walk_flops", "walk_bytes"), program.as_xla_counts().tolist()),
                                    xla_flops=xla_cost.get("flops"), xla_bytes=xla_cost.get("bytes accessed")),
        "top_ops_by_bytes": top,
        "host_reads": {key: len(names) for key, names in program.host_reads().items()},
    }


TILE_CANDIDATES = ((512, 512), (256, 256), (256, 512), (512, 256), (128, 512), (1024, 512))
GRID_STEP_SECONDS = 0.35e-6  # a Pallas TPU grid step's own cost (Pallas' TPU docs), whether it runs or skips
MXU_EDGE = {"tpu-v5e": 128, "tpu-v6e": 256}  # the MXU's systolic array is MXU_EDGE x MXU_EDGE


def _tpu_device(target: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(aot.TARGETS[target]["topology"][4], "tpu").devices[0]


def tpu_tile_costs(target: str, config: ModelConfig, arrays: PassArrays, dtype,
                   candidates=TILE_CANDIDATES) -> list[dict]:
    """Per (tile_q, tile_k): one layer's attention kernel on the contract pass compiled for `target`, its
    compiled cost and the modelled kernel time (see the module's docstring)."""
    from core.attention import device_tables, tpu
    from core.attention.rule import visible

    T, Tk = len(arrays.tokens), len(arrays.kv_meta.seq)
    q, k = arrays.q_meta, arrays.kv_meta
    visible_pairs = sum(int(visible(q.seq[s:s + 1024, None], q.item[s:s + 1024, None], q.pos[s:s + 1024, None],
                                    k.seq[None], k.item[None], k.pos[None]).sum()) for s in range(0, T, 1024))
    mesh = Mesh(np.asarray([_tpu_device(target)]), ("chip",))
    spec = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, PartitionSpec()))
    H, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    args = (spec((T, H, D), dtype), spec((Tk, Hkv, D), dtype), spec((Tk, Hkv, D), dtype),
            (spec((T,)),) * 3, (spec((Tk,)),) * 3, spec(arrays.tile_ids.shape), spec(arrays.tile_counts.shape))
    peak, edge = aot.TARGETS[target]["peak_flops"], MXU_EDGE[target]
    rows = []
    for tq, tk in candidates:
        row = {"target": target, "tile_q": tq, "tile_k": tk}
        start = time.perf_counter()
        try:
            kernel = jax.jit(partial(tpu.tpu_attention, block_q=aot.BLOCK_Q, block_k=aot.BLOCK_K, tile_q=tq, tile_k=tk))
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                compiled = kernel.trace(*args).lower(lowering_platforms=("tpu",)).compile()
        except Exception as exc:  # noqa: BLE001 - a tile size the compiler refuses (VMEM, say) is a finding
            rows.append(dict(row, compiled=False, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            continue
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, list) else cost
        cycles = sum(int(c) for c in re.findall(r'estimated_cycles":"(\d+)', compiled.as_text()))
        q_len, kv_len = device_tables.round_up(T, tq), device_tables.round_up(Tk, tk)
        ids, counts = device_tables.kernel_tables(jnp.asarray(arrays.tile_ids), jnp.asarray(arrays.tile_counts),
                                                  aot.BLOCK_Q, aot.BLOCK_K, tq, tk, q_len, kv_len)
        counts = np.asarray(counts)
        pairs = int(counts.sum())
        flops = H * pairs * 4 * tq * tk * D  # QK^T and PV of every visited tile pair, all query heads
        fill = min(D, edge) * min(tk, edge) / edge ** 2  # the stationary operand (k^T or v) on the MXU
        steps = {"static": ids.shape[0] * Hkv * ids.shape[1], "grid": ids.shape[0] * Hkv * max(int(counts.max()), 1)}
        mxu_s = flops / (peak * fill)
        row.update(compiled=True, compile_seconds=round(time.perf_counter() - start, 1),
                   xla_flops=cost.get("flops"), xla_bytes=cost.get("bytes accessed"),
                   xla_estimated_cycles=cycles,
                   visited_pairs=pairs, visited_over_visible=pairs * tq * tk / visible_pairs,
                   max_slots=int(counts.max()), table_width=int(ids.shape[1]), grid_steps=steps["grid"],
                   grid_steps_static_width=steps["static"], mxu_fill=fill, kernel_flops=flops,
                   model_mxu_ms=mxu_s * 1e3, model_steps_ms=steps["grid"] * GRID_STEP_SECONDS * 1e3,
                   model_kernel_ms=(mxu_s + steps["grid"] * GRID_STEP_SECONDS) * 1e3,
                   model_kernel_ms_static_width=(mxu_s + steps["static"] * GRID_STEP_SECONDS) * 1e3)
        rows.append(row)
    return rows


def tile_table(rows: list[dict], layers: int) -> str:
    lines = ["| chip | tiles | compiles | visited / visible pairs | slots (of width) | grid steps | XLA side Mcycles "
             f"| modelled kernel ms per layer: MXU + steps = total (static width) | x{layers} layers ms |",
             "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        tiles = f"{r['tile_q']}x{r['tile_k']}"
        if not r["compiled"]:
            lines.append(f"| {r['target']} | {tiles} | no: {r['error'][:60]} | | | | | | |")
            continue
        lines.append(f"| {r['target']} | {tiles} | yes | {r['visited_over_visible']:.2f}x | {r['max_slots']} "
                     f"({r['table_width']}) | {r['grid_steps']:,} | {r['xla_estimated_cycles'] / 1e6:.2f} "
                     f"| {r['model_mxu_ms']:.2f} + {r['model_steps_ms']:.2f} = {r['model_kernel_ms']:.2f} "
                     f"({r['model_kernel_ms_static_width']:.2f}) | {r['model_kernel_ms'] * layers:.1f} |")
    return "\n".join(lines)


def tpu_v5e_hlo(config: ModelConfig, arrays: PassArrays, dtype) -> tuple[str, dict]:
    """The optimized HLO of the pass compiled for one TPU v5e chip, and XLA's cost analysis of it."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(aot.TARGETS["tpu-v5e"]["topology"][4], "tpu")
    mesh = Mesh(np.asarray(topology.devices[:1]), ("chip",))
    args = aot.program_args(config, arrays, dtype, NamedSharding(mesh, PartitionSpec()))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(aot.pass_program(config, dtype)).trace(*args).lower(
            lowering_platforms=("tpu",)).compile()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled.as_text(), cost


def cuda_hlo(config: ModelConfig, arrays: PassArrays, dtype) -> tuple[str, dict]:
    """The pass lowered for CUDA (the Mosaic GPU kernel's lowering runs), as HLO before XLA's passes, and XLA's
    cost analysis of that HLO (no CUDA compiler runs here: before fusion)."""
    lowered = jax.jit(aot.pass_program(config, dtype)).trace(*aot.program_args(config, arrays, dtype)).lower(
        lowering_platforms=("cuda",))
    cost = lowered.cost_analysis() or {}
    return lowered.as_text(dialect="hlo"), cost[0] if isinstance(cost, list) else cost


TARGETS = {"tpu-v5e": ("tpu", "compiled", tpu_v5e_hlo), "cuda-h100": ("cuda", "lowered", cuda_hlo)}  # core.aot's names


def measure(model: str, ladder: str, target: str, dtype_name: str = "bfloat16") -> dict:
    config, dtype = MODELS[model], jnp.dtype(dtype_name)
    (arrays,) = aot.contract_passes(16384, LADDERS[ladder])  # the contract fits one pass on either ladder
    _, stage, build = TARGETS[target]
    start, cpu = time.perf_counter(), time.process_time()
    text, xla_cost = build(config, arrays, dtype)
    program = Program(text)
    out = {"model": model, "ladder": ladder, "target": target, "stage": stage,
           "build_seconds": round(time.perf_counter() - start, 1),
           "build_cpu_seconds": round(time.process_time() - cpu, 1)}
    out.update(breakdown(program, arrays, config, target, xla_cost))
    return out


def table(results: list[dict]) -> str:
    """The per-kind table of each result, one Markdown table per (target, ladder)."""
    lines = []
    for r in results:
        lines += [f"\n{r['target']} ({r['stage']}), {r['model']}, ladder {r['ladder']}: pass of {r['pass_tokens']:,} "
                  f"tokens, {r['real_tokens']:,} real; padding {r['padding_share_of_matmul_flops']:.1%} of the matmul "
                  f"FLOPs; kernel tiles {r['kernel_tiles']}",
                  "| op kind | ops per pass | GFLOP | FLOPs share | GB accessed | bytes share "
                  "| roofline ms (estimate) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for kind, row in r["kinds"].items():
            lines.append(f"| {kind} | {row['ops']:,.0f} | {row['flops'] / 1e9:,.1f} | {row['flops_share']:.1%} "
                         f"| {row['bytes'] / 1e9:,.2f} | {row['bytes_share']:.1%} | {row['roofline_ms']:,.2f} |")
        roof = r["roofline"]
        lines.append(f"| total | | {r['total_flops'] / 1e9:,.1f} | | {r['total_bytes'] / 1e9:,.2f} | "
                     f"| {roof['ms']:,.2f} |")
        lines.append(f"roofline estimate on {roof['chip']} ({roof['peak_flops'] / 1e12:,.0f} TFLOP/s, "
                     f"{roof['peak_hbm_bytes_per_s'] / 1e12:.2f} TB/s), each op at max(FLOPs/peak, bytes/HBM), no "
                     f"overlap: {roof['ms']:,.2f} ms a pass; the matmuls and the kernel alone "
                     f"{roof['matmul_and_kernel_ms']:,.2f} ms")
        copies = r["kernel_layout_copies"]
        lines.append(f"kernel layout copies [T,H,D]<->[H,T,D]: {copies['ops']:.0f} per pass, "
                     f"{copies['bytes'] / 1e9:.2f} GB")
        check = r["check_as_xla_counts"]
        if check["xla_flops"]:
            lines.append(f"check ({r['stage']} program): this walk counted as XLA counts gives "
                         f"{check['walk_flops'] / 1e9:,.1f} GFLOP and {check['walk_bytes'] / 1e9:,.2f} GB, XLA's cost "
                         f"analysis {check['xla_flops'] / 1e9:,.1f} and {check['xla_bytes'] / 1e9:,.2f}")
        lines += ["ops moving the most bytes per pass:"] + [
            f"  {o['bytes'] / 1e9:6.2f} GB  {o['runs']:4.0f} x {o['kind']:<16} {o['shape']:<40} {o['source']}"
            for o in r["top_ops_by_bytes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--ladder", choices=(*LADDERS, "both"), default="both")
    parser.add_argument("--target", choices=(*TARGETS, "tpu-v6e", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print one JSON line per program instead of tables")
    parser.add_argument("--tiles", action="store_true", help="compare the TPU kernel's tile sizes (v5e, v6e)")
    args = parser.parse_args(argv)
    if args.tiles:
        config = MODELS[args.model]
        (arrays,) = aot.contract_passes(16384)
        targets = ("tpu-v5e", "tpu-v6e") if args.target == "both" else (args.target,)
        rows = [row for target in targets for row in tpu_tile_costs(target, config, arrays, jnp.bfloat16)]
        print("\n".join(json.dumps(row) for row in rows) if args.json else tile_table(rows, config.num_layers))
        return rows
    results = []
    for target in TARGETS if args.target == "both" else (args.target,):
        for ladder in LADDERS if args.ladder == "both" else (args.ladder,):
            results.append(measure(args.model, ladder, target))
            print(json.dumps(results[-1]) if args.json else table(results[-1:]), flush=True)
    return results


if __name__ == "__main__":
    main()
