"""API keys: `psk_...` bearer tokens stored as SHA-256 hashes, each with a webhook signing secret."""

import base64
import hashlib
import secrets
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import ApiKey
from store.settings import get_settings


def hash_key(key: str) -> str:
    # A plain hash is enough: keys are 256 random bits, so there is nothing to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(session: Session, name: str) -> tuple[ApiKey, str]:
    """Stores a new key; returns the row and the plaintext key (shown once, never stored)."""
    key = get_settings().api_key_prefix + secrets.token_urlsafe(32)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    row = ApiKey(name=name, key_hash=hash_key(key), webhook_secret=secret)
    session.add(row)
    session.flush()
    return row, key


# How long an API process trusts a key it has found, without asking the database again: a deleted key stops
# working within this time. Looked up on every request instead, a key would cost a query and a commit each.
KEY_CACHE_SECONDS = 5.0
_found: dict[str, tuple[float, ApiKey]] = {}  # by key hash: (when it was read, the row, detached)


def cached_api_key(key: str) -> ApiKey | None:
    """The key's row if it was read from the database less than KEY_CACHE_SECONDS ago."""
    found = _found.get(hash_key(key))
    return found[1] if found is not None and time.monotonic() - found[0] < KEY_CACHE_SECONDS else None


def find_api_key(session: Session, key: str) -> ApiKey | None:
    """The key's row, cached or read from the database. A wrong key is never cached, so a new key works at
    once."""
    cached = cached_api_key(key)
    if cached is not None:
        return cached
    digest = hash_key(key)
    now = time.monotonic()
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
    if row is None:
        _found.pop(digest, None)
        return None
    # Detached, the row is shared by concurrent requests read-only: a rollback of this request's session
    # cannot expire it under another thread.
    session.expunge(row)
    _found[digest] = (now, row)
    return row
