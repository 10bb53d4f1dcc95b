"""Running totals and live figures from the database, for /metrics. Job, pass and webhook figures come from the
database, so every worker's passes show up here without a shared metrics store, and a scrape costs the same
at ten rows of history or ten million: running totals are kept in the `counters` table as events happen
(`count`), and the gauges count only live rows (queued and running jobs, pending deliveries) through indexes."""

import logging
import random
from bisect import bisect_left
from collections.abc import Callable, Iterator
from datetime import timedelta

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import event, func, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, SessionTransaction

from store.db import session_factory
from store.models import TERMINAL_STATUSES, CounterRow, Job, WebhookDelivery, Worker, utcnow
from store.priorities import PRIORITY_BATCH
from store.settings import get_settings

ITEMS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LIVE_JOB_STATUSES = ("queued", "running")
COUNTER_SHARDS = 8
_PENDING = "packscore_counts"


def count(session: Session, name: str, amount: float = 1.0, label: str = "") -> None:
    """Adds `amount` to the running total `name{label}` when this session's transaction commits; nothing if
    it rolls back, so the totals agree with the rows they count."""
    session.connection()  # begins the transaction if need be, so that its rollback drops these counts
    pending = session.info.setdefault(_PENDING, {})
    pending[name, label] = pending.get((name, label), 0.0) + amount


def count_pass(session: Session, n_items: int, tokens: int, seconds: float, host_seconds: float,
               device_seconds: float, device_idle_seconds: float) -> None:
    """A pass's totals. Its host and device seconds (see core.scorer.PassResult) have histograms that count their
    own passes ("timed_passes"): "passes" also counts the passes a database holds from before they were timed.
    A histogram's value counts in its own bucket only ("{measure}_in_bucket", none past the last bucket), which
    the scrape sums into cumulative buckets (`_pass_histogram`): one counter row per measure and pass, not one
    per bucket from the value up (a database's "{measure}_bucket" rows, counted that way, are still summed in)."""
    count(session, "passes")
    count(session, "timed_passes")
    count(session, "pass_tokens", tokens)
    if device_idle_seconds:
        count(session, "device_idle_seconds", device_idle_seconds)
    for measure, value, buckets in (("pass_items", n_items, ITEMS_BUCKETS), ("pass_seconds", seconds, SECONDS_BUCKETS),
                                    ("pass_host_seconds", host_seconds, SECONDS_BUCKETS),
                                    ("pass_device_seconds", device_seconds, SECONDS_BUCKETS)):
        count(session, measure, value)
        if value <= buckets[-1]:
            count(session, f"{measure}_in_bucket", label=str(buckets[bisect_left(buckets, value)]))


@event.listens_for(Session, "before_commit")
def _write_counts(session: Session) -> None:
    pending = session.info.pop(_PENDING, None)
    if not pending:
        return
    shard = random.randrange(COUNTER_SHARDS)
    # Sorted: concurrent transactions lock counter rows in the same order, so they can wait but not deadlock.
    rows = [{"name": name, "label": label, "shard": shard, "value": amount}
            for (name, label), amount in sorted(pending.items())]
    insert = postgresql_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = insert(CounterRow).values(rows)
    session.execute(statement.on_conflict_do_update(
        index_elements=["name", "label", "shard"], set_={"value": CounterRow.value + statement.excluded.value}))


@event.listens_for(Session, "after_soft_rollback")
def _drop_counts(session: Session, previous_transaction: SessionTransaction) -> None:
    if previous_transaction.parent is None:  # the whole transaction, not a savepoint within it
        session.info.pop(_PENDING, None)


