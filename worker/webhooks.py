"""Webhook delivery: Standard Webhooks signatures, SSRF guard, retries with backoff (DB-backed outbox)."""

import ipaddress
import json
import logging
import socket
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import httpx
import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

from api.db import session_scope
from api.models import ApiKey, Job, WebhookDelivery, utcnow
from api.schemas import job_out
from api.settings import Settings

log = logging.getLogger(__name__)

# Cloud metadata endpoints not already covered by the link-local/private checks.
_METADATA_NETWORKS = (ipaddress.ip_network("100.100.100.200/32"), ipaddress.ip_network("fd00:ec2::254/128"))


class UnsafeURL(ValueError):
    """A webhook URL the SSRF guard refuses."""


def _allowed_by(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allowlist: list[str]) -> bool:
    for entry in allowlist:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue  # a host name entry, matched on the name
    return False


def _forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    # not is_global covers loopback, private, link-local (169.254.169.254), shared (100.64/10), documentation...
    return (not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified
            or any(ip in net for net in _METADATA_NETWORKS))


def check_url(url: str, allowlist: list[str]) -> None:
    """Raises UnsafeURL unless `url` is http(s) and every address its host resolves to is public or allowlisted."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeURL(f"malformed URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL("webhook_url must be an http or https URL with a host")
    host = parts.hostname
    if host in allowlist:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:  # gaierror, or a name no resolver accepts
        raise UnsafeURL(f"host {host!r} does not resolve: {exc}") from None
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if _forbidden(ip) and not _allowed_by(ip, allowlist):
            raise UnsafeURL(f"host {host!r} resolves to {ip}, a non-public address")


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


def _claim_due(settings: Settings) -> tuple[str, str, str, str] | None:
    with session_scope() as session:
        row = session.scalar(
            select(WebhookDelivery)
            .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= utcnow())
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(1)
            .with_for_update(skip_locked=True))
        if row is None:
            return None
        # Claimed until the attempt's deadline: if this process dies mid-attempt, another one retries later.
        row.next_attempt_at = utcnow() + timedelta(seconds=settings.webhook_timeout_seconds + 30)
        secret = session.scalar(select(ApiKey.webhook_secret).where(ApiKey.id == row.api_key_id))
        return row.id, row.url, row.payload, secret or ""


def _attempt(settings: Settings, msg_id: str, url: str, payload: str, secret: str) -> tuple[int | None, str | None]:
    try:
        check_url(url, settings.webhook_allowlist)
    except UnsafeURL as exc:
        return None, f"refused: {exc}"
    try:
        # follow_redirects=False: a redirect could point at an internal address; a 3xx is a failed attempt.
        with httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False) as client:
            response = client.post(url, content=payload.encode(), headers=sign(secret, msg_id, payload))
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return response.status_code, None if 200 <= response.status_code < 300 else f"HTTP {response.status_code}"


def deliver_one(settings: Settings) -> bool:
    """Makes one due delivery attempt, if any is due; returns whether there was one."""
    claimed = _claim_due(settings)
    if claimed is None:
        return False
    msg_id, url, payload, secret = claimed
    status_code, error = _attempt(settings, msg_id, url, payload, secret)
    with session_scope() as session:
        row = session.get(WebhookDelivery, msg_id)
        if row is None:
            return True
        row.attempts += 1
        row.last_status_code = status_code
        row.last_error = error
        schedule = settings.webhook_retry_schedule
        if error is None:
            row.status, row.delivered_at = "delivered", utcnow()
        elif row.attempts > len(schedule) or error.startswith("refused"):
            row.status = "failed"
        else:
            row.next_attempt_at = utcnow() + timedelta(seconds=schedule[row.attempts - 1])
    if error:
        log.info("webhook %s to %s failed (attempt %s): %s", msg_id, url, row.attempts, error)
    return True


def deliver_due(settings: Settings) -> int:
    """Attempts every delivery that is due now."""
    count = 0
    while deliver_one(settings):
        count += 1
    return count
