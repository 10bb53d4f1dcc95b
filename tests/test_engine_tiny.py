"""Engine behaviour on tiny random models: isolation, compile-count bound, errors, Qwen3 parity."""

import json
import time

import jax
import numpy as np
import pytest

from core import ERROR_CODES, Scorer, ScoringError
from core.config import ModelConfig
from core.packing import ACCELERATOR_STEPS_PER_OCTAVE, FINE_RUNGS_FROM, filler_plan, ladder, pass_length


@pytest.fixture(scope="module")
def tiny() -> Scorer:
    return Scorer.from_pretrained("tiny-random", pass_tokens=512)


def test_isolation_changing_one_item_moves_no_other(tiny):
    rng = np.random.default_rng(0)
    query = rng.integers(5, 49152, 40).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(0, 12, 30)]
    labels = [1, 2, 3, 400]
    base = tiny.logprobs(query, items, labels)
    for changed in (rng.integers(5, 49152, 3).tolist(), rng.integers(5, 49152, 25).tolist(), []):
        other = list(items)
        other[7] = changed
        lp = tiny.logprobs(query, other, labels)
        keep = np.arange(len(items)) != 7
        assert np.abs(lp[keep] - base[keep]).max() <= 1e-5
        assert np.abs(lp[7] - base[7]).max() > 1e-4  # the changed item itself did move


def test_packed_matches_single_and_every_attention_impl(tiny):
    rng = np.random.default_rng(1)
    query = rng.integers(5, 49152, 23).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in (0, 1, 5, 17)]
    single = tiny.logprobs(query, items, [3, 9], mode="single")
    for impl in ("xla", "dense", "pallas-interpret"):
        other = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", attention=impl)
        assert np.abs(other.logprobs(query, items, [3, 9]) - single).max() <= 1e-4, impl


def test_a_pass_whose_length_is_not_a_multiple_of_the_token_step(tiny):
    """A ladder of 3072 has a pass length of 768: 703 real tokens take two steps of 512 (core.model.over_tokens),
    the second moved back to end at 768, recomputing rows the first did."""
    rng = np.random.default_rng(12)
    query = rng.integers(5, 49152, 23).tolist()
    items = [rng.integers(5, 49152, 40).tolist() for _ in range(17)]
    scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=3072)
    (result,) = scorer.iter_passes([scorer.tokenize(query, items, [3])])
    assert result.padded_tokens == 768 and result.tokens == 23 + 17 * 40
    single = tiny.logprobs(query, items, [3], mode="single")
    assert np.abs(scorer.logprobs(query, items, [3]) - single).max() <= 1e-4


def test_compile_count_bounded_by_buckets(tiny):
    rng = np.random.default_rng(2)
    requests = []
    for _ in range(30):
        query = rng.integers(5, 49152, int(rng.integers(1, 60))).tolist()
        items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(0, 10, int(rng.integers(1, 80)))]
        requests.append(tiny.tokenize(query, items, [1]))
    tiny.clear_prefix_cache()
    before = tiny.compiled_programs
    shapes = {result.shape_key for req in requests for result in tiny.iter_passes([req])}
    compiled = tiny.compiled_programs - before
    assert compiled <= len(shapes) <= len(tiny.pass_lengths)  # not one program per item count: the ladder's few
    assert len({r.n_items for r in requests}) > 2 * len(shapes)
    again = tiny.compiled_programs
    tiny.clear_prefix_cache()  # else the queries are cached now and the passes take other shapes
    for req in requests[::-1]:
        list(tiny.iter_passes([req]))
    assert tiny.compiled_programs == again  # every shape was already compiled


def test_empty_items_and_order(tiny):
    assert tiny.score("hello", [], [1]) == []
    lp = tiny.logprobs("hello world", ["", " a", ""], [5])
    alone = tiny.logprobs("hello world", [""], [5], mode="single")  # the query alone, in a pass of its own
    assert np.abs(lp[[0, 2]] - alone).max() <= 1e-4
    probs = tiny.score("hello world", [" a", " b"], [5, 6, 7], apply_softmax=True)
    assert np.allclose(np.sum(probs, axis=1), 1.0)
    raw = tiny.score("hello world", [" a", " b"], [5, 6, 7])
    assert np.allclose(raw, np.exp(tiny.logprobs("hello world", [" a", " b"], [5, 6, 7])))


