"""API contract on a real PostgreSQL: validation codes, auth, tenants, idempotency, cancel, pagination."""

import os

import pytest
from sqlalchemy import delete, update

from store.db import session_scope
from store.models import ApiKey, Job

QUERY = {"query": "Is this relevant?", "items": ["yes", "no"], "label_token_ids": [1, 2]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(response, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_create_and_get_job(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    response = client.post("/jobs", json={**QUERY, "metadata": {"note": "'; DROP TABLE jobs; --", "n": [1.5, None]},
                                          "webhook_url": "http://127.0.0.1:9/hook", "return_logprobs": True},
                           headers=auth(key))
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["Location"] == f"/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert job["progress"] == {"items_done": 0, "items_total": 2}
    assert job["usage"]["prompt_tokens"] > 0
    assert job["metadata"] == {"note": "'; DROP TABLE jobs; --", "n": [1.5, None]}
    assert job["model"] == "tiny-random"
    fetched = client.get(f"/jobs/{job['id']}", headers=auth(key))
    assert fetched.status_code == 200
    # The POST answers from the row it inserted, without reading it back: the same job as stored.
    assert fetched.json() == job


@pytest.mark.parametrize("body, code", [
    ({"query": [], "items": [[1]], "label_token_ids": [1]}, "empty_query"),
    ({**QUERY, "label_token_ids": []}, "empty_label_token_ids"),
    ({**QUERY, "label_token_ids": [1, 49152]}, "label_token_id_out_of_range"),
    ({**QUERY, "label_token_ids": [-1]}, "label_token_id_out_of_range"),
    ({"query": [1, 2], "items": [[3], [49152]], "label_token_ids": [1]}, "token_id_out_of_range"),
    ({"query": [1, 10**30], "items": [[3]], "label_token_ids": [1]}, "token_id_out_of_range"),
    ({"query": "text", "items": [[3, 4]], "label_token_ids": [1]}, "mixed_input_types"),
    ({"query": [1, 2], "items": ["text"], "label_token_ids": [1]}, "mixed_input_types"),
    ({**QUERY, "items": ["x"] * 5001}, "too_many_items"),
    ({**QUERY, "items": ["one two three four five six seven eight nine ten " * 3] * 4000}, "too_many_tokens"),
    ({**QUERY, "items": ["word " * 8200]}, "too_many_tokens"),  # longer than the model takes (8192)
    ({**QUERY, "model": "gpt-9"}, "unknown_model"),
    ({**QUERY, "webhook_url": "http://10.1.2.3/hook"}, "invalid_webhook_url"),
    ({**QUERY, "webhook_url": "http://169.254.169.254/latest/meta-data"}, "invalid_webhook_url"),
    ({**QUERY, "webhook_url": "ftp://example.com/x"}, "invalid_webhook_url"),
])
def test_validation_codes(client, make_key, body, code) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert_error(client.post("/jobs", json=body, headers=auth(key)), 400, code)


@pytest.mark.parametrize("body", [
    {"query": "q", "items": "not a list", "label_token_ids": [1]},
    {"query": "q", "items": ["a"], "label_token_ids": [1.5]},
    {"query": "q", "items": ["a"], "label_token_ids": ["1"]},
    {"query": "q", "items": ["a"], "label_token_ids": [True]},
    {"query": 5, "items": ["a"], "label_token_ids": [1]},
    {"query": "q", "items": [None], "label_token_ids": [1]},
    {"items": ["a"], "label_token_ids": [1]},
    {**QUERY, "apply_softmax": "yes"},
    {**QUERY, "unexpected": 1},
    {**QUERY, "metadata": "not an object"},
    [1, 2, 3],
])
def test_bad_shapes_are_422(client, make_key, body) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert_error(client.post("/jobs", json=body, headers=auth(key)), 422, "invalid_input")


def test_an_unknown_field_is_named_with_the_field_it_is_closest_to(client, make_key) -> None:  # type: ignore[no-untyped-def]
    """`labels` for `label_token_ids`: /jobs and /v1/score name both (the unknown field, and the missing one it
    probably is); so do batch lines."""
    from store.batches import LineError, parse_line

    key, _ = make_key()
    body = {"query": "q", "items": ["a"], "labels": [1]}
    response = client.post("/jobs", json=body, headers=auth(key))
    assert_error(response, 422, "invalid_input")
    message = response.json()["error"]["message"]
    assert "labels: unknown field (did you mean `label_token_ids`?)" in message, message
    assert "label_token_ids: Field required (the body has `labels`" in message, message
    response = client.post("/v1/score", json=body, headers=auth(key))
    assert_error(response, 422, "invalid_input")
    assert "did you mean `label_token_ids`?" in response.json()["error"]["message"]
    response = client.post("/jobs", json={**QUERY, "webhook": "https://example.com"}, headers=auth(key))
    assert "webhook: unknown field (did you mean `webhook_url`?)" in response.json()["error"]["message"]
    with pytest.raises(LineError) as refused:
        parse_line({"custom_id": "a", "query": "q", "item": ["a"], "label_token_ids": [1]})
    assert "item: unknown field (did you mean `items`?)" in refused.value.message
    with pytest.raises(LineError) as refused:
        parse_line({"custom_id": "a", "method": "POST", "url": "/v1/score",
                    "body": {"query": "q", "items": ["a"], "label_ids": [1]}})
    assert "body.label_token_ids: Field required (the body has `label_ids`" in refused.value.message


def test_a_typo_never_changes_the_answer(client, make_key) -> None:  # type: ignore[no-untyped-def]
    """Every body refuses a field it does not know, naming it and the field it is closest to (issue 44: a typo'd
    `apply_sofmax` was ignored and the scores came back unsoftmaxed); the fields other engines' clients send that
    change no score are accepted and dropped, and none of them is a near miss of one of ours."""
    import difflib

    from store.batches import LineError, parse_line
    from store.schemas import OTHER_ENGINES_FIELDS, RerankRequest, ScoreRequest, _field_names

    key, _ = make_key()
    rerank = {"query": "q", "documents": ["a", "b"]}
    typos = [("/v1/score", {**QUERY, "apply_sofmax": True}, "apply_sofmax", "apply_softmax"),
             ("/score", {**QUERY, "item_frist": True}, "item_frist", "item_first"),
             ("/v1/rerank", {**rerank, "topn": 1}, "topn", "top_n"),
             ("/rerank", {**rerank, "return_document": False}, "return_document", "return_documents"),
             ("/jobs", {**QUERY, "apply_sofmax": True}, "apply_sofmax", "apply_softmax"),
             ("/jobs", {"kind": "rerank", **rerank, "topn": 1}, "topn", "top_n")]
    for path, body, typo, meant in typos:
        response = client.post(path, json=body, headers=auth(key))
        assert_error(response, 422, "invalid_input")
        assert f"{typo}: unknown field (did you mean `{meant}`?)" in response.json()["error"]["message"], path
        # The same body in an OpenAI Batch line, and (for scoring) in a native batch line.
        if path != "/jobs":
            with pytest.raises(LineError) as refused:
                parse_line({"custom_id": "a", "method": "POST", "url": path, "body": body})
            assert f"body.{typo}: unknown field (did you mean `{meant}`?)" in refused.value.message
    with pytest.raises(LineError) as refused:
        parse_line({"custom_id": "a", **QUERY, "apply_sofmax": True})
    assert "apply_sofmax: unknown field (did you mean `apply_softmax`?)" in refused.value.message

    others = {"user": "u-1", "priority": 0, "request_id": "r-1", "mm_processor_kwargs": None,
              "truncate_prompt_tokens": None}
    assert set(others) == set(OTHER_ENGINES_FIELDS)
    body = {"text_1": "q", "text_2": ["a"], "label_token_ids": [1], **others}
    assert ScoreRequest.model_validate(body).items == ["a"]
    assert RerankRequest.model_validate({**rerank, "top_n": 1, **others}).top_n == 1
    ours = _field_names(ScoreRequest) | _field_names(RerankRequest)
    for name in OTHER_ENGINES_FIELDS:
        assert name not in ours and not difflib.get_close_matches(name, ours, 1, 0.75), name
    # A number asks for truncation, which packscore never does: refused, not ignored.
    response = client.post("/v1/score", json={**QUERY, "truncate_prompt_tokens": 8}, headers=auth(key))
    assert_error(response, 422, "invalid_input")
    assert "truncate_prompt_tokens" in response.json()["error"]["message"]
    # /jobs is packscore's own route: other engines' fields are unknown there.
    assert_error(client.post("/jobs", json={**QUERY, "user": "u-1"}, headers=auth(key)), 422, "invalid_input")


def test_malformed_json_and_huge_body(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = {**auth(key), "content-type": "application/json"}
    assert_error(client.post("/jobs", content=b'{"query": "x", ', headers=headers), 422, "invalid_input")
    assert_error(client.post("/jobs", content=b"\xff\xfe\x00garbage", headers=headers), 422, "invalid_input")
    huge = b'{"query": "' + b"a" * 2_100_000 + b'", "items": [], "label_token_ids": [1]}'
    assert_error(client.post("/jobs", content=huge, headers=headers), 413, "body_too_large")

    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"query": "'
        for _ in range(30):
            yield b"a" * 100_000
        yield b'", "items": [], "label_token_ids": [1]}'

    assert_error(client.post("/jobs", content=chunks(), headers=headers), 413, "body_too_large")


def test_unicode_and_empty_items(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = {"query": "Zé \u0000\u202e 漢字 🙂", "items": ["", "\t\n\x07"], "label_token_ids": [0]}
    response = client.post("/jobs", json=body, headers=auth(key))
    assert response.status_code == 202, response.text
    response = client.post("/jobs", json={**QUERY, "items": []}, headers=auth(key))
    assert response.status_code == 202
    assert response.json()["progress"]["items_total"] == 0


def test_auth_required(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job = client.post("/jobs", json=QUERY, headers=auth(key)).json()
    for method, path in [("post", "/jobs"), ("get", "/jobs"), ("get", f"/jobs/{job['id']}"),
                         ("post", f"/jobs/{job['id']}/cancel"), ("post", "/v1/score")]:
        assert_error(getattr(client, method)(path), 401, "unauthorized")
        assert_error(getattr(client, method)(path, headers=auth("psk_wrong")), 401, "unauthorized")
        assert_error(getattr(client, method)(path, headers={"Authorization": "Basic abc"}), 401, "unauthorized")


def test_deleted_key_stops_working_within_the_cache_time(client, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import time

    from api import auth as api_auth

    monkeypatch.setattr(api_auth, "KEY_CACHE_SECONDS", 1.0)
    key, _ = make_key()
    assert client.get("/jobs", headers=auth(key)).status_code == 200
    with session_scope() as session:
        session.execute(delete(ApiKey).where(ApiKey.key_hash == api_auth.hash_key(key)))
    # Within KEY_CACHE_SECONDS of its last lookup the API may still take it; after that, never.
    time.sleep(1.1)
    for _ in range(2):
        assert_error(client.get("/jobs", headers=auth(key)), 401, "unauthorized")
    # A key is cached only once found: a wrong one is looked up each time, so a new key works at once.
    assert_error(client.get("/jobs", headers=auth("psk_new")), 401, "unauthorized")
    with session_scope() as session:
        session.add(ApiKey(name="new", key_hash=api_auth.hash_key("psk_new"), webhook_secret="whsec_x"))
    assert client.get("/jobs", headers=auth("psk_new")).status_code == 200


def test_other_tenant_gets_404(client, make_key) -> None:  # type: ignore[no-untyped-def]
    owner, _ = make_key("owner")
    other, _ = make_key("other")
    job = client.post("/jobs", json=QUERY, headers=auth(owner)).json()
    assert_error(client.get(f"/jobs/{job['id']}", headers=auth(other)), 404, "not_found")
    assert_error(client.post(f"/jobs/{job['id']}/cancel", headers=auth(other)), 404, "not_found")
    assert job["id"] not in [j["id"] for j in client.get("/jobs", headers=auth(other)).json()["data"]]
    assert_error(client.get("/jobs/job_doesnotexist", headers=auth(owner)), 404, "not_found")
    assert client.get(f"/jobs/{job['id']}", headers=auth(owner)).status_code == 200


def test_idempotency_key(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = {**auth(key), "Idempotency-Key": "order-42"}
    first = client.post("/jobs", json=QUERY, headers=headers)
    again = client.post("/jobs", json=QUERY, headers=headers)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert_error(client.post("/jobs", json={**QUERY, "items": ["other"]}, headers=headers), 409,
                 "idempotency_conflict")
    # The default model named, after a first request that left it out, is the same request.
    named = client.post("/jobs", json={**QUERY, "model": first.json()["model"]}, headers=headers)
    assert named.status_code == 202 and named.json()["id"] == first.json()["id"], named.json()
    assert named.headers["Idempotent-Replayed"] == "true"
    # and the other way round
    headers_named = {**auth(key), "Idempotency-Key": "order-43"}
    first_named = client.post("/jobs", json={**QUERY, "model": first.json()["model"]}, headers=headers_named)
    unnamed = client.post("/jobs", json=QUERY, headers=headers_named)
    assert unnamed.status_code == 202 and unnamed.json()["id"] == first_named.json()["id"], unnamed.json()
    # Keys are per tenant: another tenant's same key is a different job.
    other, _ = make_key()
    third = client.post("/jobs", json=QUERY, headers={**auth(other), "Idempotency-Key": "order-42"})
    assert third.status_code == 202 and third.json()["id"] != first.json()["id"]
    assert_error(client.post("/jobs", json=QUERY, headers={**auth(key), "Idempotency-Key": "k" * 300}), 400,
                 "invalid_input")


def _set_status(job_id: str, status: str) -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=status, lease_owner="elsewhere"))


def test_cancel_rules(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    queued = client.post("/jobs", json=QUERY, headers=auth(key)).json()
    response = client.post(f"/jobs/{queued['id']}/cancel", headers=auth(key))
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert response.json()["finished_at"] is not None
    assert_error(client.post(f"/jobs/{queued['id']}/cancel", headers=auth(key)), 409, "job_finished")

    running = client.post("/jobs", json=QUERY, headers=auth(key)).json()
    _set_status(running["id"], "running")
    response = client.post(f"/jobs/{running['id']}/cancel", headers=auth(key))
    assert response.status_code == 202  # the worker cancels it at the next pass boundary
    with session_scope() as session:
        assert session.get(Job, running["id"]).cancel_requested

    for status in ("succeeded", "failed"):
        done = client.post("/jobs", json=QUERY, headers=auth(key)).json()
        _set_status(done["id"], status)
        assert_error(client.post(f"/jobs/{done['id']}/cancel", headers=auth(key)), 409, "job_finished")


def test_list_pagination_and_filter(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    ids = [client.post("/jobs", json=QUERY, headers=auth(key)).json()["id"] for _ in range(5)]
    client.post(f"/jobs/{ids[0]}/cancel", headers=auth(key))
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/jobs", params=params, headers=auth(key)).json()
        assert len(page["data"]) <= 2
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))  # newest first, each once
    cancelled = client.get("/jobs", params={"status": "cancelled"}, headers=auth(key)).json()["data"]
    assert [j["id"] for j in cancelled] == [ids[0]]
    assert_error(client.get("/jobs", params={"status": "bogus"}, headers=auth(key)), 422, "invalid_input")
    assert_error(client.get("/jobs", params={"limit": 0}, headers=auth(key)), 422, "invalid_input")
    assert_error(client.get("/jobs", params={"limit": "x"}, headers=auth(key)), 422, "invalid_input")


def test_score_validation_and_timeout(client, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from store.settings import get_settings

    key, _ = make_key()
    assert_error(client.post("/v1/score", json={**QUERY, "model": "nope"}, headers=auth(key)), 400, "unknown_model")
    assert_error(client.post("/v1/score", json={**QUERY, "label_token_ids": []}, headers=auth(key)), 400,
                 "empty_label_token_ids")
    assert_error(client.post("/v1/score", json={"items": ["a"], "label_token_ids": [1]}, headers=auth(key)), 422,
                 "invalid_input")
    # No worker runs in these tests: the job stays queued and the call times out with its id.
    monkeypatch.setattr(get_settings(), "score_timeout_seconds", 0.3)
    response = client.post("/v1/score", json={"text_1": "q", "items": "one item", "label_token_ids": [1]},
                           headers=auth(key))
    assert_error(response, 504, "timeout")
    job_id = response.json()["error"]["job_id"]
    assert client.get(f"/jobs/{job_id}", headers=auth(key)).json()["status"] == "queued"


def test_unknown_route_and_method(client) -> None:  # type: ignore[no-untyped-def]
    assert_error(client.get("/nope"), 404, "not_found")
    assert_error(client.delete("/jobs"), 405, "method_not_allowed")


def test_health_and_metrics(client, make_key) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/healthz").json() == {"status": "ok"}
    key, _ = make_key()
    client.post("/jobs", json=QUERY, headers=auth(key))
    text = client.get("/metrics").text
    assert "packscore_queue_depth" in text
    assert 'packscore_jobs{status="queued"}' in text
    assert "packscore_passes_total" in text
    assert 'packscore_http_requests_total{method="POST",route="/jobs",status="202"}' in text
    ready = client.get("/readyz")
    assert ready.json()["checks"]["database"] is True
    assert ready.json()["checks"]["broker"] is True


def test_openapi(client) -> None:  # type: ignore[no-untyped-def]
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/cancel", "/v1/score", "/healthz", "/readyz"} <= set(paths)


def test_database_down_is_503_with_retry_after(client, make_key) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from api.deps import get_db

    key, _ = make_key()
    dead = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2})

    def dead_db():  # type: ignore[no-untyped-def]
        with Session(dead) as session:
            yield session

    client.app.dependency_overrides[get_db] = dead_db
    try:
        for response in (client.post("/jobs", json=QUERY, headers=auth(key)), client.get("/jobs", headers=auth(key)),
                         client.get("/jobs/job_x", headers=auth(key))):
            assert_error(response, 503, "unavailable")
            assert int(response.headers["Retry-After"]) > 0
        assert client.get("/readyz").status_code == 503
        assert client.get("/healthz").status_code == 200
    finally:
        client.app.dependency_overrides.clear()
        dead.dispose()


def test_nul_bytes_in_ids_and_cursor(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert_error(client.get("/jobs/job%00x", headers=auth(key)), 422, "invalid_input")
    assert_error(client.get("/jobs", params={"cursor": "job_\x00"}, headers=auth(key)), 422, "invalid_input")
    assert_error(client.post("/jobs", json={**QUERY, "webhook_url": "http://a\x00b.example/"}, headers=auth(key)),
                 400, "invalid_webhook_url")
    assert_error(client.post("/jobs", json={**QUERY, "webhook_url": "http://" + "a" * 300 + ".example/"},
                             headers=auth(key)), 400, "invalid_webhook_url")


def test_lone_surrogates_are_rejected(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = {**auth(key), "content-type": "application/json"}
    for raw in (b'{"query": "a\\ud800b", "items": ["x"], "label_token_ids": [1]}',
                b'{"query": "a", "items": ["\\udfff"], "label_token_ids": [1]}',
                b'{"query": "a", "items": ["x"], "label_token_ids": [1], "metadata": {"k": "\\ud800"}}'):
        response = client.post("/jobs", content=raw, headers=headers)
        assert response.status_code in (400, 422), response.text
        assert response.json()["error"]["code"] == "invalid_input"


def test_readyz_says_warming_until_a_worker_is_ready(client, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """And how far the warm-up is (programs compiled or loaded, of how many), which `packscore wait-ready` prints
    as it goes."""
    import argparse

    import httpx
    from sqlalchemy import delete

    from packscore.cli import CommandError, wait_ready
    from store.db import session_scope
    from store.models import Worker
    from store.settings import get_settings
    from worker.drain import heartbeat

    with session_scope() as session:
        session.execute(delete(Worker))
    try:
        assert client.get("/readyz").json()["status"] == "not_ready"
        heartbeat("worker-warming", "tiny-random", get_settings(), "xla", "warming", (5, 21))
        warming = client.get("/readyz")
        assert warming.status_code == 503
        assert warming.json()["status"] == "warming"
        assert warming.json()["checks"] == {"database": True, "broker": True, "workers": 0, "warming": 1}
        [group] = warming.json()["device_groups"]
        assert group["state"] == "warming" and group["programs"] == {"done": 5, "total": 21}
        monkeypatch.setattr(httpx, "get", lambda url, timeout: client.get("/readyz"))
        with pytest.raises(CommandError, match="not ready after"):
            wait_ready(argparse.Namespace(url="http://packscore", timeout=1.5))
        assert capsys.readouterr().err.splitlines() == ["warming: tiny-random 5/21 programs"]  # once, as it changes
        heartbeat("worker-warming", "tiny-random", get_settings(), "xla", "ready", (21, 21))
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"]["workers"] == 1
        assert ready.json()["checks"]["warming"] == 0 and "programs" not in ready.json()["device_groups"][0]
    finally:
        with session_scope() as session:
            session.execute(delete(Worker))


def test_the_api_reads_the_bundled_model_without_importing_jax() -> None:
    """The API validates and tokenizes (and reads the model's configuration for rerank) without JAX: only
    workers load the engine."""
    import subprocess
    import sys

    code = ("import sys; from api.deps import get_models; "
            "get_models(); print(sorted({'jax', 'flax'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MODEL": "smollm2-135m"},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_kicks_are_coalesced_but_every_job_gets_one_after_it() -> None:
    """The first kick goes at once; those that follow within the window become one kick, sent after the last of
    them (so after its job was committed), never more than a window later; a kick after a quiet window goes at
    once again."""
    import threading
    import time

    from store.broker import KickCoalescer

    sent: list[float] = []
    kicks = KickCoalescer(lambda: sent.append(time.monotonic()), window=0.2)
    kicks.kick()
    assert len(sent) == 1  # immediate, in the caller's thread
    calls = []
    for _ in range(3):
        time.sleep(0.02)
        kicks.kick()
        calls.append(time.monotonic())
    assert len(sent) == 1
    time.sleep(0.3)
    assert len(sent) == 2 and calls[-1] < sent[1] <= sent[0] + 0.25
    time.sleep(0.25)
    kicks.kick()
    assert len(sent) == 3

    # Concurrent callers: whatever the interleaving, a kick is sent after the last call.
    sent.clear()
    kicks = KickCoalescer(lambda: sent.append(time.monotonic()), window=0.005)
    ends: list[float] = []

    def caller() -> None:
        for _ in range(200):
            kicks.kick()
        ends.append(time.monotonic())

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.05)
    assert sent[-1] > max(ends) - 0.005 and len(sent) < 8 * 200


def test_kick_drain_reaches_the_broker(redis_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import time

    import redis

    from store import broker

    # A wide window, so that a slow machine between two calls does not make them two windows.
    queue_name = os.environ["QUEUE_NAME"]  # the one model's queue (no MODELS)
    monkeypatch.setattr(broker, "_kicks",
                        {queue_name: broker.KickCoalescer(lambda: broker._send_kick(queue_name), 0.5)})
    queue = redis.Redis.from_url(redis_url)
    name = os.environ["BROKER_KEY_PREFIX"] + queue_name
    broker.clear_pending_kick("tiny-random")
    before = queue.llen(name)
    for _ in range(3):
        broker.kick_drain("tiny-random")
    assert queue.llen(name) == before + 1
    # The window's coalesced kick finds the first one pending (no worker claimed since): no second message.
    time.sleep(0.7)
    assert queue.llen(name) == before + 1
    # A worker beginning a claim clears the flag: the next kick is a message again.
    broker.clear_pending_kick("tiny-random")
    broker.kick_drain("tiny-random")
    time.sleep(0.7)
    assert queue.llen(name) == before + 2


def test_a_lost_kick_holds_later_ones_back_only_briefly(redis_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import time

    import redis

    from store import broker

    queue_name = os.environ["QUEUE_NAME"]
    monkeypatch.setattr(broker, "_kicks",
                        {queue_name: broker.KickCoalescer(lambda: broker._send_kick(queue_name), 0.0)})
    monkeypatch.setattr(broker, "KICK_PENDING_SECONDS", 0.3)
    queue = redis.Redis.from_url(redis_url)
    name = os.environ["BROKER_KEY_PREFIX"] + queue_name
    broker.clear_pending_kick("tiny-random")
    before = queue.llen(name)
    broker.kick_drain("tiny-random")
    queue.rpop(name)  # the message is lost (say, taken by a worker killed before it claimed)
    broker.kick_drain("tiny-random")
    assert queue.llen(name) == before  # the flag still says a kick is pending
    time.sleep(0.4)
    broker.kick_drain("tiny-random")
    assert queue.llen(name) == before + 1
