"""Host side of packed scoring: which tokens go into which pass, and the padded arrays.

A pass holds sequences laid out back to back. A sequence is a shared prefix (a query,
or for item_first requests a whole item+query sequence) followed by its items; see
core.attention for the mask this layout is read with. Query-first requests with the same
query share one sequence. A prefix's keys/values can be kept in a cache and read by later
passes: a request too large for one pass is split into a prefix pass and chunks of its
items against that cache, and a query seen recently is not recomputed.

Shapes come from a short fixed ladder (`pass_length`): a pass of T tokens, T one of
pass_tokens, /2, /4, ... down to the shortest pass (pass_tokens/8 unless the engine says otherwise: on CPU 64
tokens, so a small request pays for about its own tokens; larger only for one sequence longer than a pass);
on accelerators with ACCELERATOR_STEPS_PER_OCTAVE rungs per power of two from FINE_RUNGS_FROM tokens up,
offers T score rows (the LM head runs on the rows in use only), and reads a cache of 0, pass_tokens/8 or
pass_tokens keys (more only after such a long sequence). The item count, the query length
and the label count never become compile keys.
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from core.attention.rule import KEY_PAD_SEQ, QUERY_PAD_SEQ, TokenMeta
from core.attention.host_tables import block_tables, pad_tables
from core.requests import TokenizedRequest


@dataclass
class PackedSequence:
    """One attention sequence of a pass: a prefix, then items that each see the prefix and themselves.

    Query-first requests with the same query share one sequence (and so one prefix computation).
    """

    prefix: tuple[int, ...]  # tokens at positions 0..len-1
    prefix_cached: bool = False  # the prefix's keys/values come from the prefix cache, not this pass
    keep_prefix: bool = False  # store the prefix's keys/values in the prefix cache after this pass
    items: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (request, item, tokens)
    scored_at_prefix_end: list[tuple[int, int]] = field(default_factory=list)  # (request, item) of empty items

    @property
    def new_tokens(self) -> int:
        # With the prefix cached, its last token runs again once per request with empty items (see build_pass).
        own = len({r for r, _ in self.scored_at_prefix_end}) if self.prefix_cached else len(self.prefix)
        return own + sum(len(t) for _, _, t in self.items)


@dataclass
class PassPlan:
    sequences: list[PackedSequence]

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.sequences)

    @property
    def cached_tokens(self) -> int:
        return sum(len(s.prefix) for s in self.sequences if s.prefix_cached)


def round_up_bucket(n: int, minimum: int, steps_per_octave: int = 4) -> int:
    """Smallest bucket >= n: `steps_per_octave` sizes per power of two, at least `minimum`."""
    if n <= minimum:
        return minimum
    octave = 2 ** (math.ceil(math.log2(n)) - 1)
    step = max(octave // steps_per_octave, 1)
    return -(-n // step) * step


# An accelerator's pass costs its padded length in every projection and MLP matmul: on the halving ladder the
# contract's 12,000 tokens ran as 16,384 (27% of those FLOPs on padding). Rungs a quarter of an octave apart from
# 4,096 tokens up pad a pass by at most 20% (the contract's: 12,288, 2%), for 10 rungs instead of 4 at 16,384:
# each rung's programs compile when first met (the Pallas path warms none ahead; see docs/performance.md).
ACCELERATOR_STEPS_PER_OCTAVE = 4
FINE_RUNGS_FROM = 4096


# The fewest score rows of an accelerator's pass (score_row_count): a smaller bucket saves little of the LM
# head, whose every step reads all of its weights.
MIN_SCORE_ROWS = 64


def ladder(pass_tokens: int, block: int, shortest: int | None = None, steps_per_octave: int = 1) -> list[int]:
    """The pass lengths a worker compiles: pass_tokens halved down to `shortest` (None: pass_tokens/8), as
    multiples of `block`; with `steps_per_octave` > 1, each octave from FINE_RUNGS_FROM tokens up has that many
    rungs evenly spaced."""
    shortest = max(shortest or pass_tokens >> 3, block)
    rungs, T = set(), pass_tokens
    while True:
        rungs.add(-(-max(T, shortest) // block) * block)
        if T <= shortest:
            return sorted(rungs)
        if T // 2 >= FINE_RUNGS_FROM:
            step = T // 2 / steps_per_octave
            rungs.update(-(-int(T // 2 + i * step) // block) * block for i in range(1, steps_per_octave))
        T >>= 1


def pass_length(tokens: int, rows: int, pass_tokens: int, block: int, shortest: int | None = None,
                steps_per_octave: int = 1) -> int:
    """T for a pass of `tokens` tokens and `rows` score rows: the smallest rung with room for both; past
    pass_tokens (one sequence longer than a pass), pass_tokens doubled as often as needed. Rows exceed tokens
    only when many requests share a short query and score it with empty items."""
    fits = lambda T: T >= max(tokens, rows)
    T = next((T for T in ladder(pass_tokens, block, shortest, steps_per_octave) if fits(T)), None)
    if T is None:
        T = ladder(pass_tokens, block)[-1]
        while not fits(T):
            T *= 2
    return T


def cache_length(cached: int, pass_tokens: int, block: int) -> int:
    """C for a pass reading `cached` keys of cached prefixes: 0; the ladder's shortest rung where they fit in
    it (a query or two: the common case); else pass_tokens (doubled past that). Each layer copies the whole
    cache input: a 500-token query read as 4,096 keys cost a request of 400 items 7% of its time."""
    if not cached:
        return 0
    rungs = ladder(pass_tokens, block)
    return rungs[0] if cached <= rungs[0] else max(pass_length(cached, 0, pass_tokens, block), rungs[-1])


def filler_plan(tokens: int, cached: int) -> PassPlan:
    """A pass of exactly `tokens` new tokens and `cached` keys of a cached prefix, laid out as traffic is: a
    cached query with items (when `cached`), a query computed in the pass, items of several lengths. The
    warm-up runs one per program of the ladder, so that its loops and branches all run once (`tokens` and
    `cached` must be rungs: `pass_length` and `cache_length` give them back)."""
    token = (1,)
    sequences = [PackedSequence(token * cached, prefix_cached=True)] if cached else []
    sequences.append(PackedSequence(token * max(1, tokens // 4)))
    left = tokens - sequences[-1].new_tokens
    lengths = itertools.cycle((1, 7, 30, 120))
    while left:
        seq = sequences[left % len(sequences)]  # both sequences get items
        n = min(next(lengths), left)
        seq.items.append((0, len(seq.items), token * n))
        left -= n
    return PassPlan(sequences)


def _split_items(items: list, budget: int) -> list[list]:
    """Consecutive chunks of (request, item, tokens) of at most `budget` tokens (at least one item each)."""
    chunks: list[list] = [[]]
    used = 0
    for entry in items:
        if chunks[-1] and used + len(entry[2]) > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(entry)
        used += len(entry[2])
    return [c for c in chunks if c]


def plan_passes(requests: list[TokenizedRequest], pass_tokens: int, mode: str = "packed",
                is_cached: Callable[[tuple[int, ...]], bool] = lambda query: False,
                worth_keeping: Callable[[tuple[int, ...]], bool] = lambda query: True) -> list[PassPlan]:
    """Groups the requests' sequences into passes of at most `pass_tokens` new tokens.

    Query-first requests sharing a query become one sequence. A query found by `is_cached`
    is not recomputed; one that fits in a pass is kept in the prefix cache if `worth_keeping`
    says so; a sequence too large for one pass gets a prefix pass that keeps its
    keys/values, then chunks of its items against them. A single sequence longer than
    `pass_tokens` runs alone in a pass of its own size. mode "single" is the unshared
    baseline: one pass per query+item sequence, no cache.
    """
    sequences: list[PackedSequence] = []
    groups: dict[tuple[int, ...], PackedSequence] = {}
    for r, req in enumerate(requests):
        if not req.items:
            continue
        if req.item_first or mode == "single":
            for i, item in enumerate(req.items):
                tokens = item + req.query if req.item_first else req.query + item
                sequences.append(PackedSequence(tokens, scored_at_prefix_end=[(r, i)]))
            continue
        group = groups.get(req.query)
        if group is None:
            group = groups[req.query] = PackedSequence(req.query)
        for i, item in enumerate(req.items):
            if item:
                group.items.append((r, i, item))
            else:
                group.scored_at_prefix_end.append((r, i))

    if mode == "single":
        return [PassPlan([seq]) for seq in sequences]

    ordered: list[PackedSequence] = []  # prefix passes first, so a chunk's cache exists when it runs
    for group in groups.values():
        cached = is_cached(group.prefix)
        if not cached and group.new_tokens <= pass_tokens:
            group.keep_prefix = worth_keeping(group.prefix)
            sequences.append(group)
            continue
        # The first chunk also re-runs the query's last token once per request with empty items (build_pass).
        rerun = len({r for r, _ in group.scored_at_prefix_end})
        chunks = [PackedSequence(group.prefix, True, items=c)
                  for c in _split_items(group.items, max(pass_tokens - rerun, 1))]
        if not cached:
            ordered.append(PackedSequence(group.prefix, keep_prefix=True,
                                          scored_at_prefix_end=group.scored_at_prefix_end))
        elif chunks:
            chunks[0].scored_at_prefix_end = group.scored_at_prefix_end
        else:
            chunks = [PackedSequence(group.prefix, True, scored_at_prefix_end=group.scored_at_prefix_end)]
        sequences.extend(chunks)

    plans: list[PassPlan] = [PassPlan([seq]) for seq in ordered]
    current: list[PackedSequence] = []
    new = cached = 0  # the current pass's new and cached tokens, kept as it grows (not summed per sequence)
    for seq in sequences:
        seq_new, seq_cached = seq.new_tokens, len(seq.prefix) if seq.prefix_cached else 0
        if current and (new + seq_new > pass_tokens or cached + seq_cached > pass_tokens):
            plans.append(PassPlan(current))
            current, new, cached = [], 0, 0
        current.append(seq)
        new, cached = new + seq_new, cached + seq_cached
    if current:
        plans.append(PassPlan(current))
    return plans


@dataclass
class PassArrays:
    """Padded inputs of one pass (NumPy, int32) and where its scores go."""

    tokens: np.ndarray  # [T]
    q_meta: TokenMeta  # [T]
    kv_meta: TokenMeta  # [C + T]: the cached prefixes first, then this pass's tokens
    tile_ids: np.ndarray  # [T / block_q, width]
    tile_counts: np.ndarray  # [T / block_q]
    score_rows: np.ndarray  # [T] (accelerators: score_row_count's): each score row's token, the n_rows in use first
    n_rows: int
    owners: list[tuple[int, int]]  # (request, item) of every item the pass scores
    owner_rows: np.ndarray  # [len(owners)]: each owner's score row (a request's empty items share one)
    cache_len: int  # C, 0 without cached prefixes
    prefix_spans: list[tuple[int, int]]  # per sequence: [start, end) of its prefix among this pass's tokens

    @property
    def real_tokens(self) -> int:
        return int((self.q_meta.seq >= 0).sum())



def _expand_runs(lengths: list[int], *per_run: list[int]) -> tuple[np.ndarray, ...]:
    """Per-token int32 arrays from per-run values: each run's value repeated over its tokens; the last of
    `per_run` is the run's first position, counted up along the run."""
    counts = np.asarray(lengths, np.int64)
    *values, first = (np.repeat(np.asarray(v, np.int64), counts) for v in per_run)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return (*(v.astype(np.int32) for v in values), (first + np.arange(len(first)) - starts).astype(np.int32))


