"""The broker: the Celery app's configuration, and the "kick" that the API and the workers send to wake a worker.
The broker only wakes workers up: the jobs table is the queue of record, so a lost or
duplicated `drain` message costs nothing (the sweeper re-kicks, an extra drain finds nothing to do)."""

import logging
from functools import lru_cache
from pathlib import Path

from celery import Celery

from store.settings import Settings, get_settings

log = logging.getLogger(__name__)

DRAIN_TASK = "packscore.drain"


def make_celery(settings: Settings, include: tuple[str, ...] = ()) -> Celery:
    """The app as the workers run it (`include`: their task modules) and as kicks are sent with it (none)."""
    # The sending app must not replace a worker's own as Celery's current app.
    app = Celery("packscore", broker=settings.celery_broker_url, include=list(include), set_as_current=bool(include))
    transport: dict = {"visibility_timeout": 3600}
    if settings.celery_broker_url.startswith("filesystem"):
        folder = Path(settings.broker_dir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        # One folder serves as both ends: the API writes messages, the worker reads them. The exchange table
        # goes there too (kombu's default is ./control, in whatever folder the service was started from).
        transport = {"data_folder_in": str(folder), "data_folder_out": str(folder),
                     "control_folder": str(folder / "control")}
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


@lru_cache
def _sender() -> Celery:
    return make_celery(get_settings())


def kick_drain() -> None:
    """Asks some worker to drain the ready jobs. Best effort: the sweeper covers a lost message."""
    try:
        _sender().send_task(DRAIN_TASK)
    except Exception as exc:  # a broker outage must not fail a request whose job is safely stored
        log.warning("could not send a drain message (the sweeper will pick the job up): %s", exc)


def broker_reachable() -> bool:
    try:
        with _sender().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False
