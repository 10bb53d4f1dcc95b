"""The pass program built ahead of time for the accelerators, on this CPU-only machine (python -m core.aot).

- TPU v6e and v5e: the real TPU compiler (XLA and Mosaic) on libtpu's compile-only devices compiles the
  whole pass program, Pallas kernel included, at the accelerator pass size. libtpu is a test dependency
  (pyproject's `aot` extra, installed by `make test`); without it, or if a compile fails, these tests fail.
- H100: `jax.export` for CUDA runs Mosaic GPU's lowering and its checks (shared memory among them).
Each build runs `python -m core.aot` in a subprocess: the CLI as shipped, and libtpu kept out of this process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from core import aot
from core.config import ModelConfig
from core.weights import load_model, random_weights

ROOT = Path(__file__).resolve().parent.parent


def build(target: str, model: str, pass_tokens: int = 16384, dtype: str = "bfloat16", tensor_parallel: int = 1) -> dict:
    # The suite's JAX_PLATFORMS ("cpu") hides libtpu; its XLA_FLAGS (tests/conftest.py) are for CPU programs.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "core.aot", "--target", target, "--model", model,
                           "--pass-tokens", str(pass_tokens), "--dtype", dtype,
                           "--tensor-parallel", str(tensor_parallel)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, \
        f"core.aot failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def assert_compiled_with_the_kernel(out: dict, target: str, kernels: int = 1) -> None:
    assert out["stage"] == "compiled"
    assert out["pass_tokens"] == 12288  # the contract's 12,000 tokens on the accelerators' ladder of 16,384
    assert out["pallas_kernels"] >= kernels
    assert out["flops"] > 0 and out["bytes_accessed"] > 0
    assert out["memory"]["peak_bytes"] > 0
    assert out["items_per_second_roofline"] > 0 and out["roofline"]["estimate"] is True
    assert out["roofline"]["peak_flops"] == aot.TARGETS[target]["peak_flops"]


# Each target and each head size once, not every pair (a TPU compile is 10-50 s): v5e and head size 64 here,
# v6e and head size 256 (Gemma 2) below, head size 128 and Qwen3's norms in the sharded build.
def test_tpu_compiles_the_pass_program_with_the_kernel():
    assert_compiled_with_the_kernel(build("tpu-v5e", "smollm2-135m"), "tpu-v5e")


def test_cuda_lowers_the_pass_program_with_the_mosaic_gpu_kernel():
    out = build("cuda-h100", "smollm2-135m")
    assert out["stage"] == "lowered"
    assert out["pallas_kernels"] >= 1
    assert out["attention_path"] == "pallas-mosaic-gpu"


@pytest.mark.parametrize("model,kernels,path", [("qwen3-0.6b", 1, "pallas-mosaic-gpu-ws"),
                                                ("smollm2-135m", 1, "pallas-mosaic-gpu"),
                                                ("gemma2-2b", 2, "pallas-mosaic-gpu-ws")])
def test_cuda_lowers_the_pass_program_with_the_warp_specialized_kernel(monkeypatch, model, kernels, path):
    """PACKSCORE_GPU_KERNEL=ws: its consumers as two heads of a KV head (Qwen3), and Gemma 2's head_dim 256 (64-key
    tiles: 128 overflow shared memory, which the lowering checks); SmolLM2's 3 heads a KV head take today's."""
    monkeypatch.setenv("PACKSCORE_GPU_KERNEL", "ws")
    out = build("cuda-h100", model)
    assert out["stage"] == "lowered" and out["pallas_kernels"] >= kernels
    assert out["attention_path"] == path


@pytest.mark.parametrize("model", ["gemma2-2b", "mistral-7b"])
def test_windowed_families_compile_for_v6e_and_lower_for_h100(model):
    """Gemma 2's local and global layers (two attention programs, soft-caps) and Mistral's windowed layers. The TPU
    compile is Gemma 2's: its local layers are the windowed kernel Mistral's would be, and head size 128 compiles
    in the sharded v5e build (a TPU compile is 10-50 s)."""
    windows = aot.MODELS[model].attention_windows
    assert windows == ((0, 4096) if model == "gemma2-2b" else (4096,))
    if model == "gemma2-2b":
        assert_compiled_with_the_kernel(build("tpu-v6e", model), "tpu-v6e", len(windows))
    cuda = build("cuda-h100", model)
    assert cuda["stage"] == "lowered" and cuda["pallas_kernels"] >= len(windows)
    assert cuda["attention_path"] == "pallas-mosaic-gpu"


def test_tensor_parallel_compiles_for_a_v5e_slice_and_lowers_for_eight_h100s():
    """The sharded pass (core.sharding) on 4 chips of a v5e 2x2 slice: the kernel on each chip's heads, XLA's
    all-reduces, each chip holding about a quarter of the weights; Gemma 2 2B (two kernels, 4 kv heads copied
    to 8) lowered for 8 GPUs."""
    tpu = build("tpu-v5e", "qwen3-0.6b", 4096, tensor_parallel=4)
    assert tpu["stage"] == "compiled" and tpu["tensor_parallel"] == 4
    assert tpu["pallas_kernels"] >= 1 and tpu["all_reduces"] >= 2
    c = aot.MODELS["qwen3-0.6b"]
    weights = sum(np.prod(s.shape) * 2 for s in jax.tree.leaves(aot.model_specs(c, np.float32)[1]))  # bfloat16
    cache_len = max(aot.contract_passes(4096), key=lambda a: len(a.tokens)).cache_len  # the query's keys/values in
    cache = 2 * c.num_layers * cache_len * c.num_kv_heads * c.head_dim * 2
    assert 0.2 * (weights + cache) < tpu["memory"]["argument_bytes"] < 0.3 * (weights + cache)  # a quarter each
    cuda = build("cuda-h100", "gemma2-2b", 4096, tensor_parallel=8)
    assert cuda["stage"] == "lowered" and cuda["devices"] == 8 and cuda["pallas_kernels"] >= 2


def test_a_failed_build_exits_non_zero(monkeypatch, capsys):
    def fails(*args):
        raise RuntimeError("Mosaic failed to compile TPU kernel")
    monkeypatch.setattr(aot, "build", fails)
    assert aot.main(["--target", "tpu-v6e", "--model", "qwen3-0.6b"]) == 1
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["stage"] == "failed" and "Mosaic" in out["error"]


@pytest.mark.parametrize("qk_norm,tied", [(False, True), (True, True), (True, False)])
def test_weight_shapes_are_the_engines(qk_norm, tied):
    config = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=48, qk_norm=qk_norm, tie_word_embeddings=tied)
    shapes = lambda state: [(jax.tree_util.keystr(path), leaf.shape)
                            for path, leaf in jax.tree_util.tree_leaves_with_path(state)]
    real = shapes(nnx.state(load_model(config, random_weights(config))))
    assert real == shapes(aot.model_specs(config, np.float32)[1])


def test_smollm2_shape_is_the_bundled_gguf():
    from core.requests import ModelSource

    assert ModelSource.resolve("smollm2-135m").config() == aot.MODELS["smollm2-135m"]


def test_contract_layout():
    # One contract request fits one pass: 12,288 tokens on the accelerators' ladder, 16,384 on the halving one.
    (arrays,) = aot.contract_passes(16384)
    assert len(arrays.tokens) == 12288 and arrays.real_tokens == 2000 + 500 * 20
    assert len(arrays.owners) == 500
    (halving,) = aot.contract_passes(16384, steps_per_octave=1)
    assert len(halving.tokens) == 16384 and halving.real_tokens == arrays.real_tokens