@pytest.mark.parametrize("args, code", [
    (("", ["a"], [1]), "empty_query"),
    (([], [[1]], [1]), "empty_query"),
    (("q", ["a"], []), "empty_label_token_ids"),
    (("q", ["a"], [49152]), "label_token_id_out_of_range"),
    (("q", ["a"], [-1]), "label_token_id_out_of_range"),
    (([1, 2], [[3, 49152]], [1]), "token_id_out_of_range"),
    (([1, -2], [[3]], [1]), "token_id_out_of_range"),
    (("q", [[1, 2]], [1]), "mixed_input_types"),
    (([1], ["a"], [1]), "mixed_input_types"),
    (("q", ["a", [1]], [1]), "mixed_input_types"),
    (("q", ["a"] * 101, [1]), "too_many_items"),
    (([1] * 300, [[2] * 300], [1]), "too_many_tokens"),
    (("q", ["a"], [1] * 9), "too_many_labels"),
    (("q", ["a"] * 26, [1] * 8), "too_many_labels"),  # 208 scores: items x labels over MAX_SCORES
    (("q", ["a"] * 101, [1] * 8), "too_many_items"),  # the items' own limit first
    (("q", "abc", [1]), "invalid_input"),
    (("q", ["a"], [1.5]), "invalid_input"),
    (("q\ud800", ["a"], [1]), "invalid_input"),
    (([1], [[2], 3], [1]), "invalid_input"),
    ((None, ["a"], [1]), "invalid_input"),
])
def test_error_codes(tiny, args, code):
    limited = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", max_items=100, max_tokens=500,
                     max_labels=8, max_scores=200)
    with pytest.raises(ScoringError) as err:
        limited.logprobs(*args)
    assert err.value.code == code and code in ERROR_CODES


def test_sequence_longer_than_the_model_takes_is_too_many_tokens(tiny):
    limited = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", max_sequence_tokens=512)
    with pytest.raises(ScoringError) as err:
        limited.tokenize([1] * 400, [[2] * 200], [1])
    assert err.value.code == "too_many_tokens"
    limited.tokenize([1] * 400, [[2] * 100], [1])


def test_sequence_longer_than_a_pass_runs_alone(tiny):
    rng = np.random.default_rng(6)
    query = rng.integers(5, 49152, 300).tolist()
    items = [rng.integers(5, 49152, n).tolist() for n in (400, 3, 0)]
    lp = tiny.logprobs(query, items, [1, 2])  # 700 tokens > pass_tokens=512
    assert np.abs(lp - tiny.logprobs(query, items, [1, 2], mode="single")).max() <= 1e-4


def test_unknown_model():
    with pytest.raises(ScoringError) as err:
        Scorer.from_pretrained("no-such-model")
    assert err.value.code == "unknown_model"


def test_qwen3_matches_transformers(tmp_path, tiny):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf_config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                            rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial norms so a missing q/k norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config.qk_norm and config.head_dim == 32

    ours = Scorer.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(4)
    query = rng.integers(5, 49152, 30).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in (0, 1, 4, 13)]
    labels = [1, 77, 4000]
    lp = ours.logprobs(query, items, labels)
    with torch.inference_mode():
        for i, item in enumerate(items):
            logits = model(torch.tensor([query + item])).logits[0, -1].double()
            ref = torch.log_softmax(logits, -1)[labels].numpy()
            assert np.abs(lp[i] - ref).max() <= 1e-3
    assert np.abs(lp - ours.logprobs(query, items, labels, mode="single")).max() <= 1e-4


