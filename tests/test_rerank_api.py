"""/v1/rerank (and /rerank), rerank jobs (POST /jobs with "kind": "rerank") and the RERANK_TEMPLATE setting, on
the real PostgreSQL with the tiny model: relevance is the engine's P(yes) / (P(yes) + P(no)) of the template's
prompt, results sorted by it, top_n and return_documents honoured, tenants kept apart."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy.special import softmax

from api.deps import get_models
from store.rerank import TEMPLATES, RerankTemplate, rerank_prompt, template_for
from store.settings import get_settings
from tests.load_runner import SCORE_RTOL
from tests.test_batches_api import auth, clean, drain  # noqa: F401 (clean is a fixture)
from worker.scorer import get_scorer

# The last two are returned as given (return_documents), spaces and all.
DOCUMENTS = ["Paris is the capital of France.", {"text": "Bananas are yellow."}, "Berlin is in Germany.",
             "The Seine flows through Paris.", "", "  Lyon, with spaces around.\n "]
TEXTS = [d if isinstance(d, str) else d["text"] for d in DOCUMENTS]


def expected_relevance(query: str, texts: list[str], instruction: str | None = None) -> np.ndarray:
    """What the contract says, computed here from the template and the engine: P(yes) / (P(yes) + P(no))."""
    template = TEMPLATES["smollm2"]  # tiny-random is not a Qwen3 model
    assert template.prefix == "Question: {query}\nDocument:" and template.separator == " "
    suffix = f"\n{instruction or 'Does the document answer the question?'} Answer:"
    tokenizer = get_models().get(None).tokenizer.tokenizer
    labels = [tokenizer(label, add_special_tokens=False).input_ids[0] for label in (" yes", " no")]
    assert labels == [9805, 787]  # README's ids of " yes" and " no" in SmolLM2's tokenizer
    logprobs = get_scorer().logprobs(f"Question: {query}\nDocument:", [" " + t + suffix for t in texts], labels)
    return softmax(np.asarray(logprobs, np.float64), axis=-1)[:, 0]


def check_results(results: list[dict], relevance: np.ndarray, top_n: int | None, documents: bool) -> None:
    order = np.argsort(-relevance, kind="stable")[:top_n]
    assert [r["index"] for r in results] == order.tolist()
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    np.testing.assert_allclose(scores, relevance[order], rtol=SCORE_RTOL, atol=0)
    for r in results:
        assert (r.get("document") == {"text": TEXTS[r["index"]]}) if documents else r.get("document") is None


def call_while_draining(client, path: str, body: dict, key: str):  # type: ignore[no-untyped-def]
    """A synchronous call, with the worker's drain run here (no worker process in these tests)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "response", client.post(path, json=body, headers=auth(key))))
    thread.start()
    while thread.is_alive():
        drain()
        thread.join(timeout=0.05)
    return result["response"]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_sorted_by_relevance(client, make_key, clean, path: str) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = {"model": "tiny-random", "query": "What is the capital of France?", "documents": DOCUMENTS}
    response = call_while_draining(client, path, body, key)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "rerank" and out["model"] == "tiny-random" and out["id"].startswith("job_")
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"]
    check_results(out["results"], expected_relevance(body["query"], TEXTS), None, documents=True)


