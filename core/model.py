"""The decoder of every supported family as Flax NNX modules, one module per block; what differs between
families (biases, norm style, activation, soft-caps, windows and RoPE per layer, multipliers) is read from
`ModelConfig`.

`CausalLM` holds the weights (see `core.weights` for loading them into it). The decoder
layers are one `DecoderLayer` whose parameters carry a leading layer axis, so the stack
runs under one `lax.scan` (one compiled layer body). Matrices are (in, out): x @ w; q/k/v
and gate/up are fused for larger matmuls (their columns chip by chip when split over chips: core.sharding).
Parameter shapes, for L layers:
  embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
  layers: attn_norm [L, D], attn.wqkv [L, D, q+2kv], attn.wo [L, q, D], mlp_norm [L, D],
          mlp.w_gate_up [L, D, 2F], mlp.w_down [L, F, D], and where the family has them attn.bqkv [L, q+2kv]
          (Qwen2), attn.q_norm, attn.k_norm [L, head_dim] (Qwen3, Gemma 3), post_attn_norm, post_mlp_norm [L, D]
          (Gemma 2/3).
"""

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig, Rope

HEAD_ROWS = 64  # score rows per step of the LM head on CPU (passes of 512 tokens and more)
# Score rows per step of the LM head on accelerators: its logits in float32, twice over with bfloat16 weights
# (head_logits), are 0.6 GB at Qwen3's vocabulary.
DEVICE_HEAD_ROWS = 512
# Tokens per step of the projections and the MLP on CPU. On accelerators a pass runs them in one step: every
# step reads all the weights again, which costs more there than the padding it saves.
TOKEN_ROWS = 512

# attention(q [T,H,D], k [Tk,Hkv,D], v [Tk,Hkv,D], kind) -> [T,H,D]; closes over the pass metadata. kind (a
# static int) is the layer's index in config.attention_windows: its window, hence its tables.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, int], jax.Array]
# The longest repeating block of layer kinds the layer loop's body holds (Gemma 3's is 6); a pattern without a
# shorter period is looped over in runs of one kind instead.
MAX_LAYER_PERIOD = 8


def moved(move: Callable, *arrays: jax.Array) -> jax.Array:
    """`move` (a dynamic slice or update: data movement, no arithmetic) of `arrays`, bfloat16 ones as their bits
    (uint16), for XLA's CPU backend: it runs a bfloat16 dynamic slice or update in float32, converting the whole
    array (a pass's keys/values, all the layers' weights) there and back each time."""
    bits = [jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a for a in arrays]
    out = move(*bits)
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16) if arrays[0].dtype == jnp.bfloat16 else out