def test_shared_query_is_computed_once_and_cached_when_it_comes_again(tiny):
    tiny.clear_prefix_cache()
    rng = np.random.default_rng(7)
    query = rng.integers(5, 49152, 90).tolist()
    a = tiny.tokenize(query, [rng.integers(5, 49152, 4).tolist() for _ in range(6)] + [[]], [1, 2])
    b = tiny.tokenize(query, [[]] + [rng.integers(5, 49152, 7).tolist() for _ in range(5)] + [[]], [3])
    first = list(tiny.iter_passes([a, b]))
    item_tokens = sum(map(len, a.items + b.items))
    assert sum(p.tokens for p in first) == len(query) + item_tokens  # one prefix for both requests
    assert not tiny.is_cached(a.query) and tiny.cached_prefix_bytes == 0  # seen once: not kept
    second = list(tiny.iter_passes([a, b]))
    assert sum(p.tokens for p in second) == len(query) + item_tokens and tiny.is_cached(a.query)  # seen twice
    again = list(tiny.iter_passes([a, b]))
    # The query is cached; each request with empty items (their labels differ) re-runs its last token once.
    assert sum(p.tokens for p in again) == item_tokens + 2

    def collect(passes, req_index, req):
        out = np.full((req.n_items, len(req.label_token_ids)), np.nan)
        for p in passes:
            for part in p.scores:
                if part.request == req_index:
                    out[part.items] = part.logprobs
        return out

    for i, req in enumerate((a, b)):
        assert np.abs(collect(first, i, req) - collect(again, i, req)).max() <= 1e-5
        assert np.abs(collect(first, i, req) - collect(second, i, req)).max() <= 1e-5
        assert np.abs(collect(again, i, req) - tiny.logprobs(list(req.query), [list(t) for t in req.items],
                                                             list(req.label_token_ids), mode="single")).max() <= 1e-4


def test_many_cached_prefixes_in_one_pass_and_eviction(tiny):
    rng = np.random.default_rng(8)
    reqs = [tiny.tokenize(rng.integers(5, 49152, int(rng.integers(5, 70))).tolist(),
                          [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(0, 6, 5)], [4, 5])
            for _ in range(6)]
    expected = [tiny.logprobs(list(r.query), [list(t) for t in r.items], [4, 5], mode="single") for r in reqs]
    for cache_bytes in (tiny.prefix_cache_bytes, 1):  # 1 byte: every prefix is evicted at once
        scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=512,
                        prefix_cache_bytes=cache_bytes)
        for round_ in range(2):
            got = [np.full((r.n_items, 2), np.nan) for r in reqs]
            for p in scorer.iter_passes(reqs):
                for part in p.scores:
                    got[part.request][part.items] = part.logprobs
            for g, e in zip(got, expected):
                assert np.abs(g - e).max() <= 1e-4


def test_prefixes_evicted_between_planning_and_running(tiny):
    """A pass planned with cached prefixes runs correctly after some were evicted (the worker's other lane
    runs passes in between), even when computing one again evicts another the pass needs."""
    from core.packing import plan_passes

    rng = np.random.default_rng(9)
    reqs = [tiny.tokenize(rng.integers(5, 49152, 40).tolist(), [rng.integers(5, 49152, 3).tolist()] * 2, [4])
            for _ in range(2)]
    expected = [tiny.logprobs(list(r.query), [list(t) for t in r.items], [4], mode="single") for r in reqs]
    scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=512)
    list(scorer.iter_passes(reqs))
    list(scorer.iter_passes(reqs))  # the queries come again: now kept
    plans = list(plan_passes(reqs, 512, is_cached=scorer._prefix_cache.__contains__))
    assert [len([s for s in p.sequences if s.prefix_cached]) for p in plans] == [2]
    k, v = scorer._prefix_cache.pop(reqs[1].query)  # evicted by someone else's pass
    scorer.prefix_cache_bytes = k.nbytes + v.nbytes  # room for one: computing it again evicts the other
    got = [np.full((r.n_items, 1), np.nan) for r in reqs]
    for part in scorer._run_plan(reqs, plans[0]).scores:
        got[part.request][part.items] = part.logprobs
    for g, e in zip(got, expected):
        assert np.abs(g - e).max() <= 1e-4


def test_prefixes_still_needed_are_evicted_last(tiny):
    """The prefix cache evicts the least recently used prefix first, except those a pass loop says requests
    under way still need (`needed`); `prefix_bytes` is what a prefix takes there."""
    rng = np.random.default_rng(10)
    a, b, c = (tiny.tokenize(rng.integers(5, 49152, 40).tolist(), [rng.integers(5, 49152, 3).tolist()], [4])
               for _ in range(3))
    scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=512,
                    prefix_cache_bytes=2 * tiny.prefix_bytes(40))

    def run(request, needed=()):  # type: ignore[no-untyped-def]
        # planned as a request under way: its query is kept however new
        scorer.launch([request], scorer.plan_pass([request], {request.query}), needed).result()

    run(a)
    run(b)
    assert scorer.cached_prefix_bytes == 2 * scorer.prefix_bytes(40)
    run(c, needed={a.query})
    assert [scorer.is_cached(r.query) for r in (a, b, c)] == [True, False, True]
    run(b)
    assert [scorer.is_cached(r.query) for r in (a, b, c)] == [False, True, True]


