"""Batches in-process on PostgreSQL (API through TestClient, worker rounds called directly): upload with good
and bad lines, the JSON body form, results while running, cancel midway, tenant isolation, limits, the
webhook, and the batch lane's order (interactive first, tenants in turn, requests grouped by query)."""

import json

import numpy as np
import pytest
from sqlalchemy import select, text
from standardwebhooks import Webhook

from store import claims, finishing
from store.db import session_scope
from store.models import Job
from store.priorities import PRIORITY_BATCH
from store.settings import get_settings
from tests import claiming
from tests.load_runner import SCORE_RTOL
from worker import drain as drain_module
from worker import policy as policy_module
from worker.scorer import get_scorer
from worker.webhooks import deliver_due


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def clean(empty_queue) -> None:  # type: ignore[no-untyped-def]
    with session_scope() as session:
        session.execute(text("DELETE FROM batches"))


def request_line(i: int, **extra: object) -> dict:
    # 5 distinct queries, so requests share queries (the batch lane groups them).
    return {"custom_id": f"req-{i}", "query": f"Which answer fits question {i % 5}?",
            "items": [f"answer {i}", "no", "a longer answer here"][: 1 + i % 3], "label_token_ids": [5, 17, 300],
            **extra}


def upload(client, key: str, lines: list, **params: str):  # type: ignore[no-untyped-def]
    body = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode()
    return client.post("/batches", content=body, params=params,
                       headers={**auth(key), "content-type": "application/jsonl"})


