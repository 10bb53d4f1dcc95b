"""The broker: the Celery app's configuration, and the "kick" that the API and the workers send to wake a worker.
The broker only wakes workers up: the jobs table is the queue of record, so a lost or
duplicated `drain` message costs nothing (the sweeper re-kicks, an extra drain finds nothing to do). Each
model has a queue of its own (`drain_queue`): a kick for a job wakes a worker of that job's model."""

import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.transport import filesystem
from kombu.utils.json import dumps

from store.settings import Settings, get_settings

log = logging.getLogger(__name__)

DRAIN_TASK = "packscore.drain"
# How often a worker on the filesystem broker (embedded mode) looks for messages.
FILESYSTEM_POLL_SECONDS = 0.02


class _AtomicFilesystemChannel(filesystem.Channel):
    def _put(self, queue: str, payload: dict, **kwargs: Any) -> None:
        # kombu creates a message's file, then writes it: a worker looking in between would read it empty and stop
        # for good. Written under a name no reader takes (kombu's take the part after the first dot), then renamed,
        # it appears whole.
        name = f"{int(round(time.monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        writing = os.path.join(self.data_folder_out, f".{name}.writing")
        with open(writing, "wb") as f:
            f.write(dumps(payload).encode())
        os.replace(writing, os.path.join(self.data_folder_out, name))


class AtomicFilesystemTransport(filesystem.Transport):
    """kombu's filesystem transport (the embedded broker) with messages that appear whole."""

    Channel = _AtomicFilesystemChannel