def score_row_count(rows: int, tokens: int) -> int:
    """Score rows an accelerator's program has for a pass of `tokens` tokens and `rows` rows in use: a power of
    two, MIN_SCORE_ROWS at least, `tokens` at most (a compile key there). Its LM head runs on every one of them,
    so that no loop's trip count depends on the pass's data (see core.model.CausalLM.label_logprobs); a pass
    offering a row per token would run the head on every token."""
    return min(tokens, max(MIN_SCORE_ROWS, 1 << (rows - 1).bit_length()))


def build_pass(plan: PassPlan, block_q: int, block_k: int, pass_tokens: int | None = None,
               shortest: int | None = None, steps_per_octave: int = 1, row_buckets: bool = False) -> PassArrays:
    """Lays out a planned pass: cached prefixes (keys only) first, then each sequence's new tokens.

    Its length T, score rows and cache length C come from the ladder of `pass_tokens` down to `shortest`, with
    `steps_per_octave` (see `ladder` and `pass_length`; None: the ladder whose top is this pass's length rounded up
    to a power of two). The tables are as wide as
    the widest query tile needs, rounded up to 2 sizes per octave (the XLA path widens them further). Score rows:
    one per token (CPU), or with `row_buckets` `score_row_count`'s (accelerators).
    """
    # The layout is built as runs of tokens (a prefix, an item, a re-run query token), in Python per run, and
    # expanded to per-token arrays with NumPy: Python per token was most of a worker's host time per pass.
    runs: list[tuple[int, ...]] = []
    run_seq: list[int] = []
    run_item: list[int] = []  # the item id within its sequence, -1 for prefix tokens
    run_pos: list[int] = []  # the position of the run's first token
    cached: list[tuple[int, int]] = []  # (sequence, prefix length) of prefixes read from the cache
    score_rows: list[int] = []
    owners: list[tuple[int, int]] = []
    owner_rows: list[int] = []
    prefix_spans: list[tuple[int, int]] = []
    hidden_keys: list[int] = []
    n = 0  # tokens laid out so far

    def add(run: tuple[int, ...], seq_id: int, item_id: int, pos: int) -> None:
        nonlocal n
        runs.append(run)
        run_seq.append(seq_id)
        run_item.append(item_id)
        run_pos.append(pos)
        n += len(run)

    for seq_id, seq in enumerate(plan.sequences):
        start = n
        if seq.prefix_cached:
            cached.append((seq_id, len(seq.prefix)))
        else:
            add(seq.prefix, seq_id, -1, 0)
        prefix_spans.append((start, n))
        request_rows: dict[int, int] = {}  # a request's empty items share one row (its labels are the same)
        for r, item in seq.scored_at_prefix_end:
            # An empty item scores the query alone. With the prefix cached, the query's last token is
            # run again as a query row that sees the cached prefix (itself included); its key is
            # hidden from everyone, as the cache already holds it.
            if r not in request_rows:
                if seq.prefix_cached:
                    add(seq.prefix[-1:], seq_id, -1, len(seq.prefix) - 1)
                    hidden_keys.append(n - 1)
                request_rows[r] = len(score_rows)
                score_rows.append(n - 1)
            owners.append((r, item))
            owner_rows.append(request_rows[r])
        # Item ids number the sequence's items (requests sharing a query share a sequence).
        for item_id, (r, item, toks) in enumerate(seq.items):
            add(toks, seq_id, item_id, len(seq.prefix))
            owners.append((r, item))
            owner_rows.append(len(score_rows))
            score_rows.append(n - 1)

    tokens = np.fromiter(itertools.chain.from_iterable(runs), np.int32, count=n)
    seq_ids, item_ids, positions = _expand_runs([len(run) for run in runs], run_seq, run_item, run_pos)
    cache_seq, _, cache_pos = _expand_runs([length for _, length in cached], [s for s, _ in cached],
                                           [0] * len(cached), [0] * len(cached))

    block = max(block_q, block_k)  # both tile sizes must divide T and C
    pass_tokens = pass_tokens or 1 << (max(n, block) - 1).bit_length()
    T = pass_length(n, len(score_rows), pass_tokens, block, shortest, steps_per_octave)
    C = cache_length(len(cache_seq), pass_tokens, block)

    def padded(values, length, fill):
        out = np.full(length, fill, np.int32)
        out[: len(values)] = values
        return out

    q_meta = TokenMeta(padded(seq_ids, T, QUERY_PAD_SEQ), padded(item_ids, T, -1), padded(positions, T, 0))
    new_key_seq = padded(seq_ids, T, KEY_PAD_SEQ)
    new_key_seq[hidden_keys] = KEY_PAD_SEQ
    kv_meta = TokenMeta(
        np.concatenate([padded(cache_seq, C, KEY_PAD_SEQ), new_key_seq]),
        np.concatenate([np.full(C, -1, np.int32), q_meta.item]),
        np.concatenate([padded(cache_pos, C, 0), q_meta.pos]),
    )
    ids, counts = block_tables(q_meta, kv_meta, block_q, block_k)
    width = round_up_bucket(ids.shape[1], 1, steps_per_octave=2)
    return PassArrays(
        tokens=padded(tokens, T, 0),
        q_meta=q_meta,
        kv_meta=kv_meta,
        tile_ids=pad_tables(ids, width),
        tile_counts=counts,
        score_rows=padded(score_rows, score_row_count(len(score_rows), T) if row_buckets else T, 0),
        n_rows=len(score_rows),
        owners=owners,
        owner_rows=np.asarray(owner_rows, np.int32),
        cache_len=C,
        prefix_spans=prefix_spans,
    )
