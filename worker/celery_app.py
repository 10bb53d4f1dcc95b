"""The workers' Celery app (store/broker.py configures it; the API sends its kicks through the same settings)."""

from store.broker import make_celery
from store.settings import get_settings

app = make_celery(get_settings(), include=("worker.tasks",))
