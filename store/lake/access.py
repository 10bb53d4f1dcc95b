"""Where a reference batch's data may be: which URIs a key may read or write, as Locations (store.location).

Local paths are served only under BATCH_LOCAL_ROOT (none by default; `serve --embedded` sets its own folder):
the path is resolved with its symlinks and `..` first, so neither leads out of the root. Remote URIs (those of
the stores in store/storage/: `s3://`, `gs://`, `az://`) are served only under a prefix allowed for the API key:
BATCH_STORAGE_PREFIXES (every key) or the key's own `storage_prefixes` column; none by default. Output prefixes
follow the same rules.

Credentials are never in a URI, the database, a response or a log: each filesystem takes them from its
store's standard chain on the host (each store's module says which).
"""

import logging
import os
import posixpath
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from store import storage
from store.errors import ServiceError
from store.location import Location
from store.settings import Settings
from store.storage import Failure

log = logging.getLogger(__name__)
GLOB_CHARACTERS = "*?["


def refusal(code: str, message: str, status: int = 400) -> ServiceError:
    return ServiceError(status, code, message)


def store_error(location: Location, exc: BaseException) -> ServiceError:
    """A failure of the store while an object or listing is looked at, as a refusal naming it: missing (404),
    refused to this server's credentials (403), the store unreachable (503, try again), anything else the
    store's library raised (400, with its kind; logged whole). What a failure says is each store's
    (storage.failure)."""
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}".rstrip(": ")
    failure = storage.failure(exc)
    if failure is Failure.NOT_FOUND:
        return refusal("input_not_found", f"no input object at {location.uri}", 404)
    if failure is Failure.DENIED:
        return refusal("storage_access_denied", f"{location.uri}: this server's credentials for "
                                                f"{location.scheme}:// were refused or are missing ({what})", 403)
    if failure is Failure.UNREACHABLE:
        return refusal("storage_unreachable", f"{location.uri} could not be read now ({what}); try again", 503)
    log.warning("reading %s failed", location.uri, exc_info=exc)
    return refusal("input_unreadable", f"{location.uri} could not be read ({what})")


class Access:
    """What one API key may read and write (see the module's doc)."""

    def __init__(self, local_root: str | None, prefixes: list[str]) -> None:
        self.local_root = Path(local_root).resolve() if local_root else None
        self.prefixes = [_remote(prefix, check=False) for prefix in prefixes]

    def location(self, uri: str, what: str = "input") -> Location:
        """The location of `uri` if this key may use it, else a 400/403 with a stable code. A glob stays a
        glob here (its part before the first wildcard is what is checked; `expand` checks each match)."""
        if not isinstance(uri, str) or not uri.strip():
            raise refusal("invalid_uri", f"{what} must be a non-empty URI or path")
        try:
            uri.encode()  # a lone surrogate cannot name a file or an object
            scheme = urlsplit(uri).scheme.lower() if "://" in uri else ""
        except ValueError as exc:  # "s3://[b/x": an unclosed IPv6 host, say
            raise refusal("invalid_uri", f"{what} is not a valid URI or path ({exc})") from None
        if scheme in ("", "file"):
            return self._local(uri, what)
        if storage.remote(scheme) is None:
            raise refusal("unsupported_uri", f"{what}: {scheme}:// is not served "
                                             f"({storage.remote_schemes()} or a local path)")
        location = _remote(uri)
        if not any(_under(location, prefix) for prefix in self.prefixes):
            raise refusal("storage_prefix_not_allowed",
                          f"{what} {location.uri} is not under a prefix allowed for this API key", 403)
        return location

    def _local(self, uri: str, what: str) -> Location:
        if self.local_root is None:
            raise refusal("local_paths_disabled",
                          f"{what}: local paths are not served here (BATCH_LOCAL_ROOT is unset)")
        if uri.startswith("file://"):
            parts = urlsplit(uri)
            if parts.netloc not in ("", "localhost"):
                raise refusal("path_outside_root", f"{what}: file:// URIs name a local path only")
            uri = unquote(parts.path)
        if "\x00" in uri:
            raise refusal("invalid_uri", f"{what}: the path holds a NUL character")
        path = Path(uri) if Path(uri).is_absolute() else self.local_root / uri
        if ".." in path.parts:
            raise refusal("path_outside_root", f"{what}: '..' is not allowed in a path")
        # The part before a wildcard is resolved (symlinks followed) and must stay under the root.
        static = _static_part(str(path))
        if not _served(Path(static).resolve(), self.local_root):
            # Which of input and output, and the root: a local service's root is the folder it was started in,
            # which the user may not have in mind.
            raise refusal("path_outside_root", f"{what} {path} is not under BATCH_LOCAL_ROOT ({self.local_root}; "
                                               "symlinks followed), or is a hidden file or folder there")
        folder = "/" if uri.endswith("/") and not str(path).endswith("/") else ""  # "a folder's objects"
        return Location("file", str(Path(static).resolve()) + str(path)[len(static):] + folder)

    def allows(self, location: Location) -> bool:
        """Whether a concrete object (a glob's match, say) is still inside what this key may read."""
        if location.protocol == "file":
            return self.local_root is not None and _served(Path(location.path).resolve(), self.local_root)
        return any(_under(location, prefix) for prefix in self.prefixes)

    def expand(self, uris: str | list[str], output: Location | None = None) -> list[Location]:
        """Input URIs, a list of them, or globs, as the objects they name (sorted within each glob), each once
        (a `**` glob matches a file and every folder above it). A prefix ending in "/", a folder, or a glob's
        match that is a folder, names the objects under it, but for those under a name starting with "_" or "."
        (`_SUCCESS`, Spark's `_temporary/` and `.crc` files) and those under `output` (a batch's results written
        inside its input folder are not its input when it runs again). Each match is checked again: a symlink
        in a folder under the root may point out of it."""
        objects: list[Location] = []
        seen: set[str] = set()
        listed_afresh: set[int] = set()
        # Each URI once: a listing costs a request to the store, and a request may repeat a URI many times.
        for uri in dict.fromkeys([uris] if isinstance(uris, str) else uris):
            location = self.location(uri)
            fs = location.fs
            # Listed afresh: the store's listings cache (s3fs's, gcsfs's, adlfs's) lasts as long as the process,
            # and an export rewritten since an earlier batch would be planned from its old sizes and versions. All
            # of it (a folder's entry goes without those of the folders under it), which also bounds its size;
            # once per request, so that URIs of one folder share one listing.
            if id(fs) not in listed_afresh:
                fs.invalidate_cache()
                listed_afresh.add(id(fs))
            try:
                if any(c in location.path for c in GLOB_CHARACTERS):
                    found = sorted(each for path, info in fs.glob(location.path, detail=True).items()
                                   for each in (fs.find(path) if info.get("type") == "directory" else [path]))
                elif location.path.endswith("/") or fs.isdir(location.path):
                    found = sorted(fs.find(location.path))
                else:
                    found = [location.path]
            except FileNotFoundError:
                found = []
            except re.error as exc:
                raise refusal("invalid_uri", f"input {location.uri}: not a valid glob ({exc})") from None
            except Exception as exc:  # noqa: BLE001  (see store_error)
                error = store_error(location, exc)
                if error.status != 404:
                    raise error from None
                found = []
            listed = _static_part(location.path).rstrip("/")
            for path in found:
                match = Location(location.protocol, path if location.protocol != "file" else str(Path(path)))
                below = path[len(listed):] if path.startswith(listed + "/") else posixpath.basename(path)
                if any(name.startswith(("_", ".")) for name in below.split("/")):
                    continue  # _SUCCESS, _manifest.json, _temporary/, hidden files: never data
                if match.uri in seen or (output is not None and _under(match, output)):
                    continue
                seen.add(match.uri)
                if not self.allows(match):
                    raise refusal("path_outside_root", f"input {match.name} leads outside what this key may read")
                objects.append(match)
            if not found:
                raise refusal("input_not_found", f"no input object at {location.uri}", 404)
        return objects


