"""The public engine: validation, tokenization, packed passes and host-side scores."""

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Callable, Collection, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import allocator
from core import dtype as dtypes
from core import sharding
from core.attention import selection
from core.config import TINY_CONFIG, ModelConfig
from core.errors import ScoringError
from core.model import DEVICE_HEAD_ROWS, TOKEN_ROWS, CausalLM
from core.packing import (ACCELERATOR_STEPS_PER_OCTAVE, PackedSequence, PassPlan, build_pass, cache_length,
                          filler_plan, ladder, plan_passes)
from core.prefix_cache import PREFIX_CACHE_BYTES_CPU, PrefixCache, device_prefix_cache_bytes
from core.requests import ModelSource, RequestTokenizer, TokenizedRequest, scores_from_logprobs
from core.weights import load_gguf, load_hf_dir, load_model, random_weights

# XLA reads XLA_FLAGS once, when JAX's CPU backend starts: chosen on import for the Scorer's default dtype
# (float32), and again by `Scorer.from_pretrained` for its dtype if no computation has started the backend yet (a
# service that starts JAX before it builds its Scorer chooses them itself, for its DTYPE setting: `packscore
# check`). The flags per dtype and CPU feature are core.dtype's table; an XLA_FLAGS that names the option wins.
_XLA_FLAGS_CHOSEN_OUTSIDE = dtypes.YNN_FUSION in os.environ.get("XLA_FLAGS", "")


def choose_xla_flags(dtype: str) -> bool:
    """Sets XLA_FLAGS for `dtype`'s fastest CPU path (`auto` as it resolves on this CPU); False if it is too late
    (the backend has started) or XLA_FLAGS chose already."""
    from jax._src import xla_bridge

    if _XLA_FLAGS_CHOSEN_OUTSIDE or xla_bridge.backends_are_initialized():
        return False
    flags = dtypes.without_table_flags(os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + list(dtypes.xla_cpu_flags(dtype, dtypes.cpu_flags())))
    return True


choose_xla_flags("float32")


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
    seconds: float  # from its launch's start to its scores (a pass launched ahead waits for the one before it)
    shape_key: tuple  # the padded shapes that select the compiled program
    host_seconds: float  # the host's work to plan, pack and launch it (tables, cached prefixes, tokens to device)
    device_seconds: float  # from the device's start on it (its launch, or the previous pass's results) to its results
    device_idle_seconds: float  # the device's idle time before it: from the previous pass's results to its launch
    compiled: bool = False  # its program was compiled (or loaded from the compile cache) for it: its time counts that


log = logging.getLogger(__name__)

# The shortest pass on CPU, in tokens (see Scorer.shortest_pass). On the bundled model (a 2-core AVX2 host) a
# pass of 64 tokens took 0.25 s, of 128 tokens 0.38 s, of 512 tokens 1.0 s; below 64 the weights' reads
# dominate (the body's matmuls alone: 118 ms for 32 rows, 138 ms for 64).
SHORTEST_CPU_PASS = 64

# The warm-up runs each program once while its runs fit in this long: the tiny model's whole ladder takes under
# a second on a 2-core CPU, SmolLM2's over a minute there (its longest program runs, 8-9 s; the others do not).
WARM_RUN_SECONDS = 10.0
MIN_LABEL_WIDTH = 8  # label ids per score row in the program: up to 8 labels cost one program, not four


def _score_labels(requests: Sequence[TokenizedRequest], arrays) -> np.ndarray:
    """Per score row, its request's label ids [S, width]; the width is 8, or a power of two above (a compile
    key only for requests with more than 8 labels); rows padded with their first label, padding rows with
    label 0."""
    owners = _owner_requests(arrays)
    in_pass = np.unique(owners)
    width = max([MIN_LABEL_WIDTH] + [1 << (len(requests[r].label_token_ids) - 1).bit_length() for r in in_pass])
    per_request = np.zeros((len(requests), width), np.int32)
    for r in in_pass:
        ids = requests[r].label_token_ids
        per_request[r] = list(ids) + [ids[0]] * (width - len(ids))
    labels = np.zeros((len(arrays.score_rows), width), np.int32)
    labels[arrays.owner_rows] = per_request[owners]  # a request's rows: a Python loop per item cost more
    return labels


def _owner_requests(arrays) -> np.ndarray:
    """The request of each item the pass scores."""
    return np.fromiter((r for r, _ in arrays.owners), np.int64, count=len(arrays.owners))


