"""DNS rebinding against a live worker: the worker resolves webhook hosts through a DNS server of this test
(127.0.0.53:53, its own /etc/resolv.conf bind-mounted in a private mount namespace) that answers a public address
to the first look-up of a name and 127.0.0.1 to every later one. The worker must connect to the address it vetted,
so the loopback receiver never gets the POST. Needs root (port 53, unshare -m); it fails, never skips, without."""

import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session

from store.models import WebhookDelivery
from tests.conftest import WebhookReceiver
from tests.service_harness import Service, running_service

DNS_ADDRESS = ("127.0.0.53", 53)
PUBLIC = "93.184.216.34"  # not reachable from the test machine: an attempt to it fails as a transport error


class RebindingDNS:
    """A UDP DNS server answering A queries: names in `rebinding` get PUBLIC on their first A query and
    127.0.0.1 on every later one, names in `loopback` always 127.0.0.1; other names NXDOMAIN, other query
    types an empty answer. Records (name, type) of every query in `queries`."""

    def __init__(self, rebinding: set[str], loopback: set[str]) -> None:
        self.rebinding, self.loopback = rebinding, loopback
        self.queries: list[tuple[str, int]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(DNS_ADDRESS)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                query, client = self.sock.recvfrom(4096)
                self.sock.sendto(self._answer(query), client)
            except OSError:
                return  # closed

    def _answer(self, query: bytes) -> bytes:
        (qid,) = struct.unpack("!H", query[:2])
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode("ascii").lower())
            i += 1 + query[i]
        qtype, end = struct.unpack("!H", query[i + 1:i + 3])[0], i + 5
        name = ".".join(labels)
        earlier = Counter(self.queries)[(name, 1)]
        self.queries.append((name, qtype))
        records = b""
        if qtype == 1 and name in self.rebinding | self.loopback:
            ip = PUBLIC if name in self.rebinding and earlier == 0 else "127.0.0.1"
            # A pointer to the question's name, type A, class IN, TTL 0 (no caching anywhere), the address.
            records = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0, 4) + socket.inet_aton(ip)
        rcode = 0 if name in self.rebinding | self.loopback else 3
        header = struct.pack("!HHHHHH", qid, 0x8580 | rcode, 1, 1 if records else 0, 0, 0)
        return header + query[12:end] + records

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def dns_service(database_factory, redis_url: str, run_id: str,  # type: ignore[no-untyped-def]
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, RebindingDNS]]:
    """A service whose one worker resolves through RebindingDNS, with an empty WEBHOOK_ALLOWLIST."""
    dns = RebindingDNS(rebinding={"rebind.example"}, loopback={"loopback.example"})
    resolv = tmp_path_factory.mktemp("dns") / "resolv.conf"
    resolv.write_text(f"nameserver {DNS_ADDRESS[0]}\noptions timeout:2 attempts:2\n")
    system_resolv = Path("/etc/resolv.conf").read_text()
    # Private mount namespace: the bind mount is the worker's alone; "$@" is the worker's command.
    prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {resolv} /etc/resolv.conf && exec "$@"', "sh"]
    try:
        with database_factory(f"packscore_dns_{run_id}") as url:
            env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:dns:",
                   "WEBHOOK_ALLOWLIST": ""}
            with running_service(env, tmp_path_factory.mktemp("dns-logs")) as service:
                service.start_worker(prefix=prefix)
                service.wait_for_workers(1)
                assert Path("/etc/resolv.conf").read_text() == system_resolv  # the worker's mount is its own
                yield service, dns
    finally:
        dns.close()


def _enqueue(service: Service, url: str) -> str:
    """A webhook message straight into the service's outbox (the API's own submit-time check uses the system
    resolver, which does not know these names)."""
    engine = create_engine(service.env["DATABASE_URL"])
    try:
        with Session(engine) as session, session.begin():
            key_id = session.execute(text("SELECT id FROM api_keys LIMIT 1")).scalar_one()
            row = WebhookDelivery(api_key_id=key_id, url=url, payload=json.dumps({"type": "job.succeeded"}))
            session.add(row)
            session.flush()
            return row.id
    finally:
        engine.dispose()


def _settled(service: Service, delivery_id: str, seconds: float = 60) -> WebhookDelivery:
    engine = create_engine(service.env["DATABASE_URL"])
    deadline = time.monotonic() + seconds
    try:
        while True:
            with Session(engine, expire_on_commit=False) as session:
                row = session.scalars(select(WebhookDelivery).where(WebhookDelivery.id == delivery_id)).one()
            if row.status != "pending":
                return row
            assert time.monotonic() < deadline, f"delivery still pending: {row.attempts} attempts, {row.last_error}"
            time.sleep(0.2)
    finally:
        engine.dispose()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


def test_rebinding_name_never_reaches_loopback(dns_service, receiver: WebhookReceiver) -> None:  # type: ignore[no-untyped-def]
    service, dns = dns_service
    port = receiver.server.server_address[1]
    delivery_id = _enqueue(service, f"http://rebind.example:{port}/hook")
    row = _settled(service, delivery_id)
    # The worker really asked our server (so the test is not vacuous), and was told the public address first.
    assert ("rebind.example", 1) in dns.queries, dns.queries
    assert receiver.requests == []
    # First attempt: pinned to the public address, unreachable, retried; the retry's look-up said 127.0.0.1.
    assert row.status == "failed" and row.attempts >= 2, (row.status, row.attempts, row.last_error)
    assert row.last_error.startswith("refused") and "127.0.0.1" in row.last_error, row.last_error
    assert Counter(dns.queries)[("rebind.example", 1)] == row.attempts  # one look-up per attempt


def test_name_resolving_to_loopback_is_refused(dns_service, receiver: WebhookReceiver) -> None:  # type: ignore[no-untyped-def]
    service, dns = dns_service
    port = receiver.server.server_address[1]
    delivery_id = _enqueue(service, f"http://loopback.example:{port}/hook")
    row = _settled(service, delivery_id)
    assert ("loopback.example", 1) in dns.queries, dns.queries
    assert receiver.requests == []
    assert (row.status, row.attempts) == ("failed", 1)
    assert row.last_error.startswith("refused") and "127.0.0.1" in row.last_error, row.last_error

