"""A Hugging Face folder of random weights in a real model's shape, for timing on a device that cannot download
one: `python -m benchmarks.random_checkpoint OUT [--model qwen3-0.6b] [--dtype bfloat16]`.

The shape is core.aot's (the one its roofline and benchmarks.pass_cost use), written by transformers' own model
class, so the engine reads it as it reads a downloaded checkpoint. The tokenizer is the bundled model's (smaller
vocabulary than the shape's: the benchmarks score random token ids, and every id the tokenizer makes is valid).
`--tokenizer DIR` takes one saved before (a device without the bundled model's package).
"""

import argparse
import shutil
from pathlib import Path

from core.aot import MODELS


def save(out: Path, model: str, dtype: str, tokenizer: Path | None, layers: int | None = None) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if model != "qwen3-0.6b":
        raise SystemExit(f"only qwen3-0.6b is written here, not {model}")
    c = MODELS[model]
    config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=layers or c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, tie_word_embeddings=True, max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is minutes on 2 cores
        weights = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    weights.save_pretrained(out)
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            shutil.copy(file, out / file.name)
    else:
        from core.requests import ModelSource

        ModelSource.resolve("tiny-random").tokenizer().save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tokenizer", type=Path, help="a saved tokenizer's folder (default: the bundled model's)")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (a quick try of a script on a CPU)")
    args = parser.parse_args(argv)
    save(args.out, args.model, args.dtype, args.tokenizer, args.layers)


if __name__ == "__main__":
    main()