def make_celery(settings: Settings, include: tuple[str, ...] = ()) -> Celery:
    """The app as the workers run it (`include`: their task modules) and as kicks are sent with it (none)."""
    # The sending app must not replace a worker's own as Celery's current app.
    app = Celery("packscore", broker=settings.celery_broker_url, include=list(include), set_as_current=bool(include))
    # No acknowledgement bookkeeping on Redis: a drain message only wakes a worker (see above), and kombu's
    # emulated acks write a hash and a sorted set at each delivery and ack, a large share of a busy worker's time.
    transport: dict = {"visibility_timeout": 3600, "ack_emulation": False}
    if settings.celery_broker_url.startswith("filesystem"):
        folder = Path(settings.broker_dir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        # One folder serves as both ends: the API writes messages, the worker reads them. The exchange table
        # goes there too (kombu's default is ./control, in whatever folder the service was started from).
        # kombu looks for new messages once a second by default: half a second, on average, added to every
        # interactive job of the embedded service. A look is one directory listing.
        transport = {"data_folder_in": str(folder), "data_folder_out": str(folder),
                     "control_folder": str(folder / "control"), "polling_interval": FILESYSTEM_POLL_SECONDS}
        app.conf.broker_transport = f"{__name__}:AtomicFilesystemTransport"
    elif settings.broker_key_prefix:
        transport["global_keyprefix"] = settings.broker_key_prefix
    app.conf.update(
        task_default_queue=settings.queue_name,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        # Remote control and events use broadcast exchanges that the filesystem transport lacks.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport,
        # A POST must not hang on a dead broker: the job is committed already and the sweeper will kick it.
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
        broker_connection_timeout=2,
    )
    return app


def drain_queue(settings: Settings, model: str) -> str:
    """The broker queue whose messages wake `model`'s workers: QUEUE_NAME with MODEL alone; with MODELS, one
    queue per model (its name kept to characters every transport takes: the filesystem broker's file names
    end with the queue's)."""
    if not settings.models:
        return settings.queue_name
    return f"{settings.queue_name}-{re.sub(r'[^A-Za-z0-9_-]', '_', model)}"


@lru_cache
def _sender() -> Celery:
    return make_celery(get_settings())


# Redis only: a kick is sent only while none is pending, i.e. while no kick was sent since a worker last began
# a claim (a worker clears the flag before each claim, see `clear_pending_kick`). A job committed while the
# flag is set is seen by that coming claim, so it needs no message of its own. A stream of jobs then costs a
# message per claim instead of one per coalescing window (each costs a worker about a millisecond of Python),
# and a backlog of jobs queued while no worker ran leaves one message, not thousands. The flag expires, so a
# lost message holds later kicks back for at most KICK_PENDING_SECONDS.
KICK_PENDING_SECONDS = 1.0


@lru_cache
def _redis() -> Any | None:
    """A Redis client for the pending-kick flags, or None where the broker is not Redis."""
    settings = get_settings()
    if not settings.celery_broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    return redis.Redis.from_url(settings.celery_broker_url, socket_timeout=2, socket_connect_timeout=2)


def _flag_key(queue: str) -> str:
    return f"{get_settings().broker_key_prefix}{queue}:kick-pending"


def _send_kick(queue: str) -> None:
    try:
        if (client := _redis()) is not None:
            if not client.set(_flag_key(queue), 1, nx=True, px=int(KICK_PENDING_SECONDS * 1000)):
                return  # a kick is pending: the claim it starts sees this job too
        _sender().send_task(DRAIN_TASK, queue=queue)
    except Exception as exc:  # a broker outage must not fail a request whose job is safely stored
        log.warning("could not send a drain message (the sweeper will pick the job up): %s", exc)


def clear_pending_kick(model: str) -> None:
    """Called by a worker of `model` just before it claims: a job committed from now on sends a kick of its own."""
    if (client := _redis()) is not None:
        try:
            client.delete(_flag_key(drain_queue(get_settings(), model)))
        except Exception as exc:  # the flag expires by itself
            log.debug("could not clear the pending kick: %s", exc)


class KickCoalescer:
    """Sends the first kick at once, and the kicks that follow within `window` seconds of the last one sent as
    one kick at the end of the window. A message per job would cost the API a broker round trip per job, while one
    drain claims every ready job. The coalesced kick is sent after each of its callers returned, so after their
    jobs were committed: no job is left without a kick, and none waits for one more than `window`."""

    def __init__(self, send: Callable[[], None], window: float) -> None:
        self._send = send
        self._window = window
        self._lock = threading.Lock()
        self._last = -math.inf
        self._due = False  # a coalesced kick is scheduled
        self._scheduled = threading.Event()
        self._sender_pid = 0  # the process whose thread sends the coalesced kicks (a forked child starts its own)

    def kick(self) -> None:
        with self._lock:
            if self._due:
                return
            if self._last + self._window > time.monotonic():
                self._due = True
                if self._sender_pid != os.getpid():
                    # One thread for every coalesced kick: a timer thread each would cost the API a thread start
                    # per window (up to 100 a second).
                    self._sender_pid = os.getpid()
                    threading.Thread(target=self._send_scheduled, name="kick-sender", daemon=True).start()
                self._scheduled.set()
                return
            self._last = time.monotonic()
        self._send()

    def _send_scheduled(self) -> None:
        while True:
            self._scheduled.wait()
            self._scheduled.clear()
            with self._lock:
                wait = self._last + self._window - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self._lock:
                self._due = False
                self._last = time.monotonic()
            self._send()


KICK_WINDOW_SECONDS = 0.01
_kicks: dict[str, KickCoalescer] = {}  # by queue
_kicks_lock = threading.Lock()


def kick_drain(model: str) -> None:
    """Asks some worker of `model` to drain the ready jobs (coalesced per model: KickCoalescer). Best effort:
    the sweeper covers a lost message."""
    queue = drain_queue(get_settings(), model)
    with _kicks_lock:
        if (kicks := _kicks.get(queue)) is None:
            kicks = _kicks[queue] = KickCoalescer(lambda: _send_kick(queue), KICK_WINDOW_SECONDS)
    kicks.kick()


def broker_reachable() -> bool:
    try:
        with _sender().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
            # A pooled Redis connection counts as connected until it is used: ask the server itself.
            if (client := getattr(conn.default_channel, "client", None)) is not None:
                client.ping()
        return True
    except Exception:
        return False
