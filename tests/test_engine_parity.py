"""The bundled SmolLM2 model: packed vs single mode vs Hugging Face transformers (PyTorch), with the
tolerances of docs/score-semantics.md, on text and token inputs."""

import os

import jax
import numpy as np
import pytest

from core import Scorer
from core.requests import bundled_model_path

PACKED_VS_SINGLE = 1e-4
ENGINE_VS_HF = 1e-3
PARIS = 7042  # " Paris"
# The run's converted-model cache (tests/conftest.py): the GGUF is dequantized once per run, not per Scorer (10 s
# each on this machine type); test_converted_model_cache_gives_the_same_model checks the cache against a conversion.
CACHE = os.environ["MODEL_CACHE_DIR"]


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer.from_pretrained("smollm2-135m", CACHE, dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_logprobs(model, sequences: list[list[int]], labels: list[int]) -> np.ndarray:
    """log P(label | sequence) at each sequence's last token, in right-padded batches."""
    import torch

    out = np.zeros((len(sequences), len(labels)))
    for start in range(0, len(sequences), 32):
        batch = sequences[start: start + 32]
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits.double()
        for i, s in enumerate(batch):
            out[start + i] = torch.log_softmax(logits[i, len(s) - 1], -1)[labels].numpy()
    return out


def sequences_of(scorer: Scorer, query, items, item_first=False) -> list[list[int]]:
    """The scored sequences, built as docs/score-semantics.md says (token space, piece by piece)."""
    req = scorer.tokenize(query, items, [0], item_first)
    return [list(i + req.query) if item_first else list(req.query + i) for i in req.items]


def check(scorer, hf_model, query, items, labels, item_first=False, single=True):
    packed = scorer.logprobs(query, items, labels, item_first=item_first)
    reference = hf_logprobs(hf_model, sequences_of(scorer, query, items, item_first), labels)
    assert packed.shape == (len(items), len(labels))
    assert np.abs(packed - reference).max() <= ENGINE_VS_HF
    if single:
        single_lp = scorer.logprobs(query, items, labels, item_first=item_first, mode="single")
        assert np.abs(packed - single_lp).max() <= PACKED_VS_SINGLE
    return packed


def test_capital_of_france(scorer):
    lp = scorer.logprobs("The capital of France is", [""], [PARIS])
    assert lp[0, 0] == pytest.approx(-0.26, abs=0.02)
    top = scorer.tokenize("The capital of France is", [""], [PARIS])
    assert top.items == ((),)


def test_text_items_with_empty_one_token_and_unicode(scorer, hf_model):
    items = ["", " Paris", " a", " the city of lights", " Zürich — 東京 🚀", "\n\t"]
    assert [len(t) for t in scorer.tokenize("q", items, [1]).items][:3] == [0, 1, 1]
    check(scorer, hf_model, "Question: which city is the capital of France? Answer:", items, [PARIS, 314, 2])


def test_token_inputs_and_item_first(scorer, hf_model):
    rng = np.random.default_rng(1)
    query = rng.integers(5, 49152, 37).tolist()
    items = [rng.integers(5, 49152, n).tolist() for n in (0, 1, 2, 9, 30)]
    check(scorer, hf_model, query, items, [PARIS, 17])
    check(scorer, hf_model, query, [i for i in items if i], [PARIS, 17], item_first=True)


def test_many_items_in_one_pass(scorer, hf_model):
    rng = np.random.default_rng(2)
    query = rng.integers(5, 49152, 12).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(1, 4, 230)]
    packed = check(scorer, hf_model, query, items, [PARIS, 3], single=False)
    single_lp = scorer.logprobs(query, items[:12], [PARIS, 3], mode="single")
    assert np.abs(packed[:12] - single_lp).max() <= PACKED_VS_SINGLE


def test_coalesced_requests_match_separate_ones(scorer):
    reqs = [
        scorer.tokenize("The capital of France is", [" Paris", "", " Lyon"], [PARIS]),
        scorer.tokenize("Is this review positive? Great food!", [" yes", " no"], [PARIS, 5], item_first=True),
        scorer.tokenize([5, 6, 7, 8], [[9], [10, 11]], [12, 13, 14]),
    ]
    got = [np.full((r.n_items, len(r.label_token_ids)), np.nan) for r in reqs]
    passes = list(scorer.iter_passes(reqs))
    assert len(passes) == 1  # all three fit one pass
    for part in passes[0].scores:
        got[part.request][part.items] = part.logprobs
    for r, lp in zip(reqs, got):
        alone = scorer.logprobs(list(r.query), [list(i) for i in r.items], list(r.label_token_ids), r.item_first)
        assert np.abs(lp - alone).max() <= PACKED_VS_SINGLE