def _collect_scores(requests: Sequence[TokenizedRequest], arrays, logprobs: np.ndarray) -> list[ItemScores]:
    owners = _owner_requests(arrays)
    items = np.fromiter((i for _, i in arrays.owners), np.int64, count=len(arrays.owners))
    rows = logprobs[arrays.owner_rows].astype(np.float64)
    in_pass, first = np.unique(owners, return_index=True)
    scores = []
    for r in in_pass[np.argsort(first)]:  # in the order the pass holds them
        mine = owners == r
        scores.append(ItemScores(int(r), items[mine], rows[mine, :len(requests[r].label_token_ids)]))
    return scores


@partial(jax.jit, static_argnames=("model_def", "impl", "block_q", "block_k", "keep_kv", "token_rows", "mesh"))
def run_pass(model_state, tokens, q_meta, kv_meta, tables, cache_k, cache_v, score_rows, score_labels,
             n_rows, n_tokens, *, model_def: nnx.GraphDef, impl: str, block_q: int, block_k: int, keep_kv: bool,
             token_rows: int | None = None, mesh: Mesh | None = None):
    """One packed pass: (log P(label) [S, labels] float32 at each score row for the row's label ids, computed
    against the whole vocabulary on the device, and the pass's (k, v) if keep_kv else None). Only the labels'
    log-probabilities leave the device, not [S, vocab] logits. `tables`: the attention's host tables, one set
    per window of the model (see Scorer._tables). `mesh`: the chips of a tensor-parallel model (core.sharding;
    None: one device): XLA partitions the program by the weights' shardings, and the attention runs on each
    chip's own heads (shard_map), on the tables every chip holds."""
    model = nnx.merge(model_def, model_state)
    c = model.config

    def one_kind(i: int, q, k, v, q_meta, kv_meta, tables):
        layer = {"scale": c.scale, "softcap": c.attn_softcap, "window": c.attention_windows[i]}
        return selection.PATHS[impl].attend(q, k, v, q_meta, kv_meta, tables, block_q, block_k, **layer)

    def on_heads(q, k, v, i: int):  # a layer's attention; i: its window's index (static: the layer loop's block)
        if mesh is None:
            return one_kind(i, q, k, v, q_meta, kv_meta, tables[i])
        heads = sharding.HEADS
        per_chip = jax.shard_map(partial(one_kind, i), mesh=mesh, in_specs=(heads, heads, heads, P(), P(), P()),
                                 out_specs=heads, check_vma=False)  # Pallas calls carry no replication types
        return per_chip(q, k, v, q_meta, kv_meta, tables[i])

    logprobs, kv = model(tokens, q_meta[2], cache_k, cache_v, n_tokens, score_rows, score_labels, n_rows, on_heads,
                         keep_kv, token_rows)
    if mesh is not None:  # the scores on every chip (any one can hand them over), each chip's share of k/v
        logprobs = jax.lax.with_sharding_constraint(logprobs, NamedSharding(mesh, P()))
        if kv is not None:
            kv = jax.lax.with_sharding_constraint(kv, NamedSharding(mesh, sharding.KV_CACHE))
    return logprobs, kv


# The prefix cache on accelerators (see Scorer.host_prefix_cache): its slices and joins are JAX operations,
# so their shapes are kept to a few (a window of a power of two rows), or every prefix length and every set of
# cached lengths would compile, and keep, a program of its own.
def _window_rows(rows: int, block: int) -> int:
    return max(block, 1 << (rows - 1).bit_length())


