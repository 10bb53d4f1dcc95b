"""Prometheus metrics. Request metrics live in the API process; job, pass and webhook figures are read from
the database at scrape time, so every worker's passes show up here without a shared metrics store."""

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.db import session_factory
from api.models import Job, Pass, WebhookDelivery, Worker, utcnow
from api.settings import get_settings

ITEMS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


class DatabaseCollector(Collector):
    def collect(self) -> Iterator:  # type: ignore[type-arg]
        with session_factory()() as session:
            by_status = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            jobs = GaugeMetricFamily("packscore_jobs", "Jobs by status", labels=["status"])
            for status in JOB_STATUSES:
                jobs.add_metric([status], by_status.get(status, 0))
            yield jobs
            yield GaugeMetricFamily("packscore_queue_depth", "Jobs waiting for a worker",
                                    value=by_status.get("queued", 0))

            item_buckets = [func.sum(case((Pass.n_items <= b, 1), else_=0)) for b in ITEMS_BUCKETS]
            second_buckets = [func.sum(case((Pass.seconds <= b, 1), else_=0)) for b in SECONDS_BUCKETS]
            row = session.execute(select(func.count(), func.coalesce(func.sum(Pass.n_items), 0),
                                         func.coalesce(func.sum(Pass.seconds), 0.0),
                                         func.coalesce(func.sum(Pass.tokens), 0),
                                         *item_buckets, *second_buckets)).one()
            count, items, seconds, tokens = row[0], row[1], row[2], row[3]
            n = len(ITEMS_BUCKETS)
            yield CounterMetricFamily("packscore_passes", "Packed forward passes run by workers", value=count)
            yield CounterMetricFamily("packscore_pass_tokens", "Real tokens computed in passes", value=tokens)
            hist = HistogramMetricFamily("packscore_pass_items", "Items scored per pass")
            hist.add_metric([], [(str(b), row[4 + i] or 0) for i, b in enumerate(ITEMS_BUCKETS)] + [("+Inf", count)],
                            sum_value=items)
            yield hist
            hist = HistogramMetricFamily("packscore_pass_seconds", "Pass latency")
            hist.add_metric([], [(str(b), row[4 + n + i] or 0) for i, b in enumerate(SECONDS_BUCKETS)]
                            + [("+Inf", count)], sum_value=seconds)
            yield hist

            deliveries = GaugeMetricFamily("packscore_webhook_deliveries", "Webhook deliveries by status",
                                           labels=["status"])
            for status, total in session.execute(select(WebhookDelivery.status, func.count())
                                                 .group_by(WebhookDelivery.status)).all():
                deliveries.add_metric([status], total)
            yield deliveries
            attempts = session.scalar(select(func.coalesce(func.sum(WebhookDelivery.attempts), 0)))
            yield CounterMetricFamily("packscore_webhook_attempts", "Webhook delivery attempts", value=attempts)

            cutoff = utcnow().timestamp() - get_settings().worker_stale_seconds
            live = sum(1 for seen in session.scalars(select(Worker.last_seen_at)) if seen.timestamp() >= cutoff)
            yield GaugeMetricFamily("packscore_workers", "Workers seen recently", value=live)


class Metrics:
    """One registry per app (tests build several apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("packscore_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("packscore_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry)
        self.registry.register(DatabaseCollector())


class MetricsMiddleware:
    """Counts requests by route template (not raw path, which would explode label cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
