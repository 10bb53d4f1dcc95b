"""Webhook delivery: Standard Webhooks signatures, SSRF guard, retries with backoff (DB-backed outbox).

Each attempt resolves the URL's host once, vets the addresses and connects to a vetted address (Host header and
TLS server name from the URL), so DNS rebinding cannot swap in an internal address between check and connect.
Attempts run concurrently (WEBHOOK_CONCURRENCY per worker, WEBHOOK_PER_HOST per host); a DNS failure is
retried like any transport error, an address the guard forbids fails the delivery for good."""

import ipaddress
import json
import logging
import queue
import socket
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import SplitResult, urlsplit

import httpx
import numpy as np
from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

from api.db import session_scope
from api.metrics import count
from api.models import ApiKey, Job, WebhookDelivery, utcnow
from api.schemas import job_out
from api.settings import Settings

log = logging.getLogger(__name__)

# Cloud metadata endpoints not already covered by the link-local/private checks.
_METADATA_NETWORKS = (ipaddress.ip_network("100.100.100.200/32"), ipaddress.ip_network("fd00:ec2::254/128"))


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UnsafeURL(ValueError):
    """A webhook URL the SSRF guard refuses."""


def _allowed_by(ip: IPAddress, allowlist: list[str]) -> bool:
    for entry in allowlist:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue  # a host name entry, matched on the name
    return False