def result_lines(client, key: str, batch_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    response = client.get(f"/batches/{batch_id}/results", headers=auth(key))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/jsonl")
    return [json.loads(line) for line in response.text.splitlines()]


def results(client, key: str, batch_id: str) -> dict:  # type: ignore[no-untyped-def]
    lines = result_lines(client, key, batch_id)
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in the results"
    return by_id


def drain() -> int:
    return drain_module.drain(get_scorer(), "worker-a", get_settings())


def one_round(owner: str = "worker-a") -> list:  # type: ignore[type-arg]
    """One claim and run of the worker, as the drain loop does it."""
    jobs = claiming.claim_jobs(owner, get_settings(), get_scorer().pass_tokens)
    claiming.run_jobs(get_scorer(), owner, jobs)
    finishing.settle_batches({job.batch_id for job in jobs if job.batch_id})
    return jobs


def test_upload_with_good_and_bad_lines(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    good = [request_line(i, apply_softmax=i % 2 == 0, return_logprobs=i == 3) for i in range(12)]
    bad = [
        "this is not json",
        '{"custom_id": "truncated", "query": ',
        json.dumps([1, 2, 3]),
        json.dumps({"query": "no custom id", "items": ["a"], "label_token_ids": [1]}),
        json.dumps({**request_line(100), "label_token_ids": []}),
        json.dumps({**request_line(101), "label_token_ids": [10 ** 9]}),
        json.dumps({**request_line(102), "items": [[1, 2]]}),
        json.dumps({**request_line(103), "model": "other-model"}),
        json.dumps({**request_line(104), "unexpected": 1}),
        json.dumps(request_line(0)),  # duplicate custom_id
        json.dumps({**request_line(105), "custom_id": "nul\u0000id"}),
    ]
    lines = good[:6] + bad + [""] + good[6:]
    response = upload(client, key, lines, metadata=json.dumps({"run": 7}))
    assert response.status_code == 201, response.text
    batch = response.json()
    assert response.headers["Location"] == f"/batches/{batch['id']}"
    assert batch["status"] == "in_progress" and batch["metadata"] == {"run": 7}
    assert batch["counts"] == {"total": len(good) + len(bad), "succeeded": 0, "failed": len(bad), "cancelled": 0}

    assert drain() == len(good)
    batch = client.get(f"/batches/{batch['id']}", headers=auth(key)).json()
    assert batch["status"] == "completed" and batch["finished_at"] is not None
    assert batch["counts"] == {"total": len(good) + len(bad), "succeeded": len(good), "failed": len(bad),
                               "cancelled": 0}
    n_items = sum(len(line["items"]) for line in good)
    assert batch["progress"] == {"items_done": n_items, "items_total": n_items}

    lines = result_lines(client, key, batch["id"])
    assert len(lines) == len(good) + len(bad)
    scored = {line["custom_id"]: line for line in lines if "error" not in line}
    errors = [line for line in lines if "error" in line]
    scorer = get_scorer()
    for line in good:
        got = scored[line["custom_id"]]
        expected = scorer.score(line["query"], line["items"], line["label_token_ids"], line.get("apply_softmax", False))
        np.testing.assert_allclose(got["scores"], expected, rtol=SCORE_RTOL, atol=0)
        assert ("logprobs" in got) == line.get("return_logprobs", False)
    codes = sorted(line["error"]["code"] for line in errors)
    assert codes == sorted(["invalid_json", "invalid_json", "invalid_input", "invalid_input",
                            "empty_label_token_ids", "label_token_id_out_of_range", "mixed_input_types",
                            "unknown_model", "invalid_input", "duplicate_custom_id", "invalid_input"])
    assert all(line["scores"] is None for line in errors)
    # Lines with no readable custom_id; the repeated one keeps its custom_id, and its message its line.
    assert sum(line["custom_id"] is None for line in errors) == 4
    assert [e["custom_id"] for e in errors if e["error"]["code"] == "duplicate_custom_id"] == ["req-0"]
    duplicate = next(e for e in errors if e["error"]["code"] == "duplicate_custom_id")
    assert duplicate["error"]["message"] == "line 16: custom_id 'req-0' was already used on line 1", duplicate
    assert len({line["custom_id"] for line in lines if line["custom_id"] is not None}) == len(good) + len(bad) - 5
    assert all(e["error"]["message"].startswith("line ") for e in errors)


def test_json_body_form_and_webhook(client, make_key, clean, webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    key, secret = make_key()
    body = {"requests": [request_line(i) for i in range(4)] + ["not an object"], "webhook_url": webhook_receiver.url,
            "metadata": {"source": "json"}}
    response = client.post("/batches", json=body, headers=auth(key))
    assert response.status_code == 201, response.text
    batch_id = response.json()["id"]
    assert response.json()["counts"]["total"] == 5
    drain()
    deliver_due(get_settings())
    assert len(webhook_receiver.requests) == 1
    headers, payload = webhook_receiver.requests[0]
    event = Webhook(secret).verify(payload, headers)
    assert event["type"] == "batch.completed"
    assert event["data"]["id"] == batch_id and event["data"]["counts"]["succeeded"] == 4
    assert event["data"]["metadata"] == {"source": "json"}
    batch = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
    assert batch["webhook"]["status"] == "delivered" and batch["webhook"]["id"] == headers["webhook-id"]


def test_not_jsonl_and_limits(client, make_key, clean, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()

    def assert_error(response, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code

    assert_error(client.post("/batches", content=b"\x89PNG\r\n\x1a\n\x00\x00binary\xff\xfe",
                             headers=auth(key)), 400, "invalid_jsonl")
    assert_error(client.post("/batches", content=b"a,b,c\n1,2,3\n", headers=auth(key)), 400, "invalid_jsonl")
    assert_error(client.post("/batches", content=b"\n\n", headers=auth(key)), 400, "empty_batch")
    assert_error(client.post("/batches", content=b"{}", headers={**auth(key), "content-type": "application/json"}),
                 422, "invalid_input")
    assert_error(upload(client, key, [request_line(0)], webhook_url="http://10.1.2.3/hook"), 400,
                 "invalid_webhook_url")
    assert_error(upload(client, key, [request_line(0)], metadata="[1]"), 422, "invalid_input")
    monkeypatch.setattr(get_settings(), "batch_max_requests", 3)
    refused = upload(client, key, [request_line(i) for i in range(4)])
    assert_error(refused, 413, "batch_too_large")
    monkeypatch.setattr(get_settings(), "batch_max_bytes", 100)
    assert_error(upload(client, key, [request_line(i) for i in range(3)]), 413, "batch_too_large")
    # A refused upload leaves a failed batch and none of its requests.
    failed = client.get(f"/batches/{refused.json()['error']['batch_id']}", headers=auth(key)).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "batch_too_large"
    assert failed["counts"] == {"total": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    assert drain() == 0
    assert_error(client.post("/batches", content=b"{}", headers={"content-type": "application/jsonl"}), 401,
                 "unauthorized")


def test_query_parameters_beside_a_json_body_are_refused(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    """A JSON body's batch took its model, webhook and metadata from the body only: `?model=judge` ran on the
    default model, `?webhook_url=` sent nothing, and an unknown model was a 201."""
    key, _ = make_key()
    for params in ({"model": "tiny-random"}, {"model": "no-such-model"}, {"webhook_url": "https://example.com/h"},
                   {"metadata": '{"run": 1}'}):
        for body in ({"requests": [request_line(0)]}, {"input": "p.parquet", "output": "out/"}):
            response = client.post("/batches", json=body, params=params, headers=auth(key))
            assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input", \
                (params, response.text)
            assert next(iter(params)) in response.json()["error"]["message"]
    with session_scope() as session:
        assert session.scalar(text("SELECT count(*) FROM batches")) == 0


def test_hostile_values_on_the_batch_routes_get_typed_4xx(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    """Each of these was a 500, and the lone surrogate in a batch's metadata was stored: every later read of the
    batch a 500 too."""
    key, _ = make_key()
    json_body = {**auth(key), "content-type": "application/json"}
    deep = "[" * 5000 + "]" * 5000  # deeper than the parsers' recursion limit

    def code(response) -> tuple[int, str]:  # type: ignore[no-untyped-def]
        return response.status_code, response.json()["error"]["code"]

    surrogate = b'{"requests": [], "metadata": {"k": "\\ud800"}}'
    assert code(client.post("/batches", content=surrogate, headers=json_body)) == (422, "invalid_input")
    assert code(client.post("/batches", content=b'{"requests": [], "metadata": ' + deep.encode() + b"}",
                            headers=json_body)) == (422, "invalid_input")
    for metadata in ('{"k": "\\ud800"}', deep):
        assert code(upload(client, key, [request_line(0)], metadata=metadata)) == (422, "invalid_input")
    for uri in ("s3://[b/x.jsonl", "file://[x/y"):
        response = client.post("/batches", json={"input": uri, "output": uri}, headers=auth(key))
        assert code(response) == (400, "invalid_uri"), response.text
    response = client.post("/batches", content=b'{"input": "pairs\\ud800.csv", "output": "out/"}', headers=json_body)
    assert code(response) == (422, "invalid_input"), response.text
    for taken in ("scores", "error_code", "error"):  # an id column the results' own would overwrite
        response = client.post("/batches", json={"input": "p.parquet", "output": "out/", "label_token_ids": [1],
                                                 "columns": {"query": "q", "item": "d", "ids": ["pair_id", taken]}},
                               headers=auth(key))
        assert code(response) == (422, "invalid_input") and repr(taken) in response.text, response.text
    assert client.get("/batches", headers=auth(key)).status_code == 200  # nothing unreadable was stored
    # A line nested too deeply, or holding a lone surrogate, is that line's error; the others run.
    surrogates = [request_line(1, query="\ud800"), {**request_line(2), "custom_id": "\udfff"}]
    created = upload(client, key, [request_line(0), '{"custom_id": "deep", "query": ' + deep + "}", *surrogates])
    body = client.post("/batches", content=json.dumps({"requests": [request_line(0), *surrogates]}).encode(),
                       headers=json_body)
    for batch in (created, body):
        assert batch.status_code == 201, batch.text
        drain()
        lines = result_lines(client, key, batch.json()["id"])
        assert len(lines) == batch.json()["counts"]["total"] and [line["custom_id"] for line in lines][0] == "req-0"
        assert lines[0]["scores"] and all(line["error"]["code"] in ("invalid_json", "invalid_input")
                                          for line in lines[1:]), lines


def test_a_batch_is_settled_whatever_its_workers_left_undone(client, make_key, clean, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two ways a batch stayed open for good: a request handed back (its worker stopping) after the batch's
    cancel went back to a queue that no claim reads for a cancelling batch; a worker that died between its
    last result and settling the batch left it in_progress. The sweeper settles both."""
    from store import job_writer, sweeper
    from store.models import Batch

    key, _ = make_key()
    settings = get_settings()
    cancelled = upload(client, key, [request_line(i) for i in range(3)]).json()["id"]
    claimed = claiming.claim_jobs("worker-a", settings, get_scorer().pass_tokens)
    assert {job.batch_id for job in claimed} == {cancelled}
    assert client.post(f"/batches/{cancelled}/cancel", headers=auth(key)).json()["status"] == "cancelling"
    finishing.release("worker-a", settings, [job.id for job in claimed], None)  # the worker stops
    monkeypatch.setattr(job_writer, "settle_batches", lambda batch_ids: None)  # dies before settling
    completed = upload(client, key, [request_line(i) for i in range(2)]).json()["id"]
    drain()
    with session_scope() as session:
        assert session.get(Batch, completed).status == "in_progress"
        assert session.get(Batch, cancelled).status == "cancelling"
    sweeper.sweep(settings)
    for batch_id, status in ((cancelled, "cancelled"), (completed, "completed")):
        batch = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
        assert batch["status"] == status, batch
    assert client.get(f"/batches/{cancelled}", headers=auth(key)).json()["counts"]["cancelled"] == 3


def test_a_download_that_retention_cuts_short_breaks_off(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    """Retention deletes an expired batch's requests a thousand at a time, in the order the download's pages read
    them: the download came to an empty page and ended as if whole (1,000 of 3,000 lines, status 200)."""
    from datetime import timedelta

    from sqlalchemy import update

    from store import batches as batch_store
    from store.db import session_factory
    from store.models import Batch, utcnow
    from store.retention import prune

    key, _ = make_key()
    batch_id = upload(client, key, [request_line(i) for i in range(5)]).json()["id"]
    drain()
    assert client.get(f"/batches/{batch_id}", headers=auth(key)).json()["status"] == "completed"
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(finished_at=utcnow() - timedelta(days=40)))
    pages = batch_store.iter_results(batch_id, page_rows=2)
    assert next(pages).count(b"\n") == 2
    prune(session_factory(), get_settings().model_copy(update={"result_ttl_days": 30, "retention_chunk_rows": 2}))
    with pytest.raises(RuntimeError, match="3 of its 5 results were deleted"):
        list(pages)


def test_results_stream_while_running_then_cancel(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    batch_id = upload(client, key, [request_line(i) for i in range(200)]).json()["id"]
    assert results(client, key, batch_id) == {}
    first = one_round()
    assert 0 < len(first) < 200
    partial = results(client, key, batch_id)
    with session_scope() as session:
        custom_ids = set(session.scalars(select(Job.custom_id).where(Job.id.in_([job.id for job in first]))))
    assert set(partial) == custom_ids
    assert all(line["scores"] for line in partial.values())
    batch = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
    assert batch["status"] == "in_progress" and batch["counts"]["succeeded"] == len(first)

    # Cancel while a round is claimed: queued requests are cancelled now, the running ones finish.
    running = claiming.claim_jobs("worker-a", get_settings(), get_scorer().pass_tokens)
    response = client.post(f"/batches/{batch_id}/cancel", headers=auth(key))
    assert response.status_code == 202 and response.json()["status"] == "cancelling"
    claiming.run_jobs(get_scorer(), "worker-a", running)
    finishing.settle_batches({batch_id})
    batch = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
    done = len(first) + len(running)
    assert batch["status"] == "cancelled"
    assert batch["counts"] == {"total": 200, "succeeded": done, "failed": 0, "cancelled": 200 - done}
    out = results(client, key, batch_id)
    assert len(out) == 200
    assert sum(1 for line in out.values() if line["scores"]) == done
    assert {line["error"]["code"] for line in out.values() if not line["scores"]} == {"cancelled"}
    assert client.post(f"/batches/{batch_id}/cancel", headers=auth(key)).status_code == 409
    assert drain() == 0


def test_cancel_with_nothing_running_is_immediate(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    batch_id = upload(client, key, [request_line(i) for i in range(10)]).json()["id"]
    response = client.post(f"/batches/{batch_id}/cancel", headers=auth(key))
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert response.json()["counts"]["cancelled"] == 10


def test_results_come_in_line_order(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    """An upload makes many requests in the same millisecond; their results still come in the lines' order
    (ids that were time and random only sorted within a millisecond by chance: CI failed on it)."""
    key, _ = make_key()
    batch_id = upload(client, key, [request_line(i) for i in range(300)]).json()["id"]
    client.post(f"/batches/{batch_id}/cancel", headers=auth(key))
    assert [line["custom_id"] for line in result_lines(client, key, batch_id)] == [f"req-{i}" for i in range(300)]


def test_tenant_isolation_and_listing(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    alice, _ = make_key("alice")
    bob, _ = make_key("bob")
    ids = [upload(client, alice, [request_line(i)]).json()["id"] for i in range(3)]
    for path in (f"/batches/{ids[0]}", f"/batches/{ids[0]}/results"):
        response = client.get(path, headers=auth(bob))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert client.post(f"/batches/{ids[0]}/cancel", headers=auth(bob)).status_code == 404
    assert client.get("/batches", headers=auth(bob)).json()["data"] == []
    page = client.get("/batches", params={"limit": 2}, headers=auth(alice)).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2]
    rest = client.get("/batches", params={"limit": 2, "cursor": page["next_cursor"]}, headers=auth(alice)).json()
    assert [b["id"] for b in rest["data"]] == ids[:1] and rest["next_cursor"] is None
    # A batch's requests are not listed as jobs.
    assert client.get("/jobs", headers=auth(alice)).json()["data"] == []


def test_batch_lane_order(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    """Interactive jobs before any batch request; tenants take turns whatever their number of batches;
    a round takes a batch's requests grouped by query."""
    alice, _ = make_key("alice")
    bob, _ = make_key("bob")
    alice_batches = [upload(client, alice, [request_line(i) for i in range(60)]).json()["id"] for _ in range(2)]
    bob_batch = upload(client, bob, [request_line(i) for i in range(60)]).json()["id"]
    job = client.post("/jobs", json={"query": "hi", "items": ["x"], "label_token_ids": [1]}, headers=auth(bob))
    settings, tokens = get_settings(), 64
    first = claiming.claim_jobs("w", settings, tokens)
    assert [j.id for j in first] == [job.json()["id"]]
    tenants, batches = [], []
    for _ in range(6):
        with session_scope() as session:  # the claim returns what the worker needs; the test reads the rows
            claimed = [session.get(Job, j.id) for j in claiming.claim_jobs("w", settings, tokens)]
            session.expunge_all()
        assert claimed and len({j.batch_id for j in claimed}) == 1
        assert sum(j.prompt_tokens for j in claimed) <= tokens or len(claimed) == 1
        keys = [j.query_key for j in claimed]
        assert keys == sorted(keys)  # grouped by query
        tenants.append(claimed[0].api_key_id)
        batches.append(claimed[0].batch_id)
    assert tenants[0::2] != tenants[1::2] and len(set(tenants[0::2])) == 1 and len(set(tenants[1::2])) == 1
    # Alice's batches run oldest first: her second batch waits while her first has queued requests.
    assert alice_batches[1] not in batches and bob_batch in batches


def test_a_wake_up_during_a_backfill_does_not_end_the_loop(client, make_key, clean, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A kick arriving while the loop holds batch work makes it claim interactive jobs only. Finding none must
    not count as "no work left": it did, and the loop ended with the batch's other requests queued (the
    sweeper restarted it seconds later, the device idle meanwhile)."""
    import threading

    key, _ = make_key()
    batch_id = upload(client, key, [request_line(i) for i in range(150)]).json()["id"]
    scorer, settings = get_scorer(), get_settings()
    monkeypatch.setattr(policy_module, "CLAIM_AHEAD_PASSES", 1)
    wake, calls = threading.Event(), []

    def claim(interactive_only: bool) -> list:  # type: ignore[type-arg]
        calls.append(interactive_only)
        if len(calls) == 1:
            wake.set()  # a kick during the first round
        if interactive_only:
            return claims.claim_interactive("worker-a", settings, PRIORITY_BATCH)
        return claims.claim_batch_round("worker-a", settings, 2 * scorer.pass_tokens)

    claiming.run_claims(scorer, "worker-a", settings, claim, wake)
    assert calls[:2] == [False, True]  # the path under test: a round, then an interactive-only claim
    with session_scope() as session:
        statuses = session.scalars(select(Job.status).where(Job.batch_id == batch_id)).all()
    assert len(statuses) == 150 and set(statuses) == {"succeeded"}


def test_the_listing_shows_each_batch_as_its_own_get_from_counts_kept_on_the_batch(  # type: ignore[no-untyped-def]
        client, make_key, clean) -> None:
    """Batches ended every way a request ends (scored, failed at upload, cancelled with the batch or alone, handed
    back then cancelled by the sweeper) and one running: GET /batches shows each exactly as GET /batches/{id},
    with one query of the requests for the whole page (their running ones'), not one sum per batch."""
    from sqlalchemy import event

    from store import sweeper
    from store.db import get_engine

    key, _ = make_key()
    settings = get_settings()
    mixed = upload(client, key, [request_line(0), "{not json", request_line(1), request_line(1),
                                 {"custom_id": "x", "query": "q", "items": ["a"], "label_token_ids": [10 ** 9]},
                                 request_line(2)]).json()["id"]
    drain()
    alone = upload(client, key, [request_line(i) for i in range(3)]).json()["id"]
    with session_scope() as session:
        one = session.scalars(select(Job.id).where(Job.batch_id == alone).order_by(Job.id).limit(1)).one()
    assert client.post(f"/jobs/{one}/cancel", headers=auth(key)).json()["status"] == "cancelled"
    drain()
    cancelled = upload(client, key, [request_line(i) for i in range(60)]).json()["id"]
    one_round()
    running = claiming.claim_jobs("worker-a", settings, get_scorer().pass_tokens)
    assert client.post(f"/batches/{cancelled}/cancel", headers=auth(key)).status_code == 202
    claiming.run_jobs(get_scorer(), "worker-a", running)
    finishing.settle_batches({cancelled})
    handed_back = upload(client, key, [request_line(i) for i in range(3)]).json()["id"]
    claimed = claiming.claim_jobs("worker-a", settings, get_scorer().pass_tokens)
    client.post(f"/batches/{handed_back}/cancel", headers=auth(key))
    finishing.release("worker-a", settings, [job.id for job in claimed], None)
    sweeper.sweep(settings)
    in_progress = upload(client, key, [request_line(i) for i in range(40)]).json()["id"]
    one_round()
    now_running = claiming.claim_jobs("worker-b", settings, get_scorer().pass_tokens)
    with session_scope() as session:
        finishing.set_progress(session, "worker-b", [(job.id, 1) for job in now_running])

    statements: list[str] = []
    listen = lambda conn, cursor, statement, *args: statements.append(statement)  # noqa: E731
    event.listen(get_engine(), "before_cursor_execute", listen)
    try:
        listed = {batch["id"]: batch for batch in client.get("/batches", headers=auth(key)).json()["data"]}
    finally:
        event.remove(get_engine(), "before_cursor_execute", listen)
    ids = [mixed, alone, cancelled, handed_back, in_progress]
    assert set(listed) == set(ids)
    for batch_id in ids:
        own = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
        assert (listed[batch_id]["counts"], listed[batch_id]["progress"]) == (own["counts"], own["progress"]), own
    assert listed[mixed]["counts"] == {"total": 6, "succeeded": 3, "failed": 3, "cancelled": 0}
    assert listed[alone]["counts"] == {"total": 3, "succeeded": 2, "failed": 0, "cancelled": 1}
    assert listed[handed_back]["status"] == "cancelled" and listed[handed_back]["counts"]["cancelled"] == 3
    assert listed[in_progress]["progress"]["items_done"] > listed[in_progress]["counts"]["succeeded"] > 0
    assert len([s for s in statements if " jobs" in s]) == 1, statements
    claiming.run_jobs(get_scorer(), "worker-b", now_running)
