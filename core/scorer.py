"""The public engine: validation, tokenization, packed passes and host-side scores."""

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import logsumexp

from core import attention as attn
from core.config import TINY_CONFIG, ModelConfig
from core.errors import ScoringError
from core.model import forward
from core.packing import PackedSequence, PassPlan, build_pass, plan_passes
from core.requests import ModelSource, RequestTokenizer, TokenizedRequest, scores_from_logprobs
from core.weights import load_gguf, load_hf_dir, random_weights

ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas-interpret", "dense")


@dataclass
class ItemScores:
    request: int  # index into the list given to Scorer.iter_passes
    items: np.ndarray  # item indices within that request
    logprobs: np.ndarray  # [len(items), n_labels] float64


@dataclass
class PassResult:
    scores: list[ItemScores]
    tokens: int  # real tokens computed by the pass
    padded_tokens: int  # tokens after rounding up to the shape bucket
    seconds: float
    shape_key: tuple  # the padded shapes that select the compiled program


def _default_attention() -> str:
    return "xla" if jax.default_backend() == "cpu" else "pallas"


@partial(jax.jit, static_argnames=("config", "impl", "block_q", "block_k"))
def _run_pass(weights, tokens, q_meta, kv_meta, tile_ids, tile_counts, cache_k, cache_v, score_rows, *,
              config: ModelConfig, impl: str, block_q: int, block_k: int):
    def attention(q, k, v):
        if impl == "dense":
            return attn.dense_attention(q, k, v, q_meta, kv_meta)
        if impl == "xla":
            return attn.blocksparse_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q, block_k)
        return attn.pallas_attention(q, k, v, q_meta, kv_meta, tile_ids, tile_counts, block_q=block_q, block_k=block_k,
                                     interpret=impl == "pallas-interpret")

    logits, k, v = forward(config, weights, tokens, q_meta[2], cache_k, cache_v, score_rows, attention)
    return logits, k, v


