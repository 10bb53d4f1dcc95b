"""Tensor parallelism: how the model's weights split over N chips, as Megatron splits them.

A `jax.sharding.Mesh` over the process's first N devices with one axis, "tp". Each weight gets a
`NamedSharding` from PARTITION: q/k/v and gate/up split by heads and by the MLP's columns; o and down by rows
(XLA adds one all-reduce after each); the embedding, which is also the LM head when tied, and an untied LM
head by vocabulary rows (a token's row lives on one chip; the head's logits are each chip's share of the
vocabulary, reduced across chips for the log-softmax). Norms are replicated (a few KB). The attention runs
on each chip's own heads under `shard_map` (core.scorer), and the prefix cache keeps each chip's share of
the keys and values (KV_CACHE). With N = 1 there is no mesh, and nothing here applies.

Two layouts make every split a contiguous block of the weight:
- fused columns, chip by chip: wqkv holds, for each chip in turn, its q heads, its k heads, its v heads (with
  one chip, the usual [q | k | v]); w_gate_up holds each chip's gate columns, then its up columns.
- a model with fewer kv heads than chips (GQA: Qwen3-8B has 8, Qwen3-0.6B 8, SmolLM2 3) gets a copy of each
  kv head on every chip whose q heads read it, as vLLM does: the model then runs as one with N kv heads whose
  k/v weights repeat, which computes the same keys and values.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core.config import ModelConfig

AXIS = "tp"

# How each weight splits, by its path in the model's state (layer weights carry a leading layer axis).
# Anything not listed is replicated.
PARTITION = {
    "embed": P(AXIS, None),
    "lm_head": P(AXIS, None),
    "layers/attn/wqkv": P(None, None, AXIS),
    "layers/attn/bqkv": P(None, AXIS),
    "layers/attn/wo": P(None, AXIS, None),
    "layers/mlp/w_gate_up": P(None, None, AXIS),
    "layers/mlp/w_down": P(None, AXIS, None),
}
# A vocabulary that N does not divide: the embedding and head split by hidden columns instead.
VOCAB_BY_COLUMNS = P(None, AXIS)
KV_CACHE = P(None, None, AXIS, None)  # keys or values [layers, tokens, kv heads, head_dim]
HEADS = P(None, AXIS, None)  # q, k, v or the attention's output [tokens, heads, head_dim]


def valid_sizes(config: ModelConfig, up_to: int = 64) -> list[int]:
    """The tensor-parallel sizes this model splits into: N divides the q heads and the MLP's width, and the
    kv heads split evenly (N divides them) or are copied (they divide N)."""
    return [n for n in range(1, up_to + 1) if config.num_heads % n == 0 and config.intermediate_size % n == 0
            and (config.num_kv_heads % n == 0 or n % config.num_kv_heads == 0)]


def check(config: ModelConfig, n: int, devices: int) -> None:
    """Raises ValueError, naming the values that work, if the model does not split into n or the process
    has fewer than n devices."""
    if n < 1 or n not in valid_sizes(config, max(n, 1)):
        raise ValueError(
            f"tensor_parallel={n} does not split this model ({config.num_heads} attention heads, "
            f"{config.num_kv_heads} kv heads, MLP width {config.intermediate_size}); values that work: "
            f"{', '.join(map(str, valid_sizes(config, config.num_heads)))}")
    if n > devices:
        raise ValueError(f"tensor_parallel={n} needs {n} devices; this process has {devices} "
                         f"({jax.default_backend()})")


def make_mesh(n: int, devices=None) -> Mesh:  # type: ignore[no-untyped-def]
    """A one-axis mesh over the first n devices (default: this process's)."""
    return Mesh(np.asarray(list(devices if devices is not None else jax.devices())[:n]), (AXIS,))


def sharded_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config the model runs with on n chips: kv heads copied up to n where it has fewer."""
    if config.num_kv_heads >= n:
        return config
    return dataclasses.replace(config, num_kv_heads=n)


def partition(path: str, shape: tuple[int, ...], n: int) -> P:
    """The PartitionSpec of the weight at `path` on n chips."""
    spec = PARTITION.get(path, P())
    if path in ("embed", "lm_head") and shape[0] % n:
        return VOCAB_BY_COLUMNS
    return spec


def weight_sharding(mesh: Mesh, path: str, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition(path, shape, mesh.size))


def _by_chip(w: np.ndarray, blocks: list[int], n: int) -> np.ndarray:
    """The last axis of w (consecutive blocks of these sizes, each a multiple of n) reordered chip by chip:
    chip i's share of every block in turn."""
    parts = np.split(w, np.cumsum(blocks)[:-1], axis=-1)
    return np.concatenate([p.reshape(*p.shape[:-1], n, -1) for p in parts], axis=-1).reshape(w.shape)


def sharded_weights(config: ModelConfig, weights: dict, n: int) -> dict:
    """`core.weights.stack_weights`' tree laid out for n chips (see the module's doc): kv heads copied where
    the model has fewer than n, q/k/v and gate/up columns chip by chip. The tree of `config` on one chip is
    returned as it is."""
    if n == 1:
        return weights
    c, hd = config, config.head_dim
    copies = max(n // c.num_kv_heads, 1)
    kv = c.num_kv_heads * hd * copies

    def qkv(w: np.ndarray) -> np.ndarray:
        q, k, v = np.split(np.asarray(w), [c.q_size, c.q_size + c.kv_size], axis=-1)
        if copies > 1:  # each kv head repeated for the chips whose q heads read it
            k, v = (np.repeat(x.reshape(*x.shape[:-1], c.num_kv_heads, hd), copies, axis=-2)
                    .reshape(*x.shape[:-1], kv) for x in (k, v))
        return _by_chip(np.concatenate([q, k, v], axis=-1), [c.q_size, kv, kv], n)

    layers = dict(weights["layers"])
    layers["attn"] = dict(layers["attn"], wqkv=qkv(layers["attn"]["wqkv"]))
    if "bqkv" in layers["attn"]:
        layers["attn"]["bqkv"] = qkv(layers["attn"]["bqkv"])
    F = c.intermediate_size
    layers["mlp"] = dict(layers["mlp"], w_gate_up=_by_chip(np.asarray(layers["mlp"]["w_gate_up"]), [F, F], n))
    return dict(weights, layers=layers)


def state_shardings(mesh: Mesh, state):  # type: ignore[no-untyped-def]
    """A NamedSharding for each leaf of a model's state (`nnx.split`'s), by PARTITION."""
    def one(path, leaf):  # type: ignore[no-untyped-def]
        name = "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        return weight_sharding(mesh, name, leaf.shape)
    return jax.tree_util.tree_map_with_path(one, state)
