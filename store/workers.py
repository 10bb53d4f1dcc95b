"""The workers' registry: heartbeats (which also extend the leases of the jobs a worker holds), and which
workers and queued models /readyz, /v1/models and /workers see."""

import socket
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from store.db import among, session_scope
from store.models import Job, Pass, Worker, utcnow
from store.schemas import ThroughputPoint, WarmupPrograms, WorkerList, WorkerOut
from store.settings import Settings

HOUR_SECONDS = 3600.0

_JOBS = Job.__table__.c


def heartbeat(owner: str, model: str, settings: Settings, job_ids: set[str], attention: str | None = None,
              state: str = "ready", warmup: tuple[int, int] | None = None) -> None:
    """Extends the leases of `job_ids` (the jobs the process is scoring) and marks the worker alive (for
    /readyz), with its state ("warming" or "ready"), its warm-up's programs (done, total) while it warms,
    and the attention path its engine runs (for /metrics)."""
    done, total = warmup if warmup is not None and state == "warming" else (None, None)
    now = utcnow()
    lease = timedelta(seconds=settings.lease_seconds)
    with session_scope() as session:
        if job_ids:
            # Only leases past half their length (and never closer to expiry than three heartbeats): each
            # extension is a new row version, and a job held for a second or two (a batch line) needs none.
            due = now + max(lease / 2, timedelta(seconds=3 * settings.sweep_interval_seconds))
            session.execute(update(Job.__table__).where(among(session, _JOBS.id, list(job_ids)),
                                                        _JOBS.lease_owner == owner, _JOBS.status == "running",
                                                        _JOBS.lease_expires_at < due)
                            .values(lease_expires_at=now + lease))
        if not session.execute(update(Worker).where(Worker.id == owner)
                               .values(last_seen_at=now, attention=attention, state=state, warmup_done=done,
                                       warmup_total=total)).rowcount:
            session.add(Worker(id=owner, model=model, started_at=now, last_seen_at=now, attention=attention,
                               state=state, host=socket.gethostname(), device_group=settings.device_group,
                               warmup_done=done, warmup_total=total))


class DtypeMismatch(RuntimeError):
    """A worker whose dtype differs from that of its model's live workers (a score would depend on the host)."""


def register(owner: str, model: str, dtype: str, settings: Settings, platform: str | None = None) -> None:
    """Records a starting worker ("warming") with its engine's dtype, unless its model's live workers (seen within
    WORKER_STALE_SECONDS) compute in another: then DtypeMismatch, saying which and how to align them. `platform`:
    its devices' ("cpu", "tpu", "gpu"), for GET /workers. On
    PostgreSQL registrations of one model take a lock in turn, so two workers starting at once cannot both pass."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    with session_scope() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"workers.dtype:{model}"})
        others = session.execute(select(Worker.dtype, func.count()).where(
            Worker.model == model, Worker.id != owner, Worker.last_seen_at >= cutoff, Worker.dtype.is_not(None),
            Worker.dtype != dtype).group_by(Worker.dtype)).all()
        if others:
            found = ", ".join(f"{n} in {other}" for other, n in others)
            raise DtypeMismatch(f"model {model}: this worker computes in {dtype} but the model's live workers do "
                                f"not ({found}); a model is served in one dtype, so that its scores do not "
                                f"depend on the worker: set DTYPE to match, or stop those workers first")
        now = utcnow()
        session.merge(Worker(id=owner, model=model, started_at=now, last_seen_at=now, state="warming",
                             host=socket.gethostname(), device_group=settings.device_group, dtype=dtype,
                             platform=platform))


def model_dtypes(session: Session, settings: Settings) -> dict[str, str]:
    """The dtype of each model with live workers (one per model: see register)."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    return dict(session.execute(select(Worker.model, func.min(Worker.dtype)).where(
        Worker.last_seen_at >= cutoff, Worker.dtype.is_not(None)).group_by(Worker.model)).all())


