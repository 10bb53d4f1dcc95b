"""An uploaded batch's counts kept on its row as its requests end: by status, and the items scored of its ended
requests. Every statement that ends requests of a batch (finishing, cancelling, failed lines at upload) adds
what it ended here, in its own transaction, so GET /batches reads a row per batch, not its requests."""

from collections import defaultdict
from collections.abc import Iterable

from sqlalchemy import update
from sqlalchemy.orm import Session

from store.models import Batch

ENDED = ("succeeded", "failed", "cancelled")


def add_ended(session: Session, ended: Iterable[tuple[str | None, str, int]]) -> None:
    """Adds these ended requests, as (batch id, status, items done), to their batches' counts: one UPDATE per
    batch. Interactive jobs (batch id None) are left out."""
    added: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for batch_id, status, items_done in ended:
        if batch_id is not None:
            added[batch_id][status] += 1
            added[batch_id]["items_ended"] += items_done
    for batch_id, columns in sorted(added.items()):  # a fixed order: concurrent writers lock rows alike
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            {name: getattr(Batch, name) + n for name, n in columns.items()}))
