"""Celery glue: the `drain` task, the batch lane and the worker's background loops (heartbeat + sweeper,
webhook delivery, retention).

Run with `packscore worker` (`celery worker --pool solo`): one process per accelerator, no fork after JAX
has started; the model is loaded once per process, before the worker consumes.

Two lanes share the engine. The `drain` task runs interactive jobs; batch requests run in a thread of their
own that waits before each pass while interactive jobs run. So an interactive job submitted during a
backfill waits for the batch pass on the engine at most, not for a whole batch round with its database
writes (the engine serializes passes). With SQLite (embedded mode, one writer at a time) the task runs
both lanes in turn instead.
"""

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from store import jobqueue
from store.broker import DRAIN_TASK, kick_drain
from store.db import session_factory
from store.retention import prune
from store.settings import get_settings
from worker import drain as drain_module
from worker.celery_app import app
from worker.scorer import get_scorer
from worker.webhooks import dispatch_due, stop_delivery

log = logging.getLogger(__name__)

# The lease owner: unique per process, so a restarted worker never inherits a dead one's leases.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
# One drain at a time per process, run by the Celery task or by the sweeper's thread (below).
_drain_lock = threading.Lock()
_drain_requested = threading.Event()
_stop = threading.Event()
# Cleared while the interactive lane runs: the batch lane waits on it before each claim and pass.
_interactive_idle = threading.Event()
_interactive_idle.set()
_batch_lane: threading.Thread | None = None
_batch_lane_lock = threading.Lock()
_batch_lane_wanted = threading.Event()
# A stopping worker waits this long at most for webhook attempts in flight.
STOP_DELIVERY_SECONDS = 3.0
# Set once the engine's programs are warm (WARMUP): until then the heartbeat says "warming" and nothing drains.
_ready = threading.Event()


def _drain() -> int:
    """Drains the ready jobs. A call while this process drains already does not wait: it asks that drain
    to look once more before it ends, since the job this call was sent for may have been committed after
    that drain's last claim."""
    claimed = 0
    _drain_requested.set()
    while _drain_requested.is_set():
        if not _drain_lock.acquire(blocking=False):
            return claimed  # the holder sees the request, before or after it releases the lock
        try:
            while _drain_requested.is_set():
                _drain_requested.clear()
                claimed += _drain_once()
        finally:
            _drain_lock.release()
    return claimed


def _stop_at_pass_boundary() -> None:
    if _stop.is_set():
        raise drain_module.Stopping()


def _drain_once() -> int:
    settings = get_settings()
    try:
        if settings.database_url.startswith("sqlite"):
            return drain_module.drain(get_scorer(), WORKER_ID, settings, before_pass=_stop_at_pass_boundary)
        _interactive_idle.clear()
        try:
            return drain_module.drain(get_scorer(), WORKER_ID, settings, lane="interactive",
                                      before_pass=_stop_at_pass_boundary)
        finally:
            _interactive_idle.set()
            _wake_batch_lane()
    except drain_module.Stopping:  # its jobs went back to the queue; another worker (or the next start) runs them
        return 0


def _wake_batch_lane() -> None:
    """Starts the batch lane's thread, or makes the running one look for work once more before it ends."""
    global _batch_lane
    with _batch_lane_lock:
        _batch_lane_wanted.set()
        if _batch_lane is None and not _stop.is_set():
            lane = threading.Thread(target=_run_batch_lane, name="batch-lane", daemon=True)
            lane.start()
            _batch_lane = lane


def _yield_to_interactive() -> None:
    while not _stop.is_set() and not _interactive_idle.wait(1.0):
        pass
    if _stop.is_set():
        raise drain_module.Stopping()


def _run_batch_lane() -> None:
    global _batch_lane
    while True:
        _batch_lane_wanted.clear()
        try:
            drain_module.drain(get_scorer(), WORKER_ID, get_settings(), lane="batch",
                               before_pass=_yield_to_interactive)
        except drain_module.Stopping:
            pass
        except Exception:  # e.g. the database is down: the sweeper wakes this lane again
            log.exception("batch lane failed")
        with _batch_lane_lock:
            if not _batch_lane_wanted.is_set() or _stop.is_set():
                _batch_lane = None
                return


