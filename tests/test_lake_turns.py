"""Reference batches sharing workers (issue 36), in-process on PostgreSQL: turns between reference batches and
with uploaded batches, cancel with chunks held by a worker that stopped or died, progress within a chunk and
the ETA, and a CPU worker cutting long chunks into pieces of about BATCH_CHUNK_SECONDS.

The chunk feed is driven by hand where the order of events matters (a chunk's requests are "scored" by the
test), so nothing depends on how fast this machine runs the engine."""

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select, text, update

from store.db import session_scope
from store.lake import chunks as lake
from store.models import Batch, Chunk, utcnow
from store.settings import get_settings
from tests import claiming
from worker import drain as drain_module
from worker import lake as feed_module
from worker.lake import ChunkFeed, ChunkRequest
from worker.policy import Pace
from worker.scorer import get_scorer

LABELS = [5, 17, 300]


@pytest.fixture
def lake_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, empty_queue):  # type: ignore[no-untyped-def]
    """A local root, small chunks, a fast keeper; no batch of an earlier test left running (turns are between
    every running batch of the model)."""
    settings = get_settings()
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(settings, "batch_local_root", str(root))
    monkeypatch.setattr(settings, "batch_chunk_rows_target", 20)
    monkeypatch.setattr(settings, "sweep_interval_seconds", 0.1)
    with session_scope() as session:
        session.execute(text("UPDATE chunks SET status = 'cancelled' WHERE status IN ('queued', 'running')"))
        session.execute(text("UPDATE batches SET status = 'cancelled' WHERE status IN ('in_progress', 'cancelling')"))
    return settings


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def pair_table(n_queries: int, docs: int, first_id: int = 0) -> pa.Table:
    q = [f"question {i}: which one?" for i in range(n_queries) for _ in range(docs)]
    d = [f"document {j} of {i}" for i in range(n_queries) for j in range(docs)]
    ids = [first_id + k for k in range(n_queries * docs)]
    return pa.table({"q": q, "doc": d, "pair_id": pa.array(ids, pa.int64())})


def submit(client, key: str, root: Path, name: str, table: pa.Table, **extra) -> dict:  # type: ignore[no-untyped-def]
    pq.write_table(table, root / f"{name}.parquet")
    response = client.post("/batches", json={"input": f"{name}.parquet", "output": f"out-{name}", "columns": {
        "query": "q", "item": "doc", "ids": ["pair_id"]}, "label_token_ids": LABELS, **extra}, headers=auth(key))
    assert response.status_code == 201, response.text
    return response.json()


def upload_lines(client, key: str, lines: int) -> dict:  # type: ignore[no-untyped-def]
    """An uploaded batch (the JSON body form) of so many 2-item lines."""
    response = client.post("/batches", json={"requests": [
        {"custom_id": f"u{i}", "query": f"uploaded question {i}?", "items": ["a", "b"], "label_token_ids": LABELS}
        for i in range(lines)]}, headers=auth(key))
    assert response.status_code == 201, response.text
    return response.json()


def wait_for(check: Callable[[], object], what: str, seconds: float = 60) -> object:
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def next_chunk(feed: ChunkFeed) -> list[ChunkRequest]:
    """The next chunk the feed starts (a take that finds none read yet, or hands one back, finds none)."""
    return wait_for(feed.take, "a chunk to take")  # type: ignore[return-value]


def score_all(requests: list[ChunkRequest]) -> None:
    """Stands in for the pass loop: every request of the chunk scored."""
    for r in requests:
        r.work.done(r.k, np.zeros((r.tokenized.n_items, len(LABELS)), np.float32))


def batch_of(requests: list[ChunkRequest]) -> str:
    return requests[0].work.chunk.batch_id


