"""core/prefix_cache.py alone: no engine, no device (the entries are NumPy arrays of known sizes)."""

import numpy as np

from core.prefix_cache import PrefixCache, PrefixNeeds


def rows(n_bytes: int) -> np.ndarray:
    return np.zeros(n_bytes, np.uint8)


def test_the_cache_counts_its_bytes_and_evicts_least_recently_used_first() -> None:
    cache = PrefixCache(budget=300)
    for prefix in ((1,), (2,), (3,)):
        cache.keep(prefix, rows(50), rows(50))
    assert cache.bytes == 300 and list(cache) == [(1,), (2,), (3,)]
    cache.use((1,))  # now the most recently used
    cache.keep((4,), rows(50), rows(50))
    assert list(cache) == [(3,), (1,), (4,)] and cache.bytes == 300
    cache.keep((3,), rows(10), rows(10))  # replaced: its old bytes no longer count
    assert cache.bytes == 220 and (3,) in cache
    keys, values = cache.pop((1,))
    assert keys.nbytes == values.nbytes == 50 and cache.bytes == 120 and (1,) not in cache
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


def test_prefixes_still_needed_go_last_and_one_entry_always_stays() -> None:
    cache = PrefixCache(budget=200)
    cache.keep((1,), rows(50), rows(50))
    cache.keep((2,), rows(50), rows(50))
    cache.keep((3,), rows(50), rows(50), needed={(1,)})
    assert list(cache) == [(1,), (3,)]
    cache.keep((4,), rows(50), rows(50), needed={(1,), (3,)})  # only needed ones are left: the oldest goes
    assert list(cache) == [(3,), (4,)]
    cache.keep((5,), rows(500), rows(500))  # larger than the budget: kept alone
    assert list(cache) == [(5,)] and cache.bytes == 1000


def test_needs_track_owners_and_admit_a_query_only_where_the_cache_keeps_it() -> None:
    needs = PrefixNeeds(lambda tokens: 100 * tokens, budget=1000)
    assert needs.may_add((1,) * 50)  # one query always goes in, however long
    needs.add((1,) * 4, "job-a")
    needs.add((1,) * 4, "job-b")  # two requests of one query
    assert needs.may_add((2,) * 6) and not needs.may_add((2,) * 7)  # 400 + 600 bytes fit, 400 + 700 do not
    needs.release((1,) * 4, "job-a")
    assert (1,) * 4 in needs  # job-b still needs it
    needs.release((1,) * 4, "job-b")
    assert needs.queries == set() and needs.may_add((2,) * 7)


def test_a_query_is_worth_keeping_once_seen_and_only_the_latest_sightings_count() -> None:
    cache = PrefixCache(budget=300, sightings=2)
    assert not cache.seen_before((1, 2))
    cache.saw((1, 2))
    assert cache.seen_before((1, 2)) and not cache.seen_before((2, 1))
    cache.keep((1, 2), rows(50), rows(50))  # kept: no longer a sighting
    cache.saw((3,))
    cache.saw((4,))
    cache.saw((3,))  # seen again: now the latest
    cache.saw((5,))  # past the limit: the oldest sighting, (4,), is forgotten
    assert [cache.seen_before(p) for p in ((1, 2), (3,), (4,), (5,))] == [False, True, False, True]
    cache.clear()
    assert not cache.seen_before((3,))


def test_plans_keep_a_query_that_fits_a_pass_only_where_worth_keeping() -> None:
    from core.packing import plan_passes
    from core.requests import TokenizedRequest

    once, again = (TokenizedRequest((n,) * 8, ((7, 8),), (4,), False) for n in (1, 2))
    long = TokenizedRequest((3,) * 8, tuple((7, 8) for _ in range(40)), (4,), False)  # 88 tokens: two passes
    plans = plan_passes([once, again, long], 64, worth_keeping=lambda query: query == again.query)
    kept = {seq.prefix: seq.keep_prefix for plan in plans for seq in plan.sequences if not seq.prefix_cached}
    assert kept == {once.query: False, again.query: True, long.query: True}  # the long one's chunks read it
