"""Celery glue: the `drain` task, the pass loop's thread and the worker's background loops (heartbeat +
sweeper of jobs and chunks, webhook delivery, retention).

Run with `packscore worker` (`celery worker --pool solo`): one process per accelerator, no fork after JAX
has started; the model is loaded once per process, before the worker consumes.

The pass loop (worker/drain.py) runs in a thread of its own, so that the `drain` task only wakes it and
returns at once: a kick for a new job reaches the loop while it runs other jobs, and the job joins its next
pass (interactive jobs before batch requests).
"""

import linecache
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable

import kombu.exceptions
import pyarrow as pa
import redis.exceptions
import sqlalchemy.exc
from celery.signals import after_setup_logger, worker_init, worker_ready, worker_shutdown, worker_shutting_down

from core.allocator import hand_back_freed_memory, python_objects
from store import sweeper, workers
from store.broker import DRAIN_TASK, kick_drain
from store.db import session_factory
from store.lake.access import check_storage_prefixes
from store.location import load_filesystems
from store.retention import prune
from store.settings import Settings, get_settings
from worker import drain as drain_module
from worker import lake as chunk_feed
from worker.celery_app import SUPERVISOR_PID, app
from worker.scorer import get_scorer
from worker.webhooks import dispatch_due, stop_delivery

log = logging.getLogger(__name__)

# The lease owner: unique per process, so a restarted worker never inherits a dead one's leases.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
_stop = threading.Event()
# Set when a job may be waiting: the pass loop claims again (and starts if it was idle).
_wake = drain_module.WakeUp()
_loop: threading.Thread | None = None
_loop_lock = threading.Lock()
# A stopping worker waits this long at most for webhook attempts in flight.
STOP_DELIVERY_SECONDS = 3.0
# How often a supervised worker checks that its supervisor is still there.
SUPERVISOR_CHECK_SECONDS = 1.0
# Set once the engine's programs are warm (WARMUP): until then the heartbeat says "warming" (with the warm-up's
# programs done and total, for /readyz) and nothing drains.
_ready = threading.Event()
_warmup: tuple[int, int] | None = None
# The memory log's last time, and its last Python allocations (settings: MEMORY_LOG_SECONDS, TRACE_PYTHON_MEMORY).
_memory_logged_at = float("-inf")
_traced: tracemalloc.Snapshot | None = None


# What a database or broker that is down (a restart, a failover) raises in every background step and claim, each
# second, until it is back.
OUTAGE_ERRORS = (sqlalchemy.exc.OperationalError, redis.exceptions.ConnectionError,
                 kombu.exceptions.OperationalError, ConnectionError)


