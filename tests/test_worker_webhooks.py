"""Webhook signing (Standard Webhooks), the SSRF guard and delivery with retries."""

import json
import socket
import time

import pytest
from sqlalchemy import select
from standardwebhooks import Webhook

from store.db import session_scope
from store.models import WebhookDelivery
from store.outbox import UnsafeURL, check_url
from store.settings import Settings, get_settings
from worker.webhooks import deliver_due, sign

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
        from store.models import ApiKey

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


def test_delivery_retries_with_same_id(empty_queue, make_key, webhook_receiver,  # type: ignore[no-untyped-def]
                                      monkeypatch) -> None:
    import ssl

    from worker import webhooks

    made = []  # certificate stores read: once for all attempts, not once each (16 ms of CPU each)
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(a or kw) or real(*a, **kw))
    webhooks._tls_context.cache_clear()
    delivery_id, secret = _delivery(make_key, webhook_receiver.url)
    webhook_receiver.responses = [500, 302]  # a failure, then a redirect (not followed), then 200
    row = _deliver_until_settled(delivery_id)
    assert row.status == "delivered" and row.attempts == 3
    assert len(made) == 1, made
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


# -- DNS pinning, DNS failures, concurrency ---------------------------------------------------------------------


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answer) -> list[str]:  # type: ignore[no-untyped-def]
    """Patches socket.getaddrinfo: `answer(host, n)` (n: how many times `host` was looked up before) gives the IPv4
    address, or None for the real resolver. Returns the log of patched look-ups."""
    real, calls = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        ip = answer(host, calls.count(host))
        if ip is None:
            return real(host, port, *args, **kwargs)
        calls.append(host)
        if isinstance(ip, Exception):
            raise ip
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def test_rebinding_name_cannot_reach_loopback(empty_queue, make_key, webhook_receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A public address on the first look-up, loopback on later ones: the guard vets the first answer and the
    # connection must go to that very address, not to whatever a second look-up says.
    calls = _fake_dns(monkeypatch, lambda host, n: ("93.184.216.34" if n == 0 else "127.0.0.1")
                      if host == "rebind.example" else None)
    port = webhook_receiver.server.server_address[1]
    delivery_id, _ = _delivery(make_key, f"http://rebind.example:{port}/hook")
    settings = Settings(webhook_allowlist=[], webhook_timeout_seconds=1)  # 93.184.216.34 is unreachable here
    assert deliver_due(settings) == 1
    assert webhook_receiver.requests == []
    assert calls == ["rebind.example"]  # looked up once per attempt
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert (row.status, row.attempts) == ("pending", 1)
        assert "93.184.216.34" in row.last_error


def test_pinned_request_keeps_host_header_and_tls_name(empty_queue, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import httpx

    _fake_dns(monkeypatch, lambda host, n: {"v4.example": "93.184.216.34",
                                            "v6.example": "2606:2800:220:1:248:1893:25c8:1946"}.get(host))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers["host"], request.extensions.get("sni_hostname")))
        return httpx.Response(204)

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(**kw, transport=httpx.MockTransport(handler)))
    settings = Settings(webhook_allowlist=[])
    for url in ("https://v4.example:8443/hook?x=1", "http://v6.example/hook", "https://93.184.216.34/h"):
        _delivery(make_key, url)
        assert deliver_due(settings) == 1
    assert seen == [
        ("https://93.184.216.34:8443/hook?x=1", "v4.example:8443", "v4.example"),
        ("http://[2606:2800:220:1:248:1893:25c8:1946]/hook", "v6.example", None),
        ("https://93.184.216.34/h", "93.184.216.34", None),
    ]