@partial(jax.jit, static_argnames="size")
def _rows_window(kv: jax.Array, lo: jax.Array, size: int) -> jax.Array:
    """kv[:, lo : lo + size], zeros past kv's end."""
    padded = jnp.pad(kv, ((0, 0), (0, size), (0, 0), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(padded, lo, size, axis=1)


@partial(jax.jit, donate_argnums=0)
def _place_rows(out: jax.Array, window: jax.Array, offset: jax.Array, length: jax.Array) -> jax.Array:
    """out with rows [offset, offset + length) set to window's first `length` rows (offset + length <= out's
    rows). Only a window's worth of out is rewritten: near out's end the window is moved back and rotated so
    that it does not run past it, and the rows it covers that are not the part's keep their values."""
    if window.shape[1] > out.shape[1]:  # a window of a pass longer than this cache: its part still fits
        window = window[:, : out.shape[1]]
    size = window.shape[1]
    start = jnp.minimum(offset, out.shape[1] - size)
    shift = offset - start
    rows = jnp.arange(size)[None, :, None, None]
    ours = (rows >= shift) & (rows < shift + length)
    current = jax.lax.dynamic_slice_in_dim(out, start, size, axis=1)
    merged = jnp.where(ours, jnp.roll(window, shift, axis=1), current)
    return jax.lax.dynamic_update_slice_in_dim(out, merged, start, axis=1)


class InFlightPass:
    """A launched pass (see Scorer.launch). Its results are fetched in the thread that asks for them (`result()`).
    When they were ready is the first look that found them so: the engine looks at the passes in flight at each
    launch (`Scorer._look_back`), `result()` at the latest; the device runs passes in launch order."""

    def __init__(self, scorer: "Scorer", requests: list[TokenizedRequest], arrays, handle, shape_key: tuple,
                 start: float, launched: float, host_seconds: float, previous: "InFlightPass | None",
                 compiled: bool = False) -> None:
        self._scorer, self._requests, self._arrays, self._handle = scorer, requests, arrays, handle
        self.shape_key, self._start, self._launched, self._host_seconds = shape_key, start, launched, host_seconds
        self.compiled = compiled
        self._previous = previous  # the pass launched before it (None once its own result is in)
        self._ready_at: float | None = None  # when its results were first seen ready (time.perf_counter())

    def _look(self, now: float) -> bool:
        """Whether its results are ready, without waiting (noted at `now` the first time)."""
        if self._ready_at is None and self._scorer._is_ready(self._handle):
            self._ready_at = now
        return self._ready_at is not None

    def result(self) -> PassResult:
        """Waits for the pass and returns its scores (once)."""
        logprobs = self._scorer._fetch(self._handle)
        if self._ready_at is None:
            self._ready_at = time.perf_counter()
        ready, self._handle = self._ready_at, None
        allocator.trim_after_pass()
        # The device's start on it: its launch, or the previous pass's results if it queued behind them.
        previous, self._previous = self._previous, None
        before = min(previous._ready_at, ready) if previous is not None and previous._look(ready) else None
        device_seconds = ready - (self._launched if before is None else max(self._launched, before))
        idle_seconds = 0.0 if before is None else max(self._launched - before, 0.0)
        arrays = self._arrays
        return PassResult(_collect_scores(self._requests, arrays, logprobs), arrays.real_tokens,
                          len(arrays.tokens), time.perf_counter() - self._start, self.shape_key, self._host_seconds,
                          device_seconds, idle_seconds, self.compiled)


class _Programs:
    """The compiled pass programs of this process, least recently used first. At most `limit` stay resident:
    a worker serving varied traffic must not keep every shape it ever met. An evicted program is compiled
    again when needed, or loaded from JAX's persistent compilation cache where one is set."""

    def __init__(self) -> None:
        self.resident: OrderedDict[tuple, jax.stages.Compiled] = OrderedDict()
        self.compiles = 0

    def get(self, limit: int, args: tuple, statics: dict) -> jax.stages.Compiled:
        key = (jax.tree.structure(args), tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)),
               tuple(sorted(statics.items())))
        program = self.resident.pop(key, None)
        if program is None:
            program = run_pass.lower(*args, **statics).compile()
            self.compiles += 1
        self.resident[key] = program
        if len(self.resident) > limit:
            while len(self.resident) > limit:
                self.resident.popitem(last=False)
            # JAX's own caches (traces, lowerings, executables) keep every program ever compiled: clearing
            # them is what frees an evicted one. The resident programs are held here and stay usable.
            jax.clear_caches()
        return program


_PROGRAMS = _Programs()


def program_texts() -> list[str]:
    """The compiled HLO of the pass programs this process holds (`packscore check --profile` reads op kinds)."""
    return [program.as_text() for program in _PROGRAMS.resident.values()]


