"""The stores behind one interface (store/storage/): a store is one Store subclass and one line in STORES. fsspec's
in-memory filesystem, made a store here and registered for these tests only, carries reference batches through
the lake code: its URIs vetted, its objects planned, read, versioned and written, a batch scored end to end."""

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import storage
from store.errors import ServiceError
from store.lake.access import Access, store_error
from store.lake.tables import Columns, InputError, Options, plan, read_input, read_table, write_table
from store.location import Location
from store.storage import Failure, Store
from tests.test_lake import LABELS, allow, auth, lake_settings, pair_table, results, wait_batch  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


class Memory(Store):
    """fsspec's in-memory filesystem, one per process: objects live as long as the process."""

    schemes = ("memory",)
    protocol = "memory"
    version_fields = ("created",)  # set anew each time an object is written

    # Its paths start at "/": memory://lake/in/x is its /lake/in/x.
    def path(self, bucket: str, key: str) -> str:
        return f"/{bucket}{key}"

    def uri(self, path: str) -> str:
        return f"memory://{path.lstrip('/')}"


@pytest.fixture
def memory_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[fsspec.AbstractFileSystem]:
    """The memory store registered (one line, as a shipped store's), and its filesystem; emptied after."""
    monkeypatch.setattr(storage, "STORES", [*storage.STORES, Memory()])
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/lake"):
        fs.rm("/lake", recursive=True)


def put_pairs(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, rows_per_group: int) -> None:
    with fs.open(path, "wb") as f:
        pq.write_table(table, f, row_group_size=rows_per_group)


def test_a_store_not_registered_is_not_served() -> None:
    with pytest.raises(ServiceError) as refused:
        Access(None, []).location("memory://lake/in/pairs.parquet")
    assert refused.value.code == "unsupported_uri"
    assert "memory:// is not served (s3://, gs://, az:// or a local path)" in refused.value.message


def test_a_registered_store_s_uris_are_vetted_like_any_other(memory_store, lake_settings) -> None:  # type: ignore[no-untyped-def]
    location = Location.parse("memory://lake/in/pairs.parquet")
    assert location == Location("memory", "/lake/in/pairs.parquet")
    assert location.uri == "memory://lake/in/pairs.parquet" and location.scheme == "memory"
    access = Access(None, ["memory://lake/in/"])
    assert access.location("memory://lake/in/pairs.parquet") == location
    for uri, code in [("memory://lake/other/pairs.parquet", "storage_prefix_not_allowed"),
                      ("memory://lake/in/../x.parquet", "path_outside_root"),
                      ("memory://key@lake/in/x.parquet", "invalid_uri")]:
        with pytest.raises(ServiceError) as refused:
            access.location(uri)
        assert refused.value.code == code, uri
    # A missing object is named by its URI, as the store writes it.
    with pytest.raises(ServiceError) as missing:
        list(plan(access.expand("memory://lake/in/missing.parquet"), Options("", None, None), lake_settings))
    assert (missing.value.status, missing.value.code) == (404, "input_not_found")
    assert "memory://lake/in/missing.parquet" in missing.value.message