def _forbidden(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    # not is_global covers loopback, private, link-local (169.254.169.254), shared (100.64/10), documentation...
    return (not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified
            or any(ip in net for net in _METADATA_NETWORKS))


class UnresolvedHost(UnsafeURL):
    """The host name did not resolve. Refused at submission; at delivery, a transport error that is retried."""


@dataclass(frozen=True)
class Target:
    """Where one delivery attempt connects: the URL's host resolved once, its addresses vetted, and the
    connection pinned to them, so a second look-up (DNS rebinding) has no say."""

    scheme: str
    host: str  # as in the URL: a name (lower case) or an IP literal
    port: str  # as in the URL ("" when none is given)
    userinfo: str
    target: str  # path and query
    addresses: tuple[str, ...]

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else _ascii_host(self.host)
        return f"{host}:{self.port}" if self.port else host

    @property
    def extensions(self) -> dict[str, str]:
        # TLS: server name (SNI) and certificate check against the URL's host name, not the pinned address.
        if self.scheme != "https" or _is_ip(self.host):
            return {}
        return {"sni_hostname": _ascii_host(self.host)}

    def url_for(self, address: str) -> str:
        """The URL with its host replaced by `address` (one of self.addresses)."""
        host = f"[{address}]" if ":" in address else address
        netloc = f"{self.userinfo}@{host}" if self.userinfo else host
        return f"{self.scheme}://{netloc}{':' + self.port if self.port else ''}{self.target}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _ascii_host(host: str) -> str:
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        return host


def _split(url: str) -> tuple[SplitResult, str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeURL(f"malformed URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL("webhook_url must be an http or https URL with a host")
    return parts, parts.hostname, port


def _resolve(host: str, port: int) -> list[IPAddress]:
    """The host's addresses, in the resolver's order (one look-up)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (UnicodeError, ValueError) as exc:  # a name no resolver accepts: it never will
        raise UnsafeURL(f"host {host!r} is not a valid host name: {exc}") from None
    except OSError as exc:  # gaierror: no such name, or no answer now
        raise UnresolvedHost(f"host {host!r} does not resolve: {exc}") from None
    addresses: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise UnresolvedHost(f"host {host!r} does not resolve: no addresses")
    return addresses


def _vet(host: str, addresses: list[IPAddress], allowlist: list[str]) -> None:
    for ip in addresses:
        if _forbidden(ip) and not _allowed_by(ip, allowlist):
            raise UnsafeURL(f"host {host!r} resolves to {ip}, a non-public address")


def check_url(url: str, allowlist: list[str]) -> list[IPAddress]:
    """Raises UnsafeURL unless `url` is http(s) and every address its host resolves to is public or allowlisted
    (UnresolvedHost, a subclass, when the host does not resolve); returns those addresses. A host name on the
    allowlist is not looked up (nothing to vet): returns []."""
    _, host, port = _split(url)
    if host in allowlist:
        return []
    addresses = _resolve(host, port)
    _vet(host, addresses, allowlist)
    return addresses


def pin(url: str, allowlist: list[str]) -> Target:
    """Resolves the URL's host once and vets its addresses like check_url (an allowlisted host name is resolved
    but not vetted); the attempt then connects to these addresses only."""
    parts, host, port = _split(url)
    addresses = _resolve(host, port)
    if host not in allowlist:
        _vet(host, addresses, allowlist)
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    pinned = Target(parts.scheme, host, str(parts.port) if parts.port is not None else "", userinfo, target,
                    tuple(str(ip) for ip in addresses))
    for ip in addresses:  # httpx must read the pinned URL's host as that address (no parser differential)
        try:
            ok = ipaddress.ip_address(httpx.URL(pinned.url_for(str(ip))).host) == ip
        except (httpx.InvalidURL, ValueError):
            ok = False
        if not ok:
            raise UnsafeURL(f"URL {url!r} cannot be pinned to {ip}")
    return pinned


def enqueue_job_webhook(session: Session, job: Job, logprobs: np.ndarray | None = None) -> None:
    """Adds the delivery of a terminal job's webhook in the caller's transaction (an outbox: no state change
    without its webhook, none lost if the process dies before sending)."""
    if not job.webhook_url:
        return
    enqueue_webhook(session, job.api_key_id, job.webhook_url, f"job.{job.status}",
                    job_out(job, logprobs).model_dump(mode="json", exclude={"webhook"}), job_id=job.id)


def enqueue_webhook(session: Session, api_key_id: str, url: str, event_type: str, data: dict, *,
                    job_id: str | None = None, batch_id: str | None = None) -> None:
    """Adds one webhook message (a job's or a batch's) to the outbox, in the caller's transaction."""
    body = {"type": event_type, "timestamp": datetime.now(UTC).isoformat(), "data": data}
    session.add(WebhookDelivery(api_key_id=api_key_id, job_id=job_id, batch_id=batch_id, url=url,
                                payload=json.dumps(body)))


def sign(secret: str, msg_id: str, payload: str, when: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for one attempt."""
    when = when or datetime.now(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, when, payload),
        "content-type": "application/json",
    }


@dataclass(frozen=True)
class _Claimed:
    id: str
    url: str
    payload: str
    secret: str
    host: str  # for the per-host limit


def _host_of(url: str) -> str:
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


# A claim looks through up to _CLAIM_PAGES pages of due rows, so deliveries queued behind a backlog for hosts at
# their limit still go out.
_CLAIM_PAGE = 100
_CLAIM_PAGES = 10


def _claim_due(settings: Settings, slots: int, per_host: Counter[str], busy: set[str]) -> list[_Claimed]:
    """Claims up to `slots` due deliveries, oldest first, skipping those whose host already has
    WEBHOOK_PER_HOST attempts (`per_host`: attempts in flight by host) and those in flight here (`busy`)."""
    per_host = Counter(per_host)
    limit = max(1, settings.webhook_per_host)
    claimed: list[WebhookDelivery] = []
    hosts: list[str] = []
    # Claimed until the attempt's deadline: if this process dies mid-attempt, another one retries later.
    lease_until = utcnow() + timedelta(seconds=settings.webhook_timeout_seconds + 30)
    with session_scope() as session:
        after: tuple[datetime, str] | None = None
        for _ in range(_CLAIM_PAGES):
            query = (select(WebhookDelivery)
                     .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= utcnow())
                     .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                     .limit(_CLAIM_PAGE)
                     .with_for_update(skip_locked=True))
            if after is not None:
                query = query.where(tuple_(WebhookDelivery.next_attempt_at, WebhookDelivery.id) > after)
            rows = session.scalars(query).all()
            if rows:
                after = (rows[-1].next_attempt_at, rows[-1].id)
            for row in rows:
                host = _host_of(row.url)
                if row.id in busy or per_host[host] >= limit:
                    continue  # left due: a later claim (here or in another worker) takes it
                per_host[host] += 1
                row.next_attempt_at = lease_until
                claimed.append(row)
                hosts.append(host)
                if len(claimed) == slots:
                    break
            if len(claimed) == slots or len(rows) < _CLAIM_PAGE:
                break
        if not claimed:
            return []
        secrets = dict(session.execute(select(ApiKey.id, ApiKey.webhook_secret)
                                       .where(ApiKey.id.in_({row.api_key_id for row in claimed}))).all())
        return [_Claimed(row.id, row.url, row.payload, secrets.get(row.api_key_id) or "", host)
                for row, host in zip(claimed, hosts)]


def _attempt(settings: Settings, msg_id: str, url: str, payload: str,
             secret: str) -> tuple[int | None, str | None, bool]:
    """One attempt: (status code, error, whether the error is permanent)."""
    try:
        target = pin(url, settings.webhook_allowlist)
    except UnresolvedHost as exc:
        return None, f"DNS: {exc}", False  # retried like any transport error
    except UnsafeURL as exc:
        return None, f"refused: {exc}", True
    headers = {**sign(secret, msg_id, payload), "host": target.host_header}
    address = target.addresses[0]
    try:
        # follow_redirects=False: a redirect could point at an internal address; a 3xx is a failed attempt.
        with httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False) as client:
            for i, address in enumerate(target.addresses):
                try:
                    # Streamed and closed unread: only the status matters, however big the body.
                    with client.stream("POST", target.url_for(address), content=payload.encode(),
                                       headers=headers, extensions=target.extensions) as response:
                        status_code = response.status_code
                    break
                except httpx.ConnectError:
                    if i == len(target.addresses) - 1:
                        raise  # otherwise the host's next vetted address, as a plain connect would
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc} (at {address})", False
    return status_code, None if 200 <= status_code < 300 else f"HTTP {status_code}", False


def _record(settings: Settings, claimed: _Claimed, status_code: int | None, error: str | None,
            permanent: bool) -> None:
    with session_scope() as session:
        row = session.get(WebhookDelivery, claimed.id)
        if row is None:
            return
        row.attempts += 1
        count(session, "webhook_attempts")
        row.last_status_code = status_code
        row.last_error = error
        schedule = settings.webhook_retry_schedule
        if error is None:
            row.status, row.delivered_at = "delivered", utcnow()
        elif permanent or row.attempts > len(schedule):
            row.status = "failed"
        else:
            row.next_attempt_at = utcnow() + timedelta(seconds=schedule[row.attempts - 1])
        if row.status != "pending":
            count(session, "webhook_deliveries_finished", label=row.status)
        attempts = row.attempts
    if error:
        log.info("webhook %s to %s failed (attempt %s): %s", claimed.id, claimed.url, attempts, error)


class Dispatcher:
    """Runs delivery attempts concurrently: at most WEBHOOK_CONCURRENCY at once in this process, and at most
    WEBHOOK_PER_HOST of them to one host, so a slow receiver holds up its own deliveries only.

    `dispatch` claims due deliveries as far as free slots allow and starts their attempts without waiting;
    each attempt records its result (attempts, status, next retry) when it ends. The threads are daemons:
    an attempt in flight never holds up the process's exit (its lease expires and another worker retries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the bookkeeping below
        self._claim_lock = threading.Lock()  # one claim at a time: slots are counted before, taken after
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, str] = {}  # message id -> host
        self._per_host: Counter[str] = Counter()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        self._stopping = False

    def dispatch(self, settings: Settings, refill: bool = False) -> list[Future]:
        """Claims due deliveries for the free slots and starts their attempts; returns their futures (each
        done once its result is recorded). `refill`: each attempt that ends dispatches again, so a backlog
        keeps every slot busy between calls."""
        with self._claim_lock:
            with self._lock:
                if self._stopping:
                    return []
                slots = max(1, settings.webhook_concurrency) - len(self._in_flight)
                per_host, busy = Counter(self._per_host), set(self._in_flight)
            if slots <= 0:
                return []
            claimed = _claim_due(settings, slots, per_host, busy)
            futures = []
            with self._lock:
                while self._threads < max(1, settings.webhook_concurrency):
                    threading.Thread(target=self._run, name=f"webhook-{self._threads}", daemon=True).start()
                    self._threads += 1
                for delivery in claimed:
                    self._in_flight[delivery.id] = delivery.host
                    self._per_host[delivery.host] += 1
                    future: Future = Future()
                    futures.append(future)
                    self._queue.put((settings, delivery, future, refill))
            return futures

    def _run(self) -> None:
        while True:
            settings, delivery, future, refill = self._queue.get()
            try:
                _record(settings, delivery, *_attempt(settings, delivery.id, delivery.url, delivery.payload,
                                                      delivery.secret))
                error = None
            except Exception as exc:  # e.g. the database is down: the lease expires, the delivery is retried
                log.exception("webhook %s: could not record the attempt", delivery.id)
                error = exc
            with self._lock:  # the slot is free before anyone sees the future done
                del self._in_flight[delivery.id]
                self._per_host[delivery.host] -= 1
                if not self._per_host[delivery.host]:
                    del self._per_host[delivery.host]
                self._idle.notify_all()
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            if refill:
                try:
                    self.dispatch(settings, refill=True)
                except Exception:
                    log.exception("webhook dispatch failed")

    def stop(self, timeout: float) -> bool:
        """Starts no more attempts; waits up to `timeout` seconds for those in flight. Returns whether none is
        left (those left end on their own, or die with the process and are retried after their lease)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return not self._in_flight


_dispatcher = Dispatcher()


def dispatch_due(settings: Settings) -> int:
    """The worker's delivery loop: starts the due attempts that free slots allow, and returns without waiting
    for them (each ending attempt dispatches again). Returns how many it started."""
    return len(_dispatcher.dispatch(settings, refill=True))


def deliver_due(settings: Settings) -> int:
    """Attempts every delivery that is due now, concurrently within the limits, and waits for these attempts
    (tests and one-off use; the worker uses dispatch_due). Returns how many attempts it made."""
    count, pending = 0, set()
    while True:
        started = _dispatcher.dispatch(settings)
        count += len(started)
        pending.update(started)
        if not pending:
            return count
        _, pending = wait(pending, return_when=FIRST_COMPLETED)


def stop_delivery(timeout: float) -> bool:
    """Worker shutdown: starts no more attempts, waits up to `timeout` seconds for those in flight."""
    return _dispatcher.stop(timeout)