def test_resident_programs_are_capped_least_recently_used_first(tiny):
    capped = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", max_programs=2)
    rng = np.random.default_rng(11)
    # Three requests of three pass lengths (64, 1024 and 2048 tokens on the ladder of 4096).
    requests = [capped.tokenize(rng.integers(5, 400, 4).tolist(),
                                [rng.integers(5, 400, 3).tolist() for _ in range(n)], [1]) for n in (2, 200, 500)]

    def run(request) -> list[tuple]:
        capped.clear_prefix_cache()  # the same passes each time, not passes against a cached query
        return [result.shape_key for result in capped.iter_passes([request])]

    assert len({shape for request in requests for shape in run(request)}) == 3
    assert capped.resident_programs == 2
    before = capped.compiled_programs
    run(requests[2])  # the most recent shape is still resident
    assert capped.compiled_programs == before
    run(requests[0])  # the least recent one was evicted: compiled again
    assert capped.compiled_programs == before + 1
    assert capped.resident_programs == 2


def test_random_traffic_needs_no_program_beyond_the_warmed_ladder(tiny, caplog, monkeypatch):
    """The warm-up compiles every program of the ladder and runs each once on a full pass laid out as traffic
    is: a program's first run makes what XLA's runtime keeps for it (the YNNPACK executables of each loop and
    branch the pass's tables drive), which otherwise filled a worker's memory a shape at a time through its
    first half hour (issue 47); within a time budget, longest first. Then queries of 5-1,200 tokens, 1-300 items
    of 1-60 tokens, 1-8 labels, some item_first, some repeated queries (prefix cache): no pass compiles anything,
    and every shape is on the ladder. A shape off it (9 labels) compiles, and the engine's log says so (the
    warm-up's compiles are not logged one by one)."""
    caplog.set_level("WARNING", logger="jax")  # (the handler's level: the last set_level's)
    caplog.set_level("INFO", logger="core.scorer")
    new_shape = "compiled a pass program for a new shape"
    scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny")
    ran = []
    launch = scorer._launch

    def spy(arrays, cached, cached_lengths, labels, keep_kv):  # type: ignore[no-untyped-def]
        handle, kv, key = launch(arrays, cached, cached_lengths, labels, keep_kv)
        ran.append((key, arrays))
        return handle, kv, key

    monkeypatch.setattr(scorer, "_launch", spy)
    progress = []
    assert scorer.warm_up(lambda done, total: progress.append((done, total))) == 21  # 7 pass lengths, without
    # cached prefixes and with 2 cache lengths; the progress a worker reports to /readyz as it goes
    assert progress == [(n, 21) for n in range(22)]
    lengths = scorer.pass_lengths
    assert lengths == [64, 128, 256, 512, 1024, 2048, 4096]
    assert sorted(key for key, _ in ran) == sorted((T, C, T, (C + T) // 64, 8, True)
                                                   for T in lengths for C in (0, 512, 4096))
    for (T, C, *_), arrays in ran:
        # Full, with a cached query (when C), a query computed in the pass, and items of several lengths.
        assert arrays.real_tokens == T and arrays.cache_len == C
        plan = filler_plan(T, C)
        assert [seq.prefix_cached for seq in plan.sequences] == [True, False][-len(plan.sequences):]
        assert all(seq.items for seq in plan.sequences) and len(plan.sequences) == 1 + (C > 0)
        assert len({len(tokens) for seq in plan.sequences for _, _, tokens in seq.items}) >= min(T // 64, 4)
        assert T == 64 or (arrays.tile_counts > 1).any()  # the tile loops run (64 tokens: a single tile)
    ran.clear()
    assert scorer.warm_up(run_seconds=0) == 21  # past the budget the programs are compiled (resident), not run
    assert [key[:2] for key, _ in ran] == [(4096, 0)]
    monkeypatch.undo()
    rng = np.random.default_rng(5)
    queries = [rng.integers(5, 49152, int(rng.integers(5, 1200))).tolist() for _ in range(6)]
    queries.append(rng.integers(5, 49152, 300).tolist())  # a cached query this short reads the shortest cache
    before = scorer.compiled_programs
    shapes = set()
    with jax.log_compiles(True):  # JAX logs every program it compiles or loads, a pass's or any other
        for n in range(25):
            items = [rng.integers(5, 49152, int(rng.integers(1, 60))).tolist()
                     for _ in range(int(rng.integers(1, 300)))]
            labels = rng.integers(0, 49152, int(rng.integers(1, 9))).tolist()
            request = scorer.tokenize(queries[n % len(queries)], items, labels, item_first=n % 5 == 4)
            results = list(scorer.iter_passes([request]))
            assert not any(result.compiled for result in results)
            shapes |= {result.shape_key for result in results}
    assert scorer.compiled_programs == before
    # Nor anything else: moving a pass's arrays to the device compiled a program per array shape (jnp.asarray),
    # each kept with an MLIR context of its own, which grew a worker's memory for hours (issue 47).
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")] == []
    for T, C, S, width, label_width, keep_kv in shapes:
        assert T in lengths and C in (0, 512, 4096) and S == T and width == (C + T) // 64 and label_width == 8
        assert keep_kv  # on CPU every pass returns its keys/values
    assert {C for _, C, *_ in shapes} == {0, 512, 4096}  # passes against cached queries were among them
    assert new_shape not in caplog.text
    results = list(scorer.iter_passes([scorer.tokenize([5, 6, 7], [[8, 9]], list(range(100, 109)))]))
    assert [result.compiled for result in results] == [True]  # its time is no measure of the host's pace
    assert scorer.compiled_programs == before + 1
    assert [r.getMessage() for r in caplog.records if new_shape in r.getMessage()] == [
        f"tiny: {new_shape} (tokens 64, cached keys 0, table width 1, labels 16, keys/values out True): "
        f"{before + 1} compiled in this process, {scorer.resident_programs} resident"]


def test_prefix_cache_as_on_accelerators_scores_the_same_and_compiles_few_programs(tiny):
    """On accelerators the prefix cache is cut and joined by JAX operations on windows of a power of two rows
    (on CPU by NumPy). Here that path runs on CPU: its scores equal the host path's, and random query lengths,
    many cached prefixes per pass and a window longer than the cache compile only a program per (length,
    window), not one per prefix length or per set of cached lengths."""
    from core import scorer as engine

    rng = np.random.default_rng(14)
    queries = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(3, 300, 14)] + \
        [rng.integers(5, 49152, 600).tolist()]  # a window of 1,024 rows read into a cache of 640
    requests = [[rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(0, 9, 4)] for _ in queries]
    results = {}
    for host in (True, False):
        scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=640)
        scorer.host_prefix_cache = host
        tokenized = [scorer.tokenize(q, items, [4, 5]) for q, items in zip(queries, requests)]
        for _ in range(2):  # the second round reads every query from the cache, many in one pass
            got = [np.full((len(items), 2), np.nan) for items in requests]
            for p in scorer.iter_passes(tokenized):
                for part in p.scores:
                    got[part.request][part.items] = part.logprobs
        results[host] = got
    for a, b in zip(results[True], results[False]):
        assert np.isfinite(a).all() and np.abs(a - b).max() <= 1e-6
    windows = {engine._window_rows(len(q), 64) for q in queries}
    assert engine._rows_window._cache_size() <= 4 * len(windows)  # pass lengths x windows
    assert engine._place_rows._cache_size() <= len(windows)  # one cache length


