"""The workers' Celery app (store/broker.py configures it; the API sends its kicks through the same settings)."""

import os
import warnings

from celery.exceptions import SecurityWarning

from store.broker import drain_queue, make_celery
from store.settings import get_settings

app = make_celery(get_settings(), include=("worker.tasks",))
# The variable by which `worker --devices` and `serve --embedded` (packscore/supervisor.py) give each worker they
# start their own pid (worker/tasks.py stops a worker whose supervisor is gone).
SUPERVISOR_PID = "PACKSCORE_SUPERVISOR_PID"
# Celery warns at each start of a worker run as root (a container's default user, `make run` in a root shell).
# The danger it means is a message unpickled as root; these workers accept JSON only (Celery's default, which
# the broker settings keep), and Celery itself refuses to start as root if pickle is accepted.
warnings.filterwarnings("ignore", "You're running the worker with superuser privileges", SecurityWarning)


def worker_argv(loglevel: str = "INFO", node: str | None = None) -> list[str]:
    """`celery worker`'s arguments: the solo pool (the task runs in the worker's own process, which loaded the
    model; nothing forks after JAX), on the queue of the worker's model. `node`: the Celery node name, unique
    on the host (default: from this process's id; `packscore worker --devices` names each of its workers)."""
    return ["worker", "--pool", "solo", "--concurrency", "1", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-Q", drain_queue(get_settings(), get_settings().worker_model),
            "--loglevel", loglevel, "--hostname", f"{node or f'packscore-{os.getpid()}'}@%h"]
