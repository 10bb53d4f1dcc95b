"""Reference batches (issues 29, 36) in-process on PostgreSQL and real S3, GCS and Azure stores (SeaweedFS,
fake-gcs-server, Azurite): access control, planning and reading chunks of every format (Parquet, CSV and JSONL
pair tables, JSONL requests; compressed; partitioned exports), the chunk path through the pass loop to
committed objects and the manifest on every store, per-row and per-chunk errors, broken objects refused with
a 4xx, cancel, and a store outage."""

import gzip
import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from sqlalchemy import func, select, update

from store.db import session_scope
from store.errors import ServiceError
from store.lake.access import Access, Location
from store.lake.tables import Columns, InputError, Options, plan, read_chunk
from store.models import ApiKey, Batch, Chunk, Job, Pass, WebhookDelivery, utcnow
from store.settings import get_settings
from tests.load_runner import SCORE_RTOL
from tests.object_stores import Azurite, FakeGCS, SeaweedS3
from worker import drain as drain_module
from worker.scorer import get_scorer

LABELS = [5, 17, 300]


@pytest.fixture(scope="module")  # not left running (and polling) for the rest of the run
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3 store for the module; its endpoint and keys go into the environment (the standard chain)."""
    store = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    store.start()  # raises (fails the tests) if it cannot start: never a skip
    with patch.dict(os.environ, store.env):  # for this module only
        yield store
    store.stop()


def _serve(store: FakeGCS | Azurite) -> Iterator[FakeGCS | Azurite]:
    """Starts a store for the module (raises, failing the tests, if it cannot: never a skip) with its variables
    in the environment and a bucket `lake`."""
    import fsspec.config

    store.start()
    with patch.dict(os.environ, store.env):
        fsspec.config.set_conf_env(fsspec.config.conf)  # FSSPEC_GCS_TOKEN: fsspec read its variables at import
        store.create_bucket("lake")
        yield store
    store.stop()


@pytest.fixture(scope="module")
def gcs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    yield from _serve(FakeGCS(tmp_path_factory.mktemp("fake-gcs")))  # type: ignore[misc]


@pytest.fixture(scope="module")
def azure_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    yield from _serve(Azurite(tmp_path_factory.mktemp("azurite")))  # type: ignore[misc]


@pytest.fixture
def lake_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    settings = get_settings()
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(settings, "batch_local_root", str(root))
    monkeypatch.setattr(settings, "batch_chunk_rows_target", 40)
    monkeypatch.setattr(settings, "batch_chunk_bytes", 2000)
    return settings


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def allow(key: str, prefixes: list[str]) -> None:
    from api.auth import hash_key

    with session_scope() as session:
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(storage_prefixes=prefixes))
    from api import auth as auth_module
    auth_module._found.clear()  # the API's key cache


def pair_table(n_queries: int, docs: int, seed: int = 0) -> pa.Table:
    """Sorted by query, as README says a pair table should be: adjacent rows share their query."""
    rng = np.random.default_rng(seed)
    q, d, ids = [], [], []
    for i in range(n_queries):
        for j in range(docs):
            q.append(f"question {i} about {rng.integers(1000)}?")
            d.append(f"document {j} says {rng.integers(1000)}")
            ids.append(i * 1000 + j)
        q[-docs:] = [q[-docs]] * docs
    return pa.table({"q": q, "doc": d, "pair_id": pa.array(ids, pa.int64())})


def run_worker(owner: str = "lake-worker", seconds: float = 180) -> None:
    drain_module.drain(get_scorer(), owner, get_settings())


def wait_batch(client, key: str, batch_id: str, seconds: float = 180) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = client.get(f"/batches/{batch_id}", headers=auth(key)).json()
        if batch["status"] in ("completed", "cancelled", "failed"):
            return batch
        run_worker()
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not end: {batch}")


def results(client, key: str, batch_id: str, **params) -> list[dict]:  # type: ignore[no-untyped-def]
    response = client.get(f"/batches/{batch_id}/results", headers=auth(key), params=params)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


# ---- access ------------------------------------------------------------------------------------------------


def test_local_paths_stay_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "a.jsonl").write_text("{}\n")
    outside = tmp_path / "secret.jsonl"
    outside.write_text("{}\n")
    (root / "data" / "link.jsonl").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path)
    access = Access(str(root), [])
    assert access.location("data/a.jsonl").path == str(root / "data" / "a.jsonl")
    assert access.location(f"file://{root}/data/a.jsonl").protocol == "file"
    for uri in ["../secret.jsonl", "data/../../secret.jsonl", str(outside), f"file://{outside}", "data/link.jsonl",
                "linkdir/secret.jsonl", "file://otherhost/etc/passwd", "/etc/passwd"]:
        with pytest.raises(ServiceError) as refused:
            access.expand(uri)
        assert (refused.value.status, refused.value.code) == (400, "path_outside_root"), uri
    # A glob whose matches include a symlink out of the root.
    with pytest.raises(ServiceError) as refused:
        access.expand(f"{root}/data/*.jsonl")
    assert refused.value.code == "path_outside_root"
    with pytest.raises(ServiceError) as refused:
        Access(None, []).location("data/a.jsonl")
    assert refused.value.code == "local_paths_disabled"


def test_hidden_files_and_folders_under_the_root_are_never_served(tmp_path: Path) -> None:
    """`serve --embedded` serves the folder it started in and keeps its API key and database in .packscore/
    there: another key naming the key file as a CSV input read the key back in `unknown_column`'s message."""
    root = tmp_path / "root"
    (root / ".packscore").mkdir(parents=True)
    (root / ".packscore" / "api_key").write_text("psk_the_embedded_key\n")
    (root / "data").mkdir()
    (root / "data" / "a.csv").write_text("q,d\nx,y\n")
    (root / "data" / "key.csv").symlink_to(root / ".packscore" / "api_key")
    access = Access(str(root), [])
    assert [o.path for o in access.expand("data/a.csv")] == [str(root / "data" / "a.csv")]
    for uri in [".packscore/api_key", ".packscore/", str(root / ".packscore" / "api_key"), "data/key.csv",
                ".packscore/*", f"file://{root}/.packscore/api_key"]:
        with pytest.raises(ServiceError) as refused:
            access.expand(uri)
        assert (refused.value.status, refused.value.code) == (400, "path_outside_root"), uri
    with pytest.raises(ServiceError) as refused:
        access.location(".packscore/out/", "output")
    assert refused.value.code == "path_outside_root"
    with pytest.raises(ServiceError) as refused:  # a glob matching a link to it: refused, as a link out of the root
        access.expand("data/*")
    assert refused.value.code == "path_outside_root"


def test_each_object_is_input_once_and_a_batchs_own_output_never(tmp_path: Path) -> None:
    """A `**` glob matched a file and each folder above it, each listed again: the rows ran twice or three
    times. And results written inside the input's folder were read as input when the batch ran again."""
    root = tmp_path / "root"
    (root / "data" / "dt=1" / "hour=2").mkdir(parents=True)
    (root / "data" / "dt=1" / "hour=2" / "p.parquet").write_bytes(b"x")
    (root / "data" / "q.parquet").write_bytes(b"x")
    (root / "data" / "scores" / "batch_old").mkdir(parents=True)
    (root / "data" / "scores" / "batch_old" / "part-000000-attempt-1.parquet").write_bytes(b"x")
    access = Access(str(root), [])

    def names(*args) -> list[str]:  # type: ignore[no-untyped-def]
        return [location.path.removeprefix(str(root / "data") + "/") for location in access.expand(*args)]

    assert names("data/**") == ["dt=1/hour=2/p.parquet", "q.parquet", "scores/batch_old/part-000000-attempt-1.parquet"]
    assert names(["data/q.parquet", "data/*.parquet", "data/q.parquet"]) == ["q.parquet"]
    output = access.location("data/scores/", "output")
    assert names("data/", output) == names("data/**", output) == ["dt=1/hour=2/p.parquet", "q.parquet"]


def test_remote_uris_only_under_allowed_prefixes() -> None:
    access = Access(None, ["s3://bucket/team-a/", "gs://other/x"])
    assert access.location("s3://bucket/team-a/pairs/*.parquet").path == "bucket/team-a/pairs/*.parquet"
    assert access.location("gs://other/x/y.jsonl") == Location("gcs", "other/x/y.jsonl")
    assert access.location("gs://other/x/y.jsonl").uri == "gs://other/x/y.jsonl"
    for uri, code in [("s3://bucket/team-ab/x", "storage_prefix_not_allowed"),
                      ("s3://bucket/x", "storage_prefix_not_allowed"),
                      ("s3://bucket/team-a/../team-b/x", "path_outside_root"),
                      ("az://bucket/team-a/x", "storage_prefix_not_allowed"),
                      ("s3://key:secret@bucket/team-a/x", "invalid_uri"),
                      ("http://bucket/team-a/x", "unsupported_uri")]:
        with pytest.raises(ServiceError) as refused:
            access.location(uri)
        assert refused.value.code == code, uri
    with pytest.raises(ServiceError) as refused:
        Access(None, []).location("s3://bucket/team-a/x")
    assert (refused.value.status, refused.value.code) == (403, "storage_prefix_not_allowed")


