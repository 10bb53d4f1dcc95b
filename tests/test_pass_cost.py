"""benchmarks.pass_cost on the contract pass lowered for H100 (shapes only: a few CPU seconds): the walk's
matmul FLOPs are the model's, the kernel and its layout copies are found once per layer, and the padding share
is the padded rows' share of the matmuls over the pass's rows."""

from benchmarks import pass_cost
from core import aot
from core.model import HEAD_ROWS


def test_the_h100_breakdown_counts_the_models_matmuls_and_the_padding():
    c = aot.MODELS["qwen3-0.6b"]
    per_token = 2 * (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                     + 3 * c.hidden_size * c.intermediate_size)  # every layer's projections and MLP, per row
    out = pass_cost.measure("qwen3-0.6b", "new", "cuda-h100")
    T = out["pass_tokens"]
    assert T == 12288 and out["real_tokens"] == 12000
    rows = min(HEAD_ROWS, max(8, T // 8))
    head = -(-500 // rows) * 2 * (2 * rows) * c.hidden_size * c.vocab_size  # high and low parts, 500 score rows
    kinds = out["kinds"]
    assert kinds["matmul"]["flops"] == c.num_layers * T * per_token + head
    assert kinds["attention kernel"]["ops"] == c.num_layers and kinds["attention kernel"]["flops"] > 0
    assert out["kernel_layout_copies"]["ops"] == 4 * c.num_layers  # q, k, v in and the output back
    token_rows = c.num_layers * T * per_token
    assert abs(out["padding_flops"] - token_rows * (T - 12000) / T) < 1e-6 * token_rows
    assert 0.02 < out["padding_share_of_matmul_flops"] < 0.03
    assert "| matmul |" in pass_cost.table([out])


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
    program = pass_cost.Program(text, layers=1, head_steps=1)
    (conv,) = [op for op in program.computations["main"] if op.opcode == "convolution"]
    assert program.flops(conv) == 2 * 4 * 5 * 3 * 2  # batch, out features, in features, 2 taps of 4 on the input
