"""Celery glue: the `drain` task and the worker's background loops (heartbeat + sweeper, webhook delivery).

Run with `packscore worker` (`celery worker --pool solo`): one process per accelerator, no fork after JAX
has started; the model is loaded once per process, before the worker consumes.
"""

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from celery.signals import worker_ready, worker_shutdown
from sqlalchemy import delete

from api.db import session_scope
from api.models import Worker
from api.settings import get_settings
from worker import drain as drain_module
from worker.celery_app import DRAIN_TASK, app, kick_drain
from worker.scorer import get_scorer
from worker.webhooks import deliver_due

log = logging.getLogger(__name__)

# The lease owner: unique per process, so a restarted worker never inherits a dead one's leases.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
# One drain at a time per process, run by the Celery task or by the sweeper's thread (below).
_drain_lock = threading.Lock()
_stop = threading.Event()


def _drain() -> int:
    """Drains the ready jobs, unless this process is draining already (that drain loops until none is left)."""
    if not _drain_lock.acquire(blocking=False):
        return 0
    try:
        return drain_module.drain(get_scorer(), WORKER_ID, get_settings())
    finally:
        _drain_lock.release()


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
    drain_module.heartbeat(WORKER_ID, settings.model, settings)
    # Queued jobs that nobody drains (a lost message, a dead worker) while this worker is idle: wake the other
    # workers through the broker, and drain here without waiting for a message. After a Redis restart Celery's
    # consumer can sit on a dead connection and never hear one again (found by the chaos tests: jobs queued
    # for good while /readyz said ready); the jobs table, not the broker, is the queue of record.
    if drain_module.sweep(settings) and not _drain_lock.locked():
        kick_drain()
        threading.Thread(target=_drain, name="sweeper-drain", daemon=True).start()


def _deliver() -> None:
    deliver_due(get_settings())


@worker_ready.connect
def _start(**_: object) -> None:
    settings = get_settings()
    get_scorer()  # load before consuming: the first drain should not pay for it
    drain_module.heartbeat(WORKER_ID, settings.model, settings)
    for step, seconds in ((_maintain, settings.sweep_interval_seconds), (_deliver, settings.webhook_poll_seconds)):
        threading.Thread(target=_every, args=(seconds, step), name=step.__name__, daemon=True).start()
    kick_drain()  # jobs may have queued while no worker ran
    log.info("worker %s ready (model %s)", WORKER_ID, settings.model)


@worker_shutdown.connect
def _stop_loops(**_: object) -> None:
    _stop.set()
    try:
        with session_scope() as session:
            session.execute(delete(Worker).where(Worker.id == WORKER_ID))
    except Exception:
        log.warning("could not deregister worker %s", WORKER_ID)
