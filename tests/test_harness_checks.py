"""The service tests' own checks can fail: a score off by half a nat, a succeeded job without its result and a
job with two webhook messages are all caught (issue 12, item 10)."""

import json

import numpy as np
import pytest
from sqlalchemy import text

from core import Scorer
from store.db import session_scope
from tests.load_runner import scores_agree
from tests.service_harness import assert_exactly_once, assert_scores

BODY = {"query": "Which is right?", "items": ["this one", "that one", ""], "label_token_ids": [5, 17, 300]}


@pytest.fixture(scope="module")
def reference() -> Scorer:
    return Scorer.from_pretrained("tiny-random")


@pytest.mark.parametrize("apply_softmax", [False, True])
def test_score_checks_catch_half_a_nat(reference: Scorer, apply_softmax: bool) -> None:
    body = {**BODY, "apply_softmax": apply_softmax}
    expected = np.asarray(reference.score(body["query"], body["items"], body["label_token_ids"], apply_softmax))
    assert_scores({"scores": expected.tolist()}, body, reference)
    assert scores_agree(expected, expected)
    logprobs = reference.logprobs(body["query"], body["items"], body["label_token_ids"])
    off = logprobs.copy()
    off[1, 0] -= 0.5  # one score of one item off by half a nat
    wrong = np.exp(off) if not apply_softmax else np.exp(off - np.log(np.exp(off).sum(1, keepdims=True)))
    if not apply_softmax:
        assert float(np.exp(logprobs).max()) < 1e-3, "the tiny model's probabilities are tiny: the point of this test"
    with pytest.raises(AssertionError):
        assert_scores({"scores": wrong.tolist()}, body, reference)
    assert not scores_agree(wrong, expected)


def _load_job(session, key_id: str, tag: str, status: str, items_done: int, result: bool, hooks: int) -> str:  # type: ignore[no-untyped-def]
    job_id = session.execute(text(
        "INSERT INTO jobs (id, api_key_id, status, priority, model, request, return_logprobs, metadata,"
        " request_hash, items_total, items_done, prompt_tokens, attempts, cancel_requested, created_at)"
        " VALUES ('job_' || md5(random()::text), :key, :status, 0, 'tiny-random', '{}', false,"
        " CAST(:meta AS json), '', 2, :done, 3, 1, false, now()) RETURNING id"),
        {"key": key_id, "status": status, "done": items_done, "meta": json.dumps({"load_tag": tag})}).scalar_one()
    if result:
        session.execute(text("INSERT INTO job_results (job_id, n_labels, logprobs, created_at)"
                             " VALUES (:id, 1, :blob, now())"), {"id": job_id, "blob": b"\0" * 8})
    for _ in range(hooks):
        session.execute(text("INSERT INTO webhook_deliveries (id, api_key_id, job_id, url, payload, status, attempts,"
                             " next_attempt_at, created_at) VALUES ('msg_' || md5(random()::text), :key, :id,"
                             " 'http://x', '{}', 'delivered', 1, now(), now())"), {"key": key_id, "id": job_id})
    return job_id


@pytest.mark.parametrize("status, items_done, result, hooks, ok", [
    ("succeeded", 2, True, 1, True),
    ("failed", 0, False, 1, True),
    ("succeeded", 2, False, 1, False),  # the result was lost
    ("succeeded", 1, True, 0, False),  # an item was never scored
    ("failed", 0, True, 0, False),  # a failed job with a result
    ("succeeded", 2, True, 2, False),  # two webhook messages for one job
    ("running", 1, False, 0, False),  # not terminal
])
def test_exactly_once_check_can_fail(database: str, make_key, run_id: str, status: str, items_done: int,  # type: ignore[no-untyped-def]
                                     result: bool, hooks: int, ok: bool) -> None:
    from api.auth import find_api_key

    key, _ = make_key()
    tag = f"check-{run_id}-{status}-{items_done}-{result}-{hooks}"
    with session_scope() as session:
        job_id = _load_job(session, find_api_key(session, key).id, tag, status, items_done, result, hooks)
    if ok:
        assert_exactly_once(database, [job_id], tag)
    else:
        with pytest.raises(AssertionError):
            assert_exactly_once(database, [job_id], tag)
