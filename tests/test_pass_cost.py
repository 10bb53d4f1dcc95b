"""benchmarks.pass_cost on the contract pass lowered for H100 (shapes only: a few CPU seconds): the walk's
matmul FLOPs are the model's, the kernel and its layout copies are found once per layer, and the padding share
is the padded rows' share of the matmuls over the pass's rows; and on the pass lowered for H100 and compiled
for TPU v5e, that the host reads nothing back during a pass (no loop of a data-dependent trip count, no branch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import pass_cost
from core import aot

ROOT = Path(__file__).resolve().parent.parent


def test_the_h100_breakdown_counts_the_models_matmuls_and_the_padding():
    c = aot.MODELS["qwen3-0.6b"]
    qkv = 2 * c.hidden_size * (c.q_size + 2 * c.kv_size)
    rest = 2 * (c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)  # o and the MLP, per row
    out = pass_cost.measure("qwen3-0.6b", "new", "cuda-h100")
    T = out["pass_tokens"]
    assert T == 12288 and out["real_tokens"] == 12000
    S = 512  # the 500 score rows' bucket (core.packing.score_row_count): the LM head in one step
    head = 2 * (2 * S) * c.hidden_size * c.vocab_size  # high and low parts
    kinds = out["kinds"]
    # Every layer's q/k/v on every row; o and the MLP too but in the last layer, on the score rows there.
    assert kinds["matmul"]["flops"] == c.num_layers * T * qkv + ((c.num_layers - 1) * T + S) * rest + head
    assert kinds["attention kernel"]["ops"] == c.num_layers and kinds["attention kernel"]["flops"] > 0
    assert out["kernel_layout_copies"]["ops"] == 4 * c.num_layers  # q, k, v in and the output back
    token_rows = (c.num_layers * qkv + (c.num_layers - 1) * rest) * T
    assert abs(out["padding_flops"] - token_rows * (T - 12000) / T) < 1e-6 * token_rows
    assert 0.02 < out["padding_share_of_matmul_flops"] < 0.03
    # No loop whose trip count the host reads back, no branch: the device runs the pass without waiting on it.
    assert out["host_reads"] == {"loops": 0, "branches": 0}
    assert "| matmul |" in pass_cost.table([out])


def test_the_tpu_program_has_no_loop_or_branch_for_the_host():
    """The pass as the TPU compiler compiles it (libtpu's compile-only devices, in a subprocess as tests/test_aot.py
    builds): its optimized HLO has no loop whose trip count is not a constant and no conditional."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}  # libtpu, TPU flags
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pass_cost", "--model", "smollm2-135m", "--ladder", "new",
                           "--target", "tpu-v5e", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["stage"] == "compiled" and out["kinds"]["attention kernel"]["ops"] == 30  # one a layer: the kernel
    assert out["host_reads"] == {"loops": 0, "branches": 0}


def test_a_convolution_counts_only_the_taps_on_its_input():
    """The TPU compiler writes the gate and up projections as a convolution over a window of 2 padded by 1 on
    each side: half the window is padding, and XLA's cost analysis does not count it."""
    text = """HloModule m
ENTRY %main (p0: f32[4,3,1], p1: f32[2,5,3]) -> f32[4,2,5] {
  %p0 = f32[4,3,1]{2,1,0} parameter(0)
  %p1 = f32[2,5,3]{2,1,0} parameter(1)
  ROOT %c = f32[4,2,5]{2,1,0} convolution(%p0, %p1), window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
}
"""
    program = pass_cost.Program(text)
    (conv,) = [op for op in program.computations["main"] if op.opcode == "convolution"]
    assert program.flops(conv) == 2 * 4 * 5 * 3 * 2  # batch, out features, in features, 2 taps of 4 on the input