def test_rerank_top_n_documents_and_instruction(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = {"query": "capital?", "documents": DOCUMENTS, "top_n": 2, "return_documents": False,
            "instruction": "Find the city.", "truncate_prompt_tokens": None}  # vLLM's clients send it: accepted as null
    response = call_while_draining(client, "/v1/rerank", body, key)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 2 and all("document" not in r for r in results)
    check_results(results, expected_relevance("capital?", TEXTS, "Find the city."), 2, documents=False)
    # top_n 0 (vLLM's default) is every document; no documents, no results.
    everything = call_while_draining(client, "/v1/rerank", {**body, "top_n": 0}, key).json()["results"]
    assert len(everything) == len(DOCUMENTS)
    empty = call_while_draining(client, "/v1/rerank", {"query": "q", "documents": []}, key)
    assert empty.status_code == 200 and empty.json()["results"] == []


@pytest.mark.parametrize("body, status, code", [
    ({"query": "q"}, 422, "invalid_input"),
    ({"query": "q", "documents": "one string"}, 422, "invalid_input"),
    ({"query": "q", "documents": [{"title": "no text"}]}, 422, "invalid_input"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, 422, "invalid_input"),
    ({"query": "q", "documents": ["a"], "model": "Qwen3-Reranker-0.6B"}, 400, "unknown_model"),
    ({"query": "q", "documents": ["x"] * 5001}, 400, "too_many_items"),
    ({"query": "q", "documents": [{"text": "a", "title": "not read"}]}, 422, "invalid_input"),
    ({"query": "q", "documents": ["a"], "instruction": "x" * 4097}, 422, "invalid_input"),
])
def test_rerank_errors(client, make_key, body: dict, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    response = client.post("/v1/rerank", json=body, headers=auth(key))
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_documents_over_the_limits_with_their_suffix_are_refused_before_they_are_built(  # type: ignore[no-untyped-def]
        client, make_key, monkeypatch) -> None:
    """The template's suffix (the instruction, in the bundled model's) goes after every document: 200 empty
    documents with a 100 KB instruction built and tokenized 5,000,000 tokens of text before too_many_tokens."""
    from core import RequestTokenizer

    tokenized: list[int] = []
    original = RequestTokenizer.tokenize
    monkeypatch.setattr(RequestTokenizer, "tokenize", lambda self, query, items, *rest: (
        tokenized.append(len(items)), original(self, query, items, *rest))[1])
    key, _ = make_key()
    body = {"query": "q", "documents": [""] * 2000, "instruction": "word " * 200}  # 2,000 x 200 tokens
    for path, extra in (("/v1/rerank", {}), ("/jobs", {"kind": "rerank"})):
        response = client.post(path, json={**body, **extra}, headers=auth(key))
        assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_tokens", response.text
    assert tokenized == []


def test_rerank_job(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    alice, _ = make_key("alice")
    bob, _ = make_key("bob")
    body = {"kind": "rerank", "query": "capital of France", "documents": DOCUMENTS, "top_n": 3,
            "metadata": {"run": 1}}
    response = client.post("/jobs", json=body, headers={**auth(alice), "Idempotency-Key": "rr-1"})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["kind"] == "rerank" and job["status"] == "queued" and job["metadata"] == {"run": 1}
    assert job["progress"] == {"items_done": 0, "items_total": len(DOCUMENTS)}
    assert client.get(f"/jobs/{job['id']}", headers=auth(bob)).status_code == 404  # another tenant's
    replay = client.post("/jobs", json=body, headers={**auth(alice), "Idempotency-Key": "rr-1"})
    assert replay.json()["id"] == job["id"] and replay.headers["Idempotent-Replayed"] == "true"
    other = client.post("/jobs", json={**body, "top_n": 4}, headers={**auth(alice), "Idempotency-Key": "rr-1"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"

    drain()
    done = client.get(f"/jobs/{job['id']}", headers=auth(alice)).json()
    assert done["status"] == "succeeded"
    relevance = expected_relevance(body["query"], TEXTS)
    check_results(done["results"], relevance, 3, documents=True)
    # The scores are [P(yes), P(no)] per document, in the documents' order.
    np.testing.assert_allclose(np.asarray(done["scores"])[:, 0], relevance, rtol=SCORE_RTOL, atol=0)
    # A scoring job is still a scoring job.
    score_job = client.post("/jobs", json={"query": "q", "items": ["a"], "label_token_ids": [1]}, headers=auth(alice))
    assert score_job.json()["kind"] == "score" and score_job.json()["results"] is None


@pytest.mark.parametrize("body", [
    {"kind": "rerank", "query": "q", "items": ["a"], "label_token_ids": [1]},  # a scoring body called rerank
    {"kind": "rerank", "query": "q", "documents": ["a"], "return_logprobs": True},  # unknown field
    {"kind": "embed", "query": "q", "items": ["a"], "label_token_ids": [1]},
])
def test_rerank_job_body_errors(client, make_key, body: dict) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    response = client.post("/jobs", json=body, headers=auth(key))
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input", response.text


def test_templates(tmp_path: Path) -> None:
    tokenizer = get_models().get(None).tokenizer
    assert template_for("auto", "tiny-random") == TEMPLATES["smollm2"]
    # A Qwen3 model (a Hugging Face folder with a Qwen3 config) gets Qwen3-Reranker's template.
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    qwen = template_for("auto", str(tmp_path))
    assert qwen == TEMPLATES["qwen3-reranker"]
    assert qwen.suffix == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert 'Note that the answer can only be "yes" or "no".' in qwen.prefix
    assert qwen.prefix.endswith("<Instruct>: {instruction}\n<Query>: {query}\n<Document>:")
    assert qwen.separator == " "
    # A JSON prefix's trailing space before the document becomes the separator, unless one is given.
    custom = template_for('{"prefix": "Q: {query}\\nD: ", "suffix": "\\nRelevant:", "labels": ["yes", "no"]}',
                          "tiny-random")
    assert custom == RerankTemplate("Q: {query}\nD:", "\nRelevant:", "", ("yes", "no"), " ")
    assert template_for('{"prefix": "Q: {query}\\nD:\\n", "separator": ""}', "tiny-random").separator == ""
    # The label ids come from the tokenizer ("yes" without a space is another token than " yes").
    assert rerank_prompt(custom, tokenizer).label_token_ids == (10407, 4607)
    assert get_models().get(None).rerank.label_token_ids == (9805, 787)
    with pytest.raises(ValueError, match="must be one"):
        rerank_prompt(RerankTemplate("{query}", "", "", ("yes please", "no")), tokenizer)
    with pytest.raises(ValueError, match="RERANK_TEMPLATE"):
        template_for("nonsense", "tiny-random")
    assert get_settings().rerank_template == "auto"


@pytest.mark.parametrize("document", ["Paris is the capital of France.", "(aside) text", "1984 was a year.", "",
                                      "  spaced  ", "Ünïcode café"])
def test_prompt_tokens_are_the_whole_prompts(document: str) -> None:
    """tokens(query) + tokens(item), joined in token space as docs/score-semantics.md says, are the tokens of the
    whole prompt: no lone space token at the end of the prefix, none missing at the start of the document."""
    from store.schemas import RerankInput

    tokenizer = get_models().get(None).tokenizer.tokenizer
    prompt = rerank_prompt(TEMPLATES["smollm2"], get_models().get(None).tokenizer)
    score, spec = prompt.score_input(RerankInput(query="What is the capital of France?", documents=[document]))
    assert isinstance(score.query, str) and isinstance(score.items[0], str)
    joined = tokenizer(score.query).input_ids + tokenizer(score.items[0], add_special_tokens=False).input_ids
    assert joined == tokenizer(score.query + score.items[0]).input_ids
    assert score.query.endswith("\nDocument:") and score.items[0] == " " + document + spec["suffix"]


def test_template_substitution_is_one_pass() -> None:
    """{query} and {instruction} are filled in one pass: a placeholder in the request's own text stays as is."""
    from store.schemas import RerankInput

    template = RerankTemplate("I: {instruction}\nQ: {query}\nD:", "\n{instruction}?", "default")
    prompt = rerank_prompt(template, get_models().get(None).tokenizer)
    score, spec = prompt.score_input(RerankInput(query="about {instruction}", documents=["d"],
                                                 instruction="say {query} literally"))
    assert score.query == "I: say {query} literally\nQ: about {instruction}\nD:"
    assert spec["suffix"] == "\nsay {query} literally?" and score.items == [" d\nsay {query} literally?"]


def test_json_template_without_query_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    setting = '{"prefix": "Instruction: {instruction}\\nDocument:", "suffix": "\\nAnswer:"}'
    with pytest.raises(ValueError, match=r"must hold \{query\}"):
        template_for(setting, "tiny-random")
    # At start: the API's lifespan loads the template (get_models) before taking traffic.
    monkeypatch.setenv("RERANK_TEMPLATE", setting)
    get_settings.cache_clear()
    get_models.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"must hold \{query\}"):
            get_models().get(None).rerank
    finally:
        monkeypatch.delenv("RERANK_TEMPLATE")
        get_settings.cache_clear()
        get_models.cache_clear()
    assert get_models().get(None).rerank.template == TEMPLATES["smollm2"]
