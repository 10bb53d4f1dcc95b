"""Host side of packed scoring: which tokens go into which pass, and the padded arrays.

A pass holds sequences laid out back to back. A sequence is a shared prefix (a query,
or for item_first requests a whole item+query sequence) followed by its items; see
core.attention for the mask this layout is read with. Query-first requests with the same
query share one sequence. A prefix's keys/values can be kept in a cache and read by later
passes: a request too large for one pass is split into a prefix pass and chunks of its
items against that cache, and a query seen recently is not recomputed.

All shapes are rounded up to buckets so the item count never becomes a compile key.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from core.attention import KEY_PAD_SEQ, QUERY_PAD_SEQ, TokenMeta, block_tables, pad_tables
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
        own = 0 if self.prefix_cached else len(self.prefix)
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
                is_cached: Callable[[tuple[int, ...]], bool] = lambda query: False) -> list[PassPlan]:
    """Groups the requests' sequences into passes of at most `pass_tokens` new tokens.

    Query-first requests sharing a query become one sequence. A query found by `is_cached`
    is not recomputed; a sequence too large for one pass gets a prefix pass that keeps its
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
            group.keep_prefix = True
            sequences.append(group)
            continue
        chunks = [PackedSequence(group.prefix, True, items=c) for c in _split_items(group.items, pass_tokens)]
        if not cached:
            ordered.append(PackedSequence(group.prefix, keep_prefix=True, scored_at_prefix_end=group.scored_at_prefix_end))
        elif chunks:
            chunks[0].scored_at_prefix_end = group.scored_at_prefix_end
        else:
            chunks = [PackedSequence(group.prefix, True, scored_at_prefix_end=group.scored_at_prefix_end)]
        sequences.extend(chunks)

    plans: list[PassPlan] = [PassPlan([seq]) for seq in ordered]
    current: list[PackedSequence] = []
    for seq in sequences:
        plan = PassPlan(current + [seq])
        if current and (plan.new_tokens > pass_tokens or plan.cached_tokens > pass_tokens):
            plans.append(PassPlan(current))
            current = []
        current.append(seq)
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
    score_rows: np.ndarray  # [S]
    owners: list[tuple[int, int]]  # (request, item) of each real score row, in order
    cache_len: int  # C (bucketed), 0 without cached prefixes
    prefix_spans: list[tuple[int, int]]  # per sequence: [start, end) of its prefix among this pass's tokens

    @property
    def real_tokens(self) -> int:
        return int((self.q_meta.seq >= 0).sum())

    @property
    def shape_key(self) -> tuple:
        """The padded shapes that select a compiled program."""
        return len(self.tokens), self.cache_len, len(self.score_rows), self.tile_ids.shape[1]


def build_pass(plan: PassPlan, block_q: int, block_k: int) -> PassArrays:
    """Lays out a planned pass: cached prefixes (keys only) first, then each sequence's new tokens."""
    tokens: list[int] = []
    seq_ids: list[int] = []
    item_ids: list[int] = []
    positions: list[int] = []
    score_rows: list[int] = []
    owners: list[tuple[int, int]] = []
    prefix_spans: list[tuple[int, int]] = []
    cache_seq: list[int] = []
    cache_pos: list[int] = []
    hidden_keys: list[int] = []

    for seq_id, seq in enumerate(plan.sequences):
        start = len(tokens)
        if seq.prefix_cached:
            cache_seq.extend([seq_id] * len(seq.prefix))
            cache_pos.extend(range(len(seq.prefix)))
        else:
            tokens.extend(seq.prefix)
            seq_ids.extend([seq_id] * len(seq.prefix))
            item_ids.extend([-1] * len(seq.prefix))
            positions.extend(range(len(seq.prefix)))
        prefix_spans.append((start, len(tokens)))
        for owner in seq.scored_at_prefix_end:
            # An empty item scores the query alone. With the prefix cached, the query's last token is
            # run again as a query row that sees the cached prefix (itself included); its key is
            # hidden from everyone, as the cache already holds it.
            if seq.prefix_cached:
                tokens.append(seq.prefix[-1])
                seq_ids.append(seq_id)
                item_ids.append(-1)
                positions.append(len(seq.prefix) - 1)
                hidden_keys.append(len(tokens) - 1)
            score_rows.append(len(tokens) - 1)
            owners.append(owner)
        # Item ids number the sequence's items (requests sharing a query share a sequence).
        for item_id, (r, item, toks) in enumerate(seq.items):
            tokens.extend(toks)
            seq_ids.extend([seq_id] * len(toks))
            item_ids.extend([item_id] * len(toks))
            positions.extend(range(len(seq.prefix), len(seq.prefix) + len(toks)))
            score_rows.append(len(tokens) - 1)
            owners.append((r, item))

    block = max(block_q, block_k)  # both tile sizes must divide T and C
    T = -(-round_up_bucket(len(tokens), block) // block) * block
    C = -(-round_up_bucket(len(cache_seq), block) // block) * block if cache_seq else 0
    # Score rows take one of three sizes per token bucket (each shape is a compiled program, tens of MB
    # on CPU): the LM head on up to 16x spare rows costs little next to the pass itself.
    S = next(size for size in (max(8, T // 16), max(8, T // 4), T) if size >= len(score_rows))

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
        score_rows=padded(score_rows, S, 0),
        owners=owners,
        cache_len=C,
        prefix_spans=prefix_spans,
    )
