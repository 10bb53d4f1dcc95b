"""Decoder configuration: one dataclass that says what differs between the supported families.

The supported families (Hugging Face `model_type`: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3,
granite) are the rows of FAMILIES, each saying what its family changes; a new family is a row there, plus code
only where it computes something no row field says.
A checkpoint whose configuration changes the math in a way the model does not implement (an unknown RoPE
scaling, biases on the MLP, bidirectional attention, ...) is refused here, with the field named: the engine
never scores an approximation of a model.
"""

import math
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
FULL, SLIDING = "full_attention", "sliding_attention"


def _listed_layer_types(hf: dict, layers: int) -> list[str] | None:
    """config.json's own layer_types, if it lists them."""
    if not hf.get("layer_types"):
        return None
    types = list(hf["layer_types"])
    if len(types) != layers or set(types) - {FULL, SLIDING}:
        raise ValueError(f"config field layer_types={types!r} is not supported")
    return types


# Each layer's type, as transformers decides it per family: (config.json, layers, its window or None) -> types.
def _no_windows(hf: dict, layers: int, window: int | None) -> list[str]:
    return _listed_layer_types(hf, layers) or [FULL] * layers  # transformers reads no window for these


def _one_window(hf: dict, layers: int, window: int | None) -> list[str]:
    return [SLIDING if window else FULL] * layers  # one window for every layer, if any


def _qwen_windows(hf: dict, layers: int, window: int | None) -> list[str]:
    if not hf.get("use_sliding_window"):
        return [FULL] * layers
    first = hf.get("max_window_layers", layers)
    return _listed_layer_types(hf, layers) or [SLIDING if window and i >= first else FULL for i in range(layers)]


def _alternating_windows(hf: dict, layers: int, window: int | None) -> list[str]:
    return _listed_layer_types(hf, layers) or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]


def _patterned_windows(hf: dict, layers: int, window: int | None) -> list[str]:
    pattern = int(hf.get("sliding_window_pattern", 6))
    return _listed_layer_types(hf, layers) or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


@dataclass(frozen=True)
class Family:
    """What one model family changes in the decoder, where it differs from Llama's; read from config.json by
    `ModelConfig.from_hf`, from a GGUF's metadata by `ModelConfig.from_gguf_reader`, and by core.weights."""

    architecture: str  # Hugging Face's architectures[0], for a config.json whose model_type is not ours
    gguf: str | None = None  # llama.cpp's general.architecture, where it has one of its own
    # config.json's defaults where it leaves them out
    activation: str = "silu"  # the MLP's gate, read from `activation_field`
    activation_field: str = "hidden_act"
    legacy_gelu_is_tanh: bool = False  # Gemma: transformers reads its legacy "gelu" as the tanh form
    rms_norm_eps: float = 1e-5
    tied_embeddings: bool = False
    sliding_window: int | None = None  # a window transformers assumes where config.json has no sliding_window
    # what the model computes differently
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w) (a GGUF stores 1 + w already)
    scaled_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden)
    qkv_bias: bool = False  # biases on q, k and v (the one family whose attention_bias is allowed)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    sandwich_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs too
    query_scalar: bool = False  # q.k scaled by query_pre_attn_scalar ** -0.5 (a GGUF: llama.cpp's choice)
    attn_softcap: bool = False  # scores -> cap * tanh(scores / cap), cap from attn_logit_softcapping
    final_softcap: bool = False  # logits -> cap * tanh(logits / cap), cap from final_logit_softcapping
    multipliers: bool = False  # Granite: embedding, residual, attention and logits multipliers
    layer_types: Callable[[dict, int, int | None], list[str]] = _no_windows
    local_rope: bool = False  # sliding layers have a RoPE of their own (rope_local_base_freq; theta 1e6 global)
    longrope_aliases: bool = False  # rope_scaling "su" and "yarn" mean LongRoPE
    # llama.cpp fixes which layers slide in its code, not the file (layer index -> slides), and the pattern
    # it implements where the file names one
    gguf_sliding: Callable[[int], bool] | None = None
    gguf_window_pattern: int | None = None
    # the weights' layout (core.weights)
    fused_projections: bool = False  # one q/k/v tensor and one gate/up tensor
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q and K for its interleaved RoPE


