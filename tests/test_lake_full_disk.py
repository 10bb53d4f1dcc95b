"""A reference batch whose output's disk fills up (found by the soak, issue 47): it ends as a clear failure,
`failed` with `output_full`, within seconds and with nothing half-committed (no object of a chunk not
committed, no `_SUCCESS`); the same request, once the output takes writes again, resumes from the chunks
committed.
Before, the object write was retried for 60 s per attempt (holding the worker's commit queue), the chunk failed
after MAX_ATTEMPTS as `input_unavailable`, and then the manifest could not be written either: the batch stayed
`in_progress` for good, its half-written object left in the folder. The disk is full by a patched write (ENOSPC
after part of the object), in-process on PostgreSQL as tests/test_lake.py runs batches."""

import errno
import json
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from store.lake import chunks as chunks_module
from store.db import session_scope
from store.lake import tables
from store.models import Chunk
from store.settings import get_settings
from worker import drain as drain_module
from worker.scorer import get_scorer

LABELS = [9805, 787]
COLUMNS = {"query": "q", "item": "doc", "ids": ["pair_id"]}


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    settings = get_settings()
    monkeypatch.setattr(settings, "batch_local_root", str(tmp_path))
    monkeypatch.setattr(settings, "batch_chunk_rows_target", 40)
    pq.write_table(pa.table({"q": [f"question {i // 10}?" for i in range(120)],
                             "doc": [f"document {i}" for i in range(120)], "pair_id": list(range(120))}),
                   tmp_path / "pairs.parquet", row_group_size=40)
    return tmp_path


def full_disk_write(location, table, output_format) -> None:  # type: ignore[no-untyped-def]
    """Part of the object, then ENOSPC, as a write into a full folder ends."""
    with location.fs.open(location.path, "wb") as f:
        f.write(b"PAR1 half an object")
    raise OSError(errno.ENOSPC, "No space left on device")


