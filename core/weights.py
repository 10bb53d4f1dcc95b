"""Weight conversion: GGUF files and Hugging Face directories into `core.model.CausalLM`.

Loaders produce per-layer matrices in the Hugging Face layout (out, in), by the keys below
(q, k, v, o, gate, up, down, bq/bk/bv, attn_norm, mlp_norm, post_attn_norm, post_mlp_norm,
q_norm, k_norm: each family's names map onto them); `stack_weights` transposes, fuses and
stacks them into the tree of the model's parameters; `load_model` puts them into the modules.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core import sharding
from core.config import FAMILIES, ModelConfig
from core.model import CausalLM
from core.requests import write_atomically

# Per-layer tensors by Hugging Face name (model.layers.N.<name>); Phi-3's fused ones are split on reading.
_HF_LAYER = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
}
_HF_BIASES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
_HF_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
# Gemma 2/3 name the norm after the attention post_attention_layernorm, the others name the MLP's so.
_HF_SANDWICH = {"post_attn_norm": "post_attention_layernorm.weight", "mlp_norm": "pre_feedforward_layernorm.weight",
                "post_mlp_norm": "post_feedforward_layernorm.weight"}
_HF_PLAIN_NORM = {"mlp_norm": "post_attention_layernorm.weight"}
# The same tensors by GGUF name (blk.N.<name>).
_GGUF_LAYER = {
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight", "attn_norm": "attn_norm.weight",
}
_GGUF_BIASES = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
_GGUF_QK_NORMS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
_GGUF_SANDWICH = {"post_attn_norm": "post_attention_norm.weight", "mlp_norm": "ffn_norm.weight",
                  "post_mlp_norm": "post_ffw_norm.weight"}
_GGUF_PLAIN_NORM = {"mlp_norm": "ffn_norm.weight"}


def _layer_names(config: ModelConfig, gguf: bool) -> dict[str, str]:
    """Our key -> the checkpoint's per-layer tensor name, for this family."""
    names = dict(_GGUF_LAYER if gguf else _HF_LAYER)
    if config.qkv_bias:
        names.update(_GGUF_BIASES if gguf else _HF_BIASES)
    if config.qk_norm:
        names.update(_GGUF_QK_NORMS if gguf else _HF_QK_NORMS)
    if config.sandwich_norms:
        names.update(_GGUF_SANDWICH if gguf else _HF_SANDWICH)
    else:
        names.update(_GGUF_PLAIN_NORM if gguf else _HF_PLAIN_NORM)
    return names


def stack_weights(config: ModelConfig, embed: np.ndarray, final_norm: np.ndarray, layers: list[dict],
                  lm_head: np.ndarray | None = None) -> dict:
    """The tree of `core.model.CausalLM`'s parameters (NumPy float32) from Hugging Face-layout matrices."""
    def stacked(fn):
        return np.stack([fn(layer) for layer in layers]).astype(np.float32)

    out = {
        "embed": embed.astype(np.float32),
        "final_norm": {"weight": final_norm.astype(np.float32)},
        "layers": {
            "attn_norm": {"weight": stacked(lambda l: l["attn_norm"])},
            "attn": {"wqkv": stacked(lambda l: np.concatenate([l["q"], l["k"], l["v"]]).T),
                     "wo": stacked(lambda l: l["o"].T)},
            "mlp_norm": {"weight": stacked(lambda l: l["mlp_norm"])},
            "mlp": {"w_gate_up": stacked(lambda l: np.concatenate([l["gate"], l["up"]]).T),
                    "w_down": stacked(lambda l: l["down"].T)},
        },
    }
    if config.qkv_bias:
        out["layers"]["attn"]["bqkv"] = stacked(lambda l: np.concatenate([l["bq"], l["bk"], l["bv"]]))
    if config.qk_norm:
        out["layers"]["attn"]["q_norm"] = {"weight": stacked(lambda l: l["q_norm"])}
        out["layers"]["attn"]["k_norm"] = {"weight": stacked(lambda l: l["k_norm"])}
    if config.sandwich_norms:
        out["layers"]["post_attn_norm"] = {"weight": stacked(lambda l: l["post_attn_norm"])}
        out["layers"]["post_mlp_norm"] = {"weight": stacked(lambda l: l["post_mlp_norm"])}
    if lm_head is not None and not config.tie_word_embeddings:
        out["lm_head"] = lm_head.astype(np.float32)
    return out


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders Q/K rows for interleaved RoPE; undo it for the HF layout.
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_gguf(path: str | Path, cache: Path | None = None) -> tuple[ModelConfig, dict]:
    """Reads and dequantizes a GGUF file (see ModelConfig.from_gguf_reader for the architectures). With `cache`
    (a folder), the dequantized weights are read from there (memory-mapped .npy files) if an earlier call wrote
    them, and written there if not."""
    if cache is not None and cache.is_dir():
        return ModelConfig.from_dict(json.loads((cache / "config.json").read_text())), _read_tree(cache)
    config, weights = _dequantize_gguf(path)
    if cache is not None:
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config.to_dict()))
            _write_tree(folder, weights)
        write_atomically(cache, write)
    return config, weights


