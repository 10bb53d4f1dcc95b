"""Retention (store/retention.py) on PostgreSQL and SQLite: what expired is gone, what is live is untouched,
and the deletes go in bounded chunks, each its own transaction."""

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import sessionmaker

from api.auth import create_api_key
from migrations import upgrade
from store.location import Location
from store.models import Batch, Chunk, Job, JobResult, Pass, WebhookDelivery, utcnow
from store.retention import prune
from store.settings import get_settings

CHUNK = 3


@pytest.fixture(params=["postgresql", "sqlite"])
def sessions(request, database_factory, run_id: str, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'retention.db'}"
        upgrade(url)
        engine = create_engine(url)
        yield sessionmaker(engine, expire_on_commit=False)
        engine.dispose()
        return
    with database_factory(f"packscore_retention_{run_id}") as url:
        engine = create_engine(url)
        yield sessionmaker(engine, expire_on_commit=False)
        engine.dispose()


def job(key_id: str, status: str, finished_days_ago: float | None, batch_id: str | None = None) -> Job:
    now = utcnow()
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    return Job(api_key_id=key_id, status=status, model="tiny-random", request={}, request_hash="",
               items_total=1, items_done=1, prompt_tokens=1, batch_id=batch_id, finished_at=finished,
               created_at=now - timedelta(days=(finished_days_ago or 0) + 1))


def test_expired_rows_go_and_live_ones_stay(sessions) -> None:  # type: ignore[no-untyped-def]
    settings = get_settings().model_copy(update={"result_ttl_days": 30, "pass_history_days": 7,
                                                 "retention_chunk_rows": CHUNK})
    now = utcnow()
    with sessions.begin() as session:
        key, _ = create_api_key(session, "retention")
        expired = [job(key.id, status, 31) for status in ("succeeded", "failed", "cancelled") for _ in range(3)]
        live = [job(key.id, "succeeded", 29), job(key.id, "queued", None), job(key.id, "running", None),
                job(key.id, "failed", 1)]
        old_batch = Batch(api_key_id=key.id, status="completed", model="tiny-random", total=7,
                          finished_at=now - timedelta(days=40))
        running_batch = Batch(api_key_id=key.id, status="in_progress", model="tiny-random", total=2)
        # A reference batch: its chunk rows go in bounded pieces as its requests do, not all in one statement.
        old_reference = Batch(api_key_id=key.id, status="completed", model="tiny-random", total=0,
                              finished_at=now - timedelta(days=40))
        session.add_all([old_batch, running_batch, old_reference])
        session.flush()
        session.add_all([Chunk(batch_id=b.id, index=i, input=Location("file", "/in/p.csv"), part=-1, start=i,
                               stop=i + 1, status="succeeded", attempts=1, rows_done=1, rows_failed=0, items_done=1)
                         for b, n in ((old_reference, 7), (running_batch, 2)) for i in range(n)])
        expired += [job(key.id, "succeeded", 40, old_batch.id) for _ in range(7)]
        # A running batch's requests finished long ago are kept with their batch.
        live += [job(key.id, "succeeded", 40, running_batch.id), job(key.id, "queued", None, running_batch.id)]
        session.add_all(expired + live)
        session.flush()
        for j in expired + live:
            if j.status == "succeeded":
                session.add(JobResult(job_id=j.id, n_labels=1, logprobs=np.zeros(1, np.float32).tobytes()))
            session.add(WebhookDelivery(api_key_id=key.id, job_id=j.id, url="http://x", payload="{}",
                                        status="delivered"))
        session.add(WebhookDelivery(api_key_id=key.id, batch_id=old_batch.id, url="http://x", payload="{}"))
        session.add_all([Pass(worker="w", n_jobs=1, n_items=1, tokens=1, padded_tokens=1, seconds=0.1,
                              created_at=now - timedelta(days=days)) for days in (8, 8, 8, 8, 6)])
        expired_ids, live_ids = {j.id for j in expired}, {j.id for j in live}

    pruned = prune(sessions, settings)

    with sessions() as session:
        left = set(session.scalars(select(Job.id)))
        assert left & expired_ids == set()
        assert live_ids <= left
        assert set(session.scalars(select(JobResult.job_id))) <= live_ids
        assert set(session.scalars(select(WebhookDelivery.job_id))) == live_ids  # the batch's delivery went too
        assert set(session.scalars(select(Batch.id))) == {running_batch.id}
        assert set(session.scalars(select(Chunk.batch_id))) == {running_batch.id}
        assert session.scalar(select(func.count()).select_from(Pass)) == 1
    assert pruned.rows["jobs"] == len(expired_ids) and pruned.rows["passes"] == 4
    assert pruned.rows["chunks"] == 7 and pruned.rows["batches"] == 2
    # Bounded chunks: no transaction deleted more than CHUNK rows (9 + 7 jobs, 7 chunk rows, 4 passes, 2 batches).
    assert pruned.transactions >= 3 + 3 + 3 + 2 + 2
    assert prune(sessions, settings).rows == {}  # nothing left to do