def test_on_cpu_a_small_request_runs_in_a_pass_of_its_own_size(tiny):
    """The CPU ladder reaches down to 64 tokens: README's 2-item request (about 25 tokens) pays for 64, not for
    the accelerators' shortest pass (pass_tokens/8: 512 tokens), which took 2 s on the bundled model."""
    scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny")
    assert scorer.pass_lengths == [64, 128, 256, 512, 1024, 2048, 4096]
    request = scorer.tokenize(list(range(5, 17)), [list(range(20, 27)), list(range(30, 37))], [1, 2])
    (result,) = scorer.iter_passes([request])
    assert result.tokens == 26 and result.padded_tokens == 64
    single = scorer.logprobs(list(range(5, 17)), [list(range(20, 27)), list(range(30, 37))], [1, 2], mode="single")
    packed = scorer.logprobs(list(range(5, 17)), [list(range(20, 27)), list(range(30, 37))], [1, 2])
    assert np.abs(packed - single).max() <= 1e-4


def test_prefix_cache_size_defaults_from_the_device(tiny):
    """Unset: 256 MiB on CPU (a device without a memory limit); on an accelerator, PREFIX_CACHE_SHARE of the
    memory left after what is in use (the weights) and the largest pass. A size given is kept."""
    from core.prefix_cache import PREFIX_CACHE_BYTES_CPU, PREFIX_CACHE_SHARE, device_prefix_cache_bytes

    assert tiny.prefix_cache_bytes == PREFIX_CACHE_BYTES_CPU
    assert device_prefix_cache_bytes(None, 1) is None and device_prefix_cache_bytes({"bytes_in_use": 3}, 1) is None
    big = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=16384)
    small = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=512, prefix_cache_bytes=123)
    assert small.prefix_cache_bytes == 123
    # at least every layer's keys and values out and a cache input as long, in float32
    assert big.pass_bytes() > 2 * 16384 * 2 * tiny.config.num_layers * tiny.config.kv_size * 4
    assert big.pass_bytes() > small.pass_bytes()
    stats = {"bytes_limit": 80 << 30, "bytes_in_use": 3 << 30}  # an H100 holding its weights
    expected = int(((80 << 30) - (3 << 30) - big.pass_bytes()) * PREFIX_CACHE_SHARE)
    assert device_prefix_cache_bytes(stats, big.pass_bytes()) == expected > 30 << 30
    assert device_prefix_cache_bytes({"bytes_limit": 1 << 30, "bytes_in_use": 1 << 30}, 5) == 0  # no room