def _write_tree(folder: Path, tree: dict, prefix: str = "") -> None:
    for name, value in tree.items():
        if isinstance(value, dict):
            _write_tree(folder, value, f"{prefix}{name}.")
        else:
            np.save(folder / f"{prefix}{name}.npy", value)


def _read_tree(folder: Path) -> dict:
    tree: dict = {}
    for file in folder.glob("*.npy"):
        *parents, leaf = file.stem.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = np.load(file, mmap_mode="r")
    return tree


def _dequantize_gguf(path: str | Path) -> tuple[ModelConfig, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_gguf_reader(reader)
    tensors = {t.name: t for t in reader.tensors}
    # The config read the RoPE factors (Phi-3's long ones are for sequences the engine does not take).
    used = {"rope_factors_short.weight", "rope_factors_long.weight", "rope_freqs.weight"}

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        used.add(name)
        return np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))

    names = _layer_names(config, gguf=True)
    # A fused family keeps its fused tensors: attn_qkv (q, k, v rows) and ffn_up (gate rows, then up rows).
    family = FAMILIES[config.family]
    fused = ("q", "k", "v", "gate", "up") if family.fused_projections else ()
    layers = []
    for i in range(config.num_layers):
        layer = {key: read(f"blk.{i}.{name}") for key, name in names.items() if key not in fused}
        if fused:
            q, kv = config.q_size, config.kv_size
            layer.update(zip(("q", "k", "v"), np.split(read(f"blk.{i}.attn_qkv.weight"), [q, q + kv])))
            layer.update(zip(("gate", "up"), np.split(read(f"blk.{i}.ffn_up.weight"), 2)))
        if family.gguf_permuted_qk:
            layer["q"] = _unpermute_qk(layer["q"], config.num_heads)
            layer["k"] = _unpermute_qk(layer["k"], config.num_kv_heads)
        layers.append(layer)
    lm_head = read("output.weight") if "output.weight" in tensors else None
    embed, final_norm = read("token_embd.weight"), read("output_norm.weight")
    # As load_hf_dir: a tensor the model would not use (a bias, say) is refused, not ignored.
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"GGUF tensors the {config.family} model does not use: {unused[:4]}")
    return config, stack_weights(config, embed, final_norm, layers, lm_head)


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict]:
    """Reads config.json and *.safetensors (one file or shards; float32, float16 or bfloat16) of a Hugging Face
    model directory. A tensor the model would not use (a bias or norm the family does not have) is refused:
    ignoring it would score another model."""
    path = Path(path)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    raw: dict[str, np.ndarray] = {}
    for shard in sorted(path.glob("*.safetensors")):
        raw.update(_read_safetensors(shard))
    if not raw:
        raise ValueError(f"no .safetensors files in {path}")
    raw = {k.removeprefix("model."): v for k, v in raw.items()}
    names = _layer_names(config, gguf=False)
    q, kv = config.q_size, config.kv_size
    used = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    layers = []
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        if FAMILIES[config.family].fused_projections:
            names = {k: v for k, v in names.items() if k not in ("q", "k", "v", "gate", "up")}
            qkv, gate_up = raw[prefix + "self_attn.qkv_proj.weight"], raw[prefix + "mlp.gate_up_proj.weight"]
            layer = dict(zip(("q", "k", "v"), np.split(qkv, [q, q + kv])))
            layer.update(zip(("gate", "up"), np.split(gate_up, 2)))
            used |= {prefix + "self_attn.qkv_proj.weight", prefix + "mlp.gate_up_proj.weight"}
        else:
            layer = {}
        for key, name in names.items():
            if prefix + name not in raw:
                raise ValueError(f"checkpoint tensor {prefix + name} is missing")
            layer[key] = raw[prefix + name]
            used.add(prefix + name)
        layers.append(layer)
    unused = sorted(k for k in set(raw) - used if "rotary_emb" not in k)
    if unused:
        raise ValueError(f"checkpoint tensors the {config.family} model does not use: {unused[:4]}")
    lm_head = raw.get("lm_head.weight")
    if lm_head is None and not config.tie_word_embeddings:
        raise ValueError("checkpoint tensor lm_head.weight is missing (tie_word_embeddings is false)")
    return config, stack_weights(config, raw["embed_tokens.weight"], raw["norm.weight"], layers, lm_head)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A .safetensors file's tensors, memory-mapped (safetensors' own NumPy reader has no bfloat16)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    data = (np.memmap(path, np.uint8, mode="r", offset=8 + size) if path.stat().st_size > 8 + size
            else np.zeros(0, np.uint8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint tensor {name} has dtype {info['dtype']}; float32/16 and bfloat16 only")
        lo, hi = info["data_offsets"]
        out[name] = data[lo:hi].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def random_weights(config: ModelConfig, seed: int = 0) -> dict:
    """Seeded random weights (tests and the tiny test model)."""
    rng = np.random.default_rng(seed)
    D, F, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    normal = lambda *shape: rng.normal(0.0, 0.5 / np.sqrt(shape[-1]), size=shape).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32)
    layers = [{
        "q": normal(q, D), "k": normal(kv, D), "v": normal(kv, D), "o": normal(D, q),
        "gate": normal(F, D), "up": normal(F, D), "down": normal(D, F),
        "attn_norm": norm(D), "mlp_norm": norm(D), "q_norm": norm(config.head_dim), "k_norm": norm(config.head_dim),
    } for _ in range(config.num_layers)]
    # Other families' tensors from a generator of their own: the tiny model's weights stay what they were.
    other = np.random.default_rng(seed + 1)
    for layer in layers:
        layer.update({"post_attn_norm": (1.0 + 0.1 * other.normal(size=D)).astype(np.float32),
                      "post_mlp_norm": (1.0 + 0.1 * other.normal(size=D)).astype(np.float32),
                      **{key: (0.1 * other.normal(size=n)).astype(np.float32)
                         for key, n in (("bq", q), ("bk", kv), ("bv", kv))}})
    # Small enough that logits stay in a realistic range (logprobs of -5..-20, not -80).
    embed = rng.normal(0.0, 0.1, size=(config.vocab_size, D)).astype(np.float32)
    lm_head = None if config.tie_word_embeddings else normal(config.vocab_size, D)
    return stack_weights(config, embed, norm(D), layers, lm_head)


def load_model(config: ModelConfig, weights: dict, dtype=jnp.float32, mesh: Mesh | None = None) -> CausalLM:
    """The model's modules holding `weights` (the tree of `stack_weights`, as NumPy) cast to `dtype`. Every
    parameter must be given, with its shape; nothing is allocated twice (the modules are built abstract).
    With a `mesh` (core.sharding), the weights are laid out and split for its chips, and each chip receives
    its own share only; the model's config is then `core.sharding.sharded_config`'s."""
    n = mesh.size if mesh is not None else 1
    if n > 1:
        weights = sharding.sharded_weights(config, weights, n)
        config = sharding.sharded_config(config, n)
    model = nnx.eval_shape(lambda: CausalLM(config, dtype, n))

    def fill(module, tree: dict, path: str) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                fill(getattr(module, name), value, f"{path}{name}/")
                continue
            param = getattr(module, name)
            if tuple(param.shape) != value.shape:
                raise ValueError(f"weight {path}{name} has shape {value.shape}, the model wants {tuple(param.shape)}")
            if mesh is None:
                param.set_value(jnp.asarray(value, dtype))
            else:  # cast on the host, then each chip's share straight to its chip
                where = sharding.weight_sharding(mesh, path + name, value.shape)
                param.set_value(jax.device_put(np.asarray(value, dtype), where))

    fill(model, weights, "")
    missing = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))
               if isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"weights missing for {missing}")
    return model
