"""Local files (file:// URIs and plain paths), through fsspec's local filesystem."""

import errno

import fsspec
from fsspec import AbstractFileSystem

from store.storage.interface import Failure, Store

# A disk or a quota that is full: a write fails the same way until someone frees space.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class Local(Store):
    schemes = ("file",)
    protocol = "file"
    version_fields = ("mtime",)

    def filesystem(self) -> AbstractFileSystem:
        # A result object's folder is made when the object is written, as an object store's prefix is.
        return fsspec.filesystem("file", auto_mkdir=True)

    def refused_write(self, exc: BaseException) -> Failure | None:
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return Failure.FULL
        return super().refused_write(exc)