def test_tokenize_many_gives_what_tokenize_gives_each_request() -> None:
    from core.errors import ScoringError
    from core.requests import RequestTokenizer

    tokenizer = RequestTokenizer.from_pretrained("tiny-random", max_items=3, max_sequence_tokens=40)
    requests = [("Is it good?", [" yes", " no", ""], [5, 17], False),
                ("", [" a"], [5], False),  # empty_query
                ("q", [" a"], [10**9], False),  # label_token_id_out_of_range
                ("q", [" a", [1, 2]], [5], False),  # mixed_input_types
                ([1, 2, 3], [[4], [5, 6]], [5], False),  # token ids
                ("q", [" word" * 50], [5], False),  # too_many_tokens (the sequence limit)
                ("q", [" a"] * 4, [5], False),  # too_many_items
                ("A longer query, item first", [" one", " two"], [7], True),
                ("q", [], [5], False)]
    for request, got in zip(requests, tokenizer.tokenize_many(requests)):
        try:
            expected = tokenizer.tokenize(*request)
        except ScoringError as exc:
            assert isinstance(got, ScoringError) and (got.code, got.message) == (exc.code, exc.message), request
        else:
            assert got == expected, request
    assert sum(isinstance(r, ScoringError) for r in tokenizer.tokenize_many(requests)) == 5



def test_requests_share_one_int_object_per_token_id() -> None:
    """Issue 47: a token held is a pointer to the vocabulary's one int for its id, however it came (text, token
    ids, a stored request; Python shares ints under 257 only), so a lake chunk's tokens take a third of the
    memory; the ids are transformers' (texts are encoded without offsets), and ids outside the vocabulary are
    still errors."""
    from core.requests import RequestTokenizer, TokenizedRequest, token_ints

    tokenizer = RequestTokenizer.from_pretrained("tiny-random")
    vocabulary = token_ints(tokenizer.vocab_size)
    text = tokenizer.tokenize("Which museums in Lisbon open on Monday?", [" The Gulbenkian opens on Mondays.",
                                                                          " Tram 28"], [5, 17])
    ids = [1000, 40000, 1000]
    given = tokenizer.tokenize([300, *ids], [ids, [49151]], [5])
    stored = tokenizer.check_stored(text.to_bytes())
    ids_of = tokenizer.tokenizer  # transformers' tokenizer: the contract's ids
    assert text.query == tuple(ids_of("Which museums in Lisbon open on Monday?")["input_ids"])
    assert text.items[0] == tuple(ids_of(" The Gulbenkian opens on Mondays.", add_special_tokens=False)["input_ids"])
    assert stored == text and given.query == (300, *ids) and given.items == (tuple(ids), (49151,))
    for request in (text, given, stored, *tokenizer.tokenize_many([("Tram 28 to Graça", [" at 9:15"], [5], False)])):
        tokens = [t for sequence in (request.query, *request.items) for t in sequence]
        assert any(t > 256 for t in tokens)
        assert all(type(t) is int and t is vocabulary[t] for t in tokens), request
    for bad in ((1, -5), (1, tokenizer.vocab_size)):  # a stored request out of range: the error, not a wrong id
        with pytest.raises(ScoringError) as error:
            tokenizer.check_stored(TokenizedRequest(bad, ((2, 3),), (5,)).to_bytes())
        assert error.value.code == "token_id_out_of_range"


