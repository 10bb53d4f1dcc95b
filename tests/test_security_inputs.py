"""Bad input and attacks against the live service (uvicorn + a worker): malformed and hostile bodies get a typed
4xx (never a 5xx or a hang), odd text is scored like any text, metadata comes back verbatim; tenants cannot see
or touch each other's jobs and batches on any route; webhook URLs to internal addresses are refused."""

import json
import socket
import time

import httpx
import pytest

from api.deps import get_api_settings
from core import Scorer
from store.settings import Settings
from tests.service_harness import Service, assert_scores, wait_terminal

BODY = {"query": "Is this a question?", "items": ["yes", "no"], "label_token_ids": [5, 7]}


@pytest.fixture(scope="module")
def reference() -> Scorer:
    return Scorer.from_pretrained("tiny-random")


def post_raw(service: Service, path: str, content: bytes, **headers: str) -> httpx.Response:
    with service.http() as client:
        return client.post(path, content=content, headers={"content-type": "application/json", **headers})


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


BOTH = ("/jobs", "/v1/score")
# /v1/score follows vLLM and SGLang: a single string item is allowed (unknown fields are refused on both).
JOBS = ("/jobs",)


@pytest.mark.parametrize("content, status, code, paths", [
    (b'{"query": "q", "items": ["a"], "label_token_ids": [1]', 422, "invalid_input", BOTH),  # truncated JSON
    (b"not json at all", 422, "invalid_input", BOTH),
    (b"", 422, "invalid_input", BOTH),
    (b"\xff\xfe\x00garbage", 422, "invalid_input", BOTH),
    (b"[]", 422, "invalid_input", BOTH),
    (b"null", 422, "invalid_input", BOTH),
    (b'{"query": "q", "items": ["a"], "label_token_ids": [1], "query": 5}', 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "items": "yes"}).encode(), 422, "invalid_input", JOBS),
    (json.dumps({**BODY, "label_token_ids": ["5"]}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "label_token_ids": [5.5]}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "label_token_ids": [True]}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "apply_softmax": "yes"}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "query": {"$ne": 1}}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "unknown_field": 1}).encode(), 422, "invalid_input", BOTH),
    (json.dumps({**BODY, "metadata": [1, 2]}).encode(), 422, "invalid_input", JOBS),
    (json.dumps({**BODY, "webhook_url": "x" * 5000}).encode(), 422, "invalid_input", JOBS),
    (json.dumps({**BODY, "label_token_ids": [10**30]}).encode(), 400, "label_token_id_out_of_range", BOTH),
    (json.dumps({**BODY, "label_token_ids": [-1]}).encode(), 400, "label_token_id_out_of_range", BOTH),
    (json.dumps({**BODY, "label_token_ids": []}).encode(), 400, "empty_label_token_ids", BOTH),
    (json.dumps({**BODY, "query": [1, 2], "items": [[3], [10**12]]}).encode(), 400, "token_id_out_of_range", BOTH),
    (json.dumps({**BODY, "query": [-5], "items": [[3]]}).encode(), 400, "token_id_out_of_range", BOTH),
    (json.dumps({**BODY, "query": [1], "items": ["text"]}).encode(), 400, "mixed_input_types", BOTH),
    (json.dumps({**BODY, "query": ""}).encode(), 400, "empty_query", BOTH),
    (json.dumps({**BODY, "items": ["x"] * 5001}).encode(), 400, "too_many_items", BOTH),
    (json.dumps({**BODY, "label_token_ids": [5] * 4097}).encode(), 400, "too_many_labels", BOTH),
    # 1,000 items x 4,096 labels: each under its limit, 4 million scores (MAX_SCORES) together.
    (json.dumps({**BODY, "items": ["x"] * 1000, "label_token_ids": [5] * 4096}).encode(), 400, "too_many_labels",
     BOTH),
    (b'{"query": "q", "items": ["a"], "label_token_ids": [1], "metadata": {"x": NaN}}', 422, "invalid_input", JOBS),
    (json.dumps({**BODY, "query": "word " * 120_000}).encode(), 400, "too_many_tokens", BOTH),
    (b'{"query": "\\ud800 lone surrogate", "items": ["a"], "label_token_ids": [1]}', 422, "invalid_input", BOTH),
    (b'{"query": "q", "items": ["a"], "label_token_ids": [1], "metadata": ' + b'{"a":' * 5000 + b"1"
     + b"}" * 5000 + b"}", 400, "bad_request", BOTH),  # nesting deeper than the parser's recursion limit
    (b'{"query": "q", "items": ["a"], "label_token_ids": [1e999]}', 422, "invalid_input", BOTH),
    (b'{"query": "q", "items": ["a"], "label_token_ids": [NaN]}', 422, "invalid_input", BOTH),
])
def test_bad_bodies_get_typed_4xx(live_service: Service, content: bytes, status: int, code: str,
                                  paths: tuple[str, ...]) -> None:
    for path in paths:
        response = post_raw(live_service, path, content)
        assert (response.status_code, error_code(response)) == (status, code), (path, response.text[:500])


