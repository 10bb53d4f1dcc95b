"""OpenAI Batch API lines in batch uploads (POST to /v1/score, /score, /v1/rerank, /rerank), mixed with this
service's own lines, and the results in both formats: every line's body is what the synchronous route answers;
bad lines (wrong method, unknown url, body errors) are per-line errors; another tenant sees nothing."""

import json

import numpy as np

from tests.load_runner import SCORE_RTOL
from tests.test_batches_api import auth, clean, drain, result_lines, upload  # noqa: F401 (clean is a fixture)
from tests.test_rerank_api import DOCUMENTS, TEXTS, check_results, expected_relevance
from worker.scorer import get_scorer

SCORE_BODY = {"model": "tiny-random", "query": "Is it good?", "items": ["yes", "no", "maybe"],
              "label_token_ids": [5, 17], "apply_softmax": True}
RERANK_BODY = {"model": "tiny-random", "query": "capital of France", "documents": DOCUMENTS, "top_n": 3}


def openai_line(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


GOOD = [
    openai_line("score-v1", "/v1/score", SCORE_BODY),
    openai_line("score", "/score", {"text_1": "Is it good?", "text_2": ["yes", "no", "maybe"],
                                    "label_token_ids": [5, 17], "apply_softmax": True}),  # vLLM's names
    openai_line("rerank-v1", "/v1/rerank", RERANK_BODY),
    openai_line("rerank", "/rerank", {**RERANK_BODY, "top_n": None, "return_documents": False}),
    {"custom_id": "native", **{k: v for k, v in SCORE_BODY.items() if k != "model"}},  # today's format, mixed in
]
# Each bad line, its error code and its OpenAI output line's status: what the synchronous route answers for the
# same request (test_bad_lines_answer_as_the_routes checks the routes'), 422 for a body that does not fit.
BAD = [
    (openai_line("get", "/v1/score", SCORE_BODY, method="GET"), "method_not_allowed", 405),
    (openai_line("embeddings", "/v1/embeddings", {"input": "x"}), "unknown_url", 404),
    (openai_line("no-labels", "/v1/score", {"query": "q", "items": ["a"]}), "invalid_input", 422),
    (openai_line("bad-docs", "/v1/rerank", {"query": "q", "documents": [{"title": "x"}]}), "invalid_input", 422),
    (openai_line("bad-label", "/v1/score", {**SCORE_BODY, "label_token_ids": [10 ** 9]}),
     "label_token_id_out_of_range", 400),
    (openai_line("other-model", "/v1/rerank", {**RERANK_BODY, "model": "Qwen3-Reranker-8B"}), "unknown_model", 400),
    ({"custom_id": "no-body", "method": "POST", "url": "/v1/score"}, "invalid_input", 422),
    (openai_line("score-v1", "/v1/score", SCORE_BODY), "duplicate_custom_id", 400),
]


def test_openai_lines_in_both_output_formats(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    alice, _ = make_key("alice")
    bob, _ = make_key("bob")
    response = upload(client, alice, GOOD + [line for line, _, _ in BAD])
    assert response.status_code == 201, response.text
    batch = response.json()
    assert batch["counts"] == {"total": len(GOOD) + len(BAD), "succeeded": 0, "failed": len(BAD), "cancelled": 0}
    assert drain() == len(GOOD)
    assert client.get(f"/batches/{batch['id']}", headers=auth(alice)).json()["status"] == "completed"

    scores = get_scorer().score(SCORE_BODY["query"], SCORE_BODY["items"], [5, 17], True)
    relevance = expected_relevance(RERANK_BODY["query"], TEXTS)

    lines = result_lines(client, alice, batch["id"])
    assert len(lines) == len(GOOD) + len(BAD)
    # The duplicate line keeps the first line's custom_id (its error tells the two apart).
    native = {line["custom_id"]: line for line in lines if line.get("error", {}).get("code") != "duplicate_custom_id"}
    for custom_id in ("score-v1", "score", "native"):
        np.testing.assert_allclose(native[custom_id]["scores"], scores, rtol=SCORE_RTOL, atol=0)
        assert "results" not in native[custom_id] and "error" not in native[custom_id]
    check_results(native["rerank-v1"]["results"], relevance, 3, documents=True)
    check_results(native["rerank"]["results"], relevance, None, documents=False)
    for line, code, _ in BAD[:-1]:
        assert native[line["custom_id"]]["error"]["code"] == code, native[line["custom_id"]]

    response = client.get(f"/batches/{batch['id']}/results", params={"format": "openai"}, headers=auth(alice))
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/jsonl")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) == len(GOOD) + len(BAD)
    assert all(set(line) == {"id", "custom_id", "response", "error"} for line in lines)
    openai = {line["custom_id"]: line for line in lines if line["response"]["status_code"] == 200}
    assert set(openai) == {line["custom_id"] for line in GOOD}
    for line in openai.values():
        assert line["error"] is None and line["response"]["request_id"] == line["id"]
    for custom_id in ("score-v1", "score", "native"):
        body = openai[custom_id]["response"]["body"]
        assert body["object"] == "scoring" and body["id"] == openai[custom_id]["id"] and body["model"] == "tiny-random"
        assert body["usage"]["prompt_tokens"] > 0
        np.testing.assert_allclose(body["scores"], scores, rtol=SCORE_RTOL, atol=0)
    for custom_id, top_n, documents in (("rerank-v1", 3, True), ("rerank", None, False)):
        body = openai[custom_id]["response"]["body"]
        assert body["object"] == "rerank" and set(body) == {"id", "object", "created", "model", "results", "usage"}
        check_results(body["results"], relevance, top_n, documents)
    failed = [line for line in lines if line["response"]["status_code"] != 200]
    # (The repeated custom_id's line keeps it.)
    got = sorted((line["custom_id"] or "", line["response"]["status_code"], line["response"]["body"]["error"]["code"])
                 for line in failed)
    assert got == sorted((line["custom_id"], status, code) for line, code, status in BAD)
    assert all(line["error"] is None for line in failed)  # the route answered them (with an error)

    # Another tenant sees neither the batch nor its results, in either format.
    for params in ({}, {"format": "openai"}):
        response = client.get(f"/batches/{batch['id']}/results", params=params, headers=auth(bob))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert client.get(f"/batches/{batch['id']}", headers=auth(bob)).status_code == 404
    bad_format = client.get(f"/batches/{batch['id']}/results", params={"format": "csv"}, headers=auth(alice))
    assert bad_format.status_code == 422


def test_cancelled_request_in_openai_format(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    batch = upload(client, key, GOOD[:2]).json()
    assert client.post(f"/batches/{batch['id']}/cancel", headers=auth(key)).json()["status"] == "cancelled"
    response = client.get(f"/batches/{batch['id']}/results", params={"format": "openai"}, headers=auth(key))
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in lines] == [
        ("score-v1", None, "cancelled"), ("score", None, "cancelled")]


def test_bad_lines_answer_as_the_routes(client, make_key) -> None:  # type: ignore[no-untyped-def]
    """BAD's statuses and codes are what the synchronous routes answer for the same method, url and body
    (the duplicate custom_id has no route equivalent)."""
    key, _ = make_key()
    for line, code, status in BAD[:-1]:
        kwargs = {"json": line["body"]} if "body" in line else {}
        response = client.request(line["method"], line["url"], headers=auth(key), **kwargs)
        expected_code = "not_found" if code == "unknown_url" else code
        assert (response.status_code, response.json()["error"]["code"]) == (status, expected_code), line


def test_line_error_statuses() -> None:
    """A line's own codes get the status of the route error they stand for; the routes' codes their own."""
    from store.batches import _LINE_ROUTE_CODE
    from store.errors import error_status

    statuses = {code: error_status(_LINE_ROUTE_CODE.get(code, code)) for code in (
        "invalid_json", "line_too_long", "duplicate_custom_id", "unknown_url", "method_not_allowed",
        "invalid_input", "too_many_tokens", "unknown_model", "worker_lost", "internal_error")}
    assert statuses == {"invalid_json": 422, "line_too_long": 413, "duplicate_custom_id": 400, "unknown_url": 404,
                        "method_not_allowed": 405, "invalid_input": 422, "too_many_tokens": 400,
                        "unknown_model": 400, "worker_lost": 503, "internal_error": 500}