# What the Gemma generations share, and what Gemma 2 and 3 add to it.
_GEMMA = dict(activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tied_embeddings=True, norm_offset=1.0,
              scaled_embeddings=True)
_GEMMA_2_3 = dict(_GEMMA, activation_field="hidden_activation", sliding_window=4096, sandwich_norms=True,
                  query_scalar=True, final_softcap=True)
# Hugging Face model_type -> its family. Gemma 3 is its text-only checkpoints (Gemma3ForCausalLM).
FAMILIES = {
    "llama": Family("LlamaForCausalLM", gguf="llama", gguf_permuted_qk=True),
    "mistral": Family("MistralForCausalLM", sliding_window=4096, layer_types=_one_window),
    "qwen2": Family("Qwen2ForCausalLM", gguf="qwen2", qkv_bias=True, layer_types=_qwen_windows),
    "qwen3": Family("Qwen3ForCausalLM", gguf="qwen3", qk_norm=True, layer_types=_qwen_windows),
    "gemma": Family("GemmaForCausalLM", gguf="gemma", legacy_gelu_is_tanh=True, **_GEMMA),
    "gemma2": Family("Gemma2ForCausalLM", gguf="gemma2", attn_softcap=True, layer_types=_alternating_windows,
                     gguf_sliding=lambda i: i % 2 == 0, **_GEMMA_2_3),
    "gemma3_text": Family("Gemma3ForCausalLM", gguf="gemma3", qk_norm=True, layer_types=_patterned_windows,
                          local_rope=True, gguf_sliding=lambda i: (i + 1) % 6 != 0, gguf_window_pattern=6,
                          **_GEMMA_2_3),
    # llama.cpp itself turns Phi-3's window off; transformers runs it on every layer, and so does the engine.
    "phi3": Family("Phi3ForCausalLM", gguf="phi3", layer_types=_one_window, longrope_aliases=True,
                   gguf_sliding=lambda i: True, fused_projections=True),
    "granite": Family("GraniteForCausalLM", gguf="granite", multipliers=True, gguf_permuted_qk=True),
}
_ARCHITECTURES = {family.architecture: name for name, family in FAMILIES.items()}
_GGUF_FAMILIES = {family.gguf: name for name, family in FAMILIES.items() if family.gguf}  # llama.cpp's -> ours


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its inverse frequencies (float32 values, head_dim / 2 of them, any scaling
    applied) and a factor on cos and sin (LongRoPE's attention factor; 1 elsewhere)."""

    inv_freq: tuple[float, ...]
    scale: float = 1.0

    @classmethod
    def plain(cls, theta: float, head_dim: int) -> "Rope":
        return cls(tuple(_inv_freq(theta, head_dim).tolist()))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    family: str = "llama"
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w), in float32
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float = 1.0  # on the embeddings: Gemma sqrt(hidden), Granite embedding_multiplier
    residual_scale: float = 1.0  # on each block's output before it joins the residual (Granite)
    attn_scale: float | None = None  # on q.k; None: head_dim ** -0.5 (Gemma 2/3 query_pre_attn_scalar, Granite)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    logits_scaling: float = 1.0  # Granite: logits / logits_scaling
    sandwich_norms: bool = False  # Gemma 2/3: RMSNorm on the attention's and the MLP's outputs too
    # Per layer: its sliding window (keys at most window - 1 positions before the query; 0: none) and the
    # index of its RoPE in `ropes`. Empty: every layer global, `rope_theta`'s plain RoPE.
    windows: tuple[int, ...] = ()
    ropes: tuple[Rope, ...] = ()
    layer_rope: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return self.windows or (0,) * self.num_layers

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """The distinct windows (0: global), one attention program each (a static value, not per layer)."""
        return tuple(sorted(set(self.layer_windows)))

    @property
    def layer_kinds(self) -> tuple[int, ...]:
        """Per layer, the index of its window in `attention_windows`."""
        return tuple(self.attention_windows.index(w) for w in self.layer_windows)

    @property
    def rope_list(self) -> tuple[Rope, ...]:
        return self.ropes or (Rope.plain(self.rope_theta, self.head_dim),)

    @property
    def layer_rope_index(self) -> tuple[int, ...]:
        return self.layer_rope or (0,) * self.num_layers

    @property
    def scale(self) -> float:
        """The factor on q.k."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """From `to_dict` (after a JSON round trip: lists back to tuples)."""
        values = dict(values)
        values["windows"] = tuple(values.get("windows", ()))
        values["layer_rope"] = tuple(values.get("layer_rope", ()))
        values["ropes"] = tuple(Rope(tuple(r["inv_freq"]), r["scale"]) for r in values.get("ropes", ()))
        return cls(**values)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """From a Hugging Face config.json (transformers 4 or 5 layout); raises ValueError naming the field
        of a checkpoint the engine cannot score exactly."""
        arch = (hf.get("architectures") or [""])[0]
        name = hf.get("model_type", "")
        if name not in FAMILIES:
            name = _ARCHITECTURES.get(arch, "")
        if not name:
            hint = (" (Gemma 3: text-only checkpoints, Gemma3ForCausalLM, are supported)"
                    if hf.get("model_type") == "gemma3" else "")
            raise ValueError(f"unsupported architecture {arch or hf.get('model_type')!r}{hint}")
        family = FAMILIES[name]
        for field in ("quantization_config", "use_bidirectional_attention", "mlp_bias"):
            if hf.get(field):
                raise ValueError(f"config field {field}={hf[field]!r} is not supported")
        if hf.get("attention_bias") and not family.qkv_bias:
            raise ValueError(f"config field attention_bias={hf['attention_bias']!r} is not supported for {name}")
        act_field = family.activation_field
        act = hf.get(act_field) or family.activation
        if family.legacy_gelu_is_tanh and act == "gelu":
            act = "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ValueError(f"config field {act_field}={act!r} is not supported (silu, gelu_pytorch_tanh)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
        max_positions = int(hf.get("max_position_embeddings", 8192))
        window = hf.get("sliding_window", family.sliding_window)  # a null one: no window
        if window is not None and int(window) <= 0:
            raise ValueError(f"config field sliding_window={window!r} is not supported")
        types = family.layer_types(hf, layers, window)
        windows = tuple(int(window) if t == SLIDING and window else 0 for t in types)
        ropes, layer_rope, max_positions = _ropes(hf, family, types, head_dim, max_positions)
        scalar = hf.get("query_pre_attn_scalar") if family.query_scalar else None
        multiplier = hf.get("attention_multiplier") if family.multipliers else None
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rope_theta=_theta(hf, family, FULL),
            rms_norm_eps=float(hf.get("rms_norm_eps", family.rms_norm_eps)),
            qk_norm=family.qk_norm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tied_embeddings)),
            max_position_embeddings=max_positions,
            family=name,
            qkv_bias=family.qkv_bias,
            norm_offset=family.norm_offset,
            activation=_ACTIVATIONS[act],
            embed_scale=(math.sqrt(hf["hidden_size"]) if family.scaled_embeddings
                         else float(hf.get("embedding_multiplier", 1.0)) if family.multipliers else 1.0),
            residual_scale=float(hf.get("residual_multiplier", 1.0)) if family.multipliers else 1.0,
            attn_scale=float(scalar) ** -0.5 if scalar else float(multiplier) if multiplier is not None else None,
            attn_softcap=_cap(hf.get("attn_logit_softcapping")) if family.attn_softcap else None,
            final_softcap=_cap(hf.get("final_logit_softcapping")) if family.final_softcap else None,
            logits_scaling=float(hf.get("logits_scaling", 1.0)) if family.multipliers else 1.0,
            sandwich_norms=family.sandwich_norms,
            windows=windows if any(windows) else (),
            ropes=ropes,
            layer_rope=layer_rope if any(layer_rope) else (),
        )

    @classmethod
    def from_gguf_reader(cls, reader) -> "ModelConfig":  # type: ignore[no-untyped-def]
        """From a GGUF file's metadata (a `gguf.GGUFReader`; of its tensors only the small RoPE factors are
        read), by llama.cpp's architecture names (see _GGUF_FAMILIES). llama.cpp's converter stores Gemma's norms
        as 1 + w already, and some settings only in llama.cpp's code: those are taken from there (noted below)."""
        def field(key: str):  # type: ignore[no-untyped-def]
            return reader.fields[key].contents() if key in reader.fields else None

        arch = field("general.architecture")
        if arch not in _GGUF_FAMILIES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_FAMILIES)})")
        family = FAMILIES[_GGUF_FAMILIES[arch]]
        arch_field = lambda key: field(f"{arch}.{key}")
        scaling = arch_field("rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ValueError(f"GGUF field {arch}.rope.scaling.type={scaling!r} is not supported (none, linear)")
        heads, hidden = arch_field("attention.head_count"), arch_field("embedding_length")
        layers = arch_field("block_count")
        head_dim = arch_field("attention.key_length") or hidden // heads
        if arch_field("rope.dimension_count") not in (None, head_dim):
            raise ValueError(f"GGUF field {arch}.rope.dimension_count={arch_field('rope.dimension_count')} is not "
                             f"supported (partial RoPE; {head_dim}, the head size, only)")
        tensors = {t.name: t for t in reader.tensors}
        window = arch_field("attention.sliding_window") if family.gguf_sliding else None
        pattern = family.gguf_window_pattern
        if pattern and arch_field("attention.sliding_window_pattern") not in (None, pattern):
            raise ValueError(f"GGUF field {arch}.attention.sliding_window_pattern="
                             f"{arch_field('attention.sliding_window_pattern')!r} is not supported "
                             f"(llama.cpp: {pattern})")
        windows = tuple(int(window) if window and family.gguf_sliding(i) else 0 for i in range(layers))
        # Global layers: freq_base, linear scaling, frequency factors (tensors: Phi-3's LongRoPE short factors or
        # Llama 3's rope_freqs; ggml divides each frequency by its factor), LongRoPE's attention factor.
        # Gemma 3's local layers: freq_base_swa, 10000 where absent (llama.cpp's default), no scaling.
        theta = float(arch_field("rope.freq_base") or 10000.0)
        base = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
        factors = next((_gguf_tensor(tensors[n]) for n in _GGUF_ROPE_FACTORS if n in tensors), 1)
        inv = (1.0 / (factors * base)).astype(np.float32)  # as _rope computes LongRoPE's
        if scaling == "linear":
            inv = (inv / np.float32(arch_field("rope.scaling.factor"))).astype(np.float32)
        rope = Rope(tuple(inv.tolist()), float(arch_field("rope.scaling.attn_factor") or 1.0))
        local = Rope.plain(float(arch_field("rope.freq_base_swa") or 10000.0), head_dim)
        per_layer = [local if family.local_rope and w else rope for w in windows]
        ropes = tuple(dict.fromkeys(per_layer))
        max_positions = int(arch_field("context_length") or 8192)
        if "rope_factors_long.weight" in tensors:  # the short factors hold up to the original context (see _rope)
            max_positions = min(max_positions, int(arch_field("rope.scaling.original_context_length")))
        # GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim, or hidden / heads for Gemma 2 27B (46
        # layers) and Gemma 3 27B (62), which is what the published configs hold.
        scalar = (hidden / heads if layers in (46, 62) else head_dim) if family.query_scalar else None
        attn_scale = float(scalar) ** -0.5 if scalar else None
        if family.multipliers and arch_field("attention.scale"):
            attn_scale = float(arch_field("attention.scale"))
        multiplier = lambda key: float(arch_field(key) or 1.0) if family.multipliers else 1.0
        return cls(
            vocab_size=int(tensors["token_embd.weight"].shape[-1]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=arch_field("attention.head_count_kv") or heads,
            head_dim=head_dim,
            intermediate_size=arch_field("feed_forward_length"),
            rope_theta=theta,
            rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon")),
            qk_norm=family.qk_norm,
            tie_word_embeddings="output.weight" not in tensors,
            max_position_embeddings=max_positions,
            family=_GGUF_FAMILIES[arch],
            qkv_bias=family.qkv_bias,
            activation=_ACTIVATIONS[family.activation],
            embed_scale=math.sqrt(hidden) if family.scaled_embeddings else multiplier("embedding_scale"),
            residual_scale=multiplier("residual_scale"),
            attn_scale=attn_scale,
            attn_softcap=_cap(arch_field("attn_logit_softcapping")),
            final_softcap=_cap(arch_field("final_logit_softcapping")),
            logits_scaling=multiplier("logit_scale"),
            sandwich_norms=family.sandwich_norms,
            windows=windows if any(windows) else (),
            ropes=() if ropes == (Rope.plain(theta, head_dim),) else ropes,
            layer_rope=tuple(ropes.index(r) for r in per_layer) if len(ropes) > 1 else (),
        )


_GGUF_ROPE_FACTORS = ("rope_factors_short.weight", "rope_freqs.weight")


def _gguf_tensor(tensor) -> np.ndarray:  # type: ignore[no-untyped-def]
    import gguf

    return np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), np.float32)