def _pass_histogram(name: str, doc: str, totals: dict, buckets: tuple, measure: str,
                    passes: str = "passes") -> HistogramMetricFamily:
    """The cumulative buckets: the counts kept per bucket from the value up ("{measure}_bucket") plus the
    per-bucket counts ("{measure}_in_bucket", see count_pass) of this bucket and those below it."""
    family = HistogramMetricFamily(name, doc)
    below, cumulative = 0.0, []
    for b in buckets:
        below += totals.get((f"{measure}_in_bucket", str(b)), 0)
        cumulative.append((str(b), totals.get((f"{measure}_bucket", str(b)), 0) + below))
    family.add_metric([], cumulative + [("+Inf", totals.get((passes, ""), 0))], sum_value=totals.get((measure, ""), 0))
    return family


class DatabaseCollector(Collector):
    def __init__(self, sessions: Callable[[], Session] | None = None) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator:  # type: ignore[type-arg]
        up = GaugeMetricFamily("packscore_database_up", "Whether this scrape could read the database (0: the "
                               "database's figures are missing from it)")
        try:
            families = list(self._from_database())
        except SQLAlchemyError as exc:  # the database down: a scrape still gives this process's own figures
            logging.getLogger(__name__).warning("metrics: the database could not be read (%s)", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _from_database(self) -> Iterator:  # type: ignore[type-arg]
        with (self.sessions or session_factory())() as session:
            totals = {(name, label): value for name, label, value in session.execute(
                select(CounterRow.name, CounterRow.label, func.sum(CounterRow.value))
                .group_by(CounterRow.name, CounterRow.label))}
            # By model and priority too (the index's columns): per model, and the lanes apart.
            live_rows = session.execute(select(Job.model, Job.status, Job.priority, func.count())
                                        .where(Job.status.in_(LIVE_JOB_STATUSES))
                                        .group_by(Job.model, Job.status, Job.priority)).all()
            pending_deliveries = session.scalar(select(func.count()).select_from(WebhookDelivery)
                                                .where(WebhookDelivery.status == "pending"))
            settings = get_settings()
            cutoff = utcnow() - timedelta(seconds=settings.worker_stale_seconds)
            worker_rows = session.execute(select(Worker.model, Worker.attention, func.count())
                                          .where(Worker.last_seen_at >= cutoff)
                                          .group_by(Worker.model, Worker.attention)).all()
            group_rows = session.execute(select(Worker.host, Worker.device_group, Worker.model, Worker.state,
                                                func.count()).where(Worker.last_seen_at >= cutoff)
                                         .group_by(Worker.host, Worker.device_group, Worker.model, Worker.state)).all()
        workers: dict[str | None, int] = {}
        for _, path, n in worker_rows:
            workers[path] = workers.get(path, 0) + n

        live = {status: sum(n for _, s, _, n in live_rows if s == status) for status in LIVE_JOB_STATUSES}
        jobs = GaugeMetricFamily("packscore_jobs", "Jobs queued or running now", labels=["status"])
        for status in LIVE_JOB_STATUSES:
            jobs.add_metric([status], live.get(status, 0))
        yield jobs
        yield GaugeMetricFamily("packscore_queue_depth", "Jobs waiting for a worker", value=live.get("queued", 0))
        lanes = GaugeMetricFamily("packscore_queue_depth_by_lane", "Jobs waiting for a worker, by lane: interactive "
                                  "(/v1/score, /v1/rerank, POST /jobs) or batch", labels=["lane"])
        queued = [(priority, n) for _, status, priority, n in live_rows if status == "queued"]
        lanes.add_metric(["interactive"], sum(n for priority, n in queued if priority > PRIORITY_BATCH))
        lanes.add_metric(["batch"], sum(n for priority, n in queued if priority <= PRIORITY_BATCH))
        yield lanes
        finished = CounterMetricFamily("packscore_jobs_finished", "Jobs that reached a terminal status",
                                       labels=["status"])
        for status in TERMINAL_STATUSES:
            finished.add_metric([status], totals.get(("jobs_finished", status), 0))
        yield finished

        yield CounterMetricFamily("packscore_passes", "Packed forward passes run by workers",
                                  value=totals.get(("passes", ""), 0))
        yield CounterMetricFamily("packscore_pass_tokens", "Real tokens computed in passes",
                                  value=totals.get(("pass_tokens", ""), 0))
        yield _pass_histogram("packscore_pass_items", "Items scored per pass", totals, ITEMS_BUCKETS, "pass_items")
        yield _pass_histogram("packscore_pass_seconds", "Pass latency", totals, SECONDS_BUCKETS, "pass_seconds")
        yield _pass_histogram("packscore_pass_host_seconds", "Host time to plan, pack and launch a pass", totals,
                              SECONDS_BUCKETS, "pass_host_seconds", "timed_passes")
        yield _pass_histogram("packscore_pass_device_seconds", "Device time of a pass (its start to its results on "
                              "the host)", totals, SECONDS_BUCKETS, "pass_device_seconds", "timed_passes")
        yield CounterMetricFamily("packscore_device_idle_seconds", "Seconds devices sat idle waiting for the host: "
                                  "from a pass's results to the next pass's launch, where work was waiting",
                                  value=totals.get(("device_idle_seconds", ""), 0))

        yield GaugeMetricFamily("packscore_webhook_deliveries_pending", "Webhook deliveries waiting to succeed",
                                value=pending_deliveries)
        delivered = CounterMetricFamily("packscore_webhook_deliveries_finished",
                                        "Webhook deliveries that succeeded or gave up", labels=["status"])
        for status in ("delivered", "failed"):
            delivered.add_metric([status], totals.get(("webhook_deliveries_finished", status), 0))
        yield delivered
        yield CounterMetricFamily("packscore_webhook_attempts", "Webhook delivery attempts",
                                  value=totals.get(("webhook_attempts", ""), 0))
        yield GaugeMetricFamily("packscore_workers", "Workers seen recently", value=sum(workers.values()))
        paths = GaugeMetricFamily("packscore_worker_attention", "Workers seen recently, by the attention path "
                                  "their engine runs", labels=["path"])
        for path, total in sorted(workers.items(), key=lambda kv: kv[0] or ""):
            paths.add_metric([path or "unknown"], total)
        yield paths
        groups = GaugeMetricFamily("packscore_device_group_workers", "Workers seen recently, by host and the chips "
                                   "`packscore worker --devices` gave them (\"default\": a worker started alone)",
                                   labels=["host", "device_group", "model", "state"])
        for host, group, model, state, n in sorted(group_rows, key=lambda row: tuple(str(v) for v in row)):
            groups.add_metric([host or "unknown", group or "default", model, state], n)
        yield groups
        yield from _per_model(list(settings.served_models), live_rows, worker_rows)


def _per_model(models: list[str], live_rows: list, worker_rows: list) -> Iterator:
    """The figures of each configured model (and of any other a live job or worker names): a model's queue
    waits for its own workers only."""
    names = list(dict.fromkeys([*models, *(row[0] for row in live_rows), *(row[0] for row in worker_rows)]))
    depth = GaugeMetricFamily("packscore_model_queue_depth", "Jobs waiting for a worker of their model, by lane",
                              labels=["model", "lane"])
    running = GaugeMetricFamily("packscore_model_jobs_running", "Jobs running, by model", labels=["model"])
    workers = GaugeMetricFamily("packscore_model_workers", "Workers seen recently, by the model they serve",
                                labels=["model"])
    for name in names:
        queued = [(priority, n) for model, status, priority, n in live_rows if model == name and status == "queued"]
        depth.add_metric([name, "interactive"], sum(n for priority, n in queued if priority > PRIORITY_BATCH))
        depth.add_metric([name, "batch"], sum(n for priority, n in queued if priority <= PRIORITY_BATCH))
        running.add_metric([name], sum(n for model, status, _, n in live_rows if model == name and status == "running"))
        workers.add_metric([name], sum(n for model, _, n in worker_rows if model == name))
    yield depth
    yield running
    yield workers