# ---- planning and reading ----------------------------------------------------------------------------------


def test_jsonl_byte_ranges_read_every_line_once(tmp_path: Path, lake_settings) -> None:  # type: ignore[no-untyped-def]
    path = Path(lake_settings.batch_local_root) / "lines.jsonl"
    lines = [{"custom_id": f"r{i}", "query": "q " * (i % 7 + 1), "items": ["a", "b b"][: i % 3],
              "label_token_ids": LABELS} for i in range(300)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    access = Access(lake_settings.batch_local_root, [])
    options = Options("jsonl", None, None)
    tokenizer = get_scorer().requests
    for chunk_bytes in (97, 1000, 1 << 20):
        lake_settings.batch_chunk_bytes = chunk_bytes
        chunks = list(plan(access.expand("lines.jsonl"), options, lake_settings))
        assert len(chunks) == -(-path.stat().st_size // chunk_bytes)
        seen = []
        for c in chunks:
            chunk = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, tokenizer)
            seen += chunk.passthrough["custom_id"]
        assert seen == [line["custom_id"] for line in lines], chunk_bytes
    # Compressed: one chunk each, the same lines.
    for name, data in (("lines.jsonl.gz", gzip.compress(path.read_bytes())),
                       ("lines.jsonl.zst", zstandard.ZstdCompressor().compress(path.read_bytes()))):
        (path.parent / name).write_bytes(data)
        [c] = plan(access.expand(name), Options("", None, None), lake_settings)
        rows = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, Options("", None, None), tokenizer)
        assert rows.passthrough["custom_id"] == [line["custom_id"] for line in lines]


def test_parquet_is_planned_by_row_groups_and_pairs_group_by_query(lake_settings) -> None:  # type: ignore[no-untyped-def]
    root = Path(lake_settings.batch_local_root)
    table = pair_table(10, 12)
    pq.write_table(table, root / "pairs.parquet", row_group_size=50)
    access = Access(str(root), [])
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    chunks = list(plan(access.expand("pairs.parquet"), options, lake_settings))
    # 120 rows in row groups of 50 (50, 50, 20), each split at 40 rows: 40+10, 40+10, 20.
    assert [(c.part, c.start, c.stop) for c in chunks] == [(0, 0, 40), (0, 40, 50), (1, 0, 40), (1, 40, 50), (2, 0, 20)]
    ids, requests = [], 0
    for c in chunks:
        rows = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
        ids += passed(rows, "pair_id")
        assert all(len(covered) == r.n_items for covered, r, _ in rows.requests)
        requests += len(rows.requests)
    assert ids == table.column("pair_id").to_pylist()
    # One request per query, and one more at each chunk boundary inside a query's rows (40, 50, 90, 100).
    assert requests == 10 + 4
    with pytest.raises(ServiceError) as refused:
        list(plan(access.expand("pairs.parquet"), Options("", Columns("q", "text"), tuple(LABELS)), lake_settings))
    assert refused.value.code == "unknown_column"


def test_a_query_s_rows_are_cut_into_requests_within_max_scores(lake_settings) -> None:  # type: ignore[no-untyped-def]
    """A query's rows go in one request up to MAX_ITEMS; with many labels that request was over MAX_SCORES
    (items x labels), and every row of it failed `too_many_labels` though each scored on its own."""
    from core import RequestTokenizer

    root = Path(lake_settings.batch_local_root)
    table = pair_table(1, 60)  # one query, 60 rows
    pq.write_table(table, root / "one-query.parquet")
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))  # 3 labels
    limits = RequestTokenizer(get_scorer().requests.tokenizer, get_scorer().requests.vocab_size, model_name="m",
                              max_scores=100)  # 33 rows of 3 labels
    sizes, errors = [], {}
    for chunk in plan(Access(str(root), []).expand("one-query.parquet"), options, lake_settings):
        rows = read_chunk(Location.parse(chunk.input), chunk.part, chunk.start, chunk.stop, options, limits)
        sizes += [len(covered) for covered, _, _ in rows.requests]
        errors.update(rows.errors)
    assert errors == {} and sum(sizes) == 60 and max(sizes) == 33, sizes


def test_csv_byte_ranges_keep_the_header(lake_settings) -> None:  # type: ignore[no-untyped-def]
    root = Path(lake_settings.batch_local_root)
    table = pair_table(15, 7)
    import pyarrow.csv as pacsv

    pacsv.write_csv(table, root / "pairs.csv")
    lake_settings.batch_chunk_bytes = 300
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    chunks = list(plan(Access(str(root), []).expand("pairs.csv"), options, lake_settings))
    assert len(chunks) > 5
    ids, items = [], 0
    for c in chunks:
        rows = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
        ids += passed(rows, "pair_id")
        items += rows.items
    assert ids == [str(i) for i in table.column("pair_id").to_pylist()] and items == 105  # as written
    # Quoted values with line breaks: a part cut inside one fails with a code that says why; none reads a row
    # wrong.
    (root / "pairs.csv").write_text((root / "pairs.csv").read_text().replace('"document', '"a line\nbreak: document'))
    failed, read = [], 0
    for c in plan(Access(str(root), []).expand("pairs.csv"), options, lake_settings):
        try:
            rows = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
        except InputError as exc:
            failed.append(exc)
            continue
        read += rows.n_rows
        assert set(passed(rows, "pair_id")) <= {str(i) for i in table.column("pair_id").to_pylist()}
    assert failed and all(e.code == "input_corrupt" and "line break" in e.message for e in failed)
    assert read < 105


def test_a_csv_part_starting_inside_a_quoted_value_is_refused_and_ids_come_back_as_written(lake_settings) -> None:  # type: ignore[no-untyped-def]
    root = Path(lake_settings.batch_local_root)
    data = b'q,doc,pair_id\nA,"x\ny,z",007\nB,e,1.10\nC,5" screen,3\n'
    (root / "quoted.csv").write_bytes(data)
    location = Access(str(root), []).expand("quoted.csv")[0]
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    tokenizer = get_scorer().requests
    y_line, b_line = data.index(b"y,z"), data.index(b"B,e")

    def read(start: int, stop: int = len(data)) -> list:
        return passed(read_chunk(location, 0, start, stop, options, tokenizer), "pair_id")

    # A part cut at the line break inside "x\ny,z" would read `y,z",007` as the pair (y, z") of id 007.
    with pytest.raises(InputError) as refused:
        read(y_line)
    assert refused.value.code == "input_corrupt" and "line break" in refused.value.message
    # After the whole record, and across it: every row as written (a CSV's ids are its text, not guessed numbers).
    assert read(b_line) == ["1.10", "3"]
    assert read(0) == ["007", "1.10", "3"]


def test_a_run_of_one_query_longer_than_max_items_is_split_not_refused(lake_settings) -> None:  # type: ignore[no-untyped-def]
    import copy

    root = Path(lake_settings.batch_local_root)
    pq.write_table(pa.table({"q": ["the same question?"] * 10, "doc": [f"document {i}" for i in range(10)],
                             "pair_id": list(range(10))}), root / "one-query.parquet")
    tokenizer = copy.copy(get_scorer().requests)
    tokenizer.max_items = 3  # MAX_ITEMS under the 1,000 rows a request of a pair table takes
    [location] = Access(str(root), []).expand("one-query.parquet")
    rows = read_chunk(location, 0, 0, 10, Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS)), tokenizer)
    assert rows.errors == {} and rows.items == 10
    assert [len(covered) for covered, _, _ in rows.requests] == [3, 3, 3, 1]


def test_a_jsonl_line_too_deep_or_with_a_lone_surrogate_is_its_rows_error(lake_settings) -> None:  # type: ignore[no-untyped-def]
    """Each raised past its line's error: the whole chunk was retried as if the store were down, then failed."""
    root = Path(lake_settings.batch_local_root)
    good = [json.dumps({"q": "which?", "doc": f"d{i}", "pair_id": f"p{i}"}) for i in range(3)]
    bad = ['{"q": "which?", "doc": "x", "pair_id": "\\ud800"}', '{"q": "which?", "doc": ' + "[" * 5000 + "]" * 5000
           + ', "pair_id": "deep"}']
    (root / "odd.jsonl").write_text("\n".join([good[0], bad[0], good[1], bad[1], good[2]]) + "\n")
    [location] = Access(str(root), []).expand("odd.jsonl")
    tokenizer = get_scorer().requests
    rows = read_chunk(location, 0, 0, location.fs.size(location.path), Options(
        "", Columns("q", "doc", ("pair_id",)), tuple(LABELS)), tokenizer)
    assert {i: code for i, (code, _) in rows.errors.items()} == {1: "invalid_json", 3: "invalid_json"}
    assert rows.items == 3
    # The same lines as requests (JSONL without columns).
    lines = [json.dumps({"custom_id": f"r{i}", "query": "q", "items": ["a"], "label_token_ids": LABELS})
             for i in range(2)]
    (root / "odd-requests.jsonl").write_text("\n".join([lines[0], bad[0].replace("pair_id", "custom_id"),
                                                        "[" * 5000 + "]" * 5000, lines[1]]) + "\n")
    [location] = Access(str(root), []).expand("odd-requests.jsonl")
    rows = read_chunk(location, 0, 0, location.fs.size(location.path), Options("", None, None), tokenizer)
    assert {i: code for i, (code, _) in rows.errors.items()} == {1: "invalid_json", 2: "invalid_json"}
    assert rows.items == 2