def test_reference_batches_take_turns_chunk_by_chunk(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    big = submit(client, key, root, "big", pair_table(8, 10))  # 4 chunks
    feed = ChunkFeed(get_scorer(), "turns-worker", lake_settings)
    try:
        first = next_chunk(feed)
        assert batch_of(first) == big["id"]
        wait_for(lambda: feed._ready, "the next chunk of the big batch to be read ahead")
        small = submit(client, key, root, "small", pair_table(4, 10, 10_000))  # 2 chunks, behind the big one
        order = [batch_of(first)]
        score_all(first)
        while len(order) < 6:
            taken = next_chunk(feed)
            order.append(batch_of(taken))
            score_all(taken)
        # The chunk read ahead went back: the small batch started next, and the two took turns after that.
        assert order == [big["id"], small["id"], big["id"], small["id"], big["id"], big["id"]]
        for batch in (big, small):
            done = wait_for(lambda: (b := client.get(f"/batches/{batch['id']}", headers=auth(key)).json())["status"]
                            == "completed" and b, "the batch to complete")
            assert done["rows"]["done"] == done["rows"]["total"]
        with session_scope() as session:  # the chunk that went back ran once, its attempt not counted
            assert set(session.scalars(select(Chunk.attempts).where(Chunk.batch_id == big["id"]))) == {1}
    finally:
        feed.close()


def test_uploaded_and_reference_batches_take_turns(client, make_key, lake_settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    upload = upload_lines(client, key, 40)
    reference = submit(client, key, root, "behind-upload", pair_table(6, 10))
    feed = ChunkFeed(get_scorer(), "lanes-worker", lake_settings)
    claimer = claiming.claimer("lanes-worker", lake_settings, 64, feed, get_scorer())
    # The uploads' turn lasts as long as the last chunk took (at most BATCH_CHUNK_SECONDS): none here, so each
    # claim is the other lane's.
    monkeypatch.setattr(claimer.policy, "uploads_turn", lambda: 0.0)
    feed._want.set()  # the reader reads the first chunk ahead (a take asks it for the next one)
    try:
        kinds = []
        for _ in range(5):
            wait_for(lambda: feed._ready, "a chunk read ahead")
            claimed = claimer(False)
            assert claimed
            chunk = isinstance(claimed[0], ChunkRequest)
            kinds.append("chunk" if chunk else "upload")
            if chunk:
                assert batch_of(claimed) == reference["id"]
                score_all(claimed)
            else:
                assert {job.batch_id for job in claimed} == {upload["id"]}
        # Before, every round of the upload went first: the reference batch waited for the whole upload.
        assert kinds == ["chunk", "upload", "chunk", "upload", "chunk"]
    finally:
        feed.close()
        from store.finishing import release

        with session_scope() as session:
            held = list(session.scalars(text("SELECT id FROM jobs WHERE lease_owner = 'lanes-worker'")))
        release("lanes-worker", lake_settings, held, None)


def test_a_reference_batch_behind_a_running_upload_is_taken_at_once(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    """Issue 44: with no chunk to run, each claim of an upload's rounds began a new uploads' turn of
    BATCH_CHUNK_SECONDS, so a reference batch submitted then waited that long (82 s against 15 s alone)."""
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    upload = upload_lines(client, key, 40)
    feed = ChunkFeed(get_scorer(), "behind-upload-worker", lake_settings)
    claimer = claiming.claimer("behind-upload-worker", lake_settings, 64, feed, get_scorer())
    try:
        for _ in range(2):  # the upload alone: its rounds, no chunk
            claimed = claimer(False)
            assert claimed and not isinstance(claimed[0], ChunkRequest)
        reference = submit(client, key, root, "behind-running-upload", pair_table(4, 10))  # 2 chunks

        def claim_until_chunk() -> tuple[list[str], list[ChunkRequest]]:
            kinds: list[str] = []
            for _ in range(4):  # the reader reads a chunk at one claim's look, a later one takes it
                claimed = claimer(False)
                if isinstance(claimed[0], ChunkRequest):
                    return kinds, claimed
                kinds.append("upload")
                wait_for(lambda: feed._ready or not feed.busy(), "the reader")
            raise AssertionError(f"no chunk taken: {kinds}")

        _, first = claim_until_chunk()
        assert batch_of(first) == reference["id"]
        # The upload's rounds go on while the chunk runs; its turn after the chunk lasts as long as the chunk took
        # (here: nothing), counted from when the chunk is done (counted from its take, it knew no chunk time yet
        # and waited BATCH_CHUNK_SECONDS).
        for _ in range(2):
            assert not isinstance(claimer(False)[0], ChunkRequest)
        score_all(first)
        kinds, second = claim_until_chunk()
        assert batch_of(second) == reference["id"] and kinds[0] == "upload", kinds  # the uploads had their turn
    finally:
        feed.close()
        from store.finishing import release

        with session_scope() as session:
            held = list(session.scalars(text("SELECT id FROM jobs WHERE lease_owner = 'behind-upload-worker'")))
        release("behind-upload-worker", lake_settings, held, None)


def manifest_of(root: Path, name: str, batch_id: str) -> dict:
    return json.loads((root / f"out-{name}" / batch_id / "_manifest.json").read_text())


def test_a_cancelled_batch_settles_at_once_though_workers_hold_its_chunks(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    created = submit(client, key, root, "cancelled", pair_table(8, 10))  # 4 chunks
    # A worker that dies holding a chunk, and one that stops holding another (claimed by hand, as their readers
    # would have).
    dead = lake.claim_chunk("dead-worker", lake_settings)
    stopping = lake.claim_chunk("stopping-worker", lake_settings)
    assert dead and stopping
    cancelled = client.post(f"/batches/{created['id']}/cancel", headers=auth(key)).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert cancelled["chunks"] == {"total": 4, "total_final": True, "done": 0, "in_flight": 0, "failed": 0,
                                   "cancelled": 4}
    manifest = manifest_of(root, "cancelled", created["id"])
    assert manifest["status"] == "cancelled" and len(manifest["cancelled_chunks"]) == 4
    # The stopping worker's hand-back and the dead worker's late commit find their leases gone; a worker still
    # running learns it at its next lease extension.
    lake.release_chunk("stopping-worker", lake_settings, stopping, None)
    assert not lake.commit_chunk("dead-worker", dead, 20, 0, 20)
    assert lake.extend_leases("stopping-worker", lake_settings, {stopping.key: None}) == {stopping.key}
    with session_scope() as session:
        assert {c.status for c in session.scalars(select(Chunk).where(Chunk.batch_id == created["id"]))} == \
            {"cancelled"}
    assert feed_module.sweep(lake_settings) is not None
    assert client.get(f"/batches/{created['id']}", headers=auth(key)).json()["status"] == "cancelled"


def test_progress_moves_within_a_chunk_with_an_eta(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    created = submit(client, key, root, "progress", pair_table(4, 10))  # 2 chunks of 20 rows
    feed = ChunkFeed(get_scorer(), "progress-worker", lake_settings)
    try:
        requests = next_chunk(feed)
        assert len(requests) == 2  # two queries of 10 documents
        first, second = requests
        first.work.done(first.k, np.zeros((10, 3), np.float32))
        second.work.advance(second.k, 4)  # a pass scored 4 of the second request's 10 items

        def partway() -> dict | None:
            batch = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
            return batch if batch["rows"]["done"] == 14 else None

        batch = wait_for(partway, "the keeper to write the chunk's progress")
        assert batch["chunks"]["done"] == 0 and batch["chunks"]["in_flight"] >= 1
        assert batch["progress"]["items_done"] == 14
        assert batch["eta_seconds"] is not None and batch["eta_seconds"] >= 0
        score_all(requests)
        score_all(next_chunk(feed))
        done = wait_for(lambda: (b := client.get(f"/batches/{created['id']}", headers=auth(key)).json())["status"]
                        == "completed" and b, "the batch to complete")
        assert done["rows"] == {"done": 40, "failed": 0, "total": 40} and done["eta_seconds"] is None
    finally:
        feed.close()


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_cpu_worker_cuts_long_chunks_into_pieces(client, make_key, lake_settings, monkeypatch, kind) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    monkeypatch.setattr(lake_settings, "batch_chunk_rows_target", 60)
    monkeypatch.setattr(lake_settings, "batch_chunk_bytes", 6000)
    # This worker's measured pace: 1,000 tokens/s; a piece is BATCH_CHUNK_SECONDS of it.
    pace = Pace()
    pace.seconds_per_token = 1 / 1000
    monkeypatch.setitem(drain_module._PACES, get_scorer(), pace)
    monkeypatch.setattr(lake_settings, "batch_chunk_seconds", 0.1)  # 100 tokens: a couple of queries
    table = pair_table(12, 5)
    if kind == "parquet":
        created = submit(client, key, root, "cut", table)
        expected = table.column("pair_id").to_pylist()
    else:
        lines = [json.dumps({"custom_id": f"line-{i}", "query": f"question {i}, long enough to count?",
                             "items": ["first item", "second"], "label_token_ids": LABELS}) for i in range(60)]
        body = "".join(line + ("\n\n" if i % 7 == 3 else "\n") for i, line in enumerate(lines))  # blank lines too
        (root / "cut.jsonl").write_text(body)
        response = client.post("/batches", json={"input": "cut.jsonl", "output": "out-cut"}, headers=auth(key))
        assert response.status_code == 201, response.text
        created = response.json()
        expected = [f"line-{i}" for i in range(60)]
    planned = created["chunks"]["total"]
    try:
        deadline = time.monotonic() + 180
        while (batch := client.get(f"/batches/{created['id']}", headers=auth(key)).json())["status"] != "completed":
            assert time.monotonic() < deadline, batch
            drain_module.drain(get_scorer(), "cutting-worker", lake_settings)
    finally:
        feed_module.close_feeds()
    assert batch["chunks"]["total"] > planned  # cut into pieces
    assert batch["chunks"]["done"] == batch["chunks"]["total"] and batch["chunks"]["failed"] == 0
    column = "pair_id" if kind == "parquet" else "custom_id"
    rows = [json.loads(line) for line in client.get(f"/batches/{created['id']}/results",
                                                    headers=auth(key)).text.splitlines()]
    assert [r[column] for r in rows] == expected  # every row once, in the input's order
    assert all(r["scores"] is not None for r in rows)
    manifest = manifest_of(root, "cut", created["id"])
    ids = [v for entry in manifest["objects"] for v in pq.read_table(
        root / "out-cut" / created["id"] / entry["name"]).column(column).to_pylist()] \
        if kind == "parquet" else None
    assert ids is None or ids == expected
    assert manifest["rows"] == len(expected)
    with session_scope() as session:
        assert session.scalar(select(Batch.chunks_total).where(Batch.id == created["id"])) == batch["chunks"]["total"]