def test_nesting_near_the_recursion_limit_gets_a_typed_4xx(live_service: Service) -> None:
    """Metadata nested deeper than the serializer that echoes it takes (about 255 levels), or than the checks'
    JSON encoder takes, was a 500 after the job was stored. Metadata holds at most 32 levels."""
    with live_service.http() as client:
        shallow = json.loads('{"a": ' * 31 + "1" + "}" * 31)
        created = client.post("/jobs", json={**BODY, "metadata": shallow})
        assert created.status_code == 202 and created.json()["metadata"] == shallow, created.text[:300]
    for depth in (33, 100, 260, 500, *range(880, 1120, 20)):
        nested = b"[" * depth + b"]" * depth
        for path, content in [*[(path, b'{"query": "q", "items": ' + nested + b', "label_token_ids": [1]}')
                                for path in BOTH],
                              ("/jobs", b'{"query": "q", "items": ["a"], "label_token_ids": [1], "metadata": {"a": '
                               + nested + b"}}")]:
            response = post_raw(live_service, path, content)
            assert (response.status_code, error_code(response)) in ((422, "invalid_input"), (400, "bad_request")), \
                (path, depth, response.text[:300])


def test_huge_bodies_are_413(live_service: Service) -> None:
    limit = int(live_service.env["MAX_BODY_BYTES"])
    huge = json.dumps({**BODY, "items": ["x" * 1000] * (limit // 1000 + 10)}).encode()
    assert error_code(post_raw(live_service, "/jobs", huge)) == "body_too_large"

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for i in range(0, len(huge), 65536):
            yield huge[i:i + 65536]

    with live_service.http() as client:
        response = client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and error_code(response) == "body_too_large"
    # A Content-Length over the limit is refused before any of the body is read.
    host, port = live_service.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {live_service.key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {limit * 10}\r\n\r\n{{}}".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")


def test_hostile_text_is_scored_and_metadata_returned_verbatim(live_service: Service, reference: Scorer) -> None:
    hostile = [
        "emoji 👩🏽‍💻🚀 and CJK 漢字 and RTL עברית \u202e reversed",
        "zero\u200bwidth\ufeff joiners \u200d and combining e\u0301\u0301\u0301",
        "control \x01\x02\x1b[31m red \x7f tab\tnew\nline\rcr and NUL \x00 inside",
        "'; DROP TABLE jobs; --",
        "<script>alert(1)</script> {{7*7}} ${jndi:ldap://x}",
        "",
    ]
    metadata = {
        "sql": "'; DROP TABLE jobs; -- ' OR '1'='1",
        "union": "1 UNION SELECT key_hash FROM api_keys",
        "json_path": "$.x' ) OR 1=1 --",
        "nested": {"a": [1, 2.5, None, True, {"b": "\\x00 literal"}], "unicode": "ünï©ødé 🙂"},
        "controls": "bell \x07 escape \x1b[0m",
        "big_int": 2**62, "neg": -1.5e-300, "empty": {}, "list": [],
    }
    body = {"query": "Rate this: \u0007 bell", "items": hostile, "label_token_ids": [0, 1, 99],
            "metadata": metadata}
    with live_service.http() as client:
        response = client.post("/jobs", json=body, headers={"Idempotency-Key": "' OR 1=1; --"})
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        assert response.json()["metadata"] == metadata
        job = wait_terminal(client, [job_id])[job_id]
        assert job["status"] == "succeeded", job
        assert job["metadata"] == metadata
        assert_scores(job, body, reference)
        listed = client.get("/jobs", params={"limit": 100}).json()["data"]
        assert next(j for j in listed if j["id"] == job_id)["metadata"] == metadata
        # SQL in ids, cursors and filters is just a value that matches nothing.
        for path in ("/jobs/job_' OR '1'='1", "/jobs/%27%20OR%201=1--", "/jobs/" + "a" * 5000,
                     "/batches/batch_' OR 1=1 --"):
            assert client.get(path).status_code == 404, path
        response = client.get("/jobs", params={"cursor": "' OR 1=1 --", "limit": 5})
        assert response.status_code == 200 and response.json()["data"] == []
        assert client.get("/jobs", params={"status": "queued' OR 1=1"}).status_code == 422
        replay = client.post("/jobs", json=body, headers={"Idempotency-Key": "' OR 1=1; --"})
        assert replay.json()["id"] == job_id


def test_token_id_inputs_at_vocabulary_edges(live_service: Service, reference: Scorer) -> None:
    top = reference.vocab_size - 1
    body = {"query": [0, top, 1], "items": [[top], [0], []], "label_token_ids": [0, top]}
    with live_service.http() as client:
        job_id = client.post("/jobs", json=body).json()["id"]
        job = wait_terminal(client, [job_id])[job_id]
        assert job["status"] == "succeeded", job
        assert_scores(job, body, reference)
        over = client.post("/jobs", json={**body, "items": [[top + 1]]})
        assert (over.status_code, error_code(over)) == (400, "token_id_out_of_range")


# -- tenant isolation -------------------------------------------------------------------------------------------

PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def authenticated_routes(service: Service) -> list[tuple[str, str]]:
    """Every (method, path template) of the live schema that needs a key: new routes are covered as they come."""
    schema = httpx.get(f"{service.base_url}/openapi.json", timeout=10).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops
              if path not in PUBLIC]
    assert ("GET", "/jobs/{job_id}") in routes and ("POST", "/batches") in routes
    return routes


@pytest.fixture(scope="module")
def owned(live_service: Service) -> dict[str, str]:
    """A finished job and a finished batch of the service's key."""
    with live_service.http() as client:
        job_id = client.post("/jobs", json=BODY).json()["id"]
        wait_terminal(client, [job_id])
        response = client.post("/batches", json={"requests": [{**BODY, "custom_id": "one"}]})
        assert response.status_code == 201, response.text
        batch_id = response.json()["id"]
        deadline = time.monotonic() + 120
        while client.get(f"/batches/{batch_id}").json()["status"] not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, "batch not finished"
            time.sleep(0.3)
    return {"job_id": job_id, "batch_id": batch_id}


def test_no_key_or_wrong_key_is_401_everywhere(live_service: Service, owned: dict[str, str]) -> None:
    wrong = {"Authorization": "Bearer psk_" + "A" * 43}
    for method, template in authenticated_routes(live_service):
        path = template.format(**owned)
        for headers in ({}, wrong, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer"},
                        {"Authorization": f"bearer{live_service.key}"}):
            response = httpx.request(method, f"{live_service.base_url}{path}", headers=headers, json=BODY,
                                     timeout=30)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert error_code(response) == "unauthorized"


def test_another_tenant_gets_404_on_every_route(live_service: Service, owned: dict[str, str]) -> None:
    other_key, _ = live_service.create_key("other-tenant")
    per_resource = [(m, t) for m, t in authenticated_routes(live_service) if "{" in t]
    assert len(per_resource) >= 5
    with live_service.http(other_key) as other:
        for method, template in per_resource:
            response = other.request(method, template.format(**owned))
            assert response.status_code == 404, (method, template, response.text)
            assert error_code(response) == "not_found"
        assert owned["job_id"] not in other.get("/jobs", params={"limit": 100}).text
        assert owned["batch_id"] not in other.get("/batches", params={"limit": 100}).text
        # The owner's Idempotency-Key is not a way in either: the other tenant gets a job of its own.
        with live_service.http() as client:
            mine = client.post("/jobs", json=BODY, headers={"Idempotency-Key": "shared-key"}).json()["id"]
        theirs = other.post("/jobs", json=BODY, headers={"Idempotency-Key": "shared-key"})
        assert theirs.status_code == 202 and theirs.json()["id"] != mine
    with live_service.http() as client:  # and the owner still sees everything
        assert client.get(f"/jobs/{owned['job_id']}").status_code == 200
        assert client.get(f"/batches/{owned['batch_id']}/results").status_code == 200


# -- webhook SSRF at submission -----------------------------------------------------------------------------------

FORBIDDEN = ["http://127.0.0.1:9/hook", "http://[::1]/hook", "http://10.0.0.1/hook", "http://10.255.255.254/hook",
             "http://172.16.0.1/hook", "http://172.31.255.1/hook", "http://192.168.1.1/hook",
             "http://169.254.169.254/latest/meta-data/", "http://localhost/hook", "http://2130706433/hook",
             "http://0x7f000001/hook", "http://[::ffff:10.0.0.1]/hook", "http://user:pw@192.168.0.1/hook",
             "http://internal.example/hook"]


@pytest.fixture
def no_allowlist(client):  # type: ignore[no-untyped-def]
    """The in-process app with an empty WEBHOOK_ALLOWLIST (the test default allowlists 127.0.0.1)."""
    client.app.dependency_overrides[get_api_settings] = lambda: Settings(webhook_allowlist=[])
    yield client
    client.app.dependency_overrides.pop(get_api_settings)


@pytest.fixture
def private_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """internal.example resolves to a private address (no DNS server needed)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "internal.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("url", FORBIDDEN)
def test_webhook_to_internal_address_refused(no_allowlist, make_key, private_dns, url: str) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = {"Authorization": f"Bearer {key}"}
    for path, body in (("/jobs", {**BODY, "webhook_url": url}),
                       ("/batches", {"requests": [{**BODY, "custom_id": "1"}], "webhook_url": url})):
        response = no_allowlist.post(path, json=body, headers=headers)
        assert response.status_code == 400, (path, response.text)
        assert error_code(response) == "invalid_webhook_url"


def test_webhook_allowlist_lets_internal_targets_through(client, make_key, private_dns) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = {"Authorization": f"Bearer {key}"}
    client.app.dependency_overrides[get_api_settings] = lambda: Settings(
        webhook_allowlist=["10.0.0.0/8", "internal.example", "127.0.0.1"])
    try:
        for url in ("http://10.9.8.7/hook", "http://internal.example/hook", "http://127.0.0.1:9/hook"):
            assert client.post("/jobs", json={**BODY, "webhook_url": url}, headers=headers).status_code == 202, url
        for url in ("http://192.168.1.1/hook", "http://[::1]/hook", "http://169.254.169.254/"):
            assert client.post("/jobs", json={**BODY, "webhook_url": url}, headers=headers).status_code == 400, url
    finally:
        client.app.dependency_overrides.pop(get_api_settings)
