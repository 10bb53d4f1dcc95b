"""Weight conversion: GGUF files and Hugging Face directories into `core.model.CausalLM`.

Loaders produce per-layer matrices in the Hugging Face layout (out, in); `stack_weights`
transposes, fuses and stacks them into the tree of the model's parameters; `load_model`
puts them into the modules.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config import ModelConfig
from core.model import CausalLM
from core.requests import write_atomically

# Per-layer tensors by Hugging Face suffix (model.layers.N.<suffix>.weight).
_HF_LAYER = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
}
# The same tensors by GGUF name (blk.N.<name>.weight).
_GGUF_LAYER = {
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
    "attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
}


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
    if config.qk_norm:
        out["layers"]["attn"]["q_norm"] = {"weight": stacked(lambda l: l["q_norm"])}
        out["layers"]["attn"]["k_norm"] = {"weight": stacked(lambda l: l["k_norm"])}
    if lm_head is not None and not config.tie_word_embeddings:
        out["lm_head"] = lm_head.astype(np.float32)
    return out


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders Q/K rows for interleaved RoPE; undo it for the HF layout.
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_gguf(path: str | Path, cache: Path | None = None) -> tuple[ModelConfig, dict]:
    """Reads and dequantizes a llama or qwen3 GGUF file. With `cache` (a folder), the dequantized weights are
    read from there (memory-mapped .npy files) if an earlier call wrote them, and written there if not."""
    if cache is not None and cache.is_dir():
        return ModelConfig(**json.loads((cache / "config.json").read_text())), _read_tree(cache)
    config, weights = _dequantize_gguf(path)
    if cache is not None:
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
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

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))

    names = {k: v for k, v in _GGUF_LAYER.items() if config.qk_norm or k not in ("q_norm", "k_norm")}
    layers = []
    for i in range(config.num_layers):
        layer = {key: read(f"blk.{i}.{name}.weight") for key, name in names.items()}
        if not config.qk_norm:  # llama: llama.cpp's converter permuted Q and K
            layer["q"] = _unpermute_qk(layer["q"], config.num_heads)
            layer["k"] = _unpermute_qk(layer["k"], config.num_kv_heads)
        layers.append(layer)
    lm_head = read("output.weight") if "output.weight" in tensors else None
    return config, stack_weights(config, read("token_embd.weight"), read("output_norm.weight"), layers, lm_head)


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict]:
    """Reads config.json and *.safetensors of a Hugging Face model directory."""
    from safetensors.numpy import load_file

    path = Path(path)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    raw: dict[str, np.ndarray] = {}
    for shard in sorted(path.glob("*.safetensors")):
        raw.update(load_file(shard))
    if not raw:
        raise ValueError(f"no .safetensors files in {path}")
    raw = {k.removeprefix("model."): v for k, v in raw.items()}
    names = {k: v for k, v in _HF_LAYER.items() if config.qk_norm or k not in ("q_norm", "k_norm")}
    layers = [{key: raw[f"layers.{i}.{name}.weight"] for key, name in names.items()} for i in range(config.num_layers)]
    lm_head = raw.get("lm_head.weight")
    return config, stack_weights(config, raw["embed_tokens.weight"], raw["norm.weight"], layers, lm_head)


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
    # Small enough that logits stay in a realistic range (logprobs of -5..-20, not -80).
    embed = rng.normal(0.0, 0.1, size=(config.vocab_size, D)).astype(np.float32)
    lm_head = None if config.tie_word_embeddings else normal(config.vocab_size, D)
    return stack_weights(config, embed, norm(D), layers, lm_head)


def load_model(config: ModelConfig, weights: dict, dtype=jnp.float32) -> CausalLM:
    """The model's modules holding `weights` (the tree of `stack_weights`, as NumPy) cast to `dtype`. Every
    parameter must be given, with its shape; nothing is allocated twice (the modules are built abstract)."""
    model = nnx.eval_shape(lambda: CausalLM(config, dtype))

    def fill(module, tree: dict, path: str) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                fill(getattr(module, name), value, f"{path}{name}.")
                continue
            param = getattr(module, name)
            if tuple(param.shape) != value.shape:
                raise ValueError(f"weight {path}{name} has shape {value.shape}, the model wants {tuple(param.shape)}")
            param.set_value(jnp.asarray(value, dtype))

    fill(model, weights, "")
    missing = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))
               if isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"weights missing for {missing}")
    return model