def live_workers(session: Session, settings: Settings) -> dict[str, dict[str, int]]:
    """Workers seen within WORKER_STALE_SECONDS: model -> state ("ready", "warming") -> how many."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    found: dict[str, dict[str, int]] = {}
    for model, state, n in session.execute(select(Worker.model, Worker.state, func.count())
                                           .where(Worker.last_seen_at >= cutoff).group_by(Worker.model, Worker.state)):
        found.setdefault(model, {})[state] = n
    return found


def live_device_groups(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """Workers seen within WORKER_STALE_SECONDS, each with its host, the chips it was given (`packscore worker
    --devices`; None for a worker started alone), its model and state, and while it warms its `programs`
    {done, total}; by host and device group."""
    cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
    rows = session.execute(select(Worker.host, Worker.device_group, Worker.model, Worker.state, Worker.warmup_done,
                                  Worker.warmup_total).where(Worker.last_seen_at >= cutoff)).all()
    return [{"host": host, "device_group": group, "model": model, "state": state,
             **({"programs": {"done": done, "total": total}} if state == "warming" and total else {})}
            for host, group, model, state, done, total in sorted(rows, key=lambda row: (row[0] or "", row[1] or "",
                                                                                        row[2]))]


def worker_list(session: Session, settings: Settings) -> WorkerList:
    """GET /workers: each live worker with its passes of the last minute, and the deployment's items/s per minute
    over the last hour. Both read the passes table by its created_at index (a pass of reference-batch chunks
    only leaves no row there, so neither counts it). dtype and device kind as the worker registered them."""
    now = utcnow()
    minute = now - timedelta(seconds=60)
    recent = (select(Pass.worker, func.count().label("passes"), func.sum(Pass.n_items).label("n_items"),
                     func.sum(Pass.seconds).label("seconds"))
              .where(Pass.created_at >= minute).group_by(Pass.worker).subquery())
    rows = session.execute(select(Worker, recent.c.passes, recent.c.n_items, recent.c.seconds)
                           .outerjoin(recent, recent.c.worker == Worker.id)
                           .where(Worker.last_seen_at >= now - timedelta(seconds=settings.worker_stale_seconds))
                           .order_by(Worker.host, Worker.device_group, Worker.model, Worker.id)).all()
    workers = [WorkerOut(id=w.id, model=w.model, host=w.host, device_group=w.device_group,
                         device_kind=w.platform or _device_kind(w.device_group, w.attention), attention=w.attention,
                         dtype=w.dtype or settings.dtype, state=w.state, started_at=w.started_at,
                         last_seen_at=w.last_seen_at,
                         programs=WarmupPrograms(done=w.warmup_done or 0, total=w.warmup_total)
                         if w.state == "warming" and w.warmup_total else None,
                         passes_per_second=(passes or 0) / 60, items_per_second=float(items or 0) / 60,
                         busy=min(1.0, float(seconds or 0) / 60))
               for w, passes, items, seconds in rows]
    history = min(HOUR_SECONDS, settings.pass_history_days * 86400)
    return WorkerList(data=workers, throughput=_items_per_minute(session, now, history), history_seconds=history)


def _items_per_minute(session: Session, now: datetime, history: float) -> list[ThroughputPoint]:
    """Items/s of each minute of the last `history` seconds, oldest first (the current minute's over its seconds
    so far); a minute without passes is a 0."""
    # SQLite (the embedded deployment) has no date_trunc; both give the minute as a naive UTC time.
    if session.get_bind().dialect.name == "postgresql":
        bucket = func.date_trunc("minute", Pass.created_at)
    else:
        bucket = func.strftime("%Y-%m-%d %H:%M:00", Pass.created_at)
    items = {(m if isinstance(m, datetime) else datetime.fromisoformat(m)): float(n) for m, n in session.execute(
        select(bucket, func.sum(Pass.n_items)).where(Pass.created_at >= now - timedelta(seconds=history))
        .group_by(bucket))}
    current = now.replace(second=0, microsecond=0)
    minutes = [current - timedelta(minutes=back) for back in reversed(range(max(1, int(history // 60))))]
    return [ThroughputPoint(minute=m, items_per_second=items.get(m, 0.0) / (
        max(1.0, (now - m).total_seconds()) if m == current else 60.0)) for m in minutes]


def _device_kind(device_group: str | None, attention: str | None) -> str | None:
    """"tpu" of a "tpu:0,1" group; else what a kernel's attention path names ("pallas-tpu", "pallas-mosaic-gpu")."""
    if device_group:
        return device_group.split(":")[0]
    return next((kind for kind in ("tpu", "gpu") if attention and attention.endswith(f"-{kind}")), None)


def waiting_models(session: Session, models: list[str]) -> set[str]:
    """Those of these models with a job queued (one index probe each, however long the queue)."""
    return {model for model in models
            if session.scalar(select(Job.id).where(Job.model == model, Job.status == "queued").limit(1))}


def deregister(owner: str) -> None:
    """A worker stopping cleanly leaves /readyz's count at once (not a stale-heartbeat interval later)."""
    with session_scope() as session:
        session.execute(delete(Worker).where(Worker.id == owner))
