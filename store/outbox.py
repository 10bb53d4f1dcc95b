"""The webhook outbox and the URL vetting that both submission and delivery use.

A terminal job's or batch's webhook is a row added in the same transaction as the state change (no change
without its webhook, none lost if the process dies before sending); workers deliver the rows (worker/webhooks.py).
The SSRF guard refuses URLs whose host resolves to a loopback, private, link-local or metadata address unless
WEBHOOK_ALLOWLIST names it; `pin` resolves once so that delivery connects to the vetted address."""

import ipaddress
import json
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import SplitResult, urlsplit

import httpx
import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from store.errors import ServiceError
from store.models import Job, WebhookDelivery
from store.schemas import job_out
from store.settings import get_settings

# Cloud metadata endpoints not already covered by the link-local/private checks.
_METADATA_NETWORKS = (ipaddress.ip_network("100.100.100.200/32"), ipaddress.ip_network("fd00:ec2::254/128"))


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UnsafeURL(ValueError):
    """A webhook URL the SSRF guard refuses."""


class NonPublicAddress(UnsafeURL):
    """The host is (or resolves to) a loopback, private, link-local or metadata address: WEBHOOK_ALLOWLIST can
    allow it."""


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
            raise NonPublicAddress(f"host {host!r} resolves to {ip}, a non-public address")


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


def vet_webhook_url(url: str | None, allowlist: list[str]) -> None:
    """A submission's webhook_url, refused with 400 `invalid_webhook_url` (naming WEBHOOK_ALLOWLIST when that
    setting could allow it)."""
    if url is None:
        return
    try:
        check_url(url, allowlist)
    except NonPublicAddress as exc:
        raise ServiceError(400, "invalid_webhook_url", f"{exc}; webhooks to such addresses are refused unless the "
                                                       "service's WEBHOOK_ALLOWLIST setting lists the host or "
                                                       "its network") from None
    except UnsafeURL as exc:
        raise ServiceError(400, "invalid_webhook_url", str(exc)) from None


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


# The parts of a message's data that grow with its results: a message over WEBHOOK_MAX_PAYLOAD_BYTES goes
# without them, with `results_url` (the GET that has them) instead.
_RESULT_FIELDS = ("scores", "logprobs", "results")


def enqueue_webhook(session: Session, api_key_id: str, url: str, event_type: str, data: dict, *,
                    job_id: str | None = None, batch_id: str | None = None) -> None:
    """Adds one webhook message (a job's or a batch's) to the outbox, in the caller's transaction."""
    body = {"type": event_type, "timestamp": datetime.now(UTC).isoformat(), "data": data}
    payload = json.dumps(body)
    if len(payload.encode()) > get_settings().webhook_max_payload_bytes:
        results_url = f"/jobs/{job_id}" if job_id else f"/batches/{batch_id}/results"
        body["data"] = {**{k: v for k, v in data.items() if k not in _RESULT_FIELDS}, "results_url": results_url}
        payload = json.dumps(body)
    session.add(WebhookDelivery(api_key_id=api_key_id, job_id=job_id, batch_id=batch_id, url=url,
                                payload=payload))


def latest_delivery(session: Session, batch_id: str) -> WebhookDelivery | None:
    """The batch's latest webhook message (a batch's views show its state)."""
    return session.scalar(select(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id)
                          .order_by(WebhookDelivery.created_at.desc()).limit(1))
