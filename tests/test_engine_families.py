"""Every supported family on a tiny random checkpoint that transformers builds and saves: packed log-probs
against transformers' (eager attention, float32), packed against single mode, isolation, bfloat16; sequences
longer than the sliding windows, queries longer than them too. Each test also checks that the family's own
feature moved the scores (the same weights without it score differently), so a feature the engine ignored
would fail here."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from core import Scorer
from core.config import ModelConfig
from core.requests import ModelSource
from core.weights import load_hf_dir
from tests.test_engine_parity import ENGINE_VS_HF, PACKED_VS_SINGLE, hf_logprobs

WINDOW = 24
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, attn_implementation="eager")


def _phi3_rope() -> dict:
    rng = np.random.default_rng(7)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 96,
            "short_factor": (1 + rng.random(8)).tolist(), "long_factor": (2 + rng.random(8)).tolist()}


# family -> (transformers config class, its arguments, the config fields that matter: switched off they
# must change the scores)
FAMILIES = {
    "qwen2": ("Qwen2Config", {}, {"qkv_bias": False}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}, {"windows": ()}),
    "gemma": ("GemmaConfig", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256},
              {"norm_offset": 0.0}),
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0},
               {"attn_softcap": None, "final_softcap": None, "windows": ()}),
    "gemma3_text": ("Gemma3TextConfig", {
        "sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        {"ropes": (), "layer_rope": ()}),
    "phi3": ("Phi3Config", {"rope_parameters": _phi3_rope(), "max_position_embeddings": 384,
                            "original_max_position_embeddings": 96, "sliding_window": WINDOW, "pad_token_id": 0},
             {"ropes": ()}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.4,
                                  "attention_multiplier": 0.1, "logits_scaling": 0.5},
                {"residual_scale": 1.0, "logits_scaling": 1.0}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, {"ropes": ()}),
}


def build_checkpoint(family: str, path, dtype: str = "float32", tied: bool = True, shard: str | None = None,
                     **overrides):
    """A transformers model of the family with non-trivial random weights (norms, biases, logits in a
    realistic range; bfloat16 values), saved to `path` with the bundled tokenizer; returns the model (float32)."""
    import torch
    import transformers

    name, args, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**{**BASE, "tie_word_embeddings": tied, **args, **overrides})
    model = getattr(transformers, name.replace("Config", "ForCausalLM").replace("TextForCausalLM", "ForCausalLM"))(
        config).eval()
    gemma_norm = family.startswith("gemma")  # (1 + w): weights around 0
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.uniform_(-0.5, 0.5) if gemma_norm else p.uniform_(0.5, 1.5)
            elif key.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "embed" in key or "lm_head" in key:
                p.normal_(0.0, 0.3 / (8.0 if gemma_norm else 1.0))
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
            p.copy_(p.to(torch.bfloat16).float())  # values a bfloat16 checkpoint holds, as released models' are
    saved = model.to(getattr(torch, dtype)) if dtype != "float32" else model
    saved.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    ModelSource.resolve("tiny-random").tokenizer().save_pretrained(path)
    return saved.float()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_checkpoint(request.param, path)
    return request.param, path, model, Scorer.from_pretrained(str(path), pass_tokens=512)


def inputs(seed: int, query_len: int = 40):
    rng = np.random.default_rng(seed)
    query = rng.integers(5, 49152, query_len).tolist()  # longer than the window
    items = [rng.integers(5, 49152, int(n)).tolist() for n in (0, 1, 3, 9, 30, 50)]  # some longer than it too
    return query, items, [1, 77, 4000]


def test_family_matches_transformers_packed_single_and_isolated(family):
    name, path, model, scorer = family
    query, items, labels = inputs(1)
    assert scorer.config.family == name.removesuffix("-rope").replace("llama3", "llama")
    packed = scorer.logprobs(query, items, labels)
    reference = hf_logprobs(model, [query + item for item in items], labels)
    assert np.abs(packed - reference).max() <= ENGINE_VS_HF
    assert np.abs(packed - scorer.logprobs(query, items, labels, mode="single")).max() <= PACKED_VS_SINGLE
    other = list(items)
    other[4] = np.random.default_rng(9).integers(5, 49152, 17).tolist()
    moved = scorer.logprobs(query, other, labels)
    keep = np.arange(len(items)) != 4
    assert np.abs(moved[keep] - packed[keep]).max() <= 1e-5
    # The family's own features change the scores: an engine that ignored them would fail the first check.
    config, weights = load_hf_dir(path)
    without = dataclasses.replace(config, **FAMILIES[name][2])
    if name == "qwen2":  # no biases: the model has no place for them
        weights["layers"]["attn"].pop("bqkv")
    plain = Scorer(without, weights, scorer.tokenizer, name="plain").logprobs(query, items, labels)
    assert np.abs(plain - packed).max() > 1e-2


def test_family_bfloat16_within_tolerance(family):
    name, path, _, scorer = family
    query, items, labels = inputs(2)
    bf16 = Scorer.from_pretrained(str(path), dtype="bfloat16", pass_tokens=512)
    assert np.abs(bf16.logprobs(query, items, labels) - scorer.logprobs(query, items, labels)).max() <= 5e-2


@pytest.mark.parametrize("impl", ["dense", "pallas-interpret"])
def test_windows_and_softcaps_in_every_attention_path(tmp_path, impl):
    """Gemma 2's windowed and soft-capped layers through the dense reference and the TPU kernel (interpret
    mode) score as the XLA path does; a query longer than the window scores as the single-sequence model."""
    build_checkpoint("gemma2", tmp_path)
    xla = Scorer.from_pretrained(str(tmp_path), pass_tokens=512)
    other = Scorer(xla.config, xla.model, xla.tokenizer, name="other", attention=impl, pass_tokens=512)
    query, items, labels = inputs(3, query_len=70)
    lp = other.logprobs(query, items[:4], labels)
    assert np.abs(lp - xla.logprobs(query, items[:4], labels, mode="single")).max() <= PACKED_VS_SINGLE


def test_bfloat16_sharded_untied_checkpoint(tmp_path):
    """bfloat16 safetensors in several shards, with an untied head: read as transformers reads them."""
    model = build_checkpoint("gemma2", tmp_path, dtype="bfloat16", tied=False, shard="2MB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    scorer = Scorer.from_pretrained(str(tmp_path), pass_tokens=512)
    assert not scorer.config.tie_word_embeddings
    query, items, labels = inputs(4)
    reference = hf_logprobs(model, [query + item for item in items], labels)
    assert np.abs(scorer.logprobs(query, items, labels) - reference).max() <= ENGINE_VS_HF


def test_longrope_sequences_stay_within_the_short_factors_range(tmp_path):
    build_checkpoint("phi3", tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config.max_position_embeddings == 96 and config.ropes[0].scale > 1.0


HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96}


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_scaling type 'dynamic'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "text-only"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "unsupported architecture"),
])
def test_a_config_that_changes_the_math_is_refused_with_its_field(change, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        ModelConfig.from_hf({**HF_CONFIG, **change})


def test_a_tensor_the_family_does_not_use_is_refused(tmp_path):
    from safetensors.numpy import save_file

    build_checkpoint("mistral", tmp_path)
    save_file({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match="o_proj.bias"):
        load_hf_dir(tmp_path)


def write_gguf(family: str, model, path, change=None) -> None:
    """The checkpoint as llama.cpp's convert_hf_to_gguf.py writes it, in float32: its metadata keys for the
    architecture, the tensor names of gguf's own name map, and the converter's changes to tensors (Gemma's norms
    as 1 + w; Llama's and Granite's q/k rows permuted for llama.cpp's interleaved RoPE; Phi-3's LongRoPE
    factors as tensors, its fused qkv and gate_up kept). `change(writer)` adds to it."""
    import gguf

    c = model.config
    arch = {"gemma3_text": "gemma3", "llama3-rope": "llama"}.get(family, family)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [("block_count", c.num_hidden_layers), ("embedding_length", c.hidden_size),
                       ("feed_forward_length", c.intermediate_size), ("head_count", c.num_attention_heads),
                       ("head_count_kv", c.num_key_value_heads), ("layer_norm_rms_eps", c.rms_norm_eps),
                       ("rope_freq_base", rope["rope_theta"]), ("context_length", c.max_position_embeddings)]:
        getattr(writer, f"add_{add}")(value)
    if family not in ("phi3", "granite"):  # Phi-3's converter writes no head size, Granite's drops it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "phi3", "granite"):
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":  # the global layers' (Gemma 3)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if "sliding_attention" in c.rope_parameters:
        writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    if family in ("gemma2", "gemma3_text", "phi3"):
        writer.add_sliding_window(c.sliding_window or 0)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if family == "granite":  # the multipliers, under llama.cpp's names
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if rope.get("rope_type") == "llama3":  # as frequency factors (LlamaModel.generate_extra_tensors)
        old, low, high, factor = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                     "high_freq_factor", "factor"))
        wavelen = 2 * math.pi * rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        smooth = (old / wavelen - low) / (high - low)
        writer.add_tensor("rope_freqs.weight", np.where(wavelen < old / high, 1.0, np.where(
            wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))).astype(np.float32))
    if family == "phi3":  # LongRoPE: the attention factor from max / original context, the factors as tensors
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        value = tensor.float()
        if family.startswith("gemma") and key.endswith("norm.weight"):
            value = value + 1
        if arch in ("llama", "granite") and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
            value = value.reshape(heads, 2, -1, value.shape[-1]).swapaxes(1, 2).reshape(value.shape)
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), value.numpy())
    if change:
        change(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# GGUF has no query_pre_attn_scalar (llama.cpp takes head_dim, as the published 2B/9B, 1B-12B configs hold), and
# llama.cpp fixes Gemma 3's pattern of five local layers, then a global one.
GGUF_OVERRIDES = {"gemma2": {"query_pre_attn_scalar": 16},
                  "gemma3_text": {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}


@pytest.mark.parametrize("family", ["qwen2", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "llama3-rope"])
def test_gguf_families_match_transformers(tmp_path, family):
    """A checkpoint converted as llama.cpp converts it reads as the safetensors do and scores as transformers:
    qwen2 (biases), gemma (norms stored as 1 + w), gemma2 (sandwich norms, window and soft-caps in the
    metadata), gemma3 (q/k norms, local and global layers' RoPE), phi3 (fused tensors, LongRoPE), granite
    (permuted q/k, multipliers), llama with Llama 3's RoPE (its factors as a tensor)."""
    from core.weights import load_gguf

    model = build_checkpoint(family, tmp_path, **GGUF_OVERRIDES.get(family, {}))
    write_gguf(family, model, tmp_path / "model.gguf")
    config, weights = load_gguf(tmp_path / "model.gguf")
    expected = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    same = ("family", "windows", "layer_rope", "max_position_embeddings", "attn_softcap", "final_softcap", "qk_norm",
            "sandwich_norms", "tie_word_embeddings")
    assert [getattr(config, f) for f in same] == [getattr(expected, f) for f in same]
    close = ("embed_scale", "residual_scale", "scale", "logits_scaling")
    assert [getattr(config, f) for f in close] == pytest.approx([getattr(expected, f) for f in close], rel=1e-6)
    assert len(config.rope_list) == len(expected.rope_list)
    for ours, theirs in zip(config.rope_list, expected.rope_list):
        assert np.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-5) and ours.scale == pytest.approx(theirs.scale)
    tokenizer = ModelSource.resolve("tiny-random").tokenizer()
    scorer = Scorer(config, weights, tokenizer, name="gguf", pass_tokens=512)
    query, items, labels = inputs(5)
    reference = hf_logprobs(model, [query + item for item in items], labels)
    assert np.abs(scorer.logprobs(query, items, labels) - reference).max() <= ENGINE_VS_HF


