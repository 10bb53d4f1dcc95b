"""Webhook delivery: Standard Webhooks signatures, SSRF guard, retries with backoff (DB-backed outbox).

Each attempt resolves the URL's host once, vets the addresses and connects to a vetted address (Host header and
TLS server name from the URL), so DNS rebinding cannot swap in an internal address between check and connect.
Attempts run concurrently (WEBHOOK_CONCURRENCY per worker, WEBHOOK_PER_HOST per host and WEBHOOK_PER_KEY per API
key); a DNS failure is
retried like any transport error, an address the guard forbids fails the delivery for good."""

import asyncio
import functools
import logging
import queue
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select, tuple_, update
from sqlalchemy.exc import OperationalError
from standardwebhooks import Webhook

from store.counters import count
from store.db import among, session_scope
from store.models import ApiKey, WebhookDelivery, utcnow
from store.outbox import Target, UnresolvedHost, UnsafeURL, pin
from store.settings import Settings

log = logging.getLogger(__name__)
# httpx logs each request's whole URL at INFO, and a receiver's URL may hold its secret (in its path, its query,
# its user info): the worker logs a delivery by its id and host only.
logging.getLogger("httpx").setLevel(logging.WARNING)
# WEBHOOK_TIMEOUT_SECONDS bounds each phase of a request (connect, each write, each read), not the whole: a
# receiver trickling its answer a byte at a time held an attempt for hours, and its slot with it (a handful of
# such URLs held every slot of every worker), past its lease (another worker then sent the message again).
# An attempt is cut off after this many timeouts in all.
ATTEMPT_TIMEOUTS = 2


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
    key_id: str  # the API key's, for the per-key limit
    lease_ends: float  # time.monotonic() when another worker may claim it again
    lease_until: datetime  # the row's next_attempt_at while this claim holds it