@app.task(name=DRAIN_TASK, acks_late=True, reject_on_worker_lost=True)
def drain() -> int:
    return _drain()


def _every(seconds: float, step: Callable[[], None]) -> None:
    while not _stop.wait(seconds):
        try:
            step()
        except Exception:  # e.g. the database is down: keep trying, the next round may work
            log.exception("background step %s failed", step.__name__)


def _maintain() -> None:
    settings = get_settings()
    drain_module.heartbeat(WORKER_ID, settings.model, settings, get_scorer().attention_path,
                           "ready" if _ready.is_set() else "warming")
    if not _ready.is_set():
        return
    # Queued jobs that nobody drains (a lost message, a dead worker) while this worker is idle: wake the other
    # workers through the broker, and drain here without waiting for a message. After a Redis restart Celery's
    # consumer can sit on a dead connection and never hear one again (found by the chaos tests: jobs queued
    # for good while /readyz said ready); the jobs table, not the broker, is the queue of record.
    if jobqueue.sweep(settings) and not _drain_lock.locked():
        kick_drain()
        threading.Thread(target=_drain, name="sweeper-drain", daemon=True).start()


def _prune() -> None:
    pruned = prune(session_factory(), get_settings())
    if pruned.rows:
        log.info("retention deleted %s", pruned.rows)


def _deliver() -> None:
    # Starts the due attempts that free slots allow, without waiting for them (they run in the webhook pool).
    dispatch_due(get_settings())


@worker_ready.connect
def _start(**_: object) -> None:
    settings = get_settings()
    scorer = get_scorer()  # load before consuming: the first drain should not pay for it
    drain_module.heartbeat(WORKER_ID, settings.model, settings, scorer.attention_path, "warming")
    for step, seconds in ((_maintain, settings.sweep_interval_seconds), (_deliver, settings.webhook_poll_seconds),
                          (_prune, settings.retention_interval_seconds)):
        threading.Thread(target=_every, args=(seconds, step), name=step.__name__, daemon=True).start()
    if settings.warmup == "ladder":  # Celery consumes nothing before this handler returns
        start = time.perf_counter()
        try:
            programs = scorer.warm_up()
            log.info("worker %s warmed %d programs in %.1f s", WORKER_ID, programs, time.perf_counter() - start)
        except Exception:  # e.g. out of memory: serve anyway, programs compile when first needed
            log.exception("worker %s: warm-up failed; programs compile when first needed", WORKER_ID)
    _ready.set()
    drain_module.heartbeat(WORKER_ID, settings.model, settings, scorer.attention_path, "ready")
    kick_drain()  # jobs may have queued while no worker ran
    log.info("worker %s ready (model %s)", WORKER_ID, settings.model)


@worker_shutting_down.connect
def _stopping(**_: object) -> None:
    # Sent from the signal handler, while the drain task may still run: Celery's warm shutdown waits for the
    # task to end, and a drain would otherwise run every ready job first. Drains stop at the next pass boundary
    # and hand their jobs back to the queue.
    _stop.set()


@worker_shutdown.connect
def _stop_loops(**_: object) -> None:
    _stop.set()
    # No new webhook attempts; those in flight get a few seconds to end and be recorded (the rest are retried
    # once their lease expires).
    stop_delivery(min(get_settings().webhook_timeout_seconds, STOP_DELIVERY_SECONDS))
    lane = _batch_lane
    if lane is not None:
        lane.join(timeout=30)  # it releases its jobs at the next pass boundary
    # A drain in the sweeper's thread (a daemon, which the exit would cut off mid-pass with its jobs running)
    # also stops at its next pass boundary.
    if _drain_lock.acquire(timeout=30):
        _drain_lock.release()
    try:
        jobqueue.deregister(WORKER_ID)
    except Exception:
        log.warning("could not deregister worker %s", WORKER_ID)
