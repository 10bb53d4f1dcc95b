"""A storage location (`Location`): one object or prefix of a reference batch's data, local or in an object
store, with the filesystem that reaches it; and `LocationColumn`, the column type that stores one as its URI, so
that a row read back carries a Location, not a string to parse. Which locations a key may use is
store/lake/access.py's.
"""

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

from store.errors import ServiceError

# URI scheme -> fsspec protocol. gcsfs and adlfs are optional installs (`pip install packscore[gcs]` /
# `[azure]`): fsspec knows their protocols and says which package to install when one is missing.
REMOTE_PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "az", "abfs": "az", "abfss": "az"}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Location:
    """One object or prefix: `protocol` ("file" or a remote protocol) and the path fsspec takes for it
    (`/abs/path` or `bucket/key`)."""

    protocol: str
    path: str

    @classmethod
    def parse(cls, uri: str) -> "Location":
        """A URI this module made (`uri`), already vetted: stored in a chunk row, say."""
        if uri.startswith("file://"):
            return cls("file", uri[len("file://"):])
        scheme, path = uri.split("://", 1)
        return cls(REMOTE_PROTOCOLS[scheme], path)

    @property
    def uri(self) -> str:
        return f"file://{self.path}" if self.protocol == "file" else f"{self.scheme}://{self.path}"

    @property
    def scheme(self) -> str:
        return {"gcs": "gs"}.get(self.protocol, self.protocol)

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
    if protocol == "file":
        return fsspec.filesystem("file", auto_mkdir=True)
    try:
        return fsspec.filesystem(protocol)
    except ImportError as exc:
        raise ServiceError(400, "storage_unavailable",
                           f"{protocol}:// is not installed on this server ({exc})") from None
    except Exception as exc:  # noqa: BLE001  (adlfs without an account or connection string, say)
        raise ServiceError(400, "storage_unavailable", f"{protocol}:// is not configured on this server "
                                                       f"({type(exc).__name__}: {exc})") from None


def load_filesystems(prefixes: Iterable[str]) -> list[str]:
    """Loads the filesystem of each remote prefix's protocol, and s3's client (no request: botocore's service
    model), so that a worker pays for them when it starts, not during its first batch there (issue 47's soak:
    s3fs, aiobotocore and the model were 260 modules and 30 MB of a worker's memory, taken mid-run). Returns the
    protocols loaded; one that cannot be is logged, and reported by the first batch that needs it."""
    loaded = []
    for protocol in sorted({REMOTE_PROTOCOLS.get(p.split("://", 1)[0]) for p in prefixes if "://" in p} - {None}):
        try:
            fs = filesystem(protocol)
            if protocol == "s3":  # gcsfs's and adlfs's connects look for credentials, maybe over the network
                fs.connect()
        except Exception as exc:  # noqa: BLE001  (a ServiceError, or botocore's own configuration errors)
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
