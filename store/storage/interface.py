"""What a store is, to the rest of the code: the URI schemes it serves, the fsspec protocol that reaches it, the
pip extra that installs its library, where its paths' buckets are, which metadata field versions its objects,
and what its library's failures mean. Each store is one subclass in a module of its own (store/storage/)."""

import enum
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


class Failure(enum.Enum):
    """What a store's failure says, most telling first: a failure that reads as two kinds is the first."""

    NOT_FOUND = "not_found"  # the object, or its bucket, is not there
    FULL = "full"  # the disk or quota under the object is full: waiting does not free it
    DENIED = "denied"  # this server's credentials are refused or missing
    UNREACHABLE = "unreachable"  # the store cannot be reached now: trying again may work


class Store:
    """One kind of store. A subclass sets the attributes and overrides the methods its library needs; the
    defaults fit a filesystem whose paths are `bucket/key` and whose library raises Python's own OSErrors."""

    # The URI schemes it serves; its URIs are written with the first.
    schemes: tuple[str, ...] = ()
    # The fsspec protocol of its filesystem.
    protocol: str = ""
    # The pip extra that installs its library (`pip install packscore[<extra>]`); None: a base dependency.
    extra: str | None = None
    # The fields of its `info()` that change when an object is written again, in the order they are tried.
    version_fields: tuple[str, ...] = ()

    def filesystem(self) -> AbstractFileSystem:
        """A filesystem with the host's credentials (the store's own chain; never a URI's). Raises ImportError
        when its library is not installed, or the library's own error when it is not configured."""
        return fsspec.filesystem(self.protocol)

    def load(self, fs: AbstractFileSystem) -> None:
        """Loads what the filesystem's first request needs (a client, a service model) without sending one, so
        that a worker pays for it when it starts. Nothing by default: a library's own connect may look for
        credentials over the network."""

    def path(self, bucket: str, key: str) -> str:
        """The filesystem's path for `key` (empty, or starting with "/") in `bucket` (a URI's host; empty for a
        local path). The inverse of `uri`."""
        return bucket + key

    def uri(self, path: str) -> str:
        """The URI of a filesystem path, written with the first scheme. The inverse of `path`."""
        return f"{self.schemes[0]}://{path}"

    def version(self, info: dict[str, Any]) -> str | None:
        """The object's version in an `info()` (or listing) entry: the first of `version_fields` present and
        not empty (s3fs answers an empty ETag for a store that gives none), quotes stripped (an ETag is quoted
        in some answers and not in others); None if there is none. Two entries of one object have the same
        version until it is written again."""
        found = (str(info[name]).strip('"') for name in self.version_fields if info.get(name) is not None)
        return next((version for version in found if version), None)

    def failure(self, exc: BaseException) -> Failure | None:
        """What `exc`, raised while an object is listed, looked at or read, says of the store: NOT_FOUND,
        DENIED or UNREACHABLE; None where it says none of these (the object could not be read, for a reason
        given in the exception). The default reads the OSErrors that fsspec's filesystems raise; a store whose
        library raises its own types reads those first."""
        if isinstance(exc, FileNotFoundError):
            return Failure.NOT_FOUND
        if isinstance(exc, PermissionError):
            return Failure.DENIED
        if isinstance(exc, (OSError, TimeoutError)):
            return Failure.UNREACHABLE
        return None

    def refused_write(self, exc: BaseException) -> Failure | None:
        """Whether a write that raised `exc` is refused for good: FULL or DENIED. None where trying again may
        work (the store unreachable, a bucket not listed yet by a store coming back up, credentials not fetched
        in a metadata endpoint's blip). The default reads a PermissionError as DENIED: a local folder's
        permissions, and a 403 as s3fs raises it."""
        return Failure.DENIED if isinstance(exc, PermissionError) else None