class WorkerTracebacks(logging.Filter):
    """Logs a failure that an outage explains (OUTAGE_ERRORS) as one line, without its traceback: 75 lines each,
    two or three a second per worker during a database restart. Other failures keep their traceback, formatted
    here, and the source lines it read are dropped from `linecache`, which otherwise keeps every line of every
    file a traceback named for the process's life (a step of about 2 MB in each worker's memory at a database
    restart)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        error = record.exc_info[1]
        if isinstance(error, OUTAGE_ERRORS):
            reason = (str(error).splitlines() or [""])[0]
            record.msg, record.args = f"{record.getMessage()} ({type(error).__name__}: {reason})", None
            record.exc_info = record.exc_text = None
        elif not record.exc_text:
            cached = set(linecache.cache)
            record.exc_text = logging.Formatter().formatException(record.exc_info)  # what a handler would write
            for name in set(linecache.cache) - cached:
                linecache.cache.pop(name, None)
        return True


@after_setup_logger.connect
def _brief_outages(logger: logging.Logger, **_: object) -> None:
    for handler in logger.handlers:  # a handler's filter sees the records of every logger
        handler.addFilter(WorkerTracebacks())


def _drain() -> None:
    """Wakes the pass loop, starting its thread if it is idle."""
    global _loop
    with _loop_lock:
        _wake.set()
        if (_loop is None or not _loop.is_alive()) and not _stop.is_set():
            _loop = threading.Thread(target=_run_loop, name="pass-loop", daemon=True)
            _loop.start()


def _run_loop() -> None:
    """Drains until no job is left and no wake-up came in the meantime."""
    global _loop
    while True:
        try:
            drain_module.drain(get_scorer(), WORKER_ID, get_settings(), _stop.is_set, _wake)
        except Exception:  # e.g. the database is down: the sweeper wakes the loop again
            log.exception("the pass loop failed")
        with _loop_lock:
            if not _wake.is_set() or _stop.is_set():
                _loop = None
                return


def _log_memory(settings: Settings) -> None:
    global _memory_logged_at
    if time.monotonic() - _memory_logged_at < settings.memory_log_seconds:
        return
    _memory_logged_at = time.monotonic()
    scorer = get_scorer()
    held = _resident_set()["VmRSS"]
    allocator = hand_back_freed_memory()
    resident = _resident_set()
    rss = resident["VmRSS"]
    # The RSS's anonymous and file-backed parts and the threads: what lies outside the C allocator (libraries'
    # code pages a path met for the first time reads in, thread stacks) is told from memory held.
    # Python's own: its small objects live in its arenas unless PYTHONMALLOC=malloc (then in the C allocator's
    # figures), and a module imported late (a library's first use) is a step, not growth.
    log.info("memory: RSS %.1f MB (%.1f anonymous, %.1f of it in huge pages, %.1f file-backed; %d threads); "
             "prefix cache %.1f of %.1f MB; %d pass programs resident (%d compiled); Arrow's %s pool %.1f MB (the "
             "lake's tables); %.1f MB of freed memory handed back to the system by %s; Python: %s, %d modules",
             rss / 2**10, resident["RssAnon"] / 2**10, _anonymous_huge_pages() / 2**10, resident["RssFile"] / 2**10,
             resident["Threads"],
             scorer.cached_prefix_bytes / 2**20, scorer.prefix_cache_bytes / 2**20,
             scorer.resident_programs, scorer.compiled_programs, pa.default_memory_pool().backend_name,
             pa.total_allocated_bytes() / 2**20, max(0, held - rss) / 2**10, allocator, python_objects(),
             len(sys.modules))
    if settings.trace_python_memory:
        _log_python_growth()


def _resident_set() -> dict[str, int]:
    """/proc/self/status's VmRSS, RssAnon and RssFile (kB) and Threads."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {name: int(fields.get(name, "0").split()[0]) for name in ("VmRSS", "RssAnon", "RssFile", "Threads")}


