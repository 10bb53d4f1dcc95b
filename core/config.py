"""Decoder configuration shared by every supported architecture (Llama family, Qwen3)."""

from dataclasses import dataclass


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
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """From a Hugging Face config.json (LlamaForCausalLM or Qwen3ForCausalLM)."""
        arch = (hf.get("architectures") or [""])[0]
        model_type = hf.get("model_type", "")
        if model_type not in ("llama", "qwen3") and arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            raise ValueError(f"unsupported architecture {arch or model_type!r}")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            qk_norm=model_type == "qwen3" or arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        )

    @classmethod
    def from_gguf_reader(cls, reader) -> "ModelConfig":  # type: ignore[no-untyped-def]
        """From a GGUF file's metadata (a `gguf.GGUFReader`; no tensor is read). Llama or Qwen3."""
        def field(key: str):  # type: ignore[no-untyped-def]
            return reader.fields[key].contents() if key in reader.fields else None

        arch = field("general.architecture")
        if arch not in ("llama", "qwen3"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}")
        arch_field = lambda key: field(f"{arch}.{key}")
        heads, hidden = arch_field("attention.head_count"), arch_field("embedding_length")
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        return cls(
            vocab_size=int(embed.shape[-1]),
            hidden_size=hidden,
            num_layers=arch_field("block_count"),
            num_heads=heads,
            num_kv_heads=arch_field("attention.head_count_kv"),
            head_dim=arch_field("attention.key_length") or hidden // heads,
            intermediate_size=arch_field("feed_forward_length"),
            rope_theta=float(arch_field("rope.freq_base") or 10000.0),
            rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon")),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            max_position_embeddings=int(arch_field("context_length") or 8192),
        )


# A tiny decoder for tests and the embedded service's test mode; weights are random (seeded).
TINY_CONFIG = ModelConfig(
    vocab_size=49152, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
)