class Scorer:
    """Scores (query, items, label_token_ids) with one model. See README and score-semantics.md."""

    def __init__(self, config: ModelConfig, weights: dict, tokenizer, *, name: str, dtype: str = "float32",
                 attention: str = "auto", pass_tokens: int | None = None, block_q: int = 128, block_k: int = 64,
                 prefix_cache_bytes: int = 256 << 20, **limits):
        """`limits`: max_items, max_tokens, max_sequence_tokens (see RequestTokenizer)."""
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}")
        self.config = config
        self.model_name = name
        limits.setdefault("max_sequence_tokens", config.max_position_embeddings)
        self.requests = RequestTokenizer(tokenizer, config.vocab_size, model_name=name, **limits)
        self.dtype = jnp.dtype(dtype)
        self.attention = _default_attention() if attention == "auto" else attention
        # Larger passes amortize better on accelerators; on CPU memory traffic wins past ~4k tokens.
        self.pass_tokens = pass_tokens or (4096 if jax.default_backend() == "cpu" else 16384)
        self.block_q, self.block_k = block_q, block_k
        self.weights = jax.tree.map(lambda w: jnp.asarray(w, self.dtype), weights)
        self.prefix_cache_bytes = prefix_cache_bytes
        # query tokens -> (k, v) [layers, len(query), kv_heads, head_dim], least recently used first
        self._prefix_cache: OrderedDict[tuple[int, ...], tuple[jax.Array, jax.Array]] = OrderedDict()
        self._engine_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2-135m", **kwargs) -> "Scorer":
        """A bundled model name ("smollm2-135m", "tiny-random"), a .gguf file or a Hugging Face directory."""
        source = ModelSource.resolve(name_or_path)
        if source.kind == "tiny-random":
            config, weights = TINY_CONFIG, random_weights(TINY_CONFIG, seed=0)
        elif source.kind == "gguf":
            config, weights = load_gguf(source.path)
        else:
            config, weights = load_hf_dir(source.path)
        return cls(config, weights, source.tokenizer(), name=source.name, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def tokenizer(self):
        return self.requests.tokenizer

    @property
    def compiled_programs(self) -> int:
        """How many distinct pass programs have been compiled (bounded by the shape buckets in use)."""
        return _run_pass._cache_size()

    def tokenize(self, query, items, label_token_ids, item_first: bool = False) -> TokenizedRequest:
        """Validates a request and tokenizes it as score-semantics.md says; raises ScoringError."""
        return self.requests.tokenize(query, items, label_token_ids, item_first)

    # ---- passes -------------------------------------------------------------------------

    def clear_prefix_cache(self) -> None:
        with self._engine_lock:
            self._prefix_cache.clear()

    def _remember_prefix(self, query: tuple[int, ...], k: jax.Array, v: jax.Array) -> None:
        self._prefix_cache[query] = (k, v)
        self._prefix_cache.move_to_end(query)
        size = lambda kv: kv[0].nbytes + kv[1].nbytes
        while len(self._prefix_cache) > 1 and sum(map(size, self._prefix_cache.values())) > self.prefix_cache_bytes:
            self._prefix_cache.popitem(last=False)

    def iter_passes(self, requests: Sequence[TokenizedRequest], mode: str = "packed") -> Iterator[PassResult]:
        """Runs the requests in packed passes (coalesced across requests), yielding each pass's scores.

        Every item is reported exactly once. Stop iterating to cancel at a pass boundary. Threads may iterate
        at once (the worker's two lanes): their passes run one at a time.
        mode "single" runs one pass per query+item sequence, sharing nothing (the baseline).
        """
        if mode not in ("packed", "single"):
            raise ScoringError("invalid_input", "mode must be 'packed' or 'single'")
        requests = list(requests)
        for plan in plan_passes(requests, self.pass_tokens, mode, is_cached=self._prefix_cache.__contains__):
            with self._engine_lock:  # also guards the prefix cache
                result = self._run_plan(requests, plan)
            yield result

    def _run_plan(self, requests: list[TokenizedRequest], plan: PassPlan) -> PassResult:
        start = time.perf_counter()
        cached = []  # held here: computing one prefix again may evict another this pass needs
        for seq in plan.sequences:
            if not seq.prefix_cached:
                continue
            if seq.prefix not in self._prefix_cache:  # evicted since planning (e.g. by the other lane's passes)
                self._run_plan(requests, PassPlan([PackedSequence(seq.prefix, keep_prefix=True)]))
            self._prefix_cache.move_to_end(seq.prefix)
            cached.append(self._prefix_cache[seq.prefix])
        arrays = build_pass(plan, self.block_q, self.block_k)
        # Keys/values always come back (one program per shape, not two); they are kept only as asked.
        logits, k, v = self._execute(arrays, cached)
        for seq, (lo, hi) in zip(plan.sequences, arrays.prefix_spans):
            if seq.keep_prefix:
                self._remember_prefix(seq.prefix, k[:, lo:hi], v[:, lo:hi])
        return PassResult(self._collect_scores(requests, arrays, logits), arrays.real_tokens, len(arrays.tokens),
                          time.perf_counter() - start, arrays.shape_key)

    def _execute(self, arrays, cached: list[tuple[jax.Array, jax.Array]]):
        c = self.config
        empty = jnp.zeros((c.num_layers, 0, c.num_kv_heads, c.head_dim), self.dtype)
        pad = ((0, 0), (0, arrays.cache_len - sum(k.shape[1] for k, _ in cached)), (0, 0), (0, 0))
        cache_k = jnp.pad(jnp.concatenate([empty] + [k for k, _ in cached], axis=1), pad)
        cache_v = jnp.pad(jnp.concatenate([empty] + [v for _, v in cached], axis=1), pad)
        meta = lambda m: (jnp.asarray(m.seq), jnp.asarray(m.item), jnp.asarray(m.pos))
        logits, k, v = _run_pass(
            self.weights, jnp.asarray(arrays.tokens), meta(arrays.q_meta), meta(arrays.kv_meta),
            jnp.asarray(arrays.tile_ids), jnp.asarray(arrays.tile_counts), cache_k, cache_v,
            jnp.asarray(arrays.score_rows), config=c, impl=self.attention, block_q=self.block_q,
            block_k=self.block_k)
        return np.asarray(logits), k, v

    @staticmethod
    def _collect_scores(requests: list[TokenizedRequest], arrays, logits: np.ndarray) -> list[ItemScores]:
        n = len(arrays.owners)
        rows = logits[:n].astype(np.float64)
        lse = logsumexp(rows, axis=1)
        by_request: dict[int, list[int]] = {}
        for row, (r, _) in enumerate(arrays.owners):
            by_request.setdefault(r, []).append(row)
        out = []
        for r, row_ids in by_request.items():
            labels = np.asarray(requests[r].label_token_ids)
            lp = rows[np.ix_(row_ids, labels)] - lse[row_ids, None]
            out.append(ItemScores(r, np.asarray([arrays.owners[i][1] for i in row_ids]), lp))
        return out

    # ---- one-request convenience API --------------------------------------------------

    def logprobs(self, query, items, label_token_ids, item_first: bool = False, mode: str = "packed") -> np.ndarray:
        """log P(label | sequence) per item: [len(items), len(label_token_ids)] float64."""
        request = self.tokenize(query, items, label_token_ids, item_first)
        out = np.full((request.n_items, len(request.label_token_ids)), np.nan)
        for result in self.iter_passes([request], mode):
            for part in result.scores:
                out[part.items] = part.logprobs
        return out

    def score(self, query, items, label_token_ids, apply_softmax: bool = False, item_first: bool = False,
              mode: str = "packed") -> list[list[float]]:
        """Scores as the reference engines' Score API returns them (see score-semantics.md)."""
        lp = self.logprobs(query, items, label_token_ids, item_first, mode)
        return scores_from_logprobs(lp, apply_softmax).tolist()

