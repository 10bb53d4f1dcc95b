"""A user's third hour with reference batches, in-process on PostgreSQL: a cancel settles within seconds while a
chunk is in flight (the worker drops it; nothing of it is committed), the same request after a cancel resumes
from the committed chunks (the output as one uninterrupted run's), and a dry run plans without creating."""

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from packscore.backfill import run_reference_backfill
from packscore.client import Client
from store.db import session_scope
from store.models import Batch, Chunk
from tests.test_lake_turns import auth, lake_settings, pair_table, submit, wait_for  # noqa: F401  (a fixture)
from worker import drain as drain_module
from worker import lake as feed_module
from worker.scorer import get_scorer

# A cancel reaches `cancelled` within this; the chunk in flight would take far longer (CHUNK_PASSES passes of
# PASS_SECONDS at least).
CANCEL_BOUND_SECONDS = 10.0
PASS_SECONDS = 0.5
CHUNK_PASSES = 60


class SlowPasses:
    """Each pass takes at least `seconds` more (0: as it is); `launches`: when passes were launched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        self.seconds, self.launches = seconds, []
        scorer = get_scorer()
        original = scorer.launch

        def launch(*args):  # type: ignore[no-untyped-def]
            self.launches.append(time.monotonic())
            time.sleep(self.seconds)
            return original(*args)

        monkeypatch.setattr(scorer, "launch", launch)


def draining(owner: str, settings) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=drain_module.drain, args=(get_scorer(), owner, settings), daemon=True)
    thread.start()
    return thread


def test_a_cancel_settles_within_seconds_and_commits_nothing_of_the_chunk_in_flight(  # type: ignore[no-untyped-def]
        client, make_key, lake_settings, monkeypatch) -> None:
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    monkeypatch.setattr(lake_settings, "batch_chunk_rows_target", 2000)
    monkeypatch.setattr(lake_settings, "batch_round_tokens", 64)  # about one query (10 documents) a pass
    monkeypatch.setattr(feed_module, "chunk_piece_tokens", lambda *args: None)  # the chunk runs whole
    launches = SlowPasses(monkeypatch, PASS_SECONDS).launches
    created = submit(client, key, root, "long", pair_table(CHUNK_PASSES * 2, 10))
    assert created["chunks"]["total"] == 1
    worker = draining("cancel-worker", lake_settings)
    try:
        wait_for(lambda: len(launches) >= 2, "the chunk to be scored")
        asked = time.monotonic()
        answer = client.post(f"/batches/{created['id']}/cancel", headers=auth(key))
        assert answer.status_code in (200, 202), answer.text
        wait_for(lambda: client.get(f"/batches/{created['id']}", headers=auth(key)).json()["status"] == "cancelled",
                 "the batch to be cancelled", CANCEL_BOUND_SECONDS)
        settled = time.monotonic() - asked
        # The worker drops the chunk at its next lease extension: its pass loop ends (nothing else to do) long
        # before the chunk's passes would have.
        worker.join(CANCEL_BOUND_SECONDS)
        assert not worker.is_alive(), "the worker is still scoring the cancelled chunk"
        after = [t for t in launches if t > asked]
        assert len(after) < CHUNK_PASSES / 4, f"{len(after)} passes after the cancel"
    finally:
        worker.join(120)
        feed_module.close_feeds()
    print(f"\ncancelled {settled:.2f} s after the cancel, {len(after)} passes after it, of {CHUNK_PASSES}+")
    batch = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    assert batch["chunks"]["cancelled"] == 1 and batch["chunks"]["in_flight"] == 0 and batch["rows"]["done"] == 0
    folder = root / "out-long" / created["id"]
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["status"] == "cancelled" and manifest["objects"] == [] and len(manifest["cancelled_chunks"]) == 1
    assert not list(folder.glob("part-*")) and not (folder / "_SUCCESS").exists()


def test_a_cancel_that_meets_a_settle_leaves_the_batch_cancelled(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    """A worker's settle (after its chunk) reads the batch; a cancel commits before it reads the chunks: the batch
    is cancelled, its manifest says so, and no `_SUCCESS` marks its partial output as whole."""
    from sqlalchemy import event

    from store.db import get_engine
    from store.lake.chunks import settle

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    created = submit(client, key, root, "met", pair_table(4, 10))  # 2 chunks, queued
    settling, read, proceed = None, threading.Event(), threading.Event()

    def pause_after_reading_the_batch(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if threading.current_thread() is settling and "FROM batches" in statement and not read.is_set():
            read.set()
            proceed.wait(10)  # until the cancel has committed (or, where the settle holds it back, a while)

    engine = get_engine()
    event.listen(engine, "after_cursor_execute", pause_after_reading_the_batch)
    try:
        settling = threading.Thread(target=settle, args=(created["id"],), daemon=True)
        settling.start()
        assert read.wait(10)
        answer = client.post(f"/batches/{created['id']}/cancel", headers=auth(key))
        proceed.set()
        settling.join(30)
    finally:
        event.remove(engine, "after_cursor_execute", pause_after_reading_the_batch)
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
    after = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    assert after["status"] == "cancelled" and after["chunks"]["cancelled"] == 2, after
    folder = root / "out-met" / created["id"]
    assert json.loads((folder / "_manifest.json").read_text())["status"] == "cancelled"
    assert not (folder / "_SUCCESS").exists()


def test_a_batch_whose_chunks_have_all_run_is_completing_not_cancelled(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    created = submit(client, key, root, "ran-all", pair_table(4, 10))
    with session_scope() as session:  # as a worker leaves them: every chunk ended (here, its input unreadable)
        session.execute(Chunk.__table__.update().where(Chunk.batch_id == created["id"]).values(
            status="failed", error_code="input_unavailable", error_message="gone"))
    answer = client.post(f"/batches/{created['id']}/cancel", headers=auth(key))
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "batch_finished", answer.text
    assert "has run every chunk" in answer.json()["error"]["message"]
    after = client.get(f"/batches/{created['id']}", headers=auth(key)).json()
    assert after["status"] == "completed" and after["chunks"]["cancelled"] == 0, after


def ids_and_scores(folder: Path) -> tuple[list, np.ndarray]:
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["status"] == "completed" and (folder / "_SUCCESS").exists()
    table = pa.concat_tables([pq.read_table(folder / entry["name"]) for entry in manifest["objects"]])
    return table.column("pair_id").to_pylist(), np.array(table.column("scores").to_pylist())


def test_the_same_request_after_a_cancel_resumes_from_the_committed_chunks(  # type: ignore[no-untyped-def]
        client, make_key, lake_settings, monkeypatch) -> None:
    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    table = pair_table(20, 10)  # 10 chunks of 20 rows
    body = {"input": "p.parquet", "output": "out-p", "columns": {"query": "q", "item": "doc", "ids": ["pair_id"]},
            "label_token_ids": [5, 17, 300]}
    created = submit(client, key, root, "p", table)
    assert created["chunks"]["total"] == 10
    slow = SlowPasses(monkeypatch, 0.3)
    worker = draining("resume-worker", lake_settings)
    try:
        wait_for(lambda: client.get(f"/batches/{created['id']}", headers=auth(key)).json()["chunks"]["done"] >= 2,
                 "two chunks committed")
        cancelled = client.post(f"/batches/{created['id']}/cancel", headers=auth(key)).json()
        worker.join(60)
    finally:
        feed_module.close_feeds()
    assert cancelled["status"] == "cancelled", cancelled
    kept = cancelled["rows"]["done"]
    assert 0 < kept < len(table), cancelled
    assert cancelled["progress"] == {"items_done": kept, "items_total": len(table)}  # not a finished bar
    earlier = json.loads((root / "out-p" / created["id"] / "_manifest.json").read_text())["objects"]
    stamps = {e["name"]: (root / "out-p" / created["id"] / e["name"]).stat().st_mtime_ns for e in earlier}
    slow.seconds = 0

    # The dry run says what the same request does with the cancelled batch, creating nothing.
    plan = client.post("/batches/plan", json=body, headers=auth(key)).json()
    assert plan["earlier"] == {"id": created["id"], "status": "cancelled", "then": "resume", "rows_committed": kept}

    resumed = client.post("/batches", json={**body, "input": f"{root}/p.parquet"}, headers=auth(key))
    assert resumed.status_code == 201, resumed.text
    resumed = resumed.json()
    assert resumed["resumed_from"] == created["id"] and resumed["id"] != created["id"]
    assert resumed["rows"]["done"] == kept and resumed["chunks"]["done"] == len(earlier)
    cli = Client("http://testserver", key, max_retries=0)
    cli._http.close()
    cli._http = client
    monkeypatch.setitem(client.headers, "Authorization", f"Bearer {key}")
    worker = draining("resume-worker-2", lake_settings)
    try:
        said = io.StringIO()
        done = run_reference_backfill(cli, str(root / "p.parquet"), str(root / "out-p"), poll=0.05,
                                      columns=body["columns"], label_token_ids=body["label_token_ids"], stderr=said)
    finally:
        worker.join(60)
        feed_module.close_feeds()
    assert done["id"] == resumed["id"] and done["status"] == "completed", said.getvalue()
    assert f"resuming cancelled batch {created['id']}: its {kept} rows committed are kept" in said.getvalue()
    folder = root / "out-p" / created["id"]  # the resumed batch writes into the folder it took over
    assert done["output"].rstrip("/").endswith(f"out-p/{created['id']}")
    ids, scores = ids_and_scores(folder)
    assert ids == table.column("pair_id").to_pylist()  # every row once, in the input's order
    # The rows committed before were not scored again: the same objects, untouched.
    assert {name: (folder / name).stat().st_mtime_ns for name in stamps} == stamps
    with session_scope() as session:
        copied = session.scalar(select(func.count()).select_from(Chunk).where(
            Chunk.batch_id == resumed["id"], Chunk.output.in_(list(stamps))))
    assert copied == len(stamps)
    # The same as one uninterrupted run.
    whole = submit(client, key, root, "whole", table)
    worker = draining("resume-worker-3", lake_settings)
    wait_for(lambda: client.get(f"/batches/{whole['id']}", headers=auth(key)).json()["status"] == "completed",
             "the uninterrupted run", 120)
    worker.join(60)
    feed_module.close_feeds()
    whole_ids, whole_scores = ids_and_scores(root / "out-whole" / whole["id"])
    assert whole_ids == ids and np.allclose(whole_scores, scores, atol=1e-5)
    # Afresh: after a cancel, `overwrite` (the CLI's --overwrite) starts from row 0 in a folder of its own.
    whole_body = {**body, "input": "whole.parquet", "output": "out-whole"}
    again = client.post("/batches", json=whole_body, headers=auth(key)).json()
    assert again["id"] == whole["id"]  # completed: reported, not run again
    redo = client.post("/batches", json={**whole_body, "overwrite": True}, headers=auth(key))
    assert redo.status_code == 201 and redo.json()["rows"]["done"] == 0 and redo.json()["resumed_from"] is None
    client.post(f"/batches/{redo.json()['id']}/cancel", headers=auth(key))
    fresh = client.post("/batches", json={**whole_body, "overwrite": True}, headers=auth(key)).json()
    assert fresh["resumed_from"] is None and fresh["output"].rstrip("/").endswith(fresh["id"])
    assert fresh["rows"]["done"] == 0
    client.post(f"/batches/{fresh['id']}/cancel", headers=auth(key))


def test_a_dry_run_plans_and_estimates_without_creating_a_batch(client, make_key, lake_settings) -> None:  # type: ignore[no-untyped-def]
    from packscore.backfill import describe_plan

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(6, 10), root / "plan.parquet")
    body = {"input": "plan.parquet", "output": "out-plan", "columns": {"query": "q", "item": "doc",
                                                                       "ids": ["pair_id"]},
            "label_token_ids": [5, 17, 300]}
    with session_scope() as session:
        before = session.scalar(select(func.count()).select_from(Batch))
    with session_scope() as session:  # no rate measured yet: no committed chunk of the model lately
        session.execute(Chunk.__table__.update().where(Chunk.status == "succeeded").values(status="cancelled"))
    answer = client.post("/batches/plan", json=body, headers=auth(key))
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    assert (plan["rows"], plan["chunks"], plan["objects"], plan["columns"]) == (60, 3, 1, ["q", "doc", "pair_id"])
    assert plan["output"].endswith("/out-plan") and plan["earlier"] is None
    assert plan["rate"]["measured"] is False and plan["estimate_seconds"] is None and plan["rate"]["docs"]
    text = describe_plan(plan)
    assert "plan: 60 rows in 3 chunks from 1 object," in text and "columns read: q, doc, pair_id" in text
    assert "no rate measured" in text and "estimate from docs" in text, text
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Batch)) == before  # nothing created
    # A refusal is the one POST /batches gives.
    missing = client.post("/batches/plan", json={**body, "input": "nothing.parquet"}, headers=auth(key))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "input_not_found"
    # Once a batch ran, the estimate is at the rate measured.
    created = submit(client, key, root, "ran", pair_table(6, 10))
    worker = draining("plan-worker", lake_settings)
    wait_for(lambda: client.get(f"/batches/{created['id']}", headers=auth(key)).json()["status"] == "completed",
             "the batch to run", 120)
    worker.join(60)
    feed_module.close_feeds()
    plan = client.post("/batches/plan", json=body, headers=auth(key)).json()
    rate = plan["rate"]
    assert rate["measured"] and rate["rows_per_second"] > 0, rate
    assert plan["estimate_seconds"] == pytest.approx(60 / rate["rows_per_second"], abs=0.06)  # to 0.1 s
    text = describe_plan(plan)
    assert "time: about" in text and "(measured: 60 rows in the 3 chunks" in text, text


def test_backfill_dry_run_posts_the_plan_and_prints_it(monkeypatch, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from packscore import cli
    from tests.test_third_hour import _mock_client

    plan = {"model": "m", "input": ["s3://b/pairs/p.parquet"], "objects": 1, "columns": ["q", "doc"],
            "rows": 50_000, "bytes": None, "chunks": 10, "output": "s3://b/out",
            "earlier": {"id": "batch_1", "status": "cancelled", "then": "resume", "rows_committed": 20_000},
            "rate": {"rows_per_second": 100.0, "bytes_per_second": None, "measured": True, "basis": "1000 rows in "
                     "the 2 chunks of m committed last, 10.0 s of running", "docs": []}, "estimate_seconds": 300.0}
    sent = _mock_client(monkeypatch, lambda request: httpx.Response(200, json=plan))
    parser = cli.build_parser()
    args = parser.parse_args(["backfill", "s3://b/pairs/", "--out", "s3://b/out/", "--query-column", "q",
                              "--item-column", "doc", "--labels", "9805,787", "--dry-run"])
    args.func(args)
    assert [(r.method, r.url.path) for r in sent] == [("POST", "/batches/plan")]  # nothing created, nothing followed
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "plan: 50,000 rows in 10 chunks from 1 object, model m", "columns read: q, doc",
        "output: s3://b/out (the batch's objects under s3://b/out/BATCH_ID/)",
        "earlier batch batch_1 (cancelled) holds this output: the same command resumes it: its 20,000 rows committed "
        "are kept (--overwrite: from row 0)",
        "time: about 5 min at 100.0 rows/s (measured: 1000 rows in the 2 chunks of m committed last, 10.0 s of "
        "running)"], out
    (tmp_path / "r.jsonl").write_text('{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}\n')
    args = parser.parse_args(["backfill", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--dry-run"])
    with pytest.raises(cli.CommandError, match="--dry-run plans data the service reads"):
        args.func(args)