def test_a_chunk_is_planned_read_and_written_on_the_test_store(memory_store, lake_settings) -> None:  # type: ignore[no-untyped-def]
    table = pair_table(4, 10, seed=3)
    put_pairs(memory_store, "/lake/in/pairs.parquet", table, 20)
    access = Access(None, ["memory://lake/"])
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    chunks = list(plan(access.expand("memory://lake/in/"), options, lake_settings))
    assert [(c.input, c.part, c.start, c.stop) for c in chunks] == [
        ("memory://lake/in/pairs.parquet", 0, 0, 20), ("memory://lake/in/pairs.parquet", 1, 0, 20)]
    size = memory_store.size("/lake/in/pairs.parquet")
    assert chunks[0].version == chunks[1].version and chunks[0].version.startswith(f"{size}:")
    assert not chunks[0].version.endswith(":None")  # the store's version field was found
    read = [read_input(Location.parse(c.input), c.part, c.start, c.stop, options, c.version) for c in chunks]
    ids = [pairs.columns["pair_id"] for pairs in read]
    assert [i for column in ids for i in (column.to_pylist() if hasattr(column, "to_pylist") else column)] == \
        table.column("pair_id").to_pylist()
    # A result object written and read back through the same location code.
    out = Location.parse("memory://lake/out/part-000000-attempt-1.parquet")
    write_table(out, table.slice(0, 20), "parquet")
    assert [row for rows in read_table(out) for row in rows] == table.slice(0, 20).to_pylist()
    # Written again, the object is another version: its planned chunks are refused, not read as other rows.
    put_pairs(memory_store, "/lake/in/pairs.parquet", table, 20)
    with pytest.raises(InputError) as changed:
        read_input(Location.parse(chunks[0].input), 0, 0, 20, options, chunks[0].version)
    assert changed.value.code == "input_changed"


def test_a_reference_batch_runs_on_the_test_store(client, make_key, empty_queue, memory_store,  # type: ignore[no-untyped-def]
                                                  lake_settings) -> None:
    key, _ = make_key()
    allow(key, ["memory://lake/"])
    table = pair_table(3, 8, seed=4)
    put_pairs(memory_store, "/lake/in/batch/pairs.parquet", table, 12)
    body = {"input": "memory://lake/in/batch/", "output": "memory://lake/out/", "format": "parquet",
            "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS}
    created = client.post("/batches", json=body, headers=auth(key))
    assert created.status_code == 201, created.text
    batch = created.json()
    done = wait_batch(client, key, batch["id"])
    assert done["status"] == "completed", done
    assert done["rows"] == {"done": 24, "failed": 0, "total": 24}
    folder = f"/lake/out/{batch['id']}"
    manifest = json.loads(memory_store.cat(f"{folder}/_manifest.json"))
    assert memory_store.exists(f"{folder}/_SUCCESS") and manifest["rows"] == 24
    assert [r["pair_id"] for r in results(client, key, batch["id"])] == table.column("pair_id").to_pylist()


def test_each_store_reads_its_own_library_s_failures() -> None:
    """Every store is asked; the most telling answer wins (a missing object over an unreachable store)."""
    from azure.core.exceptions import ResourceNotFoundError, ServiceRequestError
    from botocore.exceptions import ClientError, EndpointConnectionError, ProfileNotFound

    no_bucket = ClientError({"Error": {"Code": "NoSuchBucket", "Message": "no bucket"}}, "ListObjectsV2")
    assert storage.failure(no_bucket) is Failure.NOT_FOUND
    assert storage.failure(ResourceNotFoundError("gone")) is Failure.NOT_FOUND
    assert storage.failure(ProfileNotFound(profile="missing")) is Failure.DENIED
    assert storage.failure(EndpointConnectionError(endpoint_url="http://127.0.0.1:1")) is Failure.UNREACHABLE
    assert storage.failure(ServiceRequestError("cannot connect")) is Failure.UNREACHABLE
    assert storage.failure(FileNotFoundError("x")) is Failure.NOT_FOUND
    assert storage.failure(ValueError("x")) is None
    # A library's configuration error is not a store to try again: it is said with its kind.
    from botocore.exceptions import NoRegionError

    error = store_error(Location.parse("s3://lake/in/x.parquet"), NoRegionError())
    assert (error.status, error.code) == (400, "input_unreadable") and "NoRegionError" in error.message


def test_each_store_says_what_installs_it() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    schemes = [scheme for store in storage.STORES for scheme in store.schemes]
    assert len(schemes) == len(set(schemes)), schemes
    for store in storage.STORES:
        assert store.protocol and store.schemes and store.version_fields, store
        assert store.extra is None or store.extra in extras, store