def _host_of(url: str) -> str:
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _limited_by(host: str, key_id: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """What an attempt counts against: its host's limit and its API key's. The host's alone let one key hold
    every slot with slow receivers on as many host names (a.example, b.example, ...: one server behind them)."""
    return ("host", host), ("key", key_id)


# A claim looks through up to _CLAIM_PAGES pages of due rows, so deliveries queued behind a backlog for hosts at
# their limit still go out.
_CLAIM_PAGE = 100
_CLAIM_PAGES = 10
# What a claim reads of the rows it looks through: not their payloads (a job's whole results, megabytes for
# a large one), which it reads for the rows it claims only. Most rows looked at are passed over (their host at
# its limit), again at each claim, and every attempt that ends claims again.
_SCANNED = (WebhookDelivery.id, WebhookDelivery.url, WebhookDelivery.api_key_id, WebhookDelivery.next_attempt_at)


def _claim_due(settings: Settings, slots: int, in_flight: Counter[tuple[str, str]],
               busy: set[str]) -> list[_Claimed]:
    """Claims up to `slots` due deliveries, oldest first, skipping those whose host already has
    WEBHOOK_PER_HOST attempts or whose API key WEBHOOK_PER_KEY (`in_flight`: attempts by `_limited_by`), and
    those in flight here (`busy`)."""
    in_flight = Counter(in_flight)
    limits = {"host": settings.webhook_per_host, "key": settings.webhook_per_key}
    # Keys at their limit are left out of the scan itself: a key with a thousand due rows of its own would fill
    # every page looked through, and other keys' rows behind them would never be reached.
    saturated = [key for (kind, key), n in in_flight.items() if kind == "key" and n >= limits["key"]]
    claimed: list = []  # rows of _SCANNED
    hosts: list[str] = []
    # Claimed until past the attempt's deadline (ATTEMPT_TIMEOUTS, after the DNS answer): if this process dies
    # mid-attempt, another one retries later.
    lease_seconds = 4 * settings.webhook_timeout_seconds + 30
    lease_until, lease_ends = utcnow() + timedelta(seconds=lease_seconds), time.monotonic() + lease_seconds
    with session_scope() as session:
        after: tuple[datetime, str] | None = None
        for _ in range(_CLAIM_PAGES):
            query = (select(*_SCANNED)
                     .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= utcnow())
                     .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                     .limit(_CLAIM_PAGE)
                     .with_for_update(skip_locked=True))
            if after is not None:
                query = query.where(tuple_(WebhookDelivery.next_attempt_at, WebhookDelivery.id) > after)
            if saturated:
                query = query.where(WebhookDelivery.api_key_id.not_in(saturated))
            rows = session.execute(query).all()
            if rows:
                after = (rows[-1].next_attempt_at, rows[-1].id)
            for row in rows:
                host = _host_of(row.url)
                counted = _limited_by(host, row.api_key_id)
                if row.id in busy or any(in_flight[what] >= limits[what[0]] for what in counted):
                    continue  # left due: a later claim (here or in another worker) takes it
                # Only if it is still as read: SQLite has no FOR UPDATE, and another worker that read it too may
                # have claimed it meanwhile (two workers of an embedded deployment delivered messages twice).
                if not session.execute(update(WebhookDelivery).where(
                        WebhookDelivery.id == row.id, WebhookDelivery.status == "pending",
                        WebhookDelivery.next_attempt_at == row.next_attempt_at)
                        .values(next_attempt_at=lease_until).execution_options(synchronize_session=False)).rowcount:
                    continue
                in_flight.update(counted)
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
        payloads = dict(session.execute(select(WebhookDelivery.id, WebhookDelivery.payload).where(
            among(session, WebhookDelivery.id, [row.id for row in claimed]))).all())
        return [_Claimed(row.id, row.url, payloads[row.id], secrets.get(row.api_key_id) or "", host,
                         row.api_key_id, lease_ends, lease_until) for row, host in zip(claimed, hosts)]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The certificate store every attempt verifies against (httpx's default: certifi's, or SSL_CERT_FILE's),
    made once. A client of its own made it again for each attempt: 16 ms of the worker's CPU reading the bundle
    (0.1 ms shared), and 0.75 MB held while the attempt lasted (WEBHOOK_CONCURRENCY attempts at once: 12 MB)."""
    return httpx.create_ssl_context()


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
    tried: list[str] = []
    limit = ATTEMPT_TIMEOUTS * settings.webhook_timeout_seconds
    try:
        # An event loop of its own (this is one of the delivery threads): a task is cut off cleanly at its
        # deadline, with its connection closed, which a blocking read cannot be.
        status_code = asyncio.run(asyncio.wait_for(
            _post(target, headers, payload.encode(), settings.webhook_timeout_seconds, tried), limit))
    except TimeoutError:
        return None, f"no whole answer within {limit:g} s (at {tried[-1] if tried else '?'})", False
    except (httpx.HTTPError, OSError) as exc:  # OSError: an ssl.SSLError after the handshake, which anyio's
        # TLS stream raises as it is (a receiver asking for a client certificate); otherwise the attempt went
        # unrecorded and was claimed again after each lease, never reaching its retry schedule's end.
        return None, f"{type(exc).__name__}: {exc} (at {tried[-1] if tried else '?'})", False
    if 200 <= status_code < 300:
        return status_code, None, False
    # A 4xx says the message itself is refused (too large, malformed, gone): sending it again gets the same
    # answer. 408 (timeout) and 429 (too many requests) say "later".
    return status_code, f"HTTP {status_code}", 400 <= status_code < 500 and status_code not in (408, 429)


async def _post(target: Target, headers: dict[str, str], body: bytes, timeout: float, tried: list[str]) -> int:
    # follow_redirects=False: a redirect could point at an internal address; a 3xx is a failed attempt.
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, verify=_tls_context()) as client:
        for i, address in enumerate(target.addresses):
            tried.append(address)
            try:
                # Streamed and closed unread: only the status matters, however big the body.
                async with client.stream("POST", target.url_for(address), content=body, headers=headers,
                                         extensions=target.extensions) as response:
                    return response.status_code
            except httpx.ConnectError:
                if i == len(target.addresses) - 1:
                    raise  # otherwise the host's next vetted address, as a plain connect would
    raise UnsafeURL("no address to connect to")  # pin() gives at least one


def _record(settings: Settings, claimed: _Claimed, status_code: int | None, error: str | None,
            permanent: bool) -> None:
    with session_scope() as session:
        # Only while the claim holds it: an attempt that outlasted its lease (a slow DNS answer, a receiver
        # trickling its answer) finds the row claimed again, and that attempt records its own outcome.
        row = session.scalar(select(WebhookDelivery).where(
            WebhookDelivery.id == claimed.id, WebhookDelivery.status == "pending",
            WebhookDelivery.next_attempt_at == claimed.lease_until).with_for_update())
        if row is None:
            log.warning("webhook %s: its claim had ended when its attempt did (%s); not recorded", claimed.id,
                        error or "delivered")
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
        log.info("webhook %s to %s failed (attempt %s): %s", claimed.id, claimed.host, attempts, error)


def _record_while_leased(settings: Settings, claimed: _Claimed, outcome: tuple) -> None:
    """Records an attempt's outcome, trying again (the database restarting) while the claim's lease lasts:
    a delivery the receiver accepted but this worker could not record would be sent again once the lease
    ended (the hour's soak met one when PostgreSQL stopped just after a 200)."""
    while True:
        try:
            return _record(settings, claimed, *outcome)
        except OperationalError:
            if time.monotonic() + 1 >= claimed.lease_ends:
                raise
            log.warning("webhook %s: the database is unreachable; recording the attempt again in 1 s", claimed.id)
            time.sleep(1)


class Dispatcher:
    """Runs delivery attempts concurrently: at most WEBHOOK_CONCURRENCY at once in this process, at most
    WEBHOOK_PER_HOST of them to one host and WEBHOOK_PER_KEY for one API key, so a slow receiver holds up its
    own deliveries only, and a key's slow receivers its own key's.

    `dispatch` claims due deliveries as far as free slots allow and starts their attempts without waiting;
    each attempt records its result (attempts, status, next retry) when it ends. The threads are daemons:
    an attempt in flight never holds up the process's exit (its lease expires and another worker retries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the bookkeeping below
        self._claim_lock = threading.Lock()  # one claim at a time: slots are counted before, taken after
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[str, tuple[tuple[str, str], ...]] = {}  # message id -> what it counts against
        self._counted: Counter[tuple[str, str]] = Counter()  # attempts by _limited_by
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
                slots = settings.webhook_concurrency - len(self._in_flight)
                in_flight, busy = Counter(self._counted), set(self._in_flight)
            if slots <= 0:
                return []
            claimed = _claim_due(settings, slots, in_flight, busy)
            futures = []
            with self._lock:
                while self._threads < settings.webhook_concurrency:
                    threading.Thread(target=self._run, name=f"webhook-{self._threads}", daemon=True).start()
                    self._threads += 1
                for delivery in claimed:
                    self._in_flight[delivery.id] = counted = _limited_by(delivery.host, delivery.key_id)
                    self._counted.update(counted)
                    future: Future = Future()
                    futures.append(future)
                    self._queue.put((settings, delivery, future, refill))
            return futures

    def _run(self) -> None:
        while True:
            settings, delivery, future, refill = self._queue.get()
            try:
                outcome = _attempt(settings, delivery.id, delivery.url, delivery.payload, delivery.secret)
                _record_while_leased(settings, delivery, outcome)
                error = None
            except Exception as exc:  # e.g. the database down past the lease: the delivery is retried
                log.exception("webhook %s: could not record the attempt", delivery.id)
                error = exc
            with self._lock:  # the slot is free before anyone sees the future done
                self._counted.subtract(self._in_flight.pop(delivery.id))
                self._counted = +self._counted  # drops the zeros: hosts and keys come and go
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