def _anonymous_huge_pages() -> int:
    """The anonymous memory in transparent huge pages (kB; 0 before Linux 4.14): a huge page is resident whole,
    whatever the allocator purged inside it. Read once per log: smaps_rollup walks every mapping."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            found = re.search(r"^AnonHugePages:\s+(\d+)", rollup.read(), re.M)
    except OSError:
        return 0
    return int(found[1]) if found else 0


def _log_python_growth() -> None:
    global _traced
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    snapshot = tracemalloc.take_snapshot()
    if _traced is not None:
        grew = snapshot.compare_to(_traced, "lineno")[:8]
        log.info("memory: Python's allocations %.1f MB; grew most since the last log: %s",
                 tracemalloc.get_traced_memory()[0] / 2**20, " | ".join(map(str, grew)))
    _traced = snapshot


@app.task(name=DRAIN_TASK, acks_late=True, reject_on_worker_lost=True)
def drain() -> None:
    _drain()


def _every(seconds: float, step: Callable[[], None]) -> None:
    while not _stop.wait(seconds):
        try:
            step()
        except Exception:  # e.g. the database is down: keep trying, the next round may work
            log.exception("background step %s failed", step.__name__)


def _heartbeat() -> None:
    settings = get_settings()
    drain_module.heartbeat(WORKER_ID, settings.worker_model, settings, get_scorer().attention_path,
                           "ready" if _ready.is_set() else "warming", _warmup)


def _maintain() -> None:
    if not _ready.is_set():
        return
    settings = get_settings()
    _log_memory(settings)
    # Queued jobs that nobody drains (a lost message, a dead worker) while this worker is idle: wake the other
    # workers through the broker, and drain here without waiting for a message. After a Redis restart Celery's
    # consumer can sit on a dead connection and never hear one again (found by the chaos tests: jobs queued
    # for good while /readyz said ready); the jobs table, not the broker, is the queue of record.
    if sweeper.sweep(settings) | chunk_feed.sweep(settings):  # both run: each also re-queues what dead workers held
        kick_drain(settings.worker_model)
        _drain()


def _prune() -> None:
    pruned = prune(session_factory(), get_settings())
    if pruned.rows:
        log.info("retention deleted %s", pruned.rows)


def _deliver() -> None:
    # Starts the due attempts that free slots allow, without waiting for them (they run in the webhook pool).
    dispatch_due(get_settings())


@worker_init.connect
def _watch_supervisor(**_: object) -> None:
    """A worker started by a supervisor stops (warm, as on SIGTERM) once that supervisor is gone: SIGKILLed or
    killed for memory, it left its workers running, holding their chips and taking jobs beside the workers of
    the supervisor started again (in embedded mode, a second worker on the same SQLite database)."""
    supervisor = os.environ.get(SUPERVISOR_PID)
    if not supervisor:
        return

    def watch() -> None:
        while os.getppid() == int(supervisor):
            time.sleep(SUPERVISOR_CHECK_SECONDS)
        log.warning("worker %s: its supervisor (pid %s) is gone; stopping", WORKER_ID, supervisor)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def _start_background_loops(settings: Settings) -> list[threading.Thread]:
    # Each in a thread of its own. The heartbeat's above all: behind a sweep that waited on the object store (a
    # chunk's manifest) or a long memory log, this worker's leases ran out, and other workers ran its jobs again.
    threads = [threading.Thread(target=_every, args=(seconds, step), name=step.__name__, daemon=True)
               for step, seconds in ((_heartbeat, settings.sweep_interval_seconds),
                                     (_maintain, settings.sweep_interval_seconds),
                                     (_deliver, settings.webhook_poll_seconds),
                                     (_prune, settings.retention_interval_seconds))]
    for thread in threads:
        thread.start()
    return threads


@worker_ready.connect
def _start(**_: object) -> None:
    # Celery logs a failing worker_ready handler and consumes anyway: a worker without its model or its
    # heartbeat would take drain messages it cannot serve, and nothing would start it again. Exiting non-zero
    # hands it to what runs it (the supervisor, systemd, compose), which starts it again after a backoff.
    # (Only the start: once warm, a database blip is waited out like anywhere else.)
    settings = get_settings()
    try:
        check_storage_prefixes(settings)
        scorer = get_scorer()  # load before consuming: the first drain should not pay for it
        loaded = load_filesystems(settings.batch_storage_prefixes)  # so too the object stores batches may read
        workers.register(WORKER_ID, settings.worker_model, scorer.dtype.name, settings,  # DtypeMismatch: exit
                         platform=scorer.platform)
        drain_module.heartbeat(WORKER_ID, settings.worker_model, settings, scorer.attention_path, "warming")
    except Exception as exc:
        log.critical("worker %s could not start: %s; exiting (code 1) to be started again", WORKER_ID, exc,
                     exc_info=True)
        raise SystemExit(1) from exc
    if loaded:
        log.info("worker %s loaded the filesystems of %s", WORKER_ID, ", ".join(f"{p}://" for p in loaded))
    _start_background_loops(settings)
    if settings.warmup == "ladder":  # Celery consumes nothing before this handler returns
        start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            global _warmup
            _warmup = (done, total)

        try:
            programs = scorer.warm_up(progress)
            log.info("worker %s warmed %d programs in %.1f s", WORKER_ID, programs, time.perf_counter() - start)
        except Exception:  # e.g. out of memory: serve anyway, programs compile when first needed
            log.exception("worker %s: warm-up failed; programs compile when first needed", WORKER_ID)
    _ready.set()
    drain_module.heartbeat(WORKER_ID, settings.worker_model, settings, scorer.attention_path, "ready")
    _drain()  # jobs may have queued while no worker ran (their kick may have gone to another worker)
    log.info("worker %s ready (model %s)", WORKER_ID, settings.worker_model)


@worker_shutting_down.connect
def _stopping(**_: object) -> None:
    # Sent from the signal handler: the pass loop stops at the next pass boundary and hands its jobs back.
    _stop.set()


@worker_shutdown.connect
def _stop_loops(**_: object) -> None:
    _stop.set()
    # No new webhook attempts; those in flight get a few seconds to end and be recorded (the rest are retried
    # once their lease expires).
    stop_delivery(min(get_settings().webhook_timeout_seconds, STOP_DELIVERY_SECONDS))
    loop = _loop
    if loop is not None:
        loop.join(timeout=30)  # it finishes the pass in flight and hands its other jobs back
    chunk_feed.close_feeds()
    try:
        workers.deregister(WORKER_ID)
    except Exception:
        log.warning("could not deregister worker %s", WORKER_ID)