def test_dns_failure_is_retried_on_the_schedule(empty_queue, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from store.models import utcnow

    # The resolver's answer for a name that does not resolve (patched: no dependence on this machine's DNS).
    _fake_dns(monkeypatch, lambda host, n: socket.gaierror(socket.EAI_NONAME, "Name or service not known")
              if host == "nosuchhost.invalid" else None)
    delivery_id, _ = _delivery(make_key, "http://nosuchhost.invalid/hook")
    settings = Settings(webhook_retry_schedule=[60, 0.1, 0.1])
    assert deliver_due(settings) == 1
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert (row.status, row.attempts) == ("pending", 1), row.last_error
        assert row.next_attempt_at > utcnow() + timedelta(seconds=50)
        assert "nosuchhost.invalid" in row.last_error and not row.last_error.startswith("refused")
        row.next_attempt_at = utcnow()  # the first retry's time has come
    deadline = time.monotonic() + 10
    while True:
        deliver_due(settings)
        with session_scope() as session:
            row = session.get(WebhookDelivery, delivery_id)
            if row.status != "pending" or time.monotonic() > deadline:
                break
        time.sleep(0.05)
    assert (row.status, row.attempts) == ("failed", 1 + len(settings.webhook_retry_schedule))


class SlowReceiver:
    """A WebhookReceiver that waits `delay` seconds before answering; counts the most requests it held at once."""

    def __init__(self, delay: float) -> None:
        from tests.conftest import WebhookReceiver

        self.receiver = WebhookReceiver()
        self.active = self.most = 0
        inner = self.receiver._handler.do_POST

        def do_post(handler) -> None:  # type: ignore[no-untyped-def]
            with self.receiver.lock:
                self.active += 1
                self.most = max(self.most, self.active)
            time.sleep(delay)
            with self.receiver.lock:
                self.active -= 1
            inner(handler)

        self.receiver._handler.do_POST = do_post
        self.port = self.receiver.server.server_address[1]


def _first_delivery_after(settings: Settings, receiver) -> float:  # type: ignore[no-untyped-def]
    """Delivers everything due (in a thread, waited for); returns the seconds until `receiver` got its first
    request (2.5 at most: it waited behind the others)."""
    import threading

    start = time.monotonic()
    runner = threading.Thread(target=deliver_due, args=(settings,))
    runner.start()
    while not receiver.requests and time.monotonic() - start < 2.5:
        time.sleep(0.02)
    first = time.monotonic() - start
    runner.join(timeout=60)
    return first


def test_slow_receiver_does_not_hold_up_others(empty_queue, make_key, webhook_receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _fake_dns(monkeypatch, lambda host, n: "127.0.0.1" if host in ("slow.example", "fast.example") else None)
    slow = SlowReceiver(delay=3)
    try:
        slow_ids = [_delivery(make_key, f"http://slow.example:{slow.port}/hook")[0] for _ in range(6)]
        fast_port = webhook_receiver.server.server_address[1]
        fast_id, _ = _delivery(make_key, f"http://fast.example:{fast_port}/hook")
        settings = Settings(webhook_allowlist=["slow.example", "fast.example"], webhook_timeout_seconds=10)
        fast_after = _first_delivery_after(settings, webhook_receiver)
        assert fast_after < 1.5, f"the fast receiver waited {fast_after:.1f}s behind the slow one"
        assert slow.most == 4  # WEBHOOK_PER_HOST: at most 4 attempts at once to one host
        with session_scope() as session:
            assert {session.get(WebhookDelivery, i).status for i in [*slow_ids, fast_id]} == {"delivered"}
    finally:
        slow.receiver.close()


def test_a_receiver_trickling_its_answer_is_cut_off(empty_queue, make_key, monkeypatch,  # type: ignore[no-untyped-def]
                                                   caplog) -> None:
    """WEBHOOK_TIMEOUT_SECONDS bounds each read, not the whole: a receiver that sent its status line a byte at a
    time, each within the timeout, held the attempt (and its slot) for hours, past its lease, after which
    another worker sent the message again. Now the attempt ends after ATTEMPT_TIMEOUTS timeouts, a failure
    retried on the schedule. And the log names the delivery's host, never its URL (whose path or query may be
    the receiver's secret), which httpx's own INFO line per request wrote whole."""
    import logging
    import threading

    from worker.webhooks import ATTEMPT_TIMEOUTS

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 10_000:
                if stop.wait(0.05):
                    return
                try:
                    connection.send(bytes([byte]))
                except OSError:
                    return  # the attempt was cut off: its connection closed

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    _fake_dns(monkeypatch, lambda host, n: "127.0.0.1" if host == "trickle.example" else None)
    url = f"http://trickle.example:{listener.getsockname()[1]}/hook/s3cr3t-path?token=s3cr3t-query"
    delivery_id, _ = _delivery(make_key, url)
    # The retry a minute on: a loaded host's pause between the attempt and the next look at the queue is no second
    # attempt in this call.
    settings = Settings(webhook_allowlist=["trickle.example"], webhook_timeout_seconds=0.5,
                        webhook_retry_schedule=[60])
    caplog.set_level(logging.INFO)
    try:
        start = time.monotonic()
        assert deliver_due(settings) == 1
        took = time.monotonic() - start
    finally:
        stop.set()
        listener.close()
    assert took < ATTEMPT_TIMEOUTS * 0.5 + 2, f"the attempt took {took:.1f} s"
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, None)
        assert "no whole answer within 1 s" in row.last_error
    assert "s3cr3t" not in caplog.text and "trickle.example" in caplog.text


def test_a_claim_reads_the_payloads_of_the_rows_it_claims_only(empty_queue, make_key) -> None:  # type: ignore[no-untyped-def]
    """A payload is a job's whole results (megabytes for a large job). Each claim looks through up to a
    thousand due rows, most passed over (their host at its limit), and every attempt that ends claims again:
    it read each row's payload each time."""
    from collections import Counter

    from sqlalchemy import event

    from store.db import get_engine
    from worker import webhooks

    big = json.dumps({"type": "job.succeeded", "data": {"scores": [0.5] * 50_000}})
    with session_scope() as session:
        from store.models import ApiKey

        _, secret = make_key()
        key_id = session.scalars(select(ApiKey.id).where(ApiKey.webhook_secret == secret)).one()
        session.add_all([WebhookDelivery(api_key_id=key_id, url=f"http://{host}.example/hook", payload=big)
                         for host in ["busy"] * 5 + ["free"]])
    statements: list[str] = []

    def seen(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(get_engine(), "before_cursor_execute", seen)
    try:
        claimed = webhooks._claim_due(get_settings(), 10, Counter({("host", "busy.example"): 4}), set())
    finally:
        event.remove(get_engine(), "before_cursor_execute", seen)
    assert [c.host for c in claimed] == ["free.example"] and claimed[0].payload == big
    reading_payloads = [s for s in statements if s.lstrip().upper().startswith("SELECT") and ".payload" in s]
    # One statement, for the claimed rows by id (`store.db.among`: `= ANY(...)` on Postgres, IN on SQLite).
    assert len(reading_payloads) == 1 and any(f in reading_payloads[0].upper() for f in (" IN ", "ANY")), statements


def test_a_tls_error_after_the_handshake_is_a_failed_attempt(empty_queue, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """anyio's TLS stream raises an ssl.SSLError after the handshake as it is (a receiver that asks for a client
    certificate alerts on the first read), not as an httpx error: the attempt went unrecorded, claimed again
    after each lease for good, never reaching the end of its retry schedule."""
    import ssl

    from worker import webhooks

    async def alert(*args) -> int:  # type: ignore[no-untyped-def]
        raise ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required")

    monkeypatch.setattr(webhooks, "_post", alert)
    delivery_id, _ = _delivery(make_key, "http://127.0.0.1:9/hook")
    assert deliver_due(get_settings()) == 1
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert (row.status, row.attempts) == ("pending", 1) and "CERTIFICATE_REQUIRED" in row.last_error


def test_stopping_does_not_wait_past_its_timeout(empty_queue, make_key, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from worker.webhooks import Dispatcher

    _fake_dns(monkeypatch, lambda host, n: "127.0.0.1" if host == "slow.example" else None)
    slow = SlowReceiver(delay=3)
    try:
        delivery_id, _ = _delivery(make_key, f"http://slow.example:{slow.port}/hook")
        settings = Settings(webhook_allowlist=["slow.example"], webhook_timeout_seconds=10)
        dispatcher = Dispatcher()
        start = time.monotonic()
        futures = dispatcher.dispatch(settings)
        assert len(futures) == 1 and time.monotonic() - start < 1  # started, not waited for
        assert dispatcher.stop(timeout=0.5) is False
        assert time.monotonic() - start < 1.5
        _delivery(make_key, f"http://slow.example:{slow.port}/hook")
        assert dispatcher.dispatch(settings) == []  # stopped: nothing new starts
        futures[0].result(timeout=15)  # the attempt in flight still ends and is recorded
        with session_scope() as session:
            assert session.get(WebhookDelivery, delivery_id).status == "delivered"
    finally:
        slow.receiver.close()


def test_two_workers_on_sqlite_never_claim_one_delivery_twice(tmp_path,  # type: ignore[no-untyped-def]
                                                              monkeypatch) -> None:
    """SQLite has no FOR UPDATE: a worker that read due deliveries while another worker claimed them must not
    claim them again (the soak's embedded deployment, two workers, delivered messages twice). The second worker's
    claim runs between the first's read and its claim."""
    from collections import Counter
    from contextlib import contextmanager

    from sqlalchemy import Select, create_engine
    from sqlalchemy.orm import sessionmaker

    from migrations import upgrade
    from store.models import ApiKey
    from worker import webhooks

    url = f"sqlite:///{tmp_path / 'webhooks.db'}"
    upgrade(url)
    engine = create_engine(url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions() as session, session.begin():
        key = ApiKey(name="k", key_hash="h", webhook_secret=SECRET)
        session.add(key)
        session.flush()
        session.add_all([WebhookDelivery(api_key_id=key.id, url="http://127.0.0.1:9/hook", payload="{}")
                         for _ in range(3)])
    settings = get_settings()
    other_worker: list = []

    class Rows:
        def __init__(self, rows: list) -> None:
            self.rows = rows

        def all(self) -> list:
            return self.rows

    @contextmanager
    def scope():  # type: ignore[no-untyped-def]
        with sessions() as session, session.begin():
            execute = session.execute

            def interleaved(statement, *args, **kwargs):  # type: ignore[no-untyped-def]
                result = execute(statement, *args, **kwargs)
                if other_worker or not isinstance(statement, Select):
                    return result
                rows = result.all()  # the due deliveries this worker has just read, which the other one claims
                other_worker.append([])
                other_worker[0] = webhooks._claim_due(settings, 10, Counter(), set())
                return Rows(rows)

            session.execute = interleaved  # type: ignore[method-assign]
            yield session

    monkeypatch.setattr(webhooks, "session_scope", scope)
    first = webhooks._claim_due(settings, 10, Counter(), set())
    second = other_worker[0]
    assert len(second) == 3 and first == [], (first, second)
    engine.dispose()


def test_an_accepted_delivery_is_recorded_once_the_database_is_back(  # type: ignore[no-untyped-def]
        empty_queue, make_key, webhook_receiver, monkeypatch) -> None:
    """The hour's soak: PostgreSQL stopped just after a receiver's 200, the worker could not record it, and the
    message went again, same id, once the claim's lease ended. The worker now tries the record again while its
    lease lasts: one request, delivered."""
    from sqlalchemy.exc import OperationalError

    from worker import webhooks

    record, failures = webhooks._record, []

    def database_down_twice(*args):  # type: ignore[no-untyped-def]
        if len(failures) < 2:
            failures.append(1)
            raise OperationalError("UPDATE webhook_deliveries", {}, ConnectionError("the database restarts"))
        return record(*args)

    monkeypatch.setattr(webhooks, "_record", database_down_twice)
    delivery_id, _ = _delivery(make_key, webhook_receiver.url)
    row = _deliver_until_settled(delivery_id)
    assert len(failures) == 2
    assert row.status == "delivered" and row.attempts == 1
    assert len(webhook_receiver.requests) == 1


def test_an_attempt_that_outlasts_its_claim_does_not_record_over_the_next(  # type: ignore[no-untyped-def]
        empty_queue, make_key) -> None:
    """An attempt can outlast its claim's lease (each phase has its timeout, DNS none); the row is claimed again
    meanwhile. The late attempt recorded over the new claim: an attempt counted twice, and a late failure put
    the row's next attempt over the lease of the one in flight."""
    from collections import Counter
    from datetime import timedelta

    from sqlalchemy import update

    from store.models import utcnow
    from worker import webhooks

    settings = get_settings()
    delivery_id, _ = _delivery(make_key, "http://127.0.0.1:9/hook")
    [late] = webhooks._claim_due(settings, 10, Counter(), set())
    with session_scope() as session:  # its lease ends while its attempt still runs
        session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id)
                        .values(next_attempt_at=utcnow() - timedelta(seconds=1)))
    [again] = webhooks._claim_due(settings, 10, Counter(), set())
    webhooks._record(settings, late, None, "ReadTimeout: the receiver trickled its answer", False)
    webhooks._record(settings, again, 200, None, False)
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert (row.status, row.attempts, row.last_status_code) == ("delivered", 1, 200)


def test_one_keys_slow_receivers_on_many_host_names_do_not_hold_up_other_keys(  # type: ignore[no-untyped-def]
        empty_queue, make_key, webhook_receiver, monkeypatch) -> None:
    """The per-host limit counts host names: one key's deliveries to slow receivers on 16 names (one server
    behind them all) held every slot of the worker, and another key's delivery waited out their attempts.
    WEBHOOK_PER_KEY leaves the other keys slots."""
    from store.models import ApiKey

    _fake_dns(monkeypatch, lambda host, n: "127.0.0.1" if host.endswith(".example") else None)
    slow = SlowReceiver(delay=3)
    try:
        hosts = [f"h{i}.slow.example" for i in range(16)]
        _, secret = make_key()
        with session_scope() as session:
            key_id = session.scalars(select(ApiKey.id).where(ApiKey.webhook_secret == secret)).one()
            slow_rows = [WebhookDelivery(api_key_id=key_id, url=f"http://{host}:{slow.port}/hook",
                                         payload=json.dumps({"type": "job.succeeded"})) for host in hosts]
            session.add_all(slow_rows)
            session.flush()
            slow_ids = [row.id for row in slow_rows]
        time.sleep(0.01)  # the other key's delivery is due after them: oldest first, it would wait behind them
        fast_port = webhook_receiver.server.server_address[1]
        fast_id, _ = _delivery(make_key, f"http://fast.example:{fast_port}/hook")
        settings = Settings(webhook_allowlist=[*hosts, "fast.example"], webhook_timeout_seconds=10)
        fast_after = _first_delivery_after(settings, webhook_receiver)
        assert fast_after < 1.5, f"the other key's delivery waited {fast_after:.1f}s behind the slow ones"
        assert slow.most == settings.webhook_per_key == 8
        with session_scope() as session:
            assert {session.get(WebhookDelivery, i).status for i in [*slow_ids, fast_id]} == {"delivered"}
    finally:
        slow.receiver.close()


def test_a_key_at_its_limit_with_a_deep_backlog_does_not_hide_other_keys(empty_queue, make_key) -> None:  # type: ignore[no-untyped-def]
    """A claim looks through at most 1,000 due rows, oldest first: one key at its limit with more than that due
    filled every page, and another key's delivery behind them was never reached."""
    from collections import Counter
    from datetime import timedelta

    from store.models import ApiKey, utcnow
    from worker import webhooks

    keys = []
    for name in ("busy", "other"):
        _, secret = make_key(name)
        with session_scope() as session:
            keys.append(session.scalars(select(ApiKey.id).where(ApiKey.webhook_secret == secret)).one())
    due = utcnow() - timedelta(minutes=1)
    with session_scope() as session:
        session.add_all([WebhookDelivery(api_key_id=keys[0], url=f"http://h{i}.example/hook", payload="{}",
                                         next_attempt_at=due) for i in range(1050)])
        session.add(WebhookDelivery(api_key_id=keys[1], url="http://other.example/hook", payload="{}"))
    settings = get_settings()
    claimed = webhooks._claim_due(settings, 4, Counter({("key", keys[0]): settings.webhook_per_key}), set())
    assert [c.key_id for c in claimed] == [keys[1]]


@pytest.mark.parametrize(("answers", "status", "attempts"), [
    ([413], "failed", 1), ([404], "failed", 1), ([400], "failed", 1),  # refused for good: not sent again
    ([429, 408], "delivered", 3),  # "later": retried
])
def test_a_4xx_is_not_retried_except_408_and_429(empty_queue, make_key, webhook_receiver,  # type: ignore[no-untyped-def]
                                                 answers, status, attempts) -> None:
    delivery_id, _ = _delivery(make_key, webhook_receiver.url)
    webhook_receiver.responses = list(answers)
    row = _deliver_until_settled(delivery_id)
    assert (row.status, row.attempts, len(webhook_receiver.requests)) == (status, attempts, attempts)
    assert row.last_status_code == (answers[0] if status == "failed" else 200)


def test_a_message_over_the_size_cap_links_to_its_results(empty_queue, make_key) -> None:  # type: ignore[no-untyped-def]
    from store.models import ApiKey, Job
    from store.outbox import enqueue_webhook

    _, secret = make_key()
    cap = get_settings().webhook_max_payload_bytes
    large = [[0.123456789] * 4] * (cap // 40)  # about 2 x the cap as JSON
    with session_scope() as session:
        key_id = session.scalars(select(ApiKey.id).where(ApiKey.webhook_secret == secret)).one()
        small_job, large_job = (Job(api_key_id=key_id, model="m", request={}, request_hash="-", items_total=1,
                                    prompt_tokens=1) for _ in range(2))
        session.add_all([small_job, large_job])
        session.flush()
        for job, scores in ((small_job, [[0.5, 0.25]]), (large_job, large)):
            enqueue_webhook(session, key_id, "http://127.0.0.1:9/hook", "job.succeeded",
                            {"id": job.id, "status": "succeeded", "scores": scores, "logprobs": scores},
                            job_id=job.id)
        small_id, large_id = small_job.id, large_job.id
    with session_scope() as session:
        sent = {row.job_id: json.loads(row.payload)["data"] for row in session.scalars(select(WebhookDelivery))}
    assert sent[small_id] == {"id": small_id, "status": "succeeded", "scores": [[0.5, 0.25]],
                              "logprobs": [[0.5, 0.25]]}
    assert sent[large_id] == {"id": large_id, "status": "succeeded", "results_url": f"/jobs/{large_id}"}
