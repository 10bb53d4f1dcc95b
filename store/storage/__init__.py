"""The stores a reference batch's data may be in, behind one interface (interface.Store): one module per store,
each listed once in STORES. A new store is a module with its Store subclass and a line here.

A failure is read by every store, not only by the one being reached: an exception's type says which library
raised it, and the store that knows that library reads it."""

from collections.abc import Iterable

from store.storage.azure import Azure
from store.storage.gcs import GCS
from store.storage.interface import Failure, Store
from store.storage.local import Local
from store.storage.s3 import S3

__all__ = ["LOCAL", "STORES", "Failure", "Store", "by_protocol", "by_scheme", "failure", "refused_write", "remote",
           "remote_schemes"]

LOCAL = Local()
STORES: list[Store] = [LOCAL, S3(), GCS(), Azure()]


def by_protocol(protocol: str) -> Store:
    """The store of an fsspec protocol a Location holds; KeyError for one no store has."""
    for store in STORES:
        if store.protocol == protocol:
            return store
    raise KeyError(f"no store has the protocol {protocol!r}")


def by_scheme(scheme: str) -> Store:
    """The store that serves a URI scheme (lower case); KeyError for one no store serves."""
    for store in STORES:
        if scheme in store.schemes:
            return store
    raise KeyError(f"no store serves {scheme}://")


def remote(scheme: str) -> Store | None:
    """The store of a remote URI scheme (lower case): None for a local path's and for a scheme not served."""
    try:
        store = by_scheme(scheme)
    except KeyError:
        return None
    return None if store is LOCAL else store


def remote_schemes() -> str:
    """The remote stores' schemes, as a refusal lists them: "s3://, gs://, az://"."""
    return ", ".join(f"{store.schemes[0]}://" for store in STORES if store is not LOCAL)


def failure(exc: BaseException) -> Failure | None:
    """What a failure while listing, looking at or reading an object says (Store.failure), the most telling of
    the stores' answers."""
    return _first(store.failure(exc) for store in STORES)


def refused_write(exc: BaseException) -> Failure | None:
    """Whether a failed write is refused for good (Store.refused_write), the most telling of the stores' answers."""
    return _first(store.refused_write(exc) for store in STORES)


def _first(answers: Iterable[Failure | None]) -> Failure | None:
    return min((answer for answer in answers if answer is not None), key=list(Failure).index, default=None)
