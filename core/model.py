"""Llama-family / Qwen3 decoder as plain functions over a weights pytree.

Weights (see `core.weights` for loading) are a dict; per-layer tensors are stacked on a
leading layer axis so the layers run under one `lax.scan` (one compiled layer body):
  embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
  layers: attn_norm [L, D], wqkv [L, D, q+2kv], wo [L, q, D], mlp_norm [L, D],
          w_gate_up [L, D, 2F], w_down [L, F, D], and for Qwen3 q_norm, k_norm [L, head_dim].
Matrices are (in, out): x @ w. q/k/v and gate/up are fused for larger matmuls.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from core.config import ModelConfig

Weights = dict
# attention(q [T,H,D], k [Tk,Hkv,D], v [Tk,Hkv,D]) -> [T,H,D]; closes over the pass metadata.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As Hugging Face: normalize in float32, cast back, then scale.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def apply_rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Non-interleaved RoPE (Hugging Face layout: rotate halves). x [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in the weights' dtype with float32 accumulation and a float32 result."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def forward_layer(config: ModelConfig, layer: Weights, x: jax.Array, positions: jax.Array,
                  cache_k: jax.Array, cache_v: jax.Array, attention: AttentionFn):
    """One decoder block over the pass's new tokens x [T, D]; keys also cover the cached
    context (cache_k/v [C, Hkv, hd], C may be 0). Returns (x, new k, new v)."""
    T = x.shape[0]
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    qkv = dense(h, layer["wqkv"]).astype(cache_k.dtype)
    q = qkv[:, : config.q_size].reshape(T, config.num_heads, config.head_dim)
    k = qkv[:, config.q_size: config.q_size + config.kv_size].reshape(T, config.num_kv_heads, config.head_dim)
    v = qkv[:, config.q_size + config.kv_size:].reshape(T, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    q = apply_rotary_embedding(q, positions, config.rope_theta)
    k = apply_rotary_embedding(k, positions, config.rope_theta)
    attn = attention(q, jnp.concatenate([cache_k, k]), jnp.concatenate([cache_v, v]))
    x = x + dense(attn.reshape(T, config.q_size), layer["wo"])
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    gate, up = jnp.split(dense(h, layer["w_gate_up"]), 2, axis=-1)
    x = x + dense(jax.nn.silu(gate) * up, layer["w_down"])
    return x, k, v


def forward(config: ModelConfig, weights: Weights, tokens: jax.Array, positions: jax.Array,
            cache_k: jax.Array, cache_v: jax.Array, score_rows: jax.Array, attention: AttentionFn):
    """Runs the pass and returns (logits [S, V] float32 at score_rows only, k, v [L, T, Hkv, hd]).

    cache_k/v [L, C, Hkv, hd] hold keys/values computed by an earlier pass (a shared
    prefix reused across chunks); the new tokens attend to them through `attention`.
    """
    # The residual stream stays float32 whatever the weights' dtype (bfloat16 weights
    # with a bfloat16 residual drift past the 5e-2 logprob tolerance).
    x = weights["embed"][tokens].astype(jnp.float32)

    def step(x, layer_and_cache):
        layer, ck, cv = layer_and_cache
        x, k, v = forward_layer(config, layer, x, positions, ck, cv, attention)
        return x, (k, v)

    x, (k, v) = jax.lax.scan(step, x, (weights["layers"], cache_k, cache_v))
    h = rms_norm(x[score_rows], weights["final_norm"], config.rms_norm_eps)
    head = weights.get("lm_head", weights["embed"])  # [V, D]; tied models reuse the embedding
    logits = jnp.einsum("sd,vd->sv", h.astype(head.dtype), head, preferred_element_type=jnp.float32)
    return logits, k, v
