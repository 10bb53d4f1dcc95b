"""API keys: `psk_...` bearer tokens stored as SHA-256 hashes, each with a webhook signing secret."""

import base64
import hashlib
import secrets

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


def find_api_key(session: Session, key: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