def test_accelerator_ladder_covers_every_length_with_little_padding_and_few_rungs(tiny):
    """Issue 45: on the halving ladder the contract's 12,000 tokens ran as 16,384 (27% of every matmul on
    padding). The accelerators' ladder has every halving rung and quarter-octave rungs from FINE_RUNGS_FROM up:
    every length gets the smallest rung that holds it, padded by at most a fifth past FINE_RUNGS_FROM, in at
    most 10 rungs at 16,384 (programs compile per rung); the CPU ladder is unchanged."""
    steps = ACCELERATOR_STEPS_PER_OCTAVE
    rungs = ladder(16384, 128, None, steps)
    assert set(ladder(16384, 128)) < set(rungs) and len(rungs) <= 10 and all(r % 128 == 0 for r in rungs)
    for n in range(1, 16385, 7):
        T = pass_length(n, 0, 16384, 128, None, steps)
        assert T >= n and T == min(r for r in rungs if r >= n)
        if n > FINE_RUNGS_FROM:
            assert (T - n) / T <= 1 / (steps + 1)
    assert pass_length(12000, 500, 16384, 128, None, steps) == 12288
    assert pass_length(20000, 0, 16384, 128, None, steps) == 32768  # one sequence longer than a pass
    assert tiny.ladder_steps == 1  # on CPU


def test_pass_as_on_accelerators_has_no_branch_and_scores_the_same(tiny):
    """On accelerators (token_rows None) a pass runs every layer on all rows in one step, with no loop over
    rows and no branch (XLA runs both from the host on a GPU, reading each predicate back), and the LM head on
    its bucketed score rows; on CPU it runs in steps. Either way the last layer's output projection and MLP run
    on the score rows only. The same log-probs either way, with the query in the pass and from the prefix
    cache."""
    from core import scorer as engine

    rng = np.random.default_rng(15)
    query, items = rng.integers(5, 49152, 150).tolist(), [rng.integers(5, 49152, n).tolist() for n in (7, 0, 40, 3)]
    got = {}
    for token_rows in (engine.TOKEN_ROWS, None):
        scorer = Scorer(tiny.config, tiny.model, tiny.tokenizer, name="tiny", pass_tokens=256)
        scorer.token_rows = token_rows
        got[token_rows] = [scorer.logprobs(query, items, [4, 5]) for _ in range(2)]  # computed, then cached
    for a, b in zip(got[engine.TOKEN_ROWS], got[None]):
        assert np.isfinite(b).all() and np.abs(a - b).max() <= 1e-5
    programs = [p.as_text() for key, p in engine._PROGRAMS.resident.items() if ("token_rows", None) in key[2]]
    assert programs and not any(" conditional(" in text for text in programs)


@pytest.mark.parametrize("token_rows", ["cpu steps", None])
def test_a_launch_returns_before_its_pass_ends(token_rows):
    """JAX dispatches a pass without waiting for it (on CPU too, for a pass that keeps no prefix: a kept one is
    copied out to the host cache), so the worker plans the next pass while this one runs: the launch returns
    with the pass still running, in the CPU's steps and in the accelerators' program (no loop or branch the
    host reads). The bundled model, a pass of about 1,000 tokens: hundreds of milliseconds of device time."""
    from core import scorer as engine

    scorer = Scorer.from_pretrained("smollm2-135m", pass_tokens=1024)
    scorer.token_rows = engine.TOKEN_ROWS if token_rows else None
    for n in range(2):  # the first compiles; each query is new, so neither pass keeps its prefix
        request = scorer.tokenize(f"question {n}: " + "some words of the query " * 12,
                                  [f"item number {i} with a few words" for i in range(60)], [1, 2])
        plan = scorer.plan_pass([request])
        assert not any(seq.keep_prefix for seq in plan.sequences)
        flight = scorer.launch([request], plan)
        running = not flight._look(time.perf_counter())
        result = flight.result()
    assert running and not result.compiled
    assert result.host_seconds < 0.5 * result.seconds, result