def layer_blocks(kinds: Sequence[int]) -> list[tuple[int, tuple[int, ...], int]]:
    """The layers of `kinds` (each layer's attention kind) as (first layer, the kinds of a block of consecutive
    layers, how many times the block repeats), in order: one loop per entry whose body runs the block's layers,
    each with its kind as a static value, so the program has no branch on a layer's kind (a conditional an
    accelerator's host must read). The shortest period of the pattern, its remainder after; a pattern with no
    period up to MAX_LAYER_PERIOD in runs of one kind."""
    n = len(kinds)
    period = next((p for p in range(1, min(n, MAX_LAYER_PERIOD) + 1)
                   if all(kinds[i] == kinds[i - p] for i in range(p, n))), None)
    if period is not None:
        whole = n // period * period
        blocks = [(0, tuple(kinds[:period]), n // period)] if whole else []
        return blocks + ([(whole, tuple(kinds[whole:]), 1)] if whole < n else [])
    blocks, start = [], 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            blocks.append((start, (kinds[start],), i - start))
            start = i
    return blocks


def rotary_tables(positions: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """cos and sin of RoPE's angles, [T, head_dim / 2] float32 (times the RoPE's scale). Computed once per pass
    for every layer: inside a layer's fused rotation XLA evaluated them once per head and element (a quarter of
    the projections' non-matmul time on CPU)."""
    inv_freq = jnp.asarray(rope.inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    if rope.scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * rope.scale, jnp.sin(angles) * rope.scale


def apply_rotary_embedding(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Non-interleaved RoPE (Hugging Face layout: rotate halves), in float32. x [T, heads, head_dim], cos and
    sin from `rotary_tables`."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense(x: jax.Array, w: nnx.Param) -> jax.Array:
    """x @ w in the weights' dtype with float32 accumulation and a float32 result. (A bfloat16 result for qkv or
    gate/up raised the bfloat16 scores' distance from float32 by 15-60% on the bundled model: kept float32.)"""
    return jnp.dot(x.astype(w.dtype), w[...], preferred_element_type=jnp.float32)


def over_tokens(fn: Callable, n_tokens: jax.Array, rows: int | None, *xs: jax.Array):
    """`fn` (row by row) on the first `n_tokens` rows of `xs` (each [T, ...]), `rows` rows a step (None: all
    T at once), for as many steps as those rows need: a pass pays for its real tokens, not for the ladder
    length it is padded to. Rows past them come out as zeros, or with None as `fn` makes them (their keys are
    masked, nothing reads them)."""
    if rows is None:
        # One step of all T rows, with no loop around it: an accelerator runs a loop's control from the host, a
        # predicate read back each trip (on an H200, 54 reads a pass, the device idle between: docs/performance.md).
        return fn(*xs)
    T = xs[0].shape[0]
    if T < rows:
        return _over_first_rows(fn, n_tokens, *xs)
    rows = min(rows, T)
    shapes = jax.eval_shape(fn, *(x[:rows] for x in xs))
    # A last step that would run past T is moved back to end at T (dynamic slices clamp), recomputing rows
    # that are already done: fn is row by row, so they come out the same.
    def step(i, out):
        part = fn(*(jax.lax.dynamic_slice_in_dim(x, i * rows, rows) for x in xs))
        return jax.tree.map(lambda o, p: moved(partial(jax.lax.dynamic_update_slice_in_dim, start_index=i * rows,
                                                       axis=0), o, p), out, part)

    init = jax.tree.map(lambda s: jnp.zeros((T, *s.shape[1:]), s.dtype), shapes)
    return jax.lax.fori_loop(0, (n_tokens + rows - 1) // rows, step, init)


def _over_first_rows(fn: Callable, n_tokens: jax.Array, *xs: jax.Array):
    """over_tokens for a pass shorter than a step: `fn` on the first n_tokens rows rounded up to a power of two
    (16 at least), one branch per size. A small request is padded to the shortest pass (64 tokens on CPU), and
    there its body's matmuls are compute-bound: the README's 2-item call (14 tokens past its cached query) took
    0.50 s in a 64-token pass on a 2-core AVX2 host, 0.35 s on 16 rows."""
    T = xs[0].shape[0]
    sizes = [16 << i for i in range(max(T.bit_length() - 5, 0)) if 16 << i < T] + [T]

    def first(size: int) -> Callable:
        pad = lambda part: jnp.pad(part, ((0, T - size),) + ((0, 0),) * (part.ndim - 1))
        return lambda: jax.tree.map(pad, fn(*(x[:size] for x in xs)))

    branch = sum((n_tokens > size).astype(jnp.int32) for size in sizes[:-1])
    return jax.lax.switch(branch, [first(size) for size in sizes])


def head_logits(h: jax.Array, head: jax.Array) -> jax.Array:
    """h [S, D] float32 @ head [V, D]^T, float32. With low-precision weights h goes in as two parts in the
    weights' dtype (h = high + low, nearly exactly), stacked into one matmul that reads the head once: rounding
    h itself moved bfloat16 log-probs of SmolLM2 by about 0.01, and the head runs on few rows."""
    if head.dtype == jnp.float32:
        return jnp.einsum("sd,vd->sv", h, head, preferred_element_type=jnp.float32)
    high = h.astype(head.dtype)
    low = (h - high.astype(jnp.float32)).astype(head.dtype)
    both = jnp.einsum("sd,vd->sv", jnp.concatenate([high, low]), head, preferred_element_type=jnp.float32)
    return both[: h.shape[0]] + both[h.shape[0]:]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, offset: float = 0.0):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.offset = offset  # Gemma: the scale is 1 + weight, taken in float32

    def __call__(self, x: jax.Array) -> jax.Array:
        # As Hugging Face: normalize in float32, cast back, then scale.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, shards: int = 1):
        c = config
        self.config = c
        self.shards = shards  # wqkv's columns hold each chip's q, k, v heads in turn (see core.sharding)
        self.wqkv = nnx.Param(jnp.zeros((c.hidden_size, c.q_size + 2 * c.kv_size), dtype))
        self.wo = nnx.Param(jnp.zeros((c.q_size, c.hidden_size), dtype))
        if c.qkv_bias:
            self.bqkv = nnx.Param(jnp.zeros((c.q_size + 2 * c.kv_size,), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)

    def project(self, h: jax.Array, cos: jax.Array, sin: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
        """q [T, H, hd] float32, k and v [T, Hkv, hd] in `dtype` (the cache's), of h [T, D] (normed)."""
        c, T = self.config, h.shape[0]
        # Norm and rotation in float32; k and v are rounded to the cache's dtype once, at the end. q stays
        # float32 (the accelerators' kernels round it themselves): rounding it to bfloat16 moved bfloat16
        # log-probs of SmolLM2 by up to 0.07 on an AVX512-BF16 CPU, 0.037 without.
        qkv = dense(h, self.wqkv)
        if c.qkv_bias:
            qkv = qkv + self.bqkv[...].astype(jnp.float32)
        qkv = qkv.reshape(T, self.shards, -1)  # [tokens, chip, its q | k | v]
        q_size, kv_size = c.q_size // self.shards, c.kv_size // self.shards
        q = qkv[..., :q_size].reshape(T, c.num_heads, c.head_dim)
        k = qkv[..., q_size: q_size + kv_size].reshape(T, c.num_kv_heads, c.head_dim)
        v = qkv[..., q_size + kv_size:].reshape(T, c.num_kv_heads, c.head_dim).astype(dtype)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_embedding(q, cos, sin)
        k = apply_rotary_embedding(k, cos, sin).astype(dtype)
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The attention output [T, H, hd] projected back to [T, D] (float32)."""
        return dense(out.reshape(out.shape[0], self.config.q_size), self.wo)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, shards: int = 1):
        self.activation = config.activation
        self.shards = shards  # w_gate_up's columns hold each chip's gate, then its up columns
        self.w_gate_up = nnx.Param(jnp.zeros((config.hidden_size, 2 * config.intermediate_size), dtype))
        self.w_down = nnx.Param(jnp.zeros((config.intermediate_size, config.hidden_size), dtype))

    def __call__(self, h: jax.Array) -> jax.Array:
        gate_up = dense(h, self.w_gate_up).reshape(h.shape[0], self.shards, 2, -1)
        gate, up = (gate_up[:, :, i].reshape(h.shape[0], -1) for i in (0, 1))
        act = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
        return dense(act * up, self.w_down)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, shards: int = 1):
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(config, dtype, shards)
        self.mlp_norm = norm()
        self.mlp = MLP(config, dtype, shards)
        if config.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.residual_scale = config.residual_scale

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], cache_k: jax.Array, cache_v: jax.Array,
                 attention: AttentionFn, n_tokens: jax.Array, token_rows: int | None,
                 rows: tuple[jax.Array, jax.Array] | None = None,
                 kind: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] float32, of which the first n_tokens are real; rope: `rotary_tables` of the tokens' positions;
        keys also cover the cached context
        (cache_k/v [C, Hkv, hd], C may be 0). Returns (x after the layer, this pass's k, v in the cache's dtype).
        `rows` (row indices [T], how many are in use): only those rows go on past the attention, and come out
        in that order (the last layer: only the score rows reach the LM head; the rest of it is keys/values).
        `kind`: the layer's attention kind (see AttentionFn)."""
        q, k, v = over_tokens(lambda x, cos, sin: self.attn.project(self.attn_norm(x), cos, sin, cache_k.dtype),
                              n_tokens, token_rows, x, *rope)
        out = attention(q, jnp.concatenate([cache_k, k]), jnp.concatenate([cache_v, v]), kind)
        sandwich = hasattr(self, "post_attn_norm")

        def finish(x, out):
            h = self.attn.output(out)
            x = x + self.residual_scale * (self.post_attn_norm(h) if sandwich else h)
            h = self.mlp(self.mlp_norm(x))
            return x + self.residual_scale * (self.post_mlp_norm(h) if sandwich else h)

        if rows is None:
            return over_tokens(finish, n_tokens, token_rows, x, out), k, v
        index, n_rows = rows
        return over_tokens(finish, n_rows, token_rows, x[index], out[index]), k, v


class CausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype = jnp.float32, shards: int = 1):
        """`shards`: the chips the weights are laid out for (see core.sharding; 1: one device)."""
        self.config = config
        self.embed = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))
        # One layer's modules with every parameter stacked over the layers (created under vmap).
        self.layers = nnx.vmap(lambda _: DecoderLayer(config, dtype, shards), in_axes=0, out_axes=0)(
            jnp.arange(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.norm_offset)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))

    @property
    def dtype(self) -> jnp.dtype:
        return self.embed.dtype

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                 n_tokens: jax.Array, score_rows: jax.Array, score_labels: jax.Array, n_rows: jax.Array,
                 attention: AttentionFn, keep_kv: bool = True, token_rows: int | None = None):
        """Runs the pass (its first n_tokens tokens are real, the rest padding; the projections and the MLP run
        `token_rows` tokens a step, see `over_tokens`) and returns (log P(label) [S, labels] float32 for the first
        `n_rows` score rows, each row's label ids in `score_labels` (after them: zeros on CPU, on accelerators
        what token 0 gives: nobody reads them); (k, v) [L, T, Hkv, hd]
        each, or None without keep_kv: a pass that keeps no prefix does not write every layer's keys/values out).

        cache_k/v [L, C, Hkv, hd] hold keys/values computed by an earlier pass (a shared prefix reused
        across chunks); the new tokens attend to them through `attention`.
        """
        # The residual stream stays float32 whatever the weights' dtype (bfloat16 weights
        # with a bfloat16 residual drift past the 5e-2 logprob tolerance).
        c = self.config
        x = self.embed[...][tokens].astype(jnp.float32)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        # Each distinct RoPE's tables once per pass; a layer picks its own (Gemma 3: local and global bases).
        tables = [rotary_tables(positions, rope) for rope in c.rope_list]
        cos_all, sin_all = (jnp.stack(t) for t in zip(*tables))
        layer_def, layer_state = nnx.split(self.layers)
        rope_index = jnp.asarray(c.layer_rope_index, jnp.int32)

        as_bits = lambda a: token_rows is not None and a.dtype == jnp.bfloat16  # on CPU (see `moved`)

        def of(a, i):  # layer i's part of a stack
            return moved(lambda b: jax.lax.dynamic_index_in_dim(b, i, keepdims=False), a) if as_bits(a) else a[i]

        def layer(i, kind: int, x, rows=None):
            """Layer i (traced in a loop; static for the last) on x, its weights and cache read in place."""
            state = jax.tree.map(lambda a: of(a, i), layer_state)
            rope = (cos_all[rope_index[i]], sin_all[rope_index[i]]) if len(tables) > 1 else tables[0]
            return nnx.merge(layer_def, state)(x, rope, of(cache_k, i), of(cache_v, i), attention, n_tokens,
                                               token_rows, rows, kind)

        def keep(kv, i, k, v):  # this pass's keys/values, written in place into [L, T, Hkv, hd]
            def put(a, x):
                if as_bits(a):
                    return moved(lambda b, y: jax.lax.dynamic_update_index_in_dim(b, y, i, 0), a, x)
                return a.at[i].set(x)
            return None if kv is None else (put(kv[0], k), put(kv[1], v))

        def loop_body(first: int, block: tuple[int, ...]):
            def step(j, carry):
                x, kv = carry
                for offset, kind in enumerate(block):
                    i = first + j * len(block) + offset
                    x, k, v = layer(i, kind, x)
                    kv = keep(kv, i, k, v)
                return x, kv
            return step

        # Every layer but the last on all rows, in loops of a fixed trip count over blocks of layers of static
        # kinds (layer_blocks); the last one outside them, its output projection and MLP on the score rows only
        # (x comes out as those rows): a few per cent of a typical pass's tokens (100 of 2,500 in the
        # benchmark's), so it saves nearly one layer's matmuls out of L, with no branch for an accelerator's
        # host to read.
        last = c.num_layers - 1
        kv_shape = (c.num_layers, x.shape[0], c.num_kv_heads, c.head_dim)
        kv = (jnp.zeros(kv_shape, cache_k.dtype),) * 2 if keep_kv else None
        for first, block, repeats in layer_blocks(c.layer_kinds[:last]):
            x, kv = jax.lax.fori_loop(0, repeats, loop_body(first, block), (x, kv))
        x, k, v = layer(last, c.layer_kinds[last], x, (score_rows, n_rows))
        # On accelerators (token_rows None) the LM head runs every score row the program has: the rows are
        # bucketed (core.packing), so a loop over the rows in use would only add a trip count to read back.
        rows_in_use = None if token_rows is None else n_rows
        return self.label_logprobs(self.final_norm(x), score_labels, rows_in_use), keep(kv, last, k, v)

    def label_logprobs(self, h: jax.Array, labels: jax.Array, n_rows: jax.Array | None) -> jax.Array:
        """log-softmax over the vocabulary, taken at `labels` [S, W], for the first n_rows rows of h [S, D]
        (None: every row, on accelerators).

        On CPU the LM head runs on a few rows at a time for as many steps as there are rows: a pass offers a
        score row per token (so the row count is never a compile key there) and pays only for the rows it uses.
        Steps are HEAD_ROWS rows, fewer in short passes: on CPU a 64-row step of the bundled model's head took
        140-215 ms (2-core AVX2 host), an 8-row step 35 ms (the weights' read), and a short pass holds a small
        request's few rows. On accelerators the rows are few already (bucketed) and every step reads the whole
        head, so they go DEVICE_HEAD_ROWS at a time, a fixed number of steps (one for up to DEVICE_HEAD_ROWS
        rows): no trip count for the host to read back."""
        head = self.lm_head if hasattr(self, "lm_head") else self.embed  # [V, D]; tied models reuse the embedding
        c = self.config
        S, W = labels.shape
        rows = min(DEVICE_HEAD_ROWS, S) if n_rows is None else min(HEAD_ROWS, max(8, S // 8))
        h = jnp.pad(h, ((0, -S % rows), (0, 0)))
        labels = jnp.pad(labels, ((0, -S % rows), (0, 0)))

        def chunk(i, out):
            hc = jax.lax.dynamic_slice_in_dim(h, i * rows, rows)
            logits = head_logits(hc, head[...])
            if c.logits_scaling != 1.0:  # Granite
                logits = logits / c.logits_scaling
            if c.final_softcap:  # Gemma 2
                logits = jnp.tanh(logits / c.final_softcap) * c.final_softcap
            picked = jnp.take_along_axis(logits, jax.lax.dynamic_slice_in_dim(labels, i * rows, rows), axis=1)
            return jax.lax.dynamic_update_slice_in_dim(
                out, picked - jax.nn.logsumexp(logits, axis=1, keepdims=True), i * rows, 0)

        out = jnp.zeros(labels.shape, jnp.float32)
        if n_rows is None and labels.shape[0] == rows:
            return chunk(0, out)[:S]
        steps = labels.shape[0] // rows if n_rows is None else (n_rows + rows - 1) // rows
        return jax.lax.fori_loop(0, steps, chunk, out)[:S]