@pytest.mark.parametrize("family,change,field", [
    ("qwen2", lambda w: w.add_rope_dimension_count(8), "qwen2.rope.dimension_count=8"),
    ("qwen2", lambda w: w.add_string("qwen2.rope.scaling.type", "yarn"), "rope.scaling.type='yarn'"),
    ("qwen2", lambda w: w.add_tensor("blk.0.attn_output.bias", np.ones(64, np.float32)), "blk.0.attn_output.bias"),
    ("gemma3_text", lambda w: w.add_sliding_window_pattern(4), "gemma3.attention.sliding_window_pattern=4"),
])
def test_a_gguf_the_engine_cannot_score_exactly_is_refused_with_its_field(tmp_path, family, change, field):
    from core.weights import load_gguf

    write_gguf(family, build_checkpoint(family, tmp_path), tmp_path / "model.gguf", change)
    with pytest.raises(ValueError, match=re.escape(field)):
        load_gguf(tmp_path / "model.gguf")


def test_a_query_split_from_its_items_under_windows(tmp_path):
    """A request larger than a pass (a prefix pass that keeps the query's keys/values, then chunks of items
    against them) under Gemma 2's windows, the query longer than the window: as transformers scores it."""
    model = build_checkpoint("gemma2", tmp_path)
    scorer = Scorer.from_pretrained(str(tmp_path), pass_tokens=256)
    rng = np.random.default_rng(6)
    query = rng.integers(5, 49152, 150).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(1, 40, 24)]
    request = scorer.tokenize(query, items, [1])
    assert len(list(scorer.iter_passes([request]))) >= 3
    labels = [1, 77, 4000]
    reference = hf_logprobs(model, [query + item for item in items], labels)
    assert np.abs(scorer.logprobs(query, items, labels) - reference).max() <= ENGINE_VS_HF


