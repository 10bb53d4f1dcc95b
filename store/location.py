"""A storage location (`Location`): one object or prefix of a reference batch's data, local or in an object
store, with the filesystem that reaches it; and `LocationColumn`, the column type that stores one as its URI, so
that a row read back carries a Location, not a string to parse. What each store is lives in store/storage/;
which locations a key may use is store/lake/access.py's.
"""

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fsspec import AbstractFileSystem
from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

from store import storage
from store.errors import ServiceError
from store.storage import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Location:
    """One object or prefix: `protocol` (its store's fsspec protocol) and the path fsspec takes for it
    (`/abs/path` or `bucket/key`)."""

    protocol: str
    path: str

    @classmethod
    def parse(cls, uri: str) -> "Location":
        """A URI this module made (`uri`), already vetted: stored in a chunk row, say."""
        scheme, rest = uri.split("://", 1)
        store = storage.by_scheme(scheme)
        bucket = rest.split("/", 1)[0]
        return cls(store.protocol, store.path(bucket, rest[len(bucket):]))

    @property
    def store(self) -> Store:
        return storage.by_protocol(self.protocol)

    @property
    def uri(self) -> str:
        return self.store.uri(self.path)

    @property
    def scheme(self) -> str:
        return self.store.schemes[0]

    @property
    def fs(self) -> AbstractFileSystem:
        return filesystem(self.protocol)

    def child(self, name: str) -> "Location":
        return Location(self.protocol, posixpath.join(self.path.rstrip("/"), name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))


@lru_cache
def filesystem(protocol: str) -> AbstractFileSystem:
    """One filesystem per protocol and process, with the host's credentials (fsspec caches its instances too)."""
    store = storage.by_protocol(protocol)
    try:
        return store.filesystem()
    except ImportError as exc:
        extra = f"; `pip install packscore[{store.extra}]` installs it" if store.extra else ""
        raise ServiceError(400, "storage_unavailable",
                           f"{protocol}:// is not installed on this server ({exc}{extra})") from None
    except Exception as exc:  # noqa: BLE001  (adlfs without an account or connection string, say)
        raise ServiceError(400, "storage_unavailable", f"{protocol}:// is not configured on this server "
                                                       f"({type(exc).__name__}: {exc})") from None


def load_filesystems(prefixes: Iterable[str]) -> list[str]:
    """Loads the filesystem of each remote prefix's store and what its first request needs (Store.load), so that
    a worker pays for them when it starts, not during its first batch there (s3fs, aiobotocore and botocore's
    service model are some 30 MB of a worker's memory). Returns the protocols loaded; one that cannot be is
    logged, and reported by the first batch that needs it."""
    loaded = []
    stores: dict[str, Store] = {}
    for prefix in prefixes:
        store = storage.remote(prefix.split("://", 1)[0]) if "://" in prefix else None
        if store is not None:
            stores[store.protocol] = store
    for protocol, store in sorted(stores.items()):
        try:
            store.load(filesystem(protocol))
        except Exception as exc:  # noqa: BLE001  (a ServiceError, or the library's own configuration errors)
            log.warning("%s:// could not be loaded at start (%s: %s)", protocol, type(exc).__name__, exc)
            continue
        loaded.append(protocol)
    return loaded


class LocationColumn(TypeDecorator):
    """A Location stored as its URI (text)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return value.uri if isinstance(value, Location) else value

    def process_result_value(self, value: str | None, dialect: Any) -> Location | None:
        return None if value is None else Location.parse(value)