def test_a_chunk_in_progress_does_not_hold_up_claims(sessions, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """While one retention chunk holds its rows (deleted, not yet committed), a worker claims queued jobs: at
    once on PostgreSQL (other rows, no lock in common); on SQLite, one writer at a time, as soon as that one
    chunk commits, not after the whole prune."""
    import contextlib
    import threading
    import time

    from sqlalchemy import event

    from store import claims
    from store.priorities import PRIORITY_BATCH

    settings = get_settings().model_copy(update={"result_ttl_days": 30, "retention_chunk_rows": CHUNK})
    with sessions.begin() as session:
        key, _ = create_api_key(session, "retention-claims")
        session.add_all([job(key.id, "succeeded", 31) for _ in range(3 * CHUNK)])
        queued = [Job(api_key_id=key.id, status="queued", model="tiny-random", request={}, request_hash="",
                      items_total=1, prompt_tokens=1, priority=10) for _ in range(2)]
        session.add_all(queued)
    queued_ids = {j.id for j in queued}

    @contextlib.contextmanager
    def claim_scope():  # type: ignore[no-untyped-def]
        with sessions.begin() as session:
            yield session

    monkeypatch.setattr(claims, "session_scope", claim_scope)
    chunk_holds, chunk_may_commit = threading.Event(), threading.Event()
    pruning = sessionmaker(sessions.kw["bind"], expire_on_commit=False)

    @event.listens_for(pruning, "before_commit")
    def hold_first_chunk(session) -> None:  # type: ignore[no-untyped-def]
        if not chunk_holds.is_set():
            chunk_holds.set()
            chunk_may_commit.wait(30)

    pruner = threading.Thread(target=prune, args=(pruning, settings))
    pruner.start()
    assert chunk_holds.wait(30)
    claimed: list[Job] = []
    claimer = threading.Thread(
        target=lambda: claimed.extend(claims.claim_interactive("worker-x", settings, PRIORITY_BATCH)))
    start = time.monotonic()
    claimer.start()
    sqlite = sessions.kw["bind"].dialect.name == "sqlite"
    claimer.join(timeout=1.0 if sqlite else 10)
    if sqlite:
        assert claimer.is_alive()  # waits for the one writer...
        chunk_may_commit.set()
        claimer.join(timeout=10)
    took = time.monotonic() - start
    chunk_may_commit.set()
    pruner.join(timeout=30)
    assert not claimer.is_alive() and {j.id for j in claimed} == queued_ids
    if not sqlite:
        assert took < 2, f"a claim waited {took:.1f} s on a retention chunk"
    with sessions() as session:  # and the prune went on to delete every expired job
        assert session.scalar(select(func.count()).select_from(Job).where(Job.status == "succeeded")) == 0