def test_chunked_request_reuses_prefix(hf_model):
    small = Scorer.from_pretrained("smollm2-135m", CACHE, pass_tokens=256)
    rng = np.random.default_rng(3)
    query = rng.integers(5, 49152, 150).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(0, 40, 25)]
    req = small.tokenize(query, items, [PARIS])
    passes = list(small.iter_passes([req]))
    assert len(passes) >= 3  # a prefix pass, then several chunks against its cached keys/values
    assert sum(p.tokens for p in passes) == req.prompt_tokens  # the query is computed once
    seen = np.concatenate([part.items for p in passes for part in p.scores])
    assert sorted(seen.tolist()) == list(range(len(items)))
    lp = small.logprobs(query, items, [PARIS])
    reference = hf_logprobs(hf_model, [query + i for i in items], [PARIS])
    assert np.abs(lp - reference).max() <= ENGINE_VS_HF


def test_bfloat16_no_further_from_float32_than_transformers(scorer, hf_model):
    """docs/score-semantics.md's bfloat16 rule, on a request drawn as `benchmarks.bench -P 60 -N 6 -L 10` draws it: the
    engine's bfloat16 is no further from its float32 than transformers' own bfloat16 model from its float32 one;
    isolation stays exact in bfloat16."""
    from core.check import transformers_model
    from core.requests import ModelSource

    rng = np.random.default_rng(0)
    query = rng.integers(10, 49152, 60).tolist()
    items = [rng.integers(10, 49152, 10).tolist() for _ in range(6)]
    labels = rng.integers(10, 49152, 4).tolist()
    hf_bf16 = transformers_model(ModelSource.resolve("smollm2-135m"), "bfloat16")
    sequences = [query + item for item in items]
    transformers = np.abs(hf_logprobs(hf_bf16, sequences, labels) - hf_logprobs(hf_model, sequences, labels)).max()
    bf16 = Scorer.from_pretrained("smollm2-135m", CACHE, dtype="bfloat16")
    lp = bf16.logprobs(query, items, labels)
    assert np.abs(lp - scorer.logprobs(query, items, labels)).max() <= transformers
    other = list(items)
    other[2] = rng.integers(10, 49152, 17).tolist()  # other content and length
    keep = np.arange(len(items)) != 2
    assert np.abs(bf16.logprobs(query, other, labels)[keep] - lp[keep]).max() <= 1e-5


def test_isolation_on_the_real_model(scorer):
    rng = np.random.default_rng(5)
    query = rng.integers(5, 49152, 60).tolist()
    items = [rng.integers(5, 49152, int(n)).tolist() for n in rng.integers(1, 15, 40)]
    base = scorer.logprobs(query, items, [PARIS, 11])
    other = list(items)
    other[3] = rng.integers(5, 49152, 31).tolist()  # other content and length
    lp = scorer.logprobs(query, other, [PARIS, 11])
    keep = np.arange(len(items)) != 3
    assert np.abs(lp[keep] - base[keep]).max() <= 1e-5


def test_converted_model_cache_gives_the_same_model(tmp_path, scorer):
    """A restart reads the GGUF's converted tokenizer and dequantized weights from MODEL_CACHE_DIR."""
    from core.requests import ModelSource
    from core.weights import load_gguf

    source = ModelSource.resolve("smollm2-135m", tmp_path)
    text = "Question: which city is the capital of France? Answer: ünïcode 🙂"
    assert source.tokenizer()(text)["input_ids"] == scorer.tokenizer(text)["input_ids"]
    assert (source.cached("tokenizer") / "tokenizer.json").is_file()  # written by the first call
    assert source.tokenizer()(text)["input_ids"] == scorer.tokenizer(text)["input_ids"]  # read back
    config, weights = load_gguf(source.path, source.cached("weights"))  # converts and writes
    again_config, again = load_gguf(source.path, source.cached("weights"))  # reads
    assert again_config == config == scorer.config
    flat = lambda tree: {str(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(tree)}
    assert flat(again).keys() == flat(weights).keys()
    assert all(np.array_equal(flat(again)[k], v) for k, v in flat(weights).items())
    cached = Scorer.from_pretrained("smollm2-135m", tmp_path)
    args = ("The capital of France is", [" Paris", " the city of"], [PARIS])
    assert np.array_equal(cached.logprobs(*args), scorer.logprobs(*args))