class Scorer:
    """Scores (query, items, label_token_ids) with one model. See README and docs/score-semantics.md."""

    def __init__(self, config: ModelConfig, weights: dict | CausalLM, tokenizer, *, name: str, dtype: str = "float32",
                 attention: str = "auto", pass_tokens: int | None = None, block_q: int | None = None, block_k: int = 64,
                 prefix_cache_bytes: int | None = None, max_programs: int = 24, shortest_pass: int | None = None,
                 tensor_parallel: int = 1, **limits):
        """`weights`: the tree of `core.weights.stack_weights` (loaded into the model in `dtype`), or a model
        already built (in its own dtype). `max_programs`: compiled pass programs kept in memory (least recently
        used go first). `prefix_cache_bytes`: None for the default (core.prefix_cache). `shortest_pass`:
        the shortest pass length compiled (None: SHORTEST_CPU_PASS on CPU, pass_tokens/8 elsewhere). `block_q`:
        query rows per tile of the block tables (None: 128; 64 on the XLA path, which reads none of them, so
        that the ladder can reach 64 tokens). `limits`: max_items, max_tokens, max_labels, max_sequence_tokens (see
        RequestTokenizer). `tensor_parallel`: the model split over this process's first N devices (see
        core.sharding); a model that N does not split raises ValueError naming the values that work."""
        self.attention = selection.setting_for(attention, jax.default_backend())
        self.config = config
        self.model_name = name
        sharding.check(config, tensor_parallel, len(jax.devices()))
        self.tensor_parallel = tensor_parallel
        self.mesh = sharding.make_mesh(tensor_parallel) if tensor_parallel > 1 else None
        limits.setdefault("max_sequence_tokens", config.max_position_embeddings)
        self.requests = RequestTokenizer(tokenizer, config.vocab_size, model_name=name, **limits)
        self.dtype = jnp.dtype(dtypes.resolve(dtype, jax.default_backend(), dtypes.cpu_flags()))  # DTYPE=auto
        self.platform = jax.default_backend()  # "cpu", "tpu", "gpu": the device kind a worker reports
        # Larger passes amortize better on accelerators; on CPU memory traffic wins past ~4k tokens.
        self.pass_tokens = pass_tokens or (4096 if jax.default_backend() == "cpu" else 16384)
        self.block_q, self.block_k = block_q or self._path.block_q, block_k
        on_cpu = jax.default_backend() == "cpu"
        # A pass costs its padded length. On CPU a small request (a few dozen tokens) in the accelerators'
        # shortest pass (pass_tokens/8: 512 tokens) took 1 s of compute on the bundled model (2-core AVX2 host),
        # so the CPU ladder reaches down to SHORTEST_CPU_PASS: three more rungs, two programs each to warm up.
        self.shortest_pass = shortest_pass or (SHORTEST_CPU_PASS if on_cpu else None)
        self.ladder_steps = 1 if on_cpu else ACCELERATOR_STEPS_PER_OCTAVE  # rungs per octave (core.packing)
        self.token_rows = TOKEN_ROWS if on_cpu else None  # see core.model.TOKEN_ROWS
        # On CPU a pass's keys/values cost little to return (they are in host memory already), so every pass
        # returns them: one program kind fewer per pass length, and a new query coalesced with cached ones is
        # kept too. On accelerators only a pass that keeps a prefix returns them (HBM traffic and space).
        self.always_keep_kv = on_cpu
        # On CPU the prefix cache holds NumPy arrays, cut and joined by NumPy: as JAX operations, every
        # (prefix span) and every set of cached prefix lengths would compile a small program, and JAX keeps
        # them all (the engine's memory grew by about 2 MB a request on the tiny model).
        # A model split over host devices (tests) keeps its cache split as an accelerator's is.
        self.host_prefix_cache = on_cpu and self.mesh is None
        # A pass loop may launch the next pass before it waits for the one running (Scorer.launch): on an
        # accelerator that hides the host's work; on CPU the "device" is the host's own cores, so there is
        # nothing to hide, and a pass launched ahead only delays a job that arrives meanwhile by a pass.
        self.launches_ahead = not on_cpu
        if isinstance(weights, CausalLM) and self.mesh is not None:
            raise ValueError("tensor_parallel > 1 takes the weights' tree (core.weights), not a built model")
        self.model = weights if isinstance(weights, CausalLM) else load_model(config, weights, self.dtype, self.mesh)
        self.dtype = self.model.dtype  # a model passed in keeps its own
        self._model_def, self._model_state = nnx.split(self.model)
        self._replicated = NamedSharding(self.mesh, P()) if self.mesh is not None else None
        self._kv_sharding = NamedSharding(self.mesh, sharding.KV_CACHE) if self.mesh is not None else None
        if prefix_cache_bytes is None:
            stats = None if on_cpu else jax.devices()[0].memory_stats()
            # Each chip keeps its share of every entry: the cache holds N chips' room.
            per_chip = device_prefix_cache_bytes(stats, self.pass_bytes()) or 0
            prefix_cache_bytes = per_chip * tensor_parallel or PREFIX_CACHE_BYTES_CPU
        self._prefix_cache = PrefixCache(prefix_cache_bytes)
        self.max_programs = max_programs
        self._warming = False  # warm_up compiles the ladder: those compiles are not logged one by one
        self._engine_lock = threading.Lock()
        self._last_launched: InFlightPass | None = None  # the pass launched last (see InFlightPass)

    @property
    def attention_path(self) -> str:
        """The attention that runs: "xla", "dense" or "pallas-interpret" as set; for "pallas", the kernel in
        the programs compiled so far ("pallas-tpu", "pallas-mosaic-gpu", or "xla" where the kernel failed to
        compile on this device or the platform has none), or "pallas" before the first pass."""
        return selection.path_in_use(self.attention)

    @property
    def _path(self) -> selection.Path:
        """The attention path's row of the selection table (core.attention.selection)."""
        return selection.PATHS[self.attention]

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2-135m", cache_dir: str | None = None,
                        name: str | None = None, **kwargs) -> "Scorer":
        """A bundled model name ("smollm2-135m", "tiny-random"), a .gguf file or a Hugging Face directory.
        `cache_dir`: where a GGUF's converted tokenizer and weights are kept across restarts. `name`: what the
        service calls the model (an alias of MODELS); the source itself by default."""
        choose_xla_flags(kwargs.get("dtype", "float32"))
        source = ModelSource.resolve(name_or_path, cache_dir)
        if source.kind == "tiny-random":
            config, weights = TINY_CONFIG, random_weights(TINY_CONFIG, seed=0)
        elif source.kind == "gguf":
            config, weights = load_gguf(source.path, source.cached("weights"))
        else:
            config, weights = load_hf_dir(source.path)
        return cls(config, weights, source.tokenizer(), name=name or source.name, **kwargs)

    @property
    def pass_lengths(self) -> list[int]:
        """The pass lengths this engine compiles (core.packing's ladder), shortest first."""
        return ladder(self.pass_tokens, max(self.block_q, self.block_k), self.shortest_pass, self.ladder_steps)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def tokenizer(self):
        return self.requests.tokenizer

    @property
    def compiled_programs(self) -> int:
        """How many pass programs this process has compiled (or loaded from the persistent cache) so far."""
        return _PROGRAMS.compiles

    @property
    def resident_programs(self) -> int:
        """How many compiled pass programs this process holds now (at most `max_programs`)."""
        return len(_PROGRAMS.resident)

    @property
    def prefix_cache_bytes(self) -> int:
        """The prefix cache's budget in bytes."""
        return self._prefix_cache.budget

    @prefix_cache_bytes.setter
    def prefix_cache_bytes(self, budget: int) -> None:
        self._prefix_cache.budget = budget

    @property
    def cached_prefix_bytes(self) -> int:
        """Bytes of keys/values the prefix cache holds now (at most about `prefix_cache_bytes`)."""
        return self._prefix_cache.bytes

    def tokenize(self, query, items, label_token_ids, item_first: bool = False) -> TokenizedRequest:
        """Validates a request and tokenizes it as docs/score-semantics.md says; raises ScoringError."""
        return self.requests.tokenize(query, items, label_token_ids, item_first)

    # ---- passes -------------------------------------------------------------------------

    def clear_prefix_cache(self) -> None:
        with self._engine_lock:
            self._prefix_cache.clear()

    def prefix_bytes(self, tokens: int) -> int:
        """Bytes the prefix cache takes to keep a prefix of this many tokens (its keys and values, on all chips)."""
        c = self.model.config  # kv heads as stored: copied per chip where the model has fewer than chips
        rows = tokens if self.host_prefix_cache else _window_rows(tokens, self.block_k)
        return 2 * rows * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def pass_bytes(self) -> int:
        """An estimate of the device memory the largest pass takes besides the weights (pass_tokens tokens
        in one step, as on accelerators): per token, the float32 residual and its norm, q/k/v, the attention's
        output and the MLP's gate/up and hidden (one layer's at a time), every layer's keys and values out, and
        a cache input as long; and the LM head's logits for a step of rows."""
        c, T = self.model.config, self.pass_tokens
        per_token = 4 * (2 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size + 3 * c.intermediate_size)
        kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        return T * (per_token + 2 * kv) + 2 * DEVICE_HEAD_ROWS * c.vocab_size * 4

    def _remember_prefix(self, query: tuple[int, ...], kv: tuple[jax.Array, jax.Array], lo: int, hi: int,
                         needed: Collection[tuple[int, ...]]) -> None:
        """Keeps rows [lo, hi) of a pass's keys and values as the query's prefix-cache entry."""
        self._prefix_cache.keep(query, *(self._prefix_rows(part, lo, hi) for part in kv), needed)

    def iter_passes(self, requests: Sequence[TokenizedRequest], mode: str = "packed") -> Iterator[PassResult]:
        """Runs the requests in packed passes (coalesced across requests), yielding each pass's scores.

        Every item is reported exactly once. Stop iterating to cancel at a pass boundary. Threads may iterate
        at once: their passes run one at a time.
        mode "single" runs one pass per query+item sequence, sharing nothing (the baseline).
        """
        if mode not in ("packed", "single"):
            raise ScoringError("invalid_input", "mode must be 'packed' or 'single'")
        requests = list(requests)
        for plan in plan_passes(requests, self.pass_tokens, mode, self.is_cached, self._prefix_cache.seen_before):
            yield self._run_plan(requests, plan)

    def is_cached(self, prefix: tuple[int, ...]) -> bool:
        """Whether the prefix cache holds this prefix's keys/values (or a launched pass will put them there)."""
        return prefix in self._prefix_cache

    def plan_pass(self, requests: Sequence[TokenizedRequest],
                  needed: Collection[tuple[int, ...]] = ()) -> PassPlan | None:
        """The first pass the engine would run for these requests (None if they hold no item): a pass loop
        that takes new requests between passes plans one pass at a time. `needed`: the queries of requests
        whose items run in later passes too (the pass keeps them in the prefix cache, as queries seen before)."""
        self._look_back(time.perf_counter())
        plans = plan_passes(list(requests), self.pass_tokens, is_cached=self.is_cached,
                            worth_keeping=lambda query: query in needed or self._prefix_cache.seen_before(query))
        return plans[0] if plans else None

    def launch(self, requests: Sequence[TokenizedRequest], plan: PassPlan, needed: Collection[tuple[int, ...]] = (),
               planned_from: float | None = None) -> "InFlightPass":
        """Dispatches one planned pass without waiting for the device (JAX dispatches asynchronously), so
        the host can plan the next pass while this one runs; `InFlightPass.result()` waits for its scores.
        Passes run in launch order. A prefix the pass keeps counts as cached from now on. `needed`: the
        prefixes of requests under way (items of theirs still to run), evicted from the prefix cache last.
        `planned_from`: when the host began planning it (time.perf_counter()), counted in its host_seconds."""
        with self._engine_lock:  # also guards the prefix cache
            return self._launch_plan(list(requests), plan, needed, planned_from)

    def _run_plan(self, requests: list[TokenizedRequest], plan: PassPlan) -> PassResult:
        with self._engine_lock:
            launched = self._launch_plan(requests, plan)
        return launched.result()

    def _launch_plan(self, requests: list[TokenizedRequest], plan: PassPlan,
                     needed: Collection[tuple[int, ...]] = (), planned_from: float | None = None) -> "InFlightPass":
        start = time.perf_counter()
        cached = []  # held here: computing one prefix again may evict another this pass needs
        cached_lengths = []
        for seq in plan.sequences:
            if not seq.prefix_cached:
                continue
            if seq.prefix not in self._prefix_cache:  # evicted since planning (e.g. by the other lane's passes)
                self._launch_plan(requests, PassPlan([PackedSequence(seq.prefix, keep_prefix=True)]),
                                  needed).result()
            cached.append(self._prefix_cache.use(seq.prefix))
            cached_lengths.append(len(seq.prefix))
        arrays = self._build_pass(plan)
        labels = _score_labels(requests, arrays)
        keep_kv = self.always_keep_kv or any(seq.keep_prefix for seq in plan.sequences)
        compiles = _PROGRAMS.compiles
        handle, kv, shape_key = self._launch(arrays, cached, cached_lengths, labels, keep_kv)
        compiled = _PROGRAMS.compiles > compiles
        launched = time.perf_counter()
        for seq, (lo, hi) in zip(plan.sequences, arrays.prefix_spans):
            if seq.keep_prefix:
                self._remember_prefix(seq.prefix, kv, lo, hi, needed)
            elif seq.items and not seq.prefix_cached:  # a query computed, not kept: kept when it comes again
                self._prefix_cache.saw(seq.prefix)
        # A prefix evicted since planning and computed again above counts here too: the host waited for it.
        host_seconds = launched - (start if planned_from is None else planned_from)
        flight = InFlightPass(self, requests, arrays, handle, shape_key, start, launched, host_seconds,
                              self._last_launched, compiled)
        self._last_launched = flight
        # On CPU keeping a prefix waited for the pass (its keys/values are copied out): it may be ready now.
        self._look_back(time.perf_counter())
        return flight

    def _look_back(self, now: float) -> None:
        """Notes which passes in flight have their results ready at `now` (at each launch, and before each plan:
        the pass loop collects a pass only after it launched the next, which would see its end late)."""
        flight = self._last_launched
        while flight is not None and flight._ready_at is None:
            flight._look(now)
            flight = flight._previous

    def _table_width(self, tokens: int, cache_len: int, needed: int) -> int:
        """The tables' width for a pass: the widest a pass of this length can need where the path's tables are
        wide (the XLA paths loop over each query tile's own list: no compile key), else the pass's own `needed`
        (a kernel's grid spans its table: a compile key on accelerators). See core.attention.selection."""
        return (cache_len + tokens) // self.block_k if self._path.wide_tables else needed

    def _tables(self, arrays, width: int) -> tuple[tuple[np.ndarray, ...], ...]:
        """The attention's host tables for a pass, one set per window of the model (a windowed layer's skip the
        tiles outside its window): `cascade_attention`'s on the XLA path, else the block tables (the Pallas
        kernels'; the dense reference reads none), `width` wide (a window's tables list no more tiles)."""
        return tuple(self._path.tables(arrays, window, width, self.block_q, self.block_k)
                     for window in self.config.attention_windows)

    def _program(self, tokens: int, cache_len: int, score_rows: int, width: int, label_width: int,
                 keep_kv: bool) -> jax.stages.Compiled:
        c = self.model.config
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._replicated)
        cache = jax.ShapeDtypeStruct((c.num_layers, cache_len, c.num_kv_heads, c.head_dim), self.dtype,
                                     sharding=self._kv_sharding)
        shapes = self._path.table_shapes(tokens, cache_len + tokens, width, self.block_q)
        tables = tuple(i32(*shape) for shape in shapes)
        tables = (tables,) * len(c.attention_windows)
        args = (self._model_state, i32(tokens), (i32(tokens),) * 3, (i32(cache_len + tokens),) * 3, tables,
                cache, cache, i32(score_rows),
                i32(score_rows, label_width), i32(), i32())
        statics = {"model_def": self._model_def, "impl": self.attention, "block_q": self.block_q,
                   "block_k": self.block_k, "keep_kv": keep_kv, "token_rows": self.token_rows, "mesh": self.mesh}
        compiled = _PROGRAMS.compiles
        program = _PROGRAMS.get(self.max_programs, args, statics)
        if _PROGRAMS.compiles > compiled and not self._warming:
            # A new shape costs a compile (seconds on CPU) and its program's memory: operators (and
            # benchmarks/soak.py) see here which traffic brings new shapes after the warm-up.
            log.info("%s: compiled a pass program for a new shape (tokens %d, cached keys %d, table width %d, "
                     "labels %d, keys/values out %s): %d compiled in this process, %d resident", self.model_name,
                     tokens, cache_len, width, label_width, keep_kv, _PROGRAMS.compiles, len(_PROGRAMS.resident))
        return program

    def warm_up(self, on_program: Callable[[int, int], None] | None = None,
                run_seconds: float = WARM_RUN_SECONDS) -> int:
        """Compiles, or loads from JAX's persistent compilation cache, the programs of the shape ladder (see
        core.packing) for up to 8 labels: for each pass length, a pass without cached prefixes and one with
        each cache length (pass_tokens/8 and pass_tokens), on accelerators each with and without keys/values
        out; longest first and at most `max_programs` (on CPU 21 of the default 24: the whole ladder). Each is
        also run once on a pass that fills it (`core.packing.filler_plan`) while the runs fit in `run_seconds`
        (the first always runs). Returns how many; `on_program(done, total)` is called before the first and after each.
        The Pallas kernels' table width is a compile key too, one that depends on the traffic, so with
        attention "pallas" nothing is compiled ahead."""
        if not self._path.wide_tables:
            return 0
        block = max(self.block_q, self.block_k)
        short_cache, full_cache = (cache_length(n, self.pass_tokens, block) for n in (1, self.pass_tokens))
        shapes = [(T, C, keep) for T in reversed(self.pass_lengths)
                  for C in (0, short_cache, full_cache)
                  for keep in (True, False) if keep or not self.always_keep_kv][: self.max_programs]
        if on_program is not None:
            on_program(0, len(shapes))
        ran, running, last = 0, 0.0, 0.0
        with self._engine_lock:
            self._warming = True
            try:
                for done, (T, C, keep) in enumerate(shapes, 1):
                    filler = self._build_pass(filler_plan(T, C))
                    self._program(T, C, len(filler.score_rows), self._table_width(T, C, 0), MIN_LABEL_WIDTH, keep)
                    if running + last <= run_seconds:  # longest first: the next run takes no longer than the last
                        started = time.perf_counter()
                        self._run_filler(filler, keep)
                        last = time.perf_counter() - started
                        running += last
                        ran += 1
                    if on_program is not None:
                        on_program(done, len(shapes))
            finally:
                self._warming = False
        log.info("%s: warm-up ran %d of its %d programs once (%.1f s)%s", self.model_name, ran, len(shapes),
                 running, "" if ran == len(shapes) else "; the others run first in traffic")
        return len(shapes)

    def _build_pass(self, plan: PassPlan):  # type: ignore[no-untyped-def]
        """A planned pass laid out for this engine's ladder (core.packing.build_pass); on accelerators its score
        rows bucketed (core.packing.score_row_count)."""
        return build_pass(plan, self.block_q, self.block_k, self.pass_tokens, self.shortest_pass, self.ladder_steps,
                          row_buckets=self.token_rows is None)

    def _run_filler(self, arrays, keep_kv: bool) -> None:  # type: ignore[no-untyped-def]
        """Runs a pass that fills a resident program of the ladder (`arrays`: core.packing.filler_plan's, laid
        out), with the structure of traffic. A program's
        first run makes what the runtime keeps for it (XLA CPU's YNNPACK executables, of each loop and branch
        the pass's tables drive: 15-21 MB for the tiny model's ladder), which would otherwise fill a worker's
        memory a shape at a time through its first traffic; on accelerators, whatever else a first run costs."""
        labels = np.zeros((len(arrays.score_rows), MIN_LABEL_WIDTH), np.int32)
        handle, kv, _ = self._launch(arrays, [], [], labels, keep_kv)
        jax.block_until_ready((handle, kv))

    def _prefix_rows(self, keys_or_values: jax.Array, lo: int, hi: int):
        """Rows [lo, hi) of a pass's keys or values [L, T, Hkv, hd], as the prefix cache keeps them: exactly
        those rows on the host; on accelerators a window of `_window_rows(hi - lo)` rows from lo (the rest
        is never read), so slicing compiles one small program per (pass length, window) only."""
        if self.host_prefix_cache:
            return np.asarray(keys_or_values)[:, lo:hi].copy()
        return _rows_window(keys_or_values, lo, _window_rows(hi - lo, self.block_k))

    def _cache_input(self, parts: list, lengths: list[int], cache_len: int):
        """The cached prefixes' keys (or values), the first `lengths` rows of each `parts` entry one after
        another, zeros after them: [L, cache_len, Hkv, hd]."""
        c = self.model.config
        shape = (c.num_layers, cache_len, c.num_kv_heads, c.head_dim)
        if self.host_prefix_cache:
            out = np.zeros(shape, self.dtype)
            if parts:
                out[:, : sum(lengths)] = np.concatenate(parts, axis=1)
            return out
        out = jnp.zeros(shape, self.dtype, device=self._kv_sharding)
        for part, offset, length in zip(parts, np.cumsum([0, *lengths]), lengths):
            out = _place_rows(out, part, jnp.int32(offset), jnp.int32(length))
        return out if self.mesh is None else jax.device_put(out, self._kv_sharding)  # as the program takes it

    def _launch(self, arrays, cached: list[tuple], cached_lengths: list[int], labels: np.ndarray, keep_kv: bool):
        """Dispatches a pass to the device without waiting for it (JAX dispatches asynchronously): returns
        (its log-probabilities as a device handle for `_fetch`, its keys/values, its shape key)."""
        T, C, S = len(arrays.tokens), arrays.cache_len, len(arrays.score_rows)
        cache_k, cache_v = (self._cache_input([kv[i] for kv in cached], cached_lengths, C) for i in (0, 1))
        width = self._table_width(T, C, arrays.tile_ids.shape[1])
        meta = lambda m: (m.seq, m.item, m.pos)
        shape_key = (T, C, S, width, labels.shape[1], keep_kv)
        program = self._program(*shape_key)
        inputs = (arrays.tokens, meta(arrays.q_meta), meta(arrays.kv_meta), self._tables(arrays, width))
        counts = (arrays.score_rows, labels, np.int32(arrays.n_rows), np.int32(arrays.real_tokens))
        # device_put, not jnp.asarray: JAX compiles (and keeps, with an MLIR context of its own) a small program
        # for each shape jnp.asarray lifts, MBs of a worker's memory per new pass shape.
        # On a mesh every chip gets the pass's tokens and tables.
        (tokens, q_meta, kv_meta, tables), counts = jax.device_put((inputs, counts), self._replicated)
        logprobs, kv = program(self._model_state, tokens, q_meta, kv_meta, tables, cache_k, cache_v, *counts)
        return logprobs, kv, shape_key

    def _fetch(self, handle) -> np.ndarray:  # type: ignore[no-untyped-def]
        """Waits for a launched pass's log-probabilities and copies them to the host."""
        return np.asarray(handle)

    def _is_ready(self, handle) -> bool:  # type: ignore[no-untyped-def]
        """Whether a launched pass's log-probabilities are ready, without waiting."""
        return handle.is_ready()

    # ---- one-request convenience API --------------------------------------------------

    def logprobs(self, query, items, label_token_ids, item_first: bool = False, mode: str = "packed") -> np.ndarray:
        """log P(label | sequence) per item: [len(items), len(label_token_ids)] float64."""
        return self.logprobs_of([self.tokenize(query, items, label_token_ids, item_first)], mode)[0]

    def logprobs_of(self, requests: Sequence[TokenizedRequest], mode: str = "packed") -> list[np.ndarray]:
        """`logprobs` of several requests, packed into passes together (as a worker coalesces them)."""
        out = [np.full((r.n_items, len(r.label_token_ids)), np.nan) for r in requests]
        for result in self.iter_passes(requests, mode):
            for part in result.scores:
                out[part.request][part.items] = part.logprobs
        return out

    def score(self, query, items, label_token_ids, apply_softmax: bool = False, item_first: bool = False,
              mode: str = "packed") -> list[list[float]]:
        """Scores as the reference engines' Score API returns them (see docs/score-semantics.md)."""
        lp = self.logprobs(query, items, label_token_ids, item_first, mode)
        return scores_from_logprobs(lp, apply_softmax).tolist()