def _cap(value) -> float | None:  # type: ignore[no-untyped-def]
    return float(value) if value else None


def _inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """RoPE's inverse frequencies in float32, as transformers computes them."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))\
        .astype(np.float32)


def _rope_parameters(hf: dict, family: Family, layer_type: str) -> dict:
    """The RoPE parameters of a layer type: transformers 5's rope_parameters (flat, or per layer type), or
    transformers 4's rope_theta / rope_scaling / rope_local_base_freq."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type in params or FULL in params:
        params = dict(params.get(layer_type) or {})
    elif not params:
        params = dict(hf.get("rope_scaling") or {})
        if family.local_rope and layer_type == SLIDING:
            params = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}  # the scaling is the global layers'
    return params


def _theta(hf: dict, family: Family, layer_type: str) -> float:
    params = _rope_parameters(hf, family, layer_type)
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if family.local_rope:
        return 10000.0 if layer_type == SLIDING else float(hf.get("rope_theta", 1_000_000.0))
    return float(hf.get("rope_theta", 10000.0))


def _ropes(hf: dict, family: Family, types: list[str], head_dim: int, max_positions: int):
    """(distinct RoPEs, each layer's index among them, the longest sequence they are exact for)."""
    by_type: dict[str, Rope] = {}
    for layer_type in dict.fromkeys(types):
        rope, max_positions = _rope(hf, family, _rope_parameters(hf, family, layer_type),
                                    _theta(hf, family, layer_type), head_dim, max_positions)
        by_type[layer_type] = rope
    ropes = tuple(dict.fromkeys(by_type.values()))
    plain = Rope.plain(_theta(hf, family, FULL), head_dim)
    if ropes == (plain,):
        return (), tuple(0 for _ in types), max_positions
    return ropes, tuple(ropes.index(by_type[t]) for t in types), max_positions


