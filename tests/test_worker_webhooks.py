"""Webhook signing (Standard Webhooks), the SSRF guard and delivery with retries."""

import json
import socket
import time

import pytest
from sqlalchemy import select
from standardwebhooks import Webhook

from api.db import session_scope
from api.models import WebhookDelivery
from api.settings import get_settings
from worker.webhooks import UnsafeURL, check_url, deliver_due, sign

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_signature_verifies_with_standardwebhooks() -> None:
    payload = json.dumps({"type": "job.succeeded", "data": {"id": "job_1"}})
    headers = sign(SECRET, "msg_1", payload)
    assert headers["webhook-id"] == "msg_1"
    assert Webhook(SECRET).verify(payload, headers) == json.loads(payload)
    with pytest.raises(Exception):
        Webhook(SECRET).verify(payload + " ", headers)
    with pytest.raises(Exception):
        Webhook("whsec_" + "A" * 32).verify(payload, headers)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x", "http://127.8.9.10:8080/x", "http://[::1]/x", "http://10.0.0.5/x", "http://172.16.3.4/x",
    "http://192.168.1.1/x", "http://169.254.169.254/latest/meta-data/", "http://0.0.0.0/x", "http://224.0.0.1/x",
    "http://[::ffff:127.0.0.1]/x", "http://[fe80::1]/x", "http://100.64.0.1/x", "http://localhost:9/x",
    "https://240.0.0.1/x", "ftp://8.8.8.8/x", "http:///nohost", "not a url", "http://[::1/x",
    # The same addresses spelled otherwise: decimal, hex, short and octal forms, IPv4-mapped IPv6, userinfo.
    "http://2130706433/x", "http://0x7f000001/x", "http://127.1/x", "http://0177.0.0.1/x", "http://10.1/x",
    "http://[::ffff:10.0.0.1]/x", "http://[::ffff:a9fe:a9fe]/x", "http://user:pw@192.168.0.1/x",
    "http://8.8.8.8@169.254.169.254/x", "http://172.31.255.255/x", "http://[fc00::1]/x",
])
def test_ssrf_guard_refuses(url: str) -> None:
    with pytest.raises(UnsafeURL):
        check_url(url, [])


def test_ssrf_guard_resolves_host_names(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        ip = {"internal.example": "10.1.2.3", "public.example": "93.184.216.34"}[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(UnsafeURL, match="10.1.2.3"):
        check_url("https://internal.example/hook", [])
    check_url("https://public.example/hook", [])
    check_url("https://internal.example/hook", ["10.0.0.0/8"])
    check_url("https://internal.example/hook", ["internal.example"])


def test_ssrf_allowlist() -> None:
    check_url("http://127.0.0.1:8080/hook", ["127.0.0.1"])
    check_url("http://93.184.216.34/hook", [])
    with pytest.raises(UnsafeURL):
        check_url("http://127.0.0.2/hook", ["127.0.0.1"])


def _delivery(make_key, url: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    _, secret = make_key()
    with session_scope() as session:
        from api.models import ApiKey

        key_id = session.scalars(select(ApiKey.id).where(ApiKey.webhook_secret == secret)).one()
        row = WebhookDelivery(api_key_id=key_id, url=url, payload=json.dumps({"type": "job.succeeded"}))
        session.add(row)
        session.flush()
        return row.id, secret


def _deliver_until_settled(delivery_id: str, seconds: float = 10) -> WebhookDelivery:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        deliver_due(get_settings())
        with session_scope() as session:
            row = session.get(WebhookDelivery, delivery_id)
            if row.status != "pending":
                return row
        time.sleep(0.05)
    raise AssertionError("delivery did not settle")


def test_delivery_retries_with_same_id(empty_queue, make_key, webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    delivery_id, secret = _delivery(make_key, webhook_receiver.url)
    webhook_receiver.responses = [500, 302]  # a failure, then a redirect (not followed), then 200
    row = _deliver_until_settled(delivery_id)
    assert row.status == "delivered" and row.attempts == 3
    assert len(webhook_receiver.requests) == 3
    for headers, body in webhook_receiver.requests:
        assert headers["webhook-id"] == delivery_id
        Webhook(secret).verify(body, headers)
    stamps = [int(h["webhook-timestamp"]) for h, _ in webhook_receiver.requests]
    assert stamps == sorted(stamps)


def test_redirect_never_followed_even_to_allowlisted_target(empty_queue, make_key) -> None:  # type: ignore[no-untyped-def]
    # 127.0.0.1 is allowlisted in the tests: the redirect target could be reached, and still is not contacted.
    from tests.conftest import WebhookReceiver

    first, target = WebhookReceiver(), WebhookReceiver()
    try:
        first.responses = [307] * 10
        first.location = target.url
        delivery_id, _ = _delivery(make_key, first.url)
        row = _deliver_until_settled(delivery_id)
        assert row.status == "failed" and row.last_status_code == 307
        assert len(first.requests) == 1 + len(get_settings().webhook_retry_schedule)
        assert target.requests == []
    finally:
        first.close()
        target.close()


def test_delivery_gives_up_after_schedule(empty_queue, make_key, webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    delivery_id, _ = _delivery(make_key, webhook_receiver.url)
    webhook_receiver.responses = [503] * 10
    row = _deliver_until_settled(delivery_id)
    assert row.status == "failed"
    assert row.attempts == 1 + len(get_settings().webhook_retry_schedule)
    assert row.last_status_code == 503


def test_delivery_refuses_private_target(empty_queue, make_key) -> None:  # type: ignore[no-untyped-def]
    delivery_id, _ = _delivery(make_key, "http://192.168.0.1/hook")
    row = _deliver_until_settled(delivery_id)
    assert row.status == "failed" and row.attempts == 1
    assert row.last_error.startswith("refused")