def test_jsonl_pair_tables_group_by_query_and_name_bad_lines(lake_settings) -> None:  # type: ignore[no-untyped-def]
    root = Path(lake_settings.batch_local_root)
    table = pair_table(6, 5)
    rows = table.to_pylist()
    lines = [json.dumps(row) for row in rows]
    lines[7] = json.dumps([rows[7]["q"], rows[7]["doc"]])  # not an object
    lines[12] = json.dumps({"q": rows[12]["q"], "pair_id": rows[12]["pair_id"]})  # no 'doc'
    lines[20] = "{" + lines[20]  # not JSON
    lines.insert(3, "")  # blank: skipped, but counted in line numbers (file lines 9, 14 and 22 are the bad ones)
    data = ("\n".join(lines) + "\n").encode()
    (root / "pairs.jsonl").write_bytes(data)
    (root / "pairs.jsonl.gz").write_bytes(gzip.compress(data))
    (root / "pairs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    access = Access(str(root), [])
    expected_ids = [None if i in (7, 20) else row["pair_id"] for i, row in enumerate(rows)]
    lake_settings.batch_chunk_bytes = 500
    for name in ("pairs.jsonl", "pairs.jsonl.gz", "pairs.jsonl.zst"):
        chunks = list(plan(access.expand(name), options, lake_settings))
        assert len(chunks) == (1 if name != "pairs.jsonl" else -(-len(data) // 500)), name
        ids, errors, requests = [], {}, 0
        for c in chunks:
            read = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
            errors.update({len(ids) + i: error for i, error in read.errors.items()})
            ids += passed(read, "pair_id")
            requests += len(read.requests)
            assert all(len(covered) == r.n_items for covered, r, _ in read.requests)
        assert ids == expected_ids, name
        assert {i: code for i, (code, _) in errors.items()} == {7: "invalid_row", 12: "invalid_row",
                                                                 20: "invalid_json"}, name
        assert "'doc'" in errors[12][1] and all("line" in message for _, message in errors.values())
        if len(chunks) == 1:  # the whole file: line numbers are the file's
            assert errors[7][1] == f"line 9 of {name} is not a JSON object"
            assert errors[12][1] == f"line 14 of {name} has no 'doc'"
            assert errors[20][1].startswith(f"line 22 of {name} is not JSON")
            # Adjacent rows with the same query are one request (a bad row among them is left out of it).
            assert requests == 6
    # A column the first line lacks is refused when planning, naming it.
    (root / "other.jsonl").write_text(json.dumps({"q": "x", "text": "y"}) + "\n")
    with pytest.raises(ServiceError) as refused:
        list(plan(access.expand("other.jsonl"), options, lake_settings))
    assert refused.value.code == "unknown_column" and "'doc'" in refused.value.message


def test_compressed_csv_is_one_chunk(lake_settings) -> None:  # type: ignore[no-untyped-def]
    import io

    import pyarrow.csv as pacsv

    root = Path(lake_settings.batch_local_root)
    table = pair_table(5, 4)
    buffer = io.BytesIO()
    pacsv.write_csv(table, buffer)
    (root / "pairs.csv.gz").write_bytes(gzip.compress(buffer.getvalue()))
    (root / "pairs.csv.zst").write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
    lake_settings.batch_chunk_bytes = 100
    options = Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS))
    access = Access(str(root), [])
    for name in ("pairs.csv.gz", "pairs.csv.zst"):
        [c] = plan(access.expand(name), options, lake_settings)
        read = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
        assert passed(read, "pair_id") == [str(i) for i in table.column("pair_id").to_pylist()] and read.items == 20
        assert len(read.requests) == 5
    (root / "pairs.parquet.gz").write_bytes(b"")
    with pytest.raises(ServiceError) as refused:
        list(plan(access.expand("pairs.parquet.gz"), options, lake_settings))
    assert refused.value.code == "unsupported_compression"


def passed(rows, name: str) -> list:  # type: ignore[no-untyped-def]
    """A chunk's passthrough column as Python values (a Parquet or CSV id column is kept as an Arrow array)."""
    values = rows.passthrough[name]
    return values.to_pylist() if isinstance(values, pa.Array) else values


def read_all(objects: list[Location], options: Options, settings) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Every chunk of these objects read, the passthrough columns concatenated."""
    out: dict[str, list] = {}
    for c in plan(objects, options, settings):
        read = read_chunk(Location.parse(c.input), c.part, c.start, c.stop, options, get_scorer().requests)
        assert not read.errors, read.errors
        for name in read.passthrough:
            out.setdefault(name, []).extend(passed(read, name))
    return out


def test_partitioned_exports_read_as_one_table(lake_settings) -> None:  # type: ignore[no-untyped-def]
    root = Path(lake_settings.batch_local_root)
    access = Access(str(root), [])
    parts = {"dt=2026-11-01": pair_table(2, 3, seed=1), "dt=2026-11-02": pair_table(3, 2, seed=2),
             "dt=__HIVE_DEFAULT_PARTITION__": pair_table(1, 2, seed=3)}
    for folder, table in parts.items():  # as Spark writes them: no partition column in the files
        (root / "export" / folder).mkdir(parents=True)
        pq.write_table(table, root / "export" / folder / "part-00000-c000.snappy.parquet")
        (root / "export" / folder / ".part-00000-c000.snappy.parquet.crc").write_bytes(b"crc")
    (root / "export" / "_SUCCESS").write_bytes(b"")
    (root / "export" / "_temporary" / "0").mkdir(parents=True)  # a Spark job's leftovers: not data
    (root / "export" / "_temporary" / "0" / "part-00001.parquet").write_bytes(b"PAR1 half-written")
    options = Options("", Columns("q", "doc", ("dt", "pair_id")), tuple(LABELS))
    read = read_all(access.expand("export/"), options, lake_settings)
    # Folders in order, each row with its partition's value (Hive's default partition is null).
    assert read["dt"] == ["2026-11-01"] * 6 + ["2026-11-02"] * 6 + [None] * 2
    assert read["pair_id"] == [i for t in parts.values() for i in t.column("pair_id").to_pylist()]
    # A glob over partition folders: the objects in the folders it matches.
    assert read_all(access.expand("export/dt=2026-11-0*"), options, lake_settings)["dt"] == \
        ["2026-11-01"] * 6 + ["2026-11-02"] * 6
    # CSV and JSONL pair tables in partition folders alike.
    (root / "csv" / "region=eu").mkdir(parents=True)
    import pyarrow.csv as pacsv
    pacsv.write_csv(parts["dt=2026-11-01"], root / "csv" / "region=eu" / "part-0.csv")
    (root / "json" / "region=us%2Feast").mkdir(parents=True)  # Hive escapes '/' in a value
    (root / "json" / "region=us%2Feast" / "part-0.json").write_text(
        "".join(json.dumps(row) + "\n" for row in parts["dt=2026-11-02"].to_pylist()))
    with_region = Options("", Columns("q", "doc", ("region", "pair_id")), tuple(LABELS))
    assert read_all(access.expand("csv/"), with_region, lake_settings)["region"] == ["eu"] * 6
    assert read_all(access.expand("json/"), with_region, lake_settings)["region"] == ["us/east"] * 6
    # BigQuery's sharded export: one table in shard order.
    shards = [pair_table(2, 2, seed=10 + i) for i in range(3)]
    for i, shard in enumerate(shards):
        pq.write_table(shard, root / f"export-{i:012d}.parquet")
    read = read_all(access.expand("export-*.parquet"), Options("", Columns("q", "doc", ("pair_id",)), tuple(LABELS)),
                    lake_settings)
    assert read["pair_id"] == [i for shard in shards for i in shard.column("pair_id").to_pylist()]
    # A column in neither the files nor their folders is refused, naming it.
    with pytest.raises(ServiceError) as refused:
        list(plan(access.expand("export/"), Options("", Columns("q", "doc", ("region",)), tuple(LABELS)),
                  lake_settings))
    assert refused.value.code == "unknown_column" and "'region'" in refused.value.message


def test_store_failures_are_refusals_naming_the_object() -> None:
    """What each store's library raises while planning, as the API answers it (never a 500)."""
    from azure.core.exceptions import ClientAuthenticationError, ResourceNotFoundError, ServiceRequestError
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError
    from google.auth.exceptions import DefaultCredentialsError

    from store.lake.access import store_error

    where = Location("s3", "lake/in/pairs.parquet")
    for exc, status, code in [
            (FileNotFoundError("lake/in/pairs.parquet"), 404, "input_not_found"),
            (ResourceNotFoundError("The specified blob does not exist."), 404, "input_not_found"),
            (PermissionError("Access Denied"), 403, "storage_access_denied"),
            (NoCredentialsError(), 403, "storage_access_denied"),
            (DefaultCredentialsError("no default credentials"), 403, "storage_access_denied"),
            (ClientAuthenticationError("signature mismatch"), 403, "storage_access_denied"),
            (ConnectionRefusedError(111, "Connection refused"), 503, "storage_unreachable"),
            (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), 503, "storage_unreachable"),
            (ServiceRequestError("cannot connect"), 503, "storage_unreachable"),
            (TimeoutError(), 503, "storage_unreachable"),
            (ValueError("something the library did not expect"), 400, "input_unreadable")]:
        error = store_error(where, exc)
        assert (error.status, error.code) == (status, code), exc
        assert "s3://lake/in/pairs.parquet" in error.message


