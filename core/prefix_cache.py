"""The prefix cache: the keys and values of queries that passes computed, kept for the passes after them.

A query-first request's query runs once; its items, in this pass or later ones, read its keys and values from
here (core.packing plans a cached query as `prefix_cached`). `PrefixCache` owns the entries, their byte budget
and the eviction; `PrefixNeeds` is the pass loop's side of it: the queries that requests under way still need,
and whether the cache can keep one more beside them. Neither holds a lock or touches a device: the engine
(core.scorer) guards the cache with its own lock and cuts the rows it keeps.
"""

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

Prefix = tuple[int, ...]  # a query's token ids
Entry = tuple[Any, Any]  # its (keys, values) [layers, rows, kv_heads, head_dim]: NumPy on the host, else JAX arrays

# The cache's size when none is given: fixed on CPU (host memory; the cache is NumPy there); on an
# accelerator, this share of the device memory left once the weights are loaded and the largest pass has room
# (the rest is headroom for XLA's own buffers and the estimate's error). A fixed 256 MiB there filled with a
# few 4,000-token queries: jobs whose items span passes then waited for one another and passes ran under-filled.
PREFIX_CACHE_BYTES_CPU = 256 << 20
PREFIX_CACHE_SHARE = 0.5
# How many queries computed but not kept the cache remembers (their hashes): a query goes in when a pass
# computes it a second time, so queries that come once (most, in ranking traffic) take neither memory nor a copy
# out of the pass; a query that comes back is computed once more, then read from the cache (with unique queries
# the cache would otherwise grow by megabytes an hour, none of it ever read).
SIGHTINGS = 4096


def device_prefix_cache_bytes(memory_stats: dict | None, pass_bytes: int) -> int | None:
    """PREFIX_CACHE_SHARE of a device's memory left after what is in use (the weights) and `pass_bytes`, from
    `jax.Device.memory_stats()`; None where the device reports no limit (the CPU)."""
    if not memory_stats or not memory_stats.get("bytes_limit"):
        return None
    free = memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0) - pass_bytes
    return max(int(free * PREFIX_CACHE_SHARE), 0)


def _entry_bytes(entry: Entry) -> int:
    return entry[0].nbytes + entry[1].nbytes


class PrefixCache(Mapping[Prefix, Entry]):
    """Prefix -> (keys, values), least recently used first, about `budget` bytes at most (one entry always
    stays, however large)."""

    def __init__(self, budget: int, sightings: int = SIGHTINGS) -> None:
        self.budget = budget
        self.bytes = 0  # kept as entries come and go: summing them per pass cost O(entries)
        self._entries: OrderedDict[Prefix, Entry] = OrderedDict()
        self._sightings, self._seen = sightings, OrderedDict[int, None]()  # hashes: a query may be long

    def seen_before(self, prefix: Prefix) -> bool:
        """Whether a pass computed this prefix lately without keeping it (see SIGHTINGS)."""
        return hash(prefix) in self._seen

    def saw(self, prefix: Prefix) -> None:
        """A pass computed this prefix and did not keep it."""
        key = hash(prefix)  # a query of thousands of tokens: hashed once
        self._seen[key] = None
        self._seen.move_to_end(key)
        if len(self._seen) > self._sightings:
            self._seen.popitem(last=False)

    def __getitem__(self, prefix: Prefix) -> Entry:
        return self._entries[prefix]

    def __iter__(self) -> Iterator[Prefix]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, prefix: Prefix) -> Entry:
        """The prefix's entry, now the most recently used."""
        self._entries.move_to_end(prefix)
        return self._entries[prefix]

    def pop(self, prefix: Prefix) -> Entry:
        entry = self._entries.pop(prefix)
        self.bytes -= _entry_bytes(entry)
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._seen.clear()
        self.bytes = 0

    def keep(self, prefix: Prefix, keys: Any, values: Any, needed: Collection[Prefix] = ()) -> None:
        """Adds (or replaces) the prefix's entry, then evicts down to the budget: least recently used first, but
        the prefixes that requests under way still need (`needed`) only when nothing else is left: evicted,
        such a prefix is computed again for the request's next items."""
        if prefix in self._entries:
            self.pop(prefix)
        self._seen.pop(hash(prefix), None)
        self._entries[prefix] = (keys, values)
        self.bytes += _entry_bytes((keys, values))
        if self.bytes <= self.budget:
            return
        # Least recently used first within each group; the walk stops as soon as enough is freed (a full cache
        # evicts one or two entries per prefix it keeps: sorting all its entries each time was most of the cost).
        excess, evicted = self.bytes - self.budget, []
        for evict_needed in (False, True):
            for old, entry in self._entries.items():
                if excess <= 0:
                    break
                if old != prefix and (old in needed) == evict_needed:
                    evicted.append(old)
                    excess -= _entry_bytes(entry)
        for old in evicted:
            self.pop(old)


class PrefixNeeds:
    """The queries that requests under way (some items run, some not) still need: their next items run against
    them, so the cache evicts them last (`PrefixCache.keep`'s `needed`). A request whose items span passes
    starts only when the cache can keep its query beside these (`may_add`); else it would find its query
    evicted by the time its next items run, and compute it again, maybe every pass.

    `entry_bytes(tokens)`: what the cache takes to keep a query of that many tokens; `budget`: the cache's."""

    def __init__(self, entry_bytes: Callable[[int], int], budget: int) -> None:
        self._entry_bytes, self._budget = entry_bytes, budget
        self._owners: dict[Prefix, set[str]] = {}  # query -> the requests under way that need it

    def __contains__(self, query: Prefix) -> bool:
        return query in self._owners

    @property
    def queries(self) -> set[Prefix]:
        return set(self._owners)

    def add(self, query: Prefix, owner: str) -> None:
        self._owners.setdefault(query, set()).add(owner)

    def release(self, query: Prefix, owner: str) -> None:
        """The owner needs the query no more (its last items are in this pass)."""
        owners = self._owners.get(query, set())
        owners.discard(owner)
        if not owners:
            self._owners.pop(query, None)

    def may_add(self, query: Prefix) -> bool:
        """Whether the cache holds this query beside those needed now (one query always goes in)."""
        queries = {*self._owners, query}
        needs = sum(self._entry_bytes(len(q)) for q in queries)
        return len(queries) <= 1 or needs <= self._budget
