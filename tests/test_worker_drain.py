"""The drain loop in-process on PostgreSQL: coalescing, results, progress, cancel at a pass boundary,
lease loss (exactly one result write) and the sweeper."""

import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import func, select, update

from core import TokenizedRequest

from store import claims, finishing, job_writer, sweeper
from store.db import session_factory, session_scope
from store.models import Job, JobPart, JobResult, Pass, WebhookDelivery, utcnow
from store.priorities import PRIORITY_BATCH
from store.settings import get_settings
from tests import claiming
from tests.load_runner import SCORE_RTOL
from worker import drain as drain_module
from worker import jobs as jobs_module
from worker.policy import policy_for
from worker.scorer import get_scorer


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submit(client, key: str, body: dict) -> str:  # type: ignore[no-untyped-def]
    response = client.post("/jobs", json=body, headers=auth(key))
    assert response.status_code == 202, response.text
    return response.json()["id"]


def job_row(job_id: str) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def count(model) -> int:  # type: ignore[no-untyped-def]
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(model))


def many_items(n: int) -> dict:
    return {"query": "Which of these answers is right?", "items": [f"answer number {i}" for i in range(n)],
            "label_token_ids": [5, 17, 300], "return_logprobs": True}


def test_jobs_coalesce_into_few_passes(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    bodies = [{"query": f"question {i}?", "items": [f"item {j}" for j in range(i % 4)] + ["yes"],
               "label_token_ids": [1, 2, 3], "apply_softmax": bool(i % 2)} for i in range(20)]
    ids = [submit(client, key, body) for body in bodies]
    assert drain_module.drain(get_scorer(), "worker-a", get_settings()) == 20
    passes = count(Pass)
    assert 1 <= passes < 20
    scorer = get_scorer()
    for job_id, body in zip(ids, bodies):
        job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
        assert job["status"] == "succeeded"
        assert job["progress"] == {"items_done": len(body["items"]), "items_total": len(body["items"])}
        expected = scorer.score(body["query"], body["items"], body["label_token_ids"], body["apply_softmax"])
        np.testing.assert_allclose(job["scores"], expected, rtol=SCORE_RTOL, atol=0)
    with session_scope() as session:
        assert session.scalar(select(func.sum(Pass.n_items))) == sum(len(b["items"]) for b in bodies)


def test_progress_is_written_per_pass(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = many_items(300)
    job_id = submit(client, key, body)
    scorer = get_scorer()
    original = finishing.write_boundaries
    seen: list[int] = []

    def spying(session, boundaries):  # type: ignore[no-untyped-def]
        closed = original(session, boundaries)
        for _ in boundaries:  # boundaries queued together are written together
            seen.append(session.scalar(select(Job.items_done).where(Job.id == job_id)))  # as this write left it
        return closed

    monkeypatch.setattr(finishing, "write_boundaries", spying)
    drain_module.drain(scorer, "worker-a", get_settings())
    assert len(seen) > 2, "the job should take several passes (PASS_TOKENS is small in tests)"
    assert seen[0] < 300 and seen == sorted(seen) and seen[-1] == 300
    job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "succeeded"
    monkeypatch.undo()
    expected = scorer.logprobs(body["query"], body["items"], body["label_token_ids"])
    np.testing.assert_allclose(job["logprobs"], expected, atol=1e-4)


def test_cancel_at_pass_boundary(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, {**many_items(300), "webhook_url": "http://127.0.0.1:9/hook"})
    jobs = claiming.claim_jobs("worker-a", get_settings())
    client.post(f"/jobs/{job_id}/cancel", headers=auth(key))
    # The boundary writes run beside the pass loop, which launches pass n+1 before it collects pass n. How many
    # passes a slow writer lets it launch before the cancel reaches it is timing (a loaded CI machine saw one
    # more): the third launch waits here until the writer has handed the first boundary's findings to the loop.
    first_writes: list[set[str]] = []
    told = threading.Event()
    original_write, original_close = finishing.write_boundaries, job_writer.JobWriter._close

    def writing(session, boundaries):  # type: ignore[no-untyped-def]
        closed = original_write(session, boundaries)
        first_writes.append(closed)
        return closed

    def closing(self, ids):  # type: ignore[no-untyped-def]
        original_close(self, ids)
        if job_id in ids:
            told.set()

    scorer = get_scorer()
    launches: list[int] = []
    original_launch = scorer.launch

    def launching(*args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(len(launches))
        if len(launches) == 3:
            assert told.wait(30), "the first boundary was never written"
        return original_launch(*args, **kwargs)

    monkeypatch.setattr(finishing, "write_boundaries", writing)
    monkeypatch.setattr(job_writer.JobWriter, "_close", closing)
    monkeypatch.setattr(scorer, "launch", launching)
    claiming.run_jobs(scorer, "worker-a", jobs)
    monkeypatch.undo()
    job = job_row(job_id)
    assert job.status == "cancelled" and job.lease_owner is None
    assert first_writes[0] == {job_id}, "the cancel is seen at the first boundary"
    # Once the loop knows, it launches nothing more (the whole job takes four passes); the passes launched
    # before are discarded.
    assert len(launches) <= 3 and count(Pass) == len(launches)
    with session_scope() as session:
        assert session.scalar(select(func.sum(Pass.n_items))) < 300, "the whole job ran"
    assert count(JobResult) == 0
    with session_scope() as session:
        delivery = session.scalars(select(WebhookDelivery)).one()
        assert '"job.cancelled"' in delivery.payload


def test_a_cancel_is_kept_when_the_worker_hands_the_job_back_during_it(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    """The cancel's two statements (a queued job cancelled, a running one flagged) matched nothing where the
    job went from running back to queued between them (its worker stopping): the API said queued, and the job
    ran to the end. Now the first statement locks the row, and the hand-back after it reads the flag."""
    from store import jobs as job_store

    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    assert [job.id for job in claiming.claim_jobs("worker-a", settings)] == [job_id]
    handing_back = threading.Thread(target=finishing.release, args=("worker-a", settings, [job_id], None))
    with session_factory()() as session:  # as the API's (the cancel commits it)
        job = session.get(Job, job_id)
        statements = 0
        execute = session.execute

        def between_the_statements(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal statements
            result = execute(*args, **kwargs)
            statements += 1
            if statements == 1:
                handing_back.start()
                handing_back.join(1.0)  # it waits for the cancel's lock (before, it committed here)
            return result

        session.execute = between_the_statements  # type: ignore[method-assign]
        commit = session.commit

        def commit_then_let_the_hand_back_end() -> None:  # type: ignore[no-untyped-def]
            commit()
            handing_back.join(30)  # it cancels the job (its flag read) before the cancel reads the job again

        session.commit = commit_then_let_the_hand_back_end  # type: ignore[method-assign]
        # This cancel's doing, not an earlier one's: not a 409 "already cancelled".
        assert job_store.cancel_job(session, job).status == "cancelled"
    handing_back.join(30)
    assert job_row(job_id).status == "cancelled"


def test_a_wake_up_as_the_loop_hands_back_claims_nothing(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A kick's thread that read the loop's listener just before the loop cleared it claimed for a loop that
    was handing back: its jobs were leased, never run nor heartbeated, until their leases ran out."""
    key, _ = make_key()
    settings = get_settings()
    submitted: list[str] = []

    class Listened(drain_module.WakeUp):
        listened: list = []

        def __setattr__(self, name, value) -> None:  # type: ignore[no-untyped-def]
            if name == "listener" and value is not None:
                self.listened.append(value)
            super().__setattr__(name, value)

    wake = Listened()
    write = jobs_module.JobBook.write

    def kicked_as_it_hands_back(book) -> None:  # type: ignore[no-untyped-def]
        # As the loop hands back, a job comes, and its kick calls the listener the racing thread had read.
        if not submitted and sys._getframe(1).f_code.co_name == "_abandon_held":
            submitted.append(submit(client, key, many_items(2)))
            wake.listened[-1]()
        write(book)

    monkeypatch.setattr(jobs_module.JobBook, "write", kicked_as_it_hands_back)
    claiming.run_claims(get_scorer(), "worker-a", settings, lambda _: claiming.claim_jobs("worker-a", settings), wake)
    job = job_row(submitted[0])
    assert (job.status, job.lease_owner) == ("queued", None)


def test_a_hand_back_does_not_undo_a_lease_taken_over_meanwhile(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    """A stopping worker hands back the jobs still leased to it. It read them unlocked, then wrote by id: had
    the sweeper ended the expired lease and another worker claimed the job between the read and the write, the
    hand-back put that worker's job back in the queue under it (to be run twice). Now the read locks the rows
    and waits, and then finds the job no longer its own."""
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    assert [job.id for job in claiming.claim_jobs("worker-a", settings)] == [job_id]
    with session_scope() as session:  # the sweeper and worker-b, in one transaction held open
        session.execute(select(Job).where(Job.id == job_id).with_for_update())
        session.execute(update(Job).where(Job.id == job_id).values(lease_owner="worker-b",
                                                                   attempts=Job.attempts + 1))
        handing_back = threading.Thread(target=finishing.release, args=("worker-a", settings, [job_id], None))
        handing_back.start()
        handing_back.join(1.0)  # it waits for the lock (before, it read the row as worker-a's and wrote after)
    handing_back.join(30)
    assert not handing_back.is_alive()
    job = job_row(job_id)
    assert (job.status, job.lease_owner, job.attempts) == ("running", "worker-b", 2)


def test_lost_lease_writes_result_once(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = many_items(40)
    job_id = submit(client, key, body)
    settings = get_settings()
    stale = claiming.claim_jobs("worker-dead", settings)  # claimed, then "killed" before finishing
    with session_scope() as session:
        session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    assert sweeper.sweep(settings) is True
    assert job_row(job_id).status == "queued"
    assert drain_module.drain(get_scorer(), "worker-b", settings) == 1
    first = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert first["status"] == "succeeded" and first["attempts"] == 2
    # The first worker wakes up and finishes its copy: every write is refused.
    claiming.run_jobs(get_scorer(), "worker-dead", stale)
    assert count(JobResult) == 1
    assert client.get(f"/jobs/{job_id}", headers=auth(key)).json() == first


def test_heartbeat_extends_leases(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    claiming.claim_jobs("worker-a", settings)
    with session_scope() as session:
        session.execute(update(Job).values(lease_expires_at=utcnow() + timedelta(seconds=0.5)))
    # Not being scored by this process (e.g. left over by a failed drain): the heartbeat lets the lease lapse.
    drain_module.heartbeat("worker-a", "tiny-random", settings)
    assert job_row(job_id).lease_expires_at < utcnow() + timedelta(seconds=1)
    held = jobs_module.ActiveJobs()
    held.add([job_id])
    monkeypatch.setattr(drain_module, "active_jobs", held)
    drain_module.heartbeat("worker-a", "tiny-random", settings)
    assert job_row(job_id).lease_expires_at > utcnow() + timedelta(seconds=settings.lease_seconds - 1)
    assert sweeper.sweep(settings) is False
    assert job_row(job_id).status == "running"


def test_a_claim_not_yet_admitted_keeps_its_lease(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A claim made ahead waits for the loop to admit it (behind the passes the loop holds). Its jobs were
    heartbeated only from their admission: a claim held longer than the lease expired, and another worker
    claimed its jobs too."""
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    claimed, admit = threading.Event(), threading.Event()
    admit_now = drain_module.PassLoop._admit

    def admitted_late(loop, requests) -> None:  # type: ignore[no-untyped-def]
        if requests:
            claimed.set()
            admit.wait(60)
        admit_now(loop, requests)

    monkeypatch.setattr(drain_module.PassLoop, "_admit", admitted_late)
    running = threading.Thread(target=claiming.run_claims, args=(
        get_scorer(), "worker-a", settings, lambda _: claiming.claim_jobs("worker-a", settings)))
    running.start()
    try:
        assert claimed.wait(60)
        with session_scope() as session:  # its lease nearly over, the job not yet admitted
            session.execute(update(Job).values(lease_expires_at=utcnow() + timedelta(seconds=0.5)))
        drain_module.heartbeat("worker-a", "tiny-random", settings)
        assert job_row(job_id).lease_expires_at > utcnow() + timedelta(seconds=settings.lease_seconds - 1)
        time.sleep(0.6)  # past the lease it had
        assert sweeper.sweep(settings) is False
        assert claiming.claim_jobs("worker-b", settings) == []
    finally:
        admit.set()
        running.join(60)
    job = job_row(job_id)
    assert (job.status, job.attempts) == ("succeeded", 1)
    assert job_id not in jobs_module.active_jobs.snapshot()


def test_a_claim_that_fails_halfway_through_admission_goes_back(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Jobs are heartbeated from their claim: a request the loop fails to admit, and those after it, go back to
    the queue (the attempt counts) instead of being kept leased with nothing to run them."""
    from worker.scheduler import Scheduler
    key, _ = make_key()
    job_ids = [submit(client, key, many_items(3)) for _ in range(3)]
    add_now, added = Scheduler.add_request, []

    def add_then_break(scheduler, sink, request, kept=None):  # type: ignore[no-untyped-def]
        added.append(sink)
        if len(added) == 2:
            raise RuntimeError("admission broke")
        return add_now(scheduler, sink, request, kept)

    monkeypatch.setattr(Scheduler, "add_request", add_then_break)
    given = [claiming.claim_jobs("worker-a", get_settings())]
    assert len(given[0]) == 3
    claiming.run_claims(get_scorer(), "worker-a", get_settings(), lambda _: given.pop() if given else [])
    assert [sink.job.id for sink in added] == job_ids[:2]  # admitted once, up to the failure
    for job_id in job_ids:
        job = job_row(job_id)
        assert (job.status, job.lease_owner, job.attempts) == ("queued", None, 1), job_id
        assert job_id not in jobs_module.active_jobs.snapshot()


def test_sweeper_fails_after_max_attempts(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    claiming.claim_jobs("worker-a", settings)
    with session_scope() as session:
        session.execute(update(Job).values(attempts=settings.max_attempts,
                                           lease_expires_at=utcnow() - timedelta(seconds=1)))
    sweeper.sweep(settings)
    job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost"


def test_request_invalid_at_the_worker_fails(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    with session_scope() as session:  # e.g. limits were lowered between submission and run
        job = session.get(Job, job_id)
        job.request = {**job.request, "label_token_ids": [10**9]}
        stored = TokenizedRequest.from_bytes(job.tokens)  # and as the API stored it, in token space
        job.tokens = TokenizedRequest(stored.query, stored.items, (10**9,), stored.item_first).to_bytes()
    drain_module.drain(get_scorer(), "worker-a", get_settings())
    job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "failed" and job["error"]["code"] == "label_token_id_out_of_range"


def test_empty_items_succeed_without_a_pass(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, {"query": "q", "items": [], "label_token_ids": [1]})
    drain_module.drain(get_scorer(), "worker-a", get_settings())
    job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "succeeded" and job["scores"] == []
    assert count(Pass) == 0


def test_engine_crash_requeues(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    scorer = get_scorer()

    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    settings = get_settings()
    monkeypatch.setattr(settings, "max_attempts", 2)
    monkeypatch.setattr(scorer, "launch", broken)
    drain_module.drain(scorer, "worker-a", settings)
    job = job_row(job_id)
    assert job.status == "failed" and job.error_code == "internal_error" and job.attempts == 2


def test_a_job_taken_back_after_an_engine_fault_runs_to_its_end(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                 monkeypatch) -> None:
    """After an engine fault the loop hands its jobs back and runs again, and its next claim takes the same job
    again. The hand-back had also told the loop the job was no longer its own, which the loop read after taking
    it back: it dropped the job, whose items were never launched, and kept extending its lease: `running`
    until the worker restarted. Only a job of several passes: one of a single pass ended before the drop."""
    key, _ = make_key()
    job_id = submit(client, key, many_items(300))
    scorer = get_scorer()
    original, faults = scorer.launch, [RuntimeError("a transient device fault")]

    def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
        if faults:
            raise faults.pop()
        return original(*args, **kwargs)

    monkeypatch.setattr(scorer, "launch", launch)
    drain_module.drain(scorer, "worker-a", get_settings())
    job = job_row(job_id)
    assert (job.status, job.attempts, job.items_done) == ("succeeded", 2, 300), (job.status, job.items_done)
    assert job_id not in jobs_module.active_jobs.snapshot()


def test_a_job_found_lost_and_claimed_again_is_kept(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A boundary finds a job's lease lost (the sweeper re-queued it) and this worker's next claim takes it again
    before the loop reads what the boundary found: that close was the old lease's, and dropping the job then
    left its items unrun while the heartbeat kept the new lease (as after an engine fault's hand-back)."""
    writer = job_writer.JobWriter(lambda ids: None)
    try:
        book = jobs_module.JobBook(writer, "worker-a", get_settings())
        job = claims.ClaimedJob("job_x", 0, "m", None, None, None, None)
        book.hold(job)
        writer._close({"job_x"})  # the boundary: no longer ours
        assert book.take_closed() == {"job_x"} and "job_x" not in book.held
        writer._close({"job_x"})  # lost again, and claimed again before the loop looked
        book.hold(job)
        assert book.take_closed() == set() and "job_x" in book.held
    finally:
        writer.close()
        jobs_module.active_jobs.discard({"job_x"})


def test_heartbeats_go_on_while_a_sweep_is_stuck(empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The heartbeat ran in the sweep's loop: a sweep waiting on the object store (a chunk's manifest written to
    a store that does not answer) held it, this worker's leases ran out and other workers ran its jobs again."""
    from store.settings import Settings
    from worker import tasks

    beats: list[float] = []
    stuck, release = threading.Event(), threading.Event()

    def stuck_sweep(settings) -> bool:  # type: ignore[no-untyped-def]
        stuck.set()
        release.wait(30)
        return False

    monkeypatch.setattr(drain_module, "heartbeat", lambda *args, **kwargs: beats.append(time.monotonic()))
    monkeypatch.setattr(tasks.sweeper, "sweep", stuck_sweep)
    for quiet in ("_log_memory", "_deliver", "_prune"):
        monkeypatch.setattr(tasks, quiet, lambda *args: None)
    monkeypatch.setattr(tasks, "_ready", threading.Event())
    tasks._ready.set()
    get_scorer()  # loaded, as in a worker that is ready
    threads = tasks._start_background_loops(Settings(sweep_interval_seconds=0.05, webhook_poll_seconds=0.05,
                                                     retention_interval_seconds=0.05))
    try:
        assert stuck.wait(10)
        beats_then = len(beats)
        time.sleep(1.0)
        assert len(beats) - beats_then >= 5, "no heartbeat while the sweep was stuck"
    finally:
        release.set()
        tasks._stop.set()
        for thread in threads:
            thread.join(10)
        tasks._stop.clear()
    assert not any(thread.is_alive() for thread in threads)


def test_priority_order(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    low = submit(client, key, many_items(2))
    high = submit(client, key, many_items(2))
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == high).values(priority=10))
    settings = get_settings()
    jobs = claiming.claim_jobs("worker-a", settings)
    assert [j.id for j in jobs] == [high, low]


def test_sweeper_rekicks_jobs_whose_message_was_lost(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(3))
    settings = get_settings()
    assert sweeper.sweep(settings) is False  # just queued: its drain message is presumably on its way
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id)
                        .values(created_at=utcnow() - timedelta(seconds=settings.sweep_interval_seconds + 1)))
    assert sweeper.sweep(settings) is True


def test_stopping_between_passes_requeues_without_counting_an_attempt(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    job_id = submit(client, key, many_items(300))
    looked = []

    def stop_after_the_first_pass() -> bool:
        looked.append(count(Pass))
        return looked[-1] >= 1

    drain_module.drain(get_scorer(), "worker-a", get_settings(), stop_after_the_first_pass)
    job = job_row(job_id)
    assert (job.status, job.attempts, job.lease_owner) == ("queued", 0, None)
    assert 1 <= count(Pass) <= 3  # the passes in flight finish, no more
    assert drain_module.drain(get_scorer(), "worker-a", get_settings()) == 1
    assert job_row(job_id).status == "succeeded"


def test_a_failing_loop_releases_only_its_own_jobs(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    other = submit(client, key, many_items(2))
    settings = get_settings()
    assert [j.id for j in claims.claim_interactive("worker-a", settings, PRIORITY_BATCH)] == [other]  # held elsewhere
    failing = submit(client, key, many_items(2))

    def broken_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("engine fault")

    monkeypatch.setattr(get_scorer(), "launch", broken_engine)
    # Released after each fault and claimed again by the same drain, until it runs out of attempts.
    assert drain_module.drain(get_scorer(), "worker-a", settings) == settings.max_attempts
    job = job_row(failing)
    assert (job.status, job.attempts, job.error_code) == ("failed", settings.max_attempts, "internal_error")
    assert "engine fault" in job.error_message
    assert (job_row(other).status, job_row(other).lease_owner) == ("running", "worker-a")


def test_a_drain_request_during_a_drain_is_not_lost(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A drain message that arrives while the pass loop runs (after its last claim, say) returns at once, and
    the loop looks once more."""
    from worker import tasks

    runs = []

    def drain(scorer, owner, settings, should_stop, wake):  # type: ignore[no-untyped-def]
        wake.clear()  # as the loop does when it claims
        runs.append(1)
        if len(runs) == 1:
            start = time.monotonic()
            tasks._drain()
            assert time.monotonic() - start < 1  # it did not wait for this drain
        return 1

    monkeypatch.setattr(drain_module, "drain", drain)
    monkeypatch.setattr(tasks, "get_scorer", lambda: None)
    tasks._drain()
    deadline = time.monotonic() + 10
    while tasks._loop is not None and time.monotonic() < deadline:  # the loop's thread ends when idle
        time.sleep(0.05)
    assert runs == [1, 1]


def test_token_ids_stored_at_submission_score_as_the_text(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The API stores the request in token space; the worker scores those tokens without tokenizing, with the
    scores of the text. A job queued before tokens were stored (NULL) is tokenized from its text and scores
    the same."""
    key, _ = make_key()
    body = {"query": "Is this review positive?", "items": [" great phone", " it broke", ""], "label_token_ids": [5, 17],
            "item_first": True}
    ids = [client.post("/jobs", json=body, headers={"Authorization": f"Bearer {key}"}).json()["id"] for _ in range(2)]
    scorer = get_scorer()
    expected = scorer.tokenize(body["query"], body["items"], body["label_token_ids"], True)
    with session_scope() as session:
        stored = session.get(Job, ids[0]).tokens
        assert TokenizedRequest.from_bytes(stored) == expected
        session.get(Job, ids[1]).tokens = None  # as queued before the upgrade

    jobs = claiming.claim_jobs("worker-a", get_settings())
    assert {job.id for job in jobs} == set(ids)
    with monkeypatch.context() as patch:
        def no_tokenizing(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("the worker tokenized a request stored as token ids")

        patch.setattr(scorer.requests, "_encode", no_tokenizing)
        claiming.run_jobs(scorer, "worker-a", [job for job in jobs if job.tokens is not None])
    claiming.run_jobs(scorer, "worker-a", [job for job in jobs if job.tokens is None])
    reference = scorer.score(body["query"], body["items"], body["label_token_ids"], item_first=True)
    for job_id in ids:
        job = client.get(f"/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
        assert job["status"] == "succeeded", job
        np.testing.assert_allclose(job["scores"], reference, rtol=1e-6, atol=0)


def test_tokenized_request_bytes_round_trip() -> None:
    for request in (TokenizedRequest((1, 2, 3), ((4,), (), (5, 6, 7)), (9, 10), False),
                    TokenizedRequest((), (), (1,), True), TokenizedRequest((2 ** 31 - 1,), ((0,),), (3,), True)):
        assert TokenizedRequest.from_bytes(request.to_bytes()) == request
    with pytest.raises(ValueError):
        TokenizedRequest.from_bytes(TokenizedRequest((1,), ((2,),), (3,)).to_bytes() + b"\0\0\0\0")
    # A negative length would step back into the header and read its values as tokens (with a vocabulary's
    # shared ids, -2 as id 98 of 100): refused.
    corrupt = np.asarray([0, 1, 0, 2, 5, -2, 4, 7, 8], "<i4").tobytes()
    for ints in ((), tuple(range(100))):
        with pytest.raises(ValueError):
            TokenizedRequest.from_bytes(corrupt, ints)


def test_a_cancel_while_the_next_pass_is_launched(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The cancel lands after pass 2 was launched and before pass 1's boundary is written: the job ends
    cancelled at that boundary, with no result, and pass 2's scores for it are dropped."""
    key, _ = make_key()
    job_id = submit(client, key, {**many_items(300), "webhook_url": "http://127.0.0.1:9/hook"})
    scorer = get_scorer()
    monkeypatch.setattr(scorer, "launches_ahead", True)
    original, launches = scorer.launch, []

    def launch(*args):  # type: ignore[no-untyped-def]
        launches.append(1)
        flight = original(*args)
        if len(launches) == 2:  # pass 1 not collected yet
            assert client.post(f"/jobs/{job_id}/cancel", headers=auth(key)).status_code == 202
        return flight

    monkeypatch.setattr(scorer, "launch", launch)
    drain_module.drain(scorer, "worker-a", get_settings())
    job = job_row(job_id)
    assert (job.status, job.lease_owner, job.items_done < 300) == ("cancelled", None, True)
    # The loop drops the job once the writer has written that boundary: the passes launched meanwhile (the
    # writer runs behind the device) still run, no more.
    assert count(JobResult) == 0 and count(Pass) <= 5
    with session_scope() as session:
        assert '"job.cancelled"' in session.scalars(select(WebhookDelivery)).one().payload


def test_a_lease_lost_while_results_wait_in_the_writer(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another worker took the job over (the sweeper re-queued it) while its results were queued behind the
    device: the queued write is refused, and the other worker's result is the only one."""
    key, _ = make_key()
    job_id = submit(client, key, {**many_items(5), "webhook_url": "http://127.0.0.1:9/hook"})
    original = finishing.write_boundaries

    def taken_over_meanwhile(session, boundaries):  # type: ignore[no-untyped-def]
        with session_scope() as other:  # committed before this boundary's transaction writes
            other.execute(update(Job).where(Job.id == job_id).values(lease_owner="worker-b", attempts=2))
        return original(session, boundaries)

    monkeypatch.setattr(finishing, "write_boundaries", taken_over_meanwhile)
    drain_module.drain(get_scorer(), "worker-a", get_settings())
    job = job_row(job_id)
    assert (job.status, job.lease_owner) == ("running", "worker-b")
    assert count(JobResult) == 0 and count(WebhookDelivery) == 0
    monkeypatch.undo()
    claiming.run_jobs(get_scorer(), "worker-b", [claims.ClaimedJob(job_id, job.priority, job.model, job.tokens,
                                                                          None, None, job.webhook_url)])
    assert job_row(job_id).status == "succeeded" and count(JobResult) == 1 and count(WebhookDelivery) == 1


def test_a_worker_killed_with_writes_queued_loses_nothing(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The writer holds several boundaries when the process dies (here: the writes never commit). The jobs'
    leases expire, the sweeper re-queues them, another worker runs them: each gets one result and one
    webhook."""
    key, _ = make_key()
    ids = [submit(client, key, {**many_items(100 + i), "webhook_url": "http://127.0.0.1:9/hook"}) for i in range(6)]
    settings = get_settings()
    queued = threading.Event()

    def killed(session, boundaries):  # type: ignore[no-untyped-def]
        queued.wait(5)  # the loop queues more boundaries behind this one meanwhile
        raise SystemExit("killed")  # nothing of this transaction commits, nothing after it runs

    original_boundary = job_writer.JobWriter.boundary

    def boundary(self, b, batch_of):  # type: ignore[no-untyped-def]
        future = original_boundary(self, b, batch_of)
        if len(self._tasks) >= 2:
            queued.set()
        return future

    monkeypatch.setattr(finishing, "write_boundaries", killed)
    monkeypatch.setattr(job_writer.JobWriter, "boundary", boundary)
    with pytest.raises(SystemExit):
        drain_module.drain(get_scorer(), "worker-dead", settings)
    assert queued.is_set(), "the writer should have held queued boundaries"
    monkeypatch.undo()
    assert jobs_module.active_jobs.snapshot() == set()  # the heartbeat no longer extends their leases
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.status == "running")) == len(ids)
        session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    assert count(JobResult) == 0 and count(WebhookDelivery) == 0
    assert sweeper.sweep(settings) is True
    assert drain_module.drain(get_scorer(), "worker-b", settings) == len(ids)
    for job_id in ids:
        assert job_row(job_id).status == "succeeded"
    assert count(JobResult) == len(ids) and count(WebhookDelivery) == len(ids)


def test_stored_requests_are_checked_as_their_token_ids() -> None:
    """The worker's check of a stored request gives what tokenizing its token ids gives: the request, or the
    same error code."""
    from core import RequestTokenizer, ScoringError

    checker = RequestTokenizer(None, 100, model_name="m", max_items=3, max_tokens=20, max_labels=4, max_scores=8,
                               max_sequence_tokens=8)
    good = TokenizedRequest((1, 2), ((3,), (), (4, 5)), (6, 7), False)
    assert checker.check_stored(good.to_bytes()) == good == checker.tokenize([1, 2], [[3], [], [4, 5]], [6, 7])
    for bad, code in ((TokenizedRequest((1,), ((2,), (100,)), (3,)), "token_id_out_of_range"),
                      (TokenizedRequest((1,), ((2,),), (100,)), "label_token_id_out_of_range"),
                      (TokenizedRequest((1,), ((2,),) * 4, (3,)), "too_many_items"),
                      (TokenizedRequest((), ((2,),), (3,)), "empty_query"),
                      (TokenizedRequest((1,) * 5, ((2,) * 4,), (3,)), "too_many_tokens"),
                      (TokenizedRequest((1,), ((2,),), (3,) * 5), "too_many_labels"),
                      (TokenizedRequest((1,), ((2,),) * 3, (3,) * 3), "too_many_labels")):  # 9 scores
        with pytest.raises(ScoringError) as stored:
            checker.check_stored(bad.to_bytes())
        with pytest.raises(ScoringError) as tokenized:
            checker.tokenize(list(bad.query), [list(i) for i in bad.items], list(bad.label_token_ids))
        assert stored.value.code == tokenized.value.code == code
        assert stored.value.message == tokenized.value.message


def test_long_jobs_start_as_the_prefix_cache_can_keep_their_queries(client, make_key, empty_queue,
                                                                   monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Four queued jobs, each longer than a pass, with a prefix cache that holds two of their queries: the
    loop starts a job when the cache can keep its query beside those of the jobs under way, so no query is
    computed twice (each pass used to start another job with half of what was left, and the cache evicted the
    query of one still under way)."""
    key, _ = make_key()
    bodies = [{"query": f"Question {q}:" + " the" * 120, "items": [f" answer {i} is" for i in range(100)],
               "label_token_ids": [5, 17], "return_logprobs": True} for q in range(4)]
    ids = [submit(client, key, body) for body in bodies]
    scorer = get_scorer()
    queries = {scorer.tokenize(b["query"], b["items"], b["label_token_ids"]).query for b in bodies}
    assert len(queries) == 4 and len({len(q) for q in queries}) == 1
    monkeypatch.setattr(scorer, "prefix_cache_bytes", 2 * scorer.prefix_bytes(len(next(iter(queries)))))
    scorer.clear_prefix_cache()
    original, computed = scorer._remember_prefix, []

    def remember(query, *args):  # type: ignore[no-untyped-def]
        computed.append(query)
        return original(query, *args)

    monkeypatch.setattr(scorer, "_remember_prefix", remember)
    assert drain_module.drain(scorer, "worker-a", get_settings()) == 4
    with session_scope() as session:
        passes = session.scalar(select(func.count()).select_from(Pass))
        assert session.scalar(select(func.sum(Pass.n_items))) == 400
    assert passes >= 4, "each job should take more than one pass (PASS_TOKENS is small in tests)"
    assert sorted(computed) == sorted(queries), "a query was computed more than once"
    monkeypatch.undo()
    for job_id, body in zip(ids, bodies):
        job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
        assert job["status"] == "succeeded"
        expected = scorer.logprobs(body["query"], body["items"], body["label_token_ids"])
        np.testing.assert_allclose(job["logprobs"], expected, atol=1e-4)


def test_a_job_claimed_while_a_pass_runs_goes_into_the_next_pass(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A wake-up's claim still on its way when the pass ends (queued in the writer behind a slow write) is
    waited for before the next pass is planned: the job it claims runs in that pass, not one pass later."""
    key, _ = make_key()
    submit(client, key, many_items(300))  # several passes
    scorer = get_scorer()
    writers = []
    monkeypatch.setattr(drain_module, "JobWriter", lambda *a: writers.append(job_writer.JobWriter(*a)) or writers[-1])
    original, passes = scorer.launch, []
    wake = drain_module.WakeUp()

    def launch(requests, *rest):  # type: ignore[no-untyped-def]
        passes.append({r.query for r in requests})
        if len(passes) == 1:
            writers[0].submit(lambda: time.sleep(0.4))  # the writer is busy when the wake-up comes
            submit(client, key, {"query": "A late small question", "items": ["yes"], "label_token_ids": [5]})
            wake.set()
        return original(requests, *rest)

    monkeypatch.setattr(scorer, "launch", launch)
    drain_module.drain(scorer, "worker-a", get_settings(), wake=wake)
    late = scorer.tokenize("A late small question", ["yes"], [5]).query
    assert late in passes[1], [len(p) for p in passes]


def test_the_engines_pace_outlives_a_pass_loop(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    """A loop that starts after an idle spell cuts its passes to the host's pace at once (worker/policy.py,
    Pace): the pace earlier loops measured is kept per engine, not measured again from full passes."""
    key, _ = make_key()
    submit(client, key, many_items(2500))  # passes of one shape after the first: the pace is measured
    scorer = get_scorer()
    drain_module.drain(scorer, "worker-a", get_settings())
    pace = drain_module._PACES[scorer]
    assert pace.seconds_per_token is not None
    writer = job_writer.JobWriter(lambda ids: None)
    try:
        policy = policy_for(scorer, get_settings(), drain_module.pace_for(scorer))
        loop = drain_module.PassLoop(scorer, policy, writer, jobs_module.JobBook(writer, "worker-a", get_settings()),
                                     lambda interactive_only: [])
        assert loop.scheduler.pace is pace and loop.scheduler.pace.seconds_per_token is not None
    finally:
        writer.close()


def launched_items(monkeypatch) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    """The items (as token ids) the engine is asked to score from now on, pass after pass."""
    scorer = get_scorer()
    original = scorer.launch
    items: list[tuple[int, ...]] = []

    def launching(views, *args, **kwargs):  # type: ignore[no-untyped-def]
        items.extend(item for view in views for item in view.items)
        return original(views, *args, **kwargs)

    monkeypatch.setattr(scorer, "launch", launching)
    return items


def progress_seen(monkeypatch, job_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    """The job's items_done as each boundary write from now on leaves it."""
    original = finishing.write_boundaries
    seen: list[int] = []

    def spying(session, boundaries):  # type: ignore[no-untyped-def]
        closed = original(session, boundaries)
        seen.append(session.scalar(select(Job.items_done).where(Job.id == job_id)))  # as this write left it
        return closed

    monkeypatch.setattr(finishing, "write_boundaries", spying)
    return seen


def assert_scored_once_as_uninterrupted(job_id: str, body: dict, launched: list[tuple[int, ...]], client,  # type: ignore[no-untyped-def]
                                        key: str) -> None:
    scorer = get_scorer()
    every = [tuple(scorer.tokenize(body["query"], [item], body["label_token_ids"], False).items[0])
             for item in body["items"]]
    assert sorted(launched) == sorted(every), "each item is scored once, across both attempts"
    job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "succeeded" and job["progress"]["items_done"] == len(body["items"])
    expected = scorer.logprobs(body["query"], body["items"], body["label_token_ids"])
    np.testing.assert_allclose(job["logprobs"], expected, atol=1e-4)  # in the items' order
    assert count(JobResult) == 1 and count(JobPart) == 0  # the result replaced the parts


def test_a_stopped_job_resumes_where_it_stopped(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker stopped mid-job (Ctrl-C, a restart) hands it back with the items its passes scored kept: the next
    drain scores only the others, its done count never goes back, and its result is an uninterrupted run's."""
    key, _ = make_key()
    body = many_items(300)
    job_id = submit(client, key, body)
    launched = launched_items(monkeypatch)
    seen = progress_seen(monkeypatch, job_id)
    drain_module.drain(get_scorer(), "worker-a", get_settings(), lambda: count(Pass) >= 1)
    job = job_row(job_id)
    assert (job.status, job.attempts) == ("queued", 0)
    kept = job.items_done
    assert 0 < kept < 300 and len(launched) == kept, (kept, len(launched))
    assert drain_module.drain(get_scorer(), "worker-a", get_settings()) == 1
    assert len(launched) == 300, f"{len(launched) - 300} items scored again"
    assert seen == sorted(seen) and seen[-1] == 300 and kept in seen, seen  # the hand-back kept it (above)
    assert_scored_once_as_uninterrupted(job_id, body, launched, client, key)


def test_a_job_whose_worker_died_resumes_from_its_last_written_pass(client, make_key, empty_queue,  # type: ignore[no-untyped-def]
                                                                    monkeypatch) -> None:
    """A worker killed mid-job: the passes written before keep their items; the sweeper re-queues the job with
    them and another worker scores only the rest."""
    key, _ = make_key()
    body = many_items(300)
    job_id = submit(client, key, body)
    settings = get_settings()
    launched = launched_items(monkeypatch)
    original = finishing.write_boundaries
    written: list[int] = []

    def killed_after_two(session, boundaries):  # type: ignore[no-untyped-def]
        if len(written) >= 2:
            raise SystemExit("killed")  # this write and every later one are lost
        written.append(len(boundaries))
        return original(session, boundaries)

    monkeypatch.setattr(finishing, "write_boundaries", killed_after_two)
    with pytest.raises(SystemExit):
        drain_module.drain(get_scorer(), "worker-dead", settings)
    monkeypatch.setattr(finishing, "write_boundaries", original)
    seen = progress_seen(monkeypatch, job_id)
    kept = job_row(job_id).items_done
    assert 0 < kept < 300 and len(launched) > kept  # the lost passes' items were scored, not written
    with session_scope() as session:
        session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    sweeper.sweep(settings)
    job = job_row(job_id)
    assert (job.status, job.items_done) == ("queued", kept)
    scored_before = len(launched)
    drain_module.drain(get_scorer(), "worker-b", settings)
    assert len(launched) - scored_before == 300 - kept
    assert [kept, *seen] == sorted([kept, *seen]) and seen[-1] == 300, (kept, seen)
    job = job_row(job_id)
    assert job.attempts == 2 and job.items_at_claim == kept
    assert_scored_once_as_uninterrupted(job_id, body, launched[:kept] + launched[scored_before:], client, key)


def test_a_pass_written_after_the_lease_was_lost_keeps_nothing(client, make_key, empty_queue, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Parts keep the lease condition: another worker takes the job over after this boundary's check of its jobs
    (the sweeper re-queued it, another worker claimed it), so the pass's items are the other's to score: this
    pass leaves no part, nor does any later one."""
    key, _ = make_key()
    job_id = submit(client, key, many_items(300))
    original = finishing.set_progress
    writes: list[int] = []

    def taken_over_after_the_first(session, owner, progress):  # type: ignore[no-untyped-def]
        if writes:
            with session_scope() as other:
                other.execute(update(Job).where(Job.id == job_id).values(lease_owner="worker-b"))
        writes.append(len(progress))
        return original(session, owner, progress)

    monkeypatch.setattr(finishing, "set_progress", taken_over_after_the_first)
    drain_module.drain(get_scorer(), "worker-a", get_settings())
    assert writes[:2] == [1, 1]
    job = job_row(job_id)
    assert (job.status, job.lease_owner) == ("running", "worker-b")
    with session_scope() as session:
        parts = session.scalars(select(JobPart)).all()
    assert len(parts) == 1 and len(parts[0].items) // 4 == job.items_done < 300  # the first pass's only


def test_eta_counts_from_the_current_attempts_claim(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    """A resumed job's eta is its pace since it was claimed again, not since it first started: the items kept
    from earlier attempts took time that is not this attempt's."""
    key, _ = make_key()
    job_id = submit(client, key, many_items(3000))
    now = utcnow()
    with session_scope() as session:  # an earlier attempt scored 743 items and was handed back
        session.execute(update(Job).where(Job.id == job_id).values(items_done=743,
                                                                   started_at=now - timedelta(seconds=9000)))
    [claimed] = claims.claim_interactive("worker-a", get_settings(), PRIORITY_BATCH)
    job = job_row(job_id)
    assert (job.items_done, job.items_at_claim, job.started_at) == (743, 743, now - timedelta(seconds=9000))
    assert job.claimed_at >= now
    assert client.get(f"/jobs/{job_id}", headers=auth(key)).json()["eta_seconds"] is None  # none scored since
    with session_scope() as session:  # 200 items in the 100 s since the claim
        session.execute(update(Job).where(Job.id == job_id).values(items_done=943,
                                                                   claimed_at=utcnow() - timedelta(seconds=100)))
    eta = client.get(f"/jobs/{job_id}", headers=auth(key)).json()["eta_seconds"]
    assert eta == pytest.approx(100 * (3000 - 943) / 200, rel=0.02)  # not 9100 s * 2057 / 943