def _rope(hf: dict, family: Family, params: dict, theta: float, head_dim: int, max_positions: int):
    kind = params.get("rope_type", params.get("type")) or "default"
    if family.longrope_aliases and kind in ("su", "yarn"):
        kind = "longrope"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config field partial_rotary_factor={partial!r} is not supported (1.0 only)")
    inv = _inv_freq(theta, head_dim)
    scale = 1.0
    if kind == "linear":
        inv = (inv / np.float32(params["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(params.get("original_max_position_embeddings", max_positions))
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(np.float32)
    elif kind == "longrope":
        # The short factors hold for sequences up to original_max_position_embeddings (transformers switches
        # to the long ones past it, for the whole batch): the engine keeps its sequences within that length.
        original = int(params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                       or max_positions)
        factor = params.get("factor") or max_positions / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = np.asarray(params["short_factor"], np.float32)
        if len(short) != head_dim // 2:
            raise ValueError(f"config field rope_scaling.short_factor has {len(short)} values, not {head_dim // 2}")
        base = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
        inv = (1.0 / (short * base)).astype(np.float32)
        scale = float(attention_factor)
        max_positions = min(max_positions, original)
    elif kind != "default":
        raise ValueError(f"config field rope_scaling type {kind!r} is not supported (default, linear, llama3, "
                         "longrope for Phi-3)")
    return Rope(tuple(inv.tolist()), scale), max_positions


# A tiny decoder for tests and the embedded service's test mode; weights are random (seeded).
TINY_CONFIG = ModelConfig(
    vocab_size=49152, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
)