def storage_prefix(uri: str) -> str:
    """A prefix an operator allows (BATCH_STORAGE_PREFIXES, `create-key --storage-prefix`), checked as the URIs
    it is compared with are; raises ValueError saying what is wrong. Checked when stored: a bad prefix would
    make every batch request of its key a 400 `invalid_uri`, as if the request's own URI were at fault."""
    scheme = urlsplit(uri).scheme.lower() if "://" in uri else ""
    if storage.remote(scheme) is None:
        raise ValueError(f"{uri!r} is not a storage prefix: a URI with a bucket ({storage.remote_schemes()}; "
                         "local paths are served under BATCH_LOCAL_ROOT)")
    if any(c in uri for c in GLOB_CHARACTERS):
        raise ValueError(f"{uri!r}: a storage prefix has no wildcard (every object under it is allowed)")
    try:
        _remote(uri)
    except ServiceError as exc:
        raise ValueError(f"{uri!r}: {exc.message}") from None
    return uri


def check_storage_prefixes(settings: Settings) -> None:
    """BATCH_STORAGE_PREFIXES by storage_prefix's rules: the API and the workers stop at start on a bad one,
    rather than refuse every batch request later as if its own URI were at fault."""
    for prefix in settings.batch_storage_prefixes:
        try:
            storage_prefix(prefix)
        except ValueError as exc:
            raise ValueError(f"BATCH_STORAGE_PREFIXES: {exc}") from None


def _remote(uri: str, check: bool = True) -> Location:
    parts = urlsplit(uri)
    store = storage.remote(parts.scheme.lower())
    if store is None or not parts.netloc:
        raise refusal("invalid_uri", f"{uri!r} is not a storage URI with a bucket")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise refusal("invalid_uri", "a storage URI has no credentials, query or fragment")
    key = parts.path
    if check and any(segment in (".", "..") for segment in key.split("/")):
        raise refusal("path_outside_root", "'.' and '..' are not allowed in a storage URI")
    return Location(store.protocol, store.path(parts.netloc, key))


def _under(location: Location, prefix: Location) -> bool:
    """At a path-segment boundary: s3://b/team-a/ does not allow s3://b/team-ab/."""
    if location.protocol != prefix.protocol:
        return False
    base = prefix.path.rstrip("/") + "/"
    return location.path == prefix.path.rstrip("/") or location.path.startswith(base)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _served(path: Path, root: Path) -> bool:
    """Under the root, through no hidden file or folder there: `serve --embedded` keeps its API key and its
    database in .packscore/ under the folder it serves, and an input's errors quote its contents."""
    return _within(path, root) and not any(part.startswith(".") for part in path.relative_to(root).parts)


def _static_part(path: str) -> str:
    """The folder part of a path before its first wildcard."""
    at = min((path.find(c) for c in GLOB_CHARACTERS if c in path), default=-1)
    return path if at < 0 else os.path.dirname(path[:at]) or "/"