def submit(client, key: str, output: str) -> str:  # type: ignore[no-untyped-def]
    """The pair table as a reference batch into `output`; its id."""
    created = client.post("/batches", json={"input": "pairs.parquet", "output": output, "columns": COLUMNS,
                                            "label_token_ids": LABELS}, headers={"Authorization": f"Bearer {key}"})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def run_until_over(client, key: str, batch_id: str, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while True:
        batch = client.get(f"/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}).json()
        if batch["status"] in ("completed", "cancelled", "failed") or time.monotonic() > deadline:
            return batch
        drain_module.drain(get_scorer(), "full-disk-worker", get_settings())
        time.sleep(0.1)


def test_a_full_disk_fails_its_batch_at_once(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                             root: Path) -> None:
    key, _ = make_key()
    batch_id = submit(client, key, "out")
    with patch("worker.lake.write_table", full_disk_write):
        batch = run_until_over(client, key, batch_id, 300)
    assert batch["status"] == "failed", batch
    # Each chunk failed at its first attempt: no write retried for a minute, no attempt run again.
    with session_scope() as session:
        attempts = session.execute(select(Chunk.error_code, Chunk.attempts)
                                   .where(Chunk.batch_id == batch["id"])).all()
    assert attempts and all(row == ("output_full", 1) for row in attempts), attempts
    assert batch["error"]["code"] == "output_full" and "disk is full" in batch["error"]["message"], batch
    folder = root / "out" / batch["id"]
    left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    assert not [name for name in left if name.startswith("part-") or name == "_SUCCESS"], left
    # Nothing was committed: the results are one error line per chunk.
    results = client.get(f"/batches/{batch_id}/results", headers={"Authorization": f"Bearer {key}"})
    assert results.status_code == 200, results.text
    errors = [json.loads(line)["error"]["code"] for line in results.text.splitlines()]
    assert errors == ["output_full"] * len(attempts), errors


def denied_write(location, table, output_format) -> None:  # type: ignore[no-untyped-def]
    raise PermissionError(13, "Permission denied", location.path)


@pytest.mark.parametrize("refusing", ["object", "manifest"])
def test_an_output_that_refuses_writes_fails_its_batch_at_once(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                root: Path, refusing: str) -> None:
    """Denied writes (a read-only folder, a bucket policy, this server's credentials) are not waited out as an
    unreachable store is: the batch stayed `in_progress` for good, its settling raising at every sweep."""
    key, _ = make_key()
    batch_id = submit(client, key, f"denied-{refusing}")
    patched = patch("worker.lake.write_table", denied_write) if refusing == "object" else \
        patch.object(chunks_module, "write_manifest", lambda prefix, manifest, success: denied_write(prefix, 0, 0))
    with patched:
        batch = run_until_over(client, key, batch_id, 300)
    assert batch["status"] == "failed" and batch["error"]["code"] == "output_denied", batch
    assert "Permission denied" in batch["error"]["message"], batch
    with session_scope() as session:
        attempts = session.execute(select(Chunk.status, Chunk.attempts).where(Chunk.batch_id == batch_id)).all()
    expected = ("failed", 1) if refusing == "object" else ("succeeded", 1)
    assert attempts and all(tuple(row) == expected for row in attempts), attempts


def test_only_a_full_disk_or_a_denied_write_is_refused_for_good() -> None:
    from store.lake.access import Location

    from azure.core.exceptions import HttpResponseError
    from botocore.exceptions import NoCredentialsError  # when the instance's credential endpoint blips

    def http_error(status_code: int) -> HttpResponseError:  # azure-core's, with the answer's status
        exc = HttpResponseError(f"status {status_code}")
        exc.status_code = status_code
        return exc

    where = Location.parse("s3://bucket/out/part-000000-attempt-1.parquet")
    codes = {name: (chunks_module.write_refused(where, exc) or ("retried",))[0] for name, exc in {
        "full": OSError(errno.ENOSPC, "No space left on device"), "quota": OSError(errno.EDQUOT, "Quota"),
        "permission": PermissionError(13, "Access Denied"), "403": http_error(403),
        "503": http_error(503), "credentials": NoCredentialsError(), "down": ConnectionError("refused"),
        "missing bucket": FileNotFoundError("NoSuchBucket")}.items()}
    assert codes == {"full": "output_full", "quota": "output_full", "permission": "output_denied",
                     "403": "output_denied", "503": "retried", "credentials": "retried", "down": "retried",
                     "missing bucket": "retried"}


def test_one_batch_that_cannot_settle_does_not_hold_up_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import lake

    settled: list[str] = []

    def settle(batch_id: str) -> bool:
        if batch_id == "unreachable":
            raise ConnectionError("the store is down")
        settled.append(batch_id)
        return True

    monkeypatch.setattr(chunks_module, "sweep_chunks", lambda settings: ["unreachable", "fine"])
    monkeypatch.setattr(chunks_module, "settle", settle)
    monkeypatch.setattr(chunks_module, "live_chunks", lambda settings: True)
    assert lake.sweep(get_settings()) is True  # and the round goes on to wake a pass loop
    assert settled == ["fine"]


def test_a_manifest_that_does_not_fit_fails_the_batch(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                     root: Path) -> None:
    """The objects fitted, the manifest did not: no `_SUCCESS`, and no object left that no manifest lists."""
    key, _ = make_key()
    batch_id = submit(client, key, "out2")
    real = tables.write_manifest

    def no_room_for_a_completed_manifest(prefix, manifest, success) -> None:  # type: ignore[no-untyped-def]
        if manifest["status"] == "completed":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(prefix, manifest, success)

    with patch.object(chunks_module, "write_manifest", no_room_for_a_completed_manifest):
        batch = run_until_over(client, key, batch_id, 300)
    assert batch["status"] == "failed" and batch["error"]["code"] == "output_full", batch
    folder = root / "out2" / batch["id"]
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["rows"] == 120, manifest
    assert sorted(p.name for p in folder.iterdir()) == sorted(["_manifest.json", *(e["name"] for e in
                                                                                  manifest["objects"])])
    # Every chunk was committed: the same request resumes with nothing to score, and completes in the call.
    again = client.post("/batches", json={"input": "pairs.parquet", "output": "out2", "columns": COLUMNS,
                                          "label_token_ids": LABELS}, headers={"Authorization": f"Bearer {key}"})
    assert again.status_code == 201 and again.json()["resumed_from"] == batch_id, again.text
    assert again.json()["status"] == "completed" and again.json()["rows"]["done"] == 120, again.json()
    assert json.loads((folder / "_manifest.json").read_text())["status"] == "completed"
    assert (folder / "_SUCCESS").exists()


def test_a_failed_batch_leaves_none_of_its_rows_in_the_worker(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                             root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once its batch is over, nothing in the worker keeps a chunk's ChunkWork (its rows and tokens): the chunk
    feed's lease keeper held the last one in a local until another chunk came, in an idle worker for good
    (issue 47's soak: 57,000 Python blocks after the full-disk batch)."""
    import gc

    from worker.lake import ChunkWork

    monkeypatch.setattr(get_settings(), "sweep_interval_seconds", 0.2)
    key, _ = make_key()
    batch_id = submit(client, key, "out")

    def slow_full_disk_write(location, table, output_format) -> None:  # type: ignore[no-untyped-def]
        time.sleep(0.5)  # the keeper's rounds see the chunk running
        full_disk_write(location, table, output_format)

    with patch("worker.lake.write_table", slow_full_disk_write):
        assert run_until_over(client, key, batch_id, 300)["status"] == "failed"
    time.sleep(1.0)  # the keeper's rounds, with no chunk held
    gc.collect()
    # This batch's only: the suite's other tests share this process (pytest-xdist), and a chunk of theirs may
    # still be in flight in their own workers.
    assert [o for o in gc.get_objects() if isinstance(o, ChunkWork) and o.chunk.batch_id == batch_id] == []


def test_a_chunk_running_when_the_database_writes_fail_goes_back(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                 root: Path) -> None:
    """A pass loop whose database writes fail ends, its jobs left to their leases. Its chunk's requests were
    never handed back: the feed kept the chunk and extended its lease for good, and the batch never ended."""
    from sqlalchemy.exc import OperationalError

    from store import finishing

    key, _ = make_key()
    # Documents long enough that a chunk takes several passes (PASS_TOKENS is 512 in tests): one is under way.
    pq.write_table(pa.table({"q": ["which?"] * 40, "doc": [f"document {i} " + "word " * 60 for i in range(40)],
                             "pair_id": list(range(40))}), root / "long.parquet")
    created = client.post("/batches", json={"input": "long.parquet", "output": "writes-fail", "columns": COLUMNS,
                                            "label_token_ids": LABELS}, headers={"Authorization": f"Bearer {key}"})
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    real, failed = finishing.write_boundaries, []

    def down_once(session, boundaries):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(1)
            raise OperationalError("INSERT INTO passes", {}, ConnectionError("the database restarts"))
        return real(session, boundaries)

    with patch.object(finishing, "write_boundaries", down_once), pytest.raises(OperationalError):
        drain_module.drain(get_scorer(), "full-disk-worker", get_settings())  # as a Celery task's fails
    batch = run_until_over(client, key, batch_id, 60)
    assert failed and batch["status"] == "completed" and batch["rows"]["done"] == 40, batch


def test_the_same_request_after_a_refused_write_resumes_from_the_committed_chunks(  # type: ignore[no-untyped-def]
        client, make_key, empty_queue, root: Path) -> None:
    """The output takes one object, then its disk is full: the batch fails keeping that object (its manifest
    says failed and lists it). Freed, the same request resumes: only the rows not committed are scored, and the
    output is that of one uninterrupted run."""
    from packscore.backfill import describe_plan
    from tests.test_lake_cancel import ids_and_scores
    from worker import lake as feed_module

    key, _ = make_key()
    headers = {"Authorization": f"Bearer {key}"}
    body = {"input": "pairs.parquet", "output": "resumed", "columns": COLUMNS, "label_token_ids": LABELS}
    real, written = feed_module.write_table, []

    def full_after_one(location, table, output_format) -> None:  # type: ignore[no-untyped-def]
        if written:
            full_disk_write(location, table, output_format)
        real(location, table, output_format)
        written.append(table.num_rows)

    batch_id = submit(client, key, "resumed")
    with patch("worker.lake.write_table", full_after_one):
        failed = run_until_over(client, key, batch_id, 300)
    assert failed["status"] == "failed" and failed["error"]["code"] == "output_full", failed
    kept = failed["rows"]["done"]
    assert written == [kept] and 0 < kept < 120, (written, failed)
    folder = root / "resumed" / batch_id
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["status"] == "failed" and [e["rows"] for e in manifest["objects"]] == [kept], manifest
    assert manifest["failed_chunks"] and not (folder / "_SUCCESS").exists()
    # The committed object is kept; the half-written ones of the chunks that failed are not.
    assert sorted(p.name for p in folder.glob("part-*")) == [manifest["objects"][0]["name"]]
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*")}
    # Its results: the committed rows, and one error line per chunk that failed.
    results = client.get(f"/batches/{batch_id}/results", headers=headers)
    assert results.status_code == 200, results.text
    lines = [json.loads(line) for line in results.text.splitlines()]
    assert len([line for line in lines if "pair_id" in line and line.get("scores")]) == kept
    assert [line["error"]["code"] for line in lines if "chunk" in line] == ["output_full"] * len(
        manifest["failed_chunks"])

    # The dry run says the same request resumes it.
    plan = client.post("/batches/plan", json=body, headers=headers).json()
    assert plan["earlier"] == {"id": batch_id, "status": "failed", "then": "resume", "rows_committed": kept}
    assert f"earlier batch {batch_id} (failed) holds this output: the same command resumes it" in describe_plan(plan)
    afresh = client.post("/batches/plan", json={**body, "overwrite": True}, headers=headers).json()
    assert afresh["earlier"]["then"] == "replace"  # `overwrite`: from row 0, in a folder of its own

    written.clear()
    created = client.post("/batches", json=body, headers=headers)
    assert created.status_code == 201, created.text
    resumed = created.json()
    assert resumed["resumed_from"] == batch_id and resumed["rows"]["done"] == kept, resumed

    def counted(location, table, output_format) -> None:  # type: ignore[no-untyped-def]
        real(location, table, output_format)
        written.append(table.num_rows)

    with patch("worker.lake.write_table", counted):
        done = run_until_over(client, key, resumed["id"], 300)
    assert done["status"] == "completed" and done["rows"]["done"] == 120, done
    assert sum(written) == 120 - kept, written  # the rows committed before were not scored again
    assert {name: (folder / name).stat().st_mtime_ns for name in stamps} == stamps
    ids, scores = ids_and_scores(folder)
    assert ids == list(range(120))  # every row once, in the input's order

    # The same as one uninterrupted run.
    whole = submit(client, key, "whole")
    assert run_until_over(client, key, whole, 300)["status"] == "completed"
    whole_ids, whole_scores = ids_and_scores(root / "whole" / whole)
    assert whole_ids == ids and np.allclose(whole_scores, scores, atol=1e-5)