@pytest.mark.parametrize("kinds,blocks", [
    ((0,) * 5, [(0, (0,), 5)]),
    ((0, 1) * 3, [(0, (0, 1), 3)]),
    ((0, 1) * 3 + (0,), [(0, (0, 1), 3), (6, (0,), 1)]),  # Gemma 2's 26 layers, the last outside the loops
    ((0,) * 5 + (1,) + (0,) * 5 + (1,) + (0,), [(0, (0,) * 5 + (1,), 2), (12, (0,), 1)]),  # Gemma 3's 1-in-6
    ((1,) * 10 + (0,) * 4, [(0, (1,), 10), (10, (0,), 4)]),  # Qwen2's max_window_layers: no short period
    ((), []),
])
def test_layer_blocks_cover_every_layer_in_order_with_its_kind(kinds, blocks):
    from core.model import layer_blocks

    assert layer_blocks(kinds) == blocks
    assert [k for _, block, repeats in blocks for k in block * repeats] == list(kinds)


@pytest.mark.parametrize("family,layers", [("gemma2", 6), ("gemma3_text", 8)])
def test_alternating_windows_on_accelerators_have_no_branch(tmp_path, family, layers):
    """Layers of two windows (Gemma 2's alternating, Gemma 3's 1-in-6 with two RoPEs) in the accelerators' pass
    (no row steps): each layer's window is a static value of its loop's body, so the program has no conditional
    for a GPU's host to read back, and it scores as transformers does."""
    from core import scorer as engine

    types = (["sliding_attention", "full_attention"] * 3 if family == "gemma2"
             else ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2)
    model = build_checkpoint(family, tmp_path, num_hidden_layers=layers, layer_types=types)
    scorer = Scorer.from_pretrained(str(tmp_path), pass_tokens=512)
    assert len(scorer.config.attention_windows) == 2 and scorer.config.layer_kinds[:layers] != (0,) * layers
    scorer.token_rows = None
    query, items, labels = inputs(4, query_len=50)
    reference = hf_logprobs(model, [query + item for item in items], labels)
    assert np.abs(scorer.logprobs(query, items, labels) - reference).max() <= ENGINE_VS_HF
    programs = [p.as_text() for key, p in engine._PROGRAMS.resident.items() if ("token_rows", None) in key[2]]
    assert programs and not any(" conditional(" in text for text in programs)