def test_a_worker_loads_the_stores_it_may_read_when_it_starts() -> None:
    """store.location.load_filesystems (worker/tasks.py, at start): s3fs and its client are in memory before the
    first batch (issue 47's soak: 30 MB and 260 modules met mid-run), with no request sent (nothing listens at
    the endpoint); a store that cannot be loaded (adlfs without an account) is logged, not raised."""
    import subprocess
    import sys

    code = """
import json, sys
from store.location import filesystem, load_filesystems
before = "s3fs" in sys.modules
loaded = load_filesystems(["s3://lake/in/", "s3a://other/", "file:///tmp/", "az://container/", "ftp://x/"])
print(json.dumps([before, loaded, filesystem("s3")._s3 is not None, "botocore.client" in sys.modules]))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "AWS_"))}
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [False, ["s3"], True, True]
    assert "az:// could not be loaded at start" in proc.stderr


# ---- the chunk path end to end -----------------------------------------------------------------------------


def test_pair_table_from_s3_matches_jobs(client, make_key, empty_queue, s3_store, lake_settings) -> None:  # type: ignore[no-untyped-def]
    import fsspec

    key, _ = make_key()
    allow(key, ["s3://lake/in/", "s3://lake/out/"])
    table = pair_table(8, 12, seed=1)
    fs = fsspec.filesystem("s3")
    with fs.open("lake/in/match/pairs.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=48)
    body = {"input": "s3://lake/in/match/", "output": "s3://lake/out/match/", "format": "parquet",
            "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS,
            "return_logprobs": True}
    created = client.post("/batches", json=body, headers=auth(key))
    assert created.status_code == 201, created.text
    batch = created.json()
    assert batch["chunks"]["total"] == 4 and batch["counts"]["total"] == 96 and batch["status"] == "in_progress"
    done = wait_batch(client, key, batch["id"])
    assert done["status"] == "completed", done
    assert done["rows"] == {"done": 96, "failed": 0, "total": 96} and done["progress"]["items_done"] == 96
    assert done["chunks"] == {"total": 4, "total_final": True, "done": 4, "in_flight": 0, "failed": 0, "cancelled": 0}
    # The output: one object per chunk, typed columns, then the manifest and _SUCCESS.
    folder = f"lake/out/match/{batch['id']}"
    manifest = json.loads(fs.cat(f"{folder}/_manifest.json"))
    assert fs.exists(f"{folder}/_SUCCESS") and manifest["rows"] == 96 and len(manifest["objects"]) == 4
    parts = [pq.read_table(fs.open(f"{folder}/{entry['name']}")) for entry in manifest["objects"]]
    out = pa.concat_tables(parts)
    assert out.schema.field("pair_id").type == pa.int64()
    assert out.schema.field("scores").type == pa.list_(pa.float64())
    assert out.column("pair_id").to_pylist() == table.column("pair_id").to_pylist()
    assert out.column("error_code").null_count == 96
    # The same pairs as POST /jobs requests: the engine's agreement (1e-4).
    queries = table.column("q").to_pylist()
    docs = table.column("doc").to_pylist()
    rows = results(client, key, batch["id"])
    assert [r["pair_id"] for r in rows] == table.column("pair_id").to_pylist()
    for start in range(0, 96, 12):
        job = client.post("/jobs", json={"query": queries[start], "items": docs[start:start + 12],
                                         "label_token_ids": LABELS, "return_logprobs": True}, headers=auth(key))
        run_worker()
        job = client.get(f"/jobs/{job.json()['id']}", headers=auth(key)).json()
        assert job["status"] == "succeeded"
        expected = np.asarray(job["logprobs"])
        got = np.asarray([r["logprobs"] for r in rows[start:start + 12]])
        np.testing.assert_allclose(got, expected, atol=1e-4)
    openai = results(client, key, batch["id"], format="openai")
    assert len(openai) == 96 and all(line["response"]["status_code"] == 200 for line in openai)
    # Nothing per line in Postgres: the batch row and its chunk rows.
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Chunk).where(Chunk.batch_id == batch["id"])) == 4


# ---- every format on every store ---------------------------------------------------------------------------

STORES = ("local", "s3", "gs", "az")
# The Parquet input is a Hive-partitioned export (its folder named, a partition column among the ids).
FORMATS = {"parquet": "dt=2026-11-01/part-00000.parquet", "csv": "pairs.csv", "jsonl pair table": "pairs.jsonl",
           "jsonl requests": "requests.jsonl"}


def put(store: str, root: Path, key: str, data: bytes) -> str:
    """Writes an object at `key` (a path under `lake/`) on a store; returns the URI a batch names it by."""
    import fsspec

    if store == "local":
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        return key
    fsspec.filesystem({"gs": "gcs"}.get(store, store)).pipe(f"lake/{key}", data)
    return f"{store}://lake/{key}"


def encoded(fmt: str, table: pa.Table) -> bytes:
    import io

    import pyarrow.csv as pacsv

    buffer = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buffer, row_group_size=6)
    elif fmt == "csv":
        pacsv.write_csv(table, buffer)
    elif fmt == "jsonl pair table":
        buffer.write("".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode())
    else:  # one request per query, with its documents
        rows = table.to_pylist()
        for q in dict.fromkeys(row["q"] for row in rows):
            buffer.write(json.dumps({"custom_id": q, "query": q, "items": [r["doc"] for r in rows if r["q"] == q],
                                     "label_token_ids": LABELS}).encode() + b"\n")
    return buffer.getvalue()


def test_every_format_on_every_store_scores_as_the_engine(client, make_key, empty_queue, lake_settings,  # type: ignore[no-untyped-def]
                                                          s3_store, gcs_store, azure_store) -> None:
    key, _ = make_key()
    allow(key, [f"{store}://lake/matrix/" for store in STORES[1:]])
    root = Path(lake_settings.batch_local_root)
    # Text inputs in several byte ranges: every range after the first reads its CSV's header again, remotely.
    lake_settings.batch_chunk_bytes = 300
    table = pair_table(4, 3, seed=5)
    rows = table.to_pylist()
    queries = list(dict.fromkeys(row["q"] for row in rows))
    scorer = get_scorer()
    expected = {q: scorer.score(q, [r["doc"] for r in rows if r["q"] == q], LABELS) for q in queries}
    created = {}
    for store in STORES:
        for fmt, name in FORMATS.items():
            folder = f"matrix/in/{fmt.replace(' ', '-')}"
            uri = put(store, root, f"{folder}/{name}", encoded(fmt, table))
            out = f"matrix/out/{fmt.replace(' ', '-')}"  # an output takes one input
            body = {"input": uri, "output": out if store == "local" else f"{store}://lake/{out}/"}
            if fmt != "jsonl requests":
                body |= {"columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS}
            if fmt == "parquet":
                put(store, root, f"{folder}/_SUCCESS", b"")
                body |= {"input": uri.rsplit("/", 2)[0] + "/", "columns": {"query": "q", "item": "doc",
                                                                           "ids": ["dt", "pair_id"]}}
            response = client.post("/batches", json=body, headers=auth(key))
            assert response.status_code == 201, (store, fmt, response.text)
            created[store, fmt] = response.json()
        if store != "local":  # the key's rules hold on every store
            response = client.post("/batches", json={"input": f"{store}://lake/elsewhere/pairs.parquet",
                                                     "output": f"{store}://lake/matrix/out/"}, headers=auth(key))
            assert (response.status_code, response.json()["error"]["code"]) == (403, "storage_prefix_not_allowed")
    for (store, fmt), batch in created.items():
        done = wait_batch(client, key, batch["id"])
        assert done["status"] == "completed" and done["rows"]["failed"] == 0, (store, fmt, done)
        # The output as a reader finds it: _SUCCESS, the manifest, its objects read with pyarrow.
        out = Location.parse(done["output"])
        assert out.fs.exists(out.child("_SUCCESS").path), (store, fmt)
        manifest = json.loads(out.fs.cat(out.child("_manifest.json").path))
        # (A text input's id types are inferred per chunk: a chunk with no rows has null-typed columns.)
        got = pa.concat_tables([pq.read_table(out.fs.open(out.child(entry["name"]).path))
                                for entry in manifest["objects"]], promote_options="default").to_pylist()
        if fmt == "jsonl requests":
            assert [r["custom_id"] for r in got] == queries
            for r in got:
                np.testing.assert_allclose(r["scores"], expected[r["custom_id"]], rtol=SCORE_RTOL, atol=0)
        else:
            as_written = str if fmt == "csv" else lambda pair_id: pair_id  # a CSV's ids are its text
            assert [r["pair_id"] for r in got] == [as_written(r["pair_id"]) for r in rows], (store, fmt)
            assert fmt != "parquet" or {r["dt"] for r in got} == {"2026-11-01"}
            for row, r in zip(rows, got):
                j = [x["doc"] for x in rows if x["q"] == row["q"]].index(row["doc"])
                np.testing.assert_allclose(r["scores"], expected[row["q"]][j], rtol=SCORE_RTOL, atol=0)
        assert manifest["rows"] == len(got)


def test_an_input_rewritten_after_planning_fails_its_chunks_on_every_store(  # type: ignore[no-untyped-def]
        client, make_key, empty_queue, lake_settings, s3_store, gcs_store, azure_store) -> None:
    """A chunk is a range of the object as planned: an object rewritten in between (rows added, or the same size
    with other bytes) held other rows at those offsets, which were read as if planned (rows lost or read twice,
    unnoticed). Its chunks fail `input_changed` now; an object left alone still scores on every store (the
    API's listing and the worker's own look at the object agree on its version). Sent again with `overwrite`,
    as the message says, the object is planned as it is now: the rewrite came from another client, and this
    process's listings cache, which lasts as long as the process, must not plan the old sizes again."""
    import fsspec

    key, _ = make_key()
    allow(key, [f"{store}://lake/changed/" for store in STORES[1:]])
    root = Path(lake_settings.batch_local_root)
    lake_settings.batch_chunk_bytes = 300
    planned = encoded("csv", pair_table(4, 3, seed=7))
    rewrites = {"grown": encoded("csv", pair_table(6, 3, seed=8)),
                "same size": planned.replace(b"document", b"Document"), "unchanged": None}
    assert len(rewrites["same size"]) == len(planned) != len(rewrites["grown"])
    created = {}
    for store in STORES:
        for change, data in rewrites.items():
            name = f"changed/in/{store}-{change.replace(' ', '-')}/pairs.csv"
            out = f"changed/out/{store}-{change.replace(' ', '-')}"
            # Its folder, listed (a listing is what the store's filesystem caches).
            body = {"input": put(store, root, name, planned).removesuffix("pairs.csv"),
                    "output": out if store == "local" else f"{store}://lake/{out}/",
                    "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
                    "label_token_ids": LABELS}
            response = client.post("/batches", json=body, headers=auth(key))
            assert response.status_code == 201, (store, change, response.text)
            created[store, change] = response.json()["id"]
            if data is not None and store == "local":
                put(store, root, name, data)
            elif data is not None:  # another client: this process's filesystem does not see the write
                fsspec.filesystem({"gs": "gcs"}.get(store, store), skip_instance_cache=True).pipe(f"lake/{name}", data)
    for (store, change), batch_id in created.items():
        done = wait_batch(client, key, batch_id)
        chunk_errors = [r["error"] for r in results(client, key, batch_id) if "chunk" in r]
        if change == "unchanged":
            assert done["status"] == "completed" and done["rows"]["failed"] == 0 and not chunk_errors, \
                (store, done, chunk_errors)
            assert done["rows"]["done"] == 12
        else:
            assert done["chunks"]["failed"] == done["chunks"]["total"] > 1, (store, change, done)
            assert {e["code"] for e in chunk_errors} == {"input_changed"}, (store, change, chunk_errors)
            assert "changed after the batch was planned" in chunk_errors[0]["message"]
            assert "overwrite" in chunk_errors[0]["message"]
            folder = f"changed/in/{store}-{change.replace(' ', '-')}/"
            out = f"changed/out/{store}-{change.replace(' ', '-')}"
            again = client.post("/batches", json={
                "input": folder if store == "local" else f"{store}://lake/{folder}", "overwrite": True,
                "output": out if store == "local" else f"{store}://lake/{out}/", "label_token_ids": LABELS,
                "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}}, headers=auth(key))
            assert again.status_code == 201, again.text
            redone = wait_batch(client, key, again.json()["id"])
            assert redone["status"] == "completed" and redone["chunks"]["failed"] == 0, (store, change, redone)
            assert redone["rows"]["done"] == (18 if change == "grown" else 12)


def test_a_uri_given_many_times_is_listed_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`input` may list 10,000 URIs: 10,000 copies of one glob listed its folder 10,000 times, in an API thread."""
    from fsspec.implementations.local import LocalFileSystem

    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    for i in range(3):
        (root / "data" / f"part-{i}.csv").write_text("q,doc\n")
    listings: list[str] = []
    glob = LocalFileSystem.glob
    monkeypatch.setattr(LocalFileSystem, "glob",
                        lambda self, path, **kw: (listings.append(path), glob(self, path, **kw))[1])
    objects = Access(str(root), []).expand(["data/*.csv"] * 2000)
    assert [o.name for o in objects] == [f"part-{i}.csv" for i in range(3)] and len(listings) == 1


def test_each_plan_lists_the_store_afresh(lake_settings, s3_store, gcs_store, azure_store) -> None:  # type: ignore[no-untyped-def]
    """The stores' filesystems cache their listings as long as the process lives: an export rewritten by another
    client after an earlier batch listed its folder was planned again from its old size and version (every
    chunk of the new batch then failed `input_changed`, or read the old size's bytes)."""
    import fsspec

    options = Options("", Columns("q", "doc", ("pair_id",), None), tuple(LABELS))
    planned, grown = encoded("csv", pair_table(4, 3, seed=7)), encoded("csv", pair_table(6, 3, seed=8))
    for store in STORES[1:]:
        put(store, Path(lake_settings.batch_local_root), "fresh/in/pairs.csv", planned)
        access = Access(None, [f"{store}://lake/fresh/"])
        first = list(plan(access.expand(f"{store}://lake/fresh/in/"), options, lake_settings))
        fsspec.filesystem({"gs": "gcs"}.get(store, store), skip_instance_cache=True).pipe("lake/fresh/in/pairs.csv",
                                                                                          grown)
        second = list(plan(access.expand(f"{store}://lake/fresh/in/"), options, lake_settings))
        assert first[-1].stop == len(planned) and second[-1].stop == len(grown), store
        assert first[0].version != second[0].version, store


BROKEN = [  # (name, data or None for no object, status, code)
    ("corrupt.parquet", b"PAR1 this is not parquet at all PAR1", 400, "input_corrupt"),
    ("empty.parquet", b"", 400, "input_corrupt"),
    ("truncated.parquet", "half", 400, "input_corrupt"),
    ("corrupt.csv.gz", b"\x1f\x8b\x08\x00 not gzip after all", 400, "input_corrupt"),
    ("corrupt.csv.zst", b"\x28\xb5\x2f\xfd not zstd after all", 400, "input_corrupt"),
    ("corrupt.jsonl.gz", b"\x1f\x8b\x08\x00 not gzip after all", 400, "input_corrupt"),
    ("empty.csv", b"", 400, "empty_batch"),
    ("binary.csv", bytes(range(256)) * 4, 400, "unknown_column"),
    ("other-columns.csv", b"a,b\n1,2\n", 400, "unknown_column"),
    ("other-columns.jsonl", b'{"a": 1, "b": 2}\n', 400, "unknown_column"),
    ("noformat.bin", b"PAR1", 400, "unknown_format"),
    ("missing.parquet", None, 404, "input_not_found"),
    ("nothing-here/", None, 404, "input_not_found"),
]


def test_broken_objects_on_every_store_are_refused_with_a_4xx(client, make_key, lake_settings,  # type: ignore[no-untyped-def]
                                                               s3_store, gcs_store, azure_store) -> None:
    import io

    key, _ = make_key()
    allow(key, [f"{store}://{bucket}/" for store in STORES[1:] for bucket in ("lake", "no-such-bucket")])
    root = Path(lake_settings.batch_local_root)
    whole = io.BytesIO()
    pq.write_table(pair_table(4, 3), whole)
    columns = {"query": "q", "item": "doc"}
    for store in STORES:
        cases = [*BROKEN, *([] if store == "local" else [(f"{store}://no-such-bucket/x.parquet", None, 404,
                                                          "input_not_found")])]
        for name, data, status, code in cases:
            uri = name if "://" in name else f"broken/{name}" if store == "local" else f"{store}://lake/broken/{name}"
            if data is not None:
                put(store, root, f"broken/{name}", whole.getvalue()[: len(whole.getvalue()) // 2] if data == "half"
                    else data)
            response = client.post("/batches", json={"input": uri, "output": "out" if store == "local" else
                                                     f"{store}://lake/out/", "columns": columns,
                                                     "label_token_ids": LABELS}, headers=auth(key))
            error = response.json()["error"]
            assert (response.status_code, error["code"]) == (status, code), (store, name, error)
            assert name.rstrip("/").rsplit("/", 1)[-1] in error["message"], (store, name, error)
        for odd in ("broken/[unclosed.parquet", "broken/**/*.parquet", "broken/\u00e9t\u00e9 \u2603.csv"):
            uri = odd if store == "local" else f"{store}://lake/{odd}"
            response = client.post("/batches", json={"input": uri, "output": "out" if store == "local" else
                                                     f"{store}://lake/out/", "columns": columns,
                                                     "label_token_ids": LABELS}, headers=auth(key))
            assert 400 <= response.status_code < 500, (store, odd, response.text)


def test_bad_rows_and_a_missing_or_rewritten_object_fail_only_their_rows(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                        lake_settings) -> None:
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    (root / "in").mkdir()
    good = pair_table(3, 4)
    bad = pa.table({"q": ["ok query", None, "ok query", "long " * 9000],
                    "doc": ["fine", "no query", "x", "y"], "pair_id": pa.array([1, 2, 3, 4], pa.int64()),
                    "labels": [LABELS, LABELS, [1, 10**9], LABELS]})
    pq.write_table(good.append_column("labels", pa.array([LABELS] * 12)), root / "in" / "a.parquet")
    pq.write_table(bad, root / "in" / "b.parquet")
    pq.write_table(good.append_column("labels", pa.array([LABELS] * 12)), root / "in" / "c.parquet")
    body = {"input": "in/*.parquet", "output": "out", "columns": {"query": "q", "item": "doc", "ids": ["pair_id"],
                                                                  "label": "labels"}}
    created = client.post("/batches", json=body, headers=auth(key))
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    # After planning: c.parquet is rewritten (corrupt: the version check names it as the change it is), a.parquet
    # removed.
    (root / "in" / "c.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    (root / "in" / "a.parquet").unlink()
    done = wait_batch(client, key, batch_id)
    assert done["status"] == "completed" and done["chunks"]["failed"] == 2
    rows = results(client, key, batch_id)
    chunk_errors = sorted(r["error"]["code"] for r in rows if "chunk" in r)
    assert chunk_errors == ["input_changed", "input_not_found"]
    by_id = {r["pair_id"]: r for r in rows if "chunk" not in r}
    assert by_id[1]["scores"] is not None and "error" not in by_id[1]
    assert by_id[2]["error"]["code"] == "invalid_row"
    assert by_id[3]["error"]["code"] == "label_token_id_out_of_range"
    assert by_id[4]["error"]["code"] == "too_many_tokens"
    manifest = json.loads((root / "out" / batch_id / "_manifest.json").read_text())
    assert manifest["rows"] == 4 and manifest["rows_failed"] == 3
    assert {c["error"]["code"] for c in manifest["failed_chunks"]} == {"input_changed", "input_not_found"}


def test_empty_and_header_only_csv_parts_in_a_folder_add_no_rows(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                   lake_settings) -> None:
    """An export's empty parts beside the others: a 0-byte CSV refused the whole folder (`unknown_column`: no
    header), and a header with no line break after it failed its chunk as `input_corrupt`."""
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    (root / "parts").mkdir()
    (root / "parts" / "part-0.csv").write_bytes(encoded("csv", pair_table(2, 3)))
    (root / "parts" / "part-1.csv").write_bytes(b"")
    (root / "parts" / "part-2.csv").write_bytes(b'"q","doc","pair_id"')
    body = {"input": "parts/", "output": "parts-out", "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
            "label_token_ids": LABELS}
    created = client.post("/batches", json=body, headers=auth(key))
    assert created.status_code == 201, created.text
    done = wait_batch(client, key, created.json()["id"])
    assert done["status"] == "completed" and done["chunks"]["failed"] == 0 and done["rows"]["failed"] == 0, done
    assert sorted(r["pair_id"] for r in results(client, key, done["id"])) == sorted(
        str(i) for i in pair_table(2, 3).column("pair_id").to_pylist())
    # Only empty objects: nothing to run, said with their names.
    response = client.post("/batches", json={**body, "input": "parts/part-1.csv", "output": "empty-out"},
                           headers=auth(key))
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "empty_batch") and "part-1.csv" in error["message"]


def test_a_chunk_with_nothing_to_score_is_committed(client, make_key, empty_queue, lake_settings) -> None:  # type: ignore[no-untyped-def]
    """A byte range in which no line starts (a line longer than the range) and a range whose every row fails:
    both end with the batch, their rows (if any) as errors, instead of staying in flight."""
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    long_line = json.dumps({"q": "a question? " * 25, "doc": "a document", "pair_id": 1})
    bad = "".join(json.dumps({"q": "x", "pair_id": i}) + "\n" for i in range(2, 6))  # no 'doc'
    (root / "odd.jsonl").write_text(long_line + "\n" + bad)
    lake_settings.batch_chunk_bytes = 100
    created = client.post("/batches", json={"input": "odd.jsonl", "output": "out", "columns": {
        "query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS}, headers=auth(key))
    assert created.status_code == 201, created.text
    assert created.json()["chunks"]["total"] > 4  # ranges inside the long line
    done = wait_batch(client, key, created.json()["id"], 60)
    assert done["status"] == "completed" and done["rows"] == {"done": 5, "failed": 4, "total": 5}, done
    rows = results(client, key, done["id"])
    assert [r["pair_id"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["scores"] is not None and all(r["error"]["code"] == "invalid_row" for r in rows[1:])


def test_refusals(client, make_key, empty_queue, lake_settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    other, _ = make_key("other")
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(2, 2), root / "p.parquet")
    (tmp_path / "secret.parquet").write_bytes((root / "p.parquet").read_bytes())
    (root / "escape.parquet").symlink_to(tmp_path / "secret.parquet")
    base = {"output": "out", "columns": {"query": "q", "item": "doc"}, "label_token_ids": LABELS}
    for body, status, code in [
            ({**base, "input": "../secret.parquet"}, 400, "path_outside_root"),
            ({**base, "input": str(tmp_path / "secret.parquet")}, 400, "path_outside_root"),
            ({**base, "input": "escape.parquet"}, 400, "path_outside_root"),
            ({**base, "input": "p.parquet", "output": "../out"}, 400, "path_outside_root"),
            ({**base, "input": "s3://lake/in/x.parquet"}, 403, "storage_prefix_not_allowed"),
            ({**base, "input": "p.parquet", "output": "s3://lake/out/"}, 403, "storage_prefix_not_allowed"),
            ({**base, "input": "missing.parquet"}, 404, "input_not_found"),
            ({**base, "input": "p.parquet", "label_token_ids": [10**9]}, 400, "label_token_id_out_of_range"),
            ({**base, "input": "p.parquet", "columns": {"query": "q", "item": "nope"}}, 400, "unknown_column")]:
        response = client.post("/batches", json=body, headers=auth(key))
        assert (response.status_code, response.json()["error"]["code"]) == (status, code), body
    # Which of input and output is refused, and the root they must be under.
    for body, refused in [({**base, "input": str(tmp_path / "secret.parquet")}, f"input {tmp_path}/secret.parquet"),
                          ({**base, "input": "p.parquet", "output": str(tmp_path / "out")}, f"output {tmp_path}/out")]:
        message = client.post("/batches", json=body, headers=auth(key)).json()["error"]["message"]
        assert message.startswith(f"{refused} is not under BATCH_LOCAL_ROOT ({root.resolve()};"), message
    created = client.post("/batches", json={**base, "input": "p.parquet"}, headers=auth(key)).json()
    assert client.get(f"/batches/{created['id']}", headers=auth(other)).status_code == 404
    assert client.get(f"/batches/{created['id']}/results", headers=auth(other)).status_code == 404
    assert client.post(f"/batches/{created['id']}/cancel", headers=auth(other)).status_code == 404
    client.post(f"/batches/{created['id']}/cancel", headers=auth(key))



def test_backfill_passes_on_which_path_was_refused() -> None:
    """`packscore backfill` said "the service cannot read INPUT" whichever of input and output was refused."""
    from packscore.backfill import BackfillError, run_reference_backfill
    from packscore.client import PackscoreError

    class Refusing:
        def create_reference_batch(self, *args: object, **kwargs: object) -> dict:
            raise PackscoreError(400, "path_outside_root",
                                 "output /elsewhere/out is not under BATCH_LOCAL_ROOT (/srv/work; symlinks followed)")

    with pytest.raises(BackfillError) as refused:
        run_reference_backfill(Refusing(), "pairs.parquet", "/elsewhere/out")  # type: ignore[arg-type]
    assert str(refused.value).startswith("output /elsewhere/out is not under BATCH_LOCAL_ROOT (/srv/work;"), \
        refused.value

def test_cancel_stops_claiming_chunks(client, make_key, empty_queue, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(20, 10), root / "p.parquet", row_group_size=40)
    created = client.post("/batches", json={"input": "p.parquet", "output": "out", "columns": {
        "query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS,
        "webhook_url": "http://127.0.0.1:9/hook"}, headers=auth(key)).json()
    assert created["chunks"]["total"] == 5
    # One chunk runs (claimed by hand, as a worker would), then the batch is cancelled.
    from store.lake import chunks as lake
    claimed = lake.claim_chunk("by-hand", get_settings())
    cancelled = client.post(f"/batches/{created['id']}/cancel", headers=auth(key))
    # The running chunk is cancelled too: the batch is settled at once.
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert lake.claim_chunk("another", get_settings()) is None  # no chunk starts after the cancel
    assert not lake.commit_chunk("by-hand", claimed, 0, 0, 0, ("input_corrupt", "stand-in"))  # its lease is gone
    assert not lake.settle(created["id"])  # settled once: one webhook
    with session_scope() as session:
        payloads = session.scalars(select(WebhookDelivery.payload)
                                   .where(WebhookDelivery.batch_id == created["id"])).all()
    assert [json.loads(payload)["type"] for payload in payloads] == ["batch.cancelled"]
    batch = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    assert batch["status"] == "cancelled" and batch["chunks"]["cancelled"] == 5
    manifest = json.loads((root / "out" / created["id"] / "_manifest.json").read_text())
    assert manifest["status"] == "cancelled" and len(manifest["cancelled_chunks"]) == 5
    assert not (root / "out" / created["id"] / "_SUCCESS").exists()


def test_a_stopping_worker_hands_back_the_chunk_it_read_ahead(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                             lake_settings) -> None:
    from worker.lake import ChunkFeed

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(8, 10), root / "p.parquet", row_group_size=40)
    created = client.post("/batches", json={"input": "p.parquet", "output": "out", "columns": {
        "query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS}, headers=auth(key)).json()
    assert created["chunks"]["total"] == 2
    feed = ChunkFeed(get_scorer(), "stopping-worker", get_settings())
    taken = feed.take()  # the pass loop's chunk; the reader reads the next one ahead
    assert taken
    deadline = time.monotonic() + 30
    while not feed._ready:
        assert time.monotonic() < deadline, "the reader did not read ahead"
        time.sleep(0.05)
    taken[0].work.abandon(None)  # the pass loop stopped and handed its requests back
    feed.close()
    assert not any(thread.is_alive() for thread in feed._threads)
    with session_scope() as session:
        rows = session.scalars(select(Chunk).where(Chunk.batch_id == created["id"])).all()
    # Both back in the queue at once, their attempts not counted: no waiting for a lease to expire.
    assert [(r.status, r.lease_owner, r.attempts) for r in rows] == [("queued", None, 0)] * 2


def test_store_outage_retries_chunks_without_loss_or_duplicates(client, make_key, empty_queue, s3_store,  # type: ignore[no-untyped-def]
                                                               lake_settings) -> None:
    import fsspec

    key, _ = make_key()
    allow(key, ["s3://lake/"])
    table = pair_table(30, 8, seed=3)
    fs = fsspec.filesystem("s3")
    with fs.open("lake/in/outage/pairs.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=24)
    created = client.post("/batches", json={"input": "s3://lake/in/outage/pairs.parquet", "output": "s3://lake/out/",
                                            "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
                                            "label_token_ids": LABELS}, headers=auth(key)).json()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            run_worker("outage-worker")
            time.sleep(0.2)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while client.get(f"/batches/{created['id']}", headers=auth(key)).json()["chunks"]["done"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    s3_store.stop()
    started = time.monotonic()
    # Meanwhile a batch cannot be planned: a 503 that names the object (try again), not a 500.
    refused = client.post("/batches", json={"input": "s3://lake/in/outage/pairs.parquet", "output": "s3://lake/o2/",
                                            "columns": {"query": "q", "item": "doc"}, "label_token_ids": LABELS},
                          headers=auth(key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "storage_unreachable"), refused.text
    assert "s3://lake/in/outage/pairs.parquet" in refused.json()["error"]["message"]
    time.sleep(max(0.0, 10 - (time.monotonic() - started)))
    s3_store.start()
    try:
        done = wait_batch(client, key, created["id"], 240)
    finally:
        stop.set()
        worker.join(60)
    assert done["status"] == "completed", done
    assert done["chunks"]["failed"] == 0
    rows = results(client, key, created["id"])
    assert sorted(r["pair_id"] for r in rows) == sorted(table.column("pair_id").to_pylist())
    assert all(r["scores"] is not None for r in rows)
    # Only committed objects are left, one per chunk.
    folder = f"lake/out/{created['id']}"
    parts = [p for p in fs.ls(folder, refresh=True) if "/part-" in p]
    assert len(parts) == created["chunks"]["total"]


def test_jsonl_lines_in_both_formats_as_a_reference_batch(client, make_key, empty_queue, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    lines = [json.dumps({"custom_id": f"own-{i}", "query": f"question {i}?", "items": ["a", "b c"],
                         "label_token_ids": LABELS, "return_logprobs": i == 0}) for i in range(30)]
    lines += [json.dumps({"custom_id": f"oai-{i}", "method": "POST", "url": "/v1/score",
                          "body": {"text_1": f"query {i}", "text_2": "one item", "label_token_ids": LABELS}})
              for i in range(30)]
    lines.insert(7, "{not json")
    (root / "lines.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    created = client.post("/batches", json={"input": "lines.jsonl.gz", "output": "out", "output_format": "jsonl"},
                          headers=auth(key))
    assert created.status_code == 201, created.text
    done = wait_batch(client, key, created.json()["id"])
    # Rows planned by size are known once read: counts.total and rows.total say the same, as an upload's total.
    assert done["status"] == "completed" and done["rows"] == {"done": 61, "failed": 1, "total": 61}
    assert done["counts"] == {"total": 61, "succeeded": 60, "failed": 1, "cancelled": 0}
    rows = results(client, key, done["id"])
    assert len(rows) == 61 and rows[7]["error"]["code"] == "invalid_json"
    by_id = {r["custom_id"]: r for r in rows if r["custom_id"]}
    assert np.asarray(by_id["own-0"]["scores"]).shape == (2, 3) and len(by_id["own-0"]["logprobs"]) == 2
    assert by_id["own-1"].get("logprobs") is None
    assert np.asarray(by_id["oai-3"]["scores"]).shape == (1, 3)
    openai = results(client, key, done["id"], format="openai")
    assert sum(line["response"]["status_code"] == 200 for line in openai) == 60
    with session_scope() as session:  # the chunk rows are the record: no row per line, nor per pass
        assert session.scalar(select(func.count()).select_from(Job)) == 0
        assert session.scalar(select(func.count()).select_from(Pass)) == 0


def test_ids_json_has_no_type_for_come_back_as_text_in_both_output_formats(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                           lake_settings) -> None:
    """A date, decimal or bytes id column (BigQuery's DATE, NUMERIC, BYTES): each JSONL write of the chunk
    failed as if the store were down, until the chunk failed; the results of a Parquet output broke off. A
    float id's NaN or infinity was written as a bare `NaN`, which strict JSON readers refuse: now null."""
    import base64
    import datetime
    from decimal import Decimal

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    ids = {"day": pa.array([datetime.date(2026, 12, i + 1) for i in range(4)]),
           "at": pa.array([datetime.datetime(2026, 12, 6, 13, i) for i in range(4)], pa.timestamp("us")),
           "amount": pa.array([Decimal("1.10"), Decimal("-0.05"), None, Decimal("12345678901234567890.5")],
                              pa.decimal128(38, 2)),
           "raw": pa.array([b"\x00\xff", b"", None, b"id"]),
           "weight": pa.array([float("nan"), float("inf"), -float("inf"), 1.5])}
    pq.write_table(pa.table({"q": ["which?"] * 4, "doc": ["a", "b", "c", "d"], **ids}), root / "typed.parquet")
    expected = [{"day": f"2026-12-0{i + 1}", "at": f"2026-12-06T13:0{i}:00",
                 "amount": [None if v is None else str(v) for v in ids["amount"].to_pylist()][i],
                 "raw": [None if v is None else base64.b64encode(v).decode() for v in ids["raw"].to_pylist()][i],
                 "weight": [None, None, None, 1.5][i]}
                for i in range(4)]

    def strict(text: str) -> list[dict]:
        def refuse(constant: str) -> None:
            raise AssertionError(f"{constant} is not JSON")
        return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]

    for output_format in ("jsonl", "parquet"):
        created = client.post("/batches", json={"input": "typed.parquet", "output": f"typed-{output_format}",
                                                "output_format": output_format, "label_token_ids": LABELS,
                                                "columns": {"query": "q", "item": "doc", "ids": list(ids)}},
                              headers=auth(key))
        assert created.status_code == 201, created.text
        done = wait_batch(client, key, created.json()["id"])
        assert done["status"] == "completed" and done["rows"]["failed"] == 0, done
        got = strict(client.get(f"/batches/{done['id']}/results", headers=auth(key)).text)
        assert [{name: row[name] for name in ids} for row in got] == expected, output_format
        if output_format == "jsonl":
            written = root / f"typed-{output_format}" / done["id"]
            assert len(strict("".join(p.read_text() for p in written.glob("part-*.jsonl")))) == 4


# ---- the same request again (issue 44, item 3) and progress totals (item 5) -------------------------------------


def test_the_same_request_again_finds_its_batch(client, make_key, empty_queue, lake_settings,  # type: ignore[no-untyped-def]
                                                monkeypatch) -> None:
    from store.lake import chunks as lake

    key, _ = make_key()
    other, _ = make_key("other")
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(4, 10), root / "p.parquet", row_group_size=20)  # 2 chunks
    body = {"input": "p.parquet", "output": "out", "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
            "label_token_ids": LABELS}
    first = client.post("/batches", json=body, headers=auth(key))
    assert first.status_code == 201, first.text
    batch_id = first.json()["id"]
    # The same input and output (spelled otherwise): the batch running, 200, nothing planned again.
    again = client.post("/batches", json={**body, "input": [str(root / "p.parquet")], "output": "out/"},
                        headers=auth(key))
    assert again.status_code == 200 and again.headers["Location"] == f"/batches/{batch_id}", again.text
    assert {k: again.json()[k] for k in ("id", "status", "chunks", "rows")} == \
        {k: first.json()[k] for k in ("id", "status", "chunks", "rows")}
    # Another input, other options, or an overwrite while it runs: refused, naming the batch that holds it.
    for change in ({"input": "q.parquet"}, {"apply_softmax": True}, {"overwrite": True}):
        refused = client.post("/batches", json={**body, **change}, headers=auth(key))
        error = refused.json()["error"]
        assert (refused.status_code, error["code"], error["batch_id"]) == (409, "output_in_use", batch_id), change
        assert batch_id in error["message"]
    # Another key's batch is not found: it gets a batch of its own.
    theirs = client.post("/batches", json=body, headers=auth(other))
    assert theirs.status_code == 201 and theirs.json()["id"] != batch_id
    client.post(f"/batches/{theirs.json()['id']}/cancel", headers=auth(other))
    done = wait_batch(client, key, batch_id)
    assert done["status"] == "completed" and done["manifest"].endswith(f"/out/{batch_id}/_manifest.json")
    rerun = client.post("/batches", json=body, headers=auth(key))
    assert rerun.status_code == 200 and rerun.json()["id"] == batch_id and rerun.json()["status"] == "completed"
    assert Path(Location.parse(rerun.json()["manifest"]).path).exists()
    # Redoing it is asked for: a new batch, which the same request finds from then on.
    redo = client.post("/batches", json={**body, "overwrite": True}, headers=auth(key))
    assert redo.status_code == 201 and redo.json()["id"] != batch_id and redo.json()["manifest"] is None
    assert client.post("/batches", json=body, headers=auth(key)).json()["id"] == redo.json()["id"]
    # A cancelled batch gives its output up.
    client.post(f"/batches/{redo.json()['id']}/cancel", headers=auth(key))
    fresh = client.post("/batches", json=body, headers=auth(key))
    assert fresh.status_code == 201 and fresh.json()["id"] not in (batch_id, redo.json()["id"])
    # So does a failed one: sent again, it runs again (it was answered with the failed batch, and an overwrite
    # was refused as if that batch still ran).
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == fresh.json()["id"]).values(status="failed"))
    again = client.post("/batches", json=body, headers=auth(key))
    assert again.status_code == 201 and again.json()["id"] != fresh.json()["id"], again.text
    # Two requests at once: the one that finds the output taken as it inserts is answered with the first's batch.
    client.post(f"/batches/{again.json()['id']}/cancel", headers=auth(key))
    winner = client.post("/batches", json={**body, "output": "raced"}, headers=auth(key)).json()
    looked = []
    holder = lake._output_holder

    def late(*args, **kwargs):  # type: ignore[no-untyped-def]
        looked.append(1)  # the first look happened before the winner's commit
        return (None, None) if len(looked) == 1 else holder(*args, **kwargs)

    monkeypatch.setattr(lake, "_output_holder", late)
    raced = client.post("/batches", json={**body, "output": "raced"}, headers=auth(key))
    assert (raced.status_code, raced.json()["id"], len(looked)) == (200, winner["id"], 2), raced.text
    client.post(f"/batches/{winner['id']}/cancel", headers=auth(key))


def test_progress_totals_are_stable_and_say_so(client, make_key, empty_queue, lake_settings) -> None:  # type: ignore[no-untyped-def]
    from store.lake import chunks as lake

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(4, 10), root / "p.parquet", row_group_size=20)
    created = client.post("/batches", json={"input": "p.parquet", "output": "out", "columns": {
        "query": "q", "item": "doc"}, "label_token_ids": LABELS}, headers=auth(key)).json()
    # Known rows are items to score (a pair table's row is one item); the chunks may still be cut into pieces.
    assert created["progress"] == {"items_done": 0, "items_total": 40} and created["rows"]["total"] == 40
    assert created["chunks"]["total_final"] is False and created["manifest"] is None
    assert created["counts"]["total"] == 40
    done = wait_batch(client, key, created["id"])
    assert done["progress"] == {"items_done": 40, "items_total": 40} and done["chunks"]["total_final"] is True
    assert done["counts"] == {"total": 40, "succeeded": 40, "failed": 0, "cancelled": 0} == \
        client.get("/batches", headers=auth(key)).json()["data"][0]["counts"]
    assert done["eta_seconds"] is None
    # Rows planned by size (JSONL): the ETA is by the input's bytes, so cutting a chunk into pieces leaves it.
    lines = "".join(json.dumps({"custom_id": f"r{i}", "query": f"question {i}?", "items": ["a", "b"],
                                "label_token_ids": LABELS}) + "\n" for i in range(80))
    (root / "lines.jsonl").write_text(lines)
    created = client.post("/batches", json={"input": "lines.jsonl", "output": "out-lines"}, headers=auth(key)).json()
    planned = -(-len(lines) // lake_settings.batch_chunk_bytes)
    assert created["chunks"]["total"] == planned >= 3 and created["progress"]["items_total"] == 0  # unknown yet
    assert created["counts"]["total"] is None and created["rows"]["total"] is None
    first = lake.claim_chunk("by-hand", lake_settings)
    assert first is not None and first.batch_id == created["id"] and lake.commit_chunk("by-hand", first, 20, 0, 40)
    with session_scope() as session:  # as if the batch had started 10 s ago
        session.execute(update(Chunk).where(Chunk.batch_id == created["id"], Chunk.index == first.index)
                        .values(started_at=utcnow() - timedelta(seconds=10)))
    before = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    second = lake.claim_chunk("by-hand", lake_settings)
    assert second is not None
    middle = lines.encode().index(b"\n", second.start + 100) + 1
    assert lake.split_chunk("by-hand", second, [(middle, None)], None) is not None
    after = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    assert after["chunks"]["total"] == planned + 1 and after["chunks"]["total_final"] is False
    assert before["eta_seconds"] == pytest.approx(after["eta_seconds"], abs=0.5)
    cancelled = client.post(f"/batches/{created['id']}/cancel", headers=auth(key)).json()
    assert cancelled["status"] == "cancelled" and cancelled["chunks"]["total_final"] is True


def test_a_pair_tables_result_columns_hold_each_rows_values_or_null() -> None:
    """result_table builds a pair table's list columns from whole arrays (issue 47: a list of floats a row was
    most of a commit's Python): each scored row has its item's label values (softmax where its request asked),
    a row in error or of a request not scored is null with its code, and logprobs only where asked for."""
    from core import TokenizedRequest
    from store.lake.tables import ChunkRows, result_table

    rng = np.random.default_rng(0)
    requests = [([0, 1, 3], TokenizedRequest((1,), ((2,),) * 3, (5, 6)), True),  # row 2 is an error row
                ([4], TokenizedRequest((1,), ((2,),), (5, 6, 7)), False),
                ([5, 6], TokenizedRequest((1,), ((2,),) * 2, (5,)), False),  # not scored
                (range(7, 9), TokenizedRequest((1,), ((2,),) * 2, (5, 6, 7)), False)]  # a run of rows
    logprobs = [np.log(rng.uniform(0.01, 1, (3, 2))), np.log(rng.uniform(0.01, 1, (1, 3))), None,
                np.log(rng.uniform(0.01, 1, (2, 3))).astype(np.float32)]
    rows = ChunkRows(True, 9, {"pair_id": list(range(100, 109))}, {"pair_id": pa.int64()}, requests,
                     errors={2: ("invalid_row", "no query")})
    for return_logprobs in (False, True):
        options = Options("parquet", Columns("q", "doc", ("pair_id",)), (5, 6), return_logprobs=return_logprobs)
        table = result_table(rows, logprobs, options, failure=("output_full", "the disk is full")).to_pydict()
        assert table["pair_id"] == list(range(100, 109)) and ("logprobs" in table) == return_logprobs
        expected_scores, expected_raw = [None] * 9, [None] * 9
        for (covered, _, softmax), lp in zip(requests, logprobs):
            for row, values in zip(covered, lp if lp is not None else []):
                values = np.asarray(values, np.float64)
                expected_raw[row] = values.tolist()
                expected_scores[row] = (np.exp(values) / np.exp(values).sum() if softmax else np.exp(values)).tolist()
        for got, expected in zip(table["scores"], expected_scores):
            assert (got is None) == (expected is None) and (got is None or np.allclose(got, expected, rtol=1e-12))
        if return_logprobs:
            assert table["logprobs"] == expected_raw
        assert table["error_code"] == [None, None, "invalid_row", None, None, "output_full", "output_full", None, None]
        assert table["error_message"][5] == "the disk is full"
