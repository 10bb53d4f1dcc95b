"""The monitoring that `docker compose --profile monitoring up` starts (monitoring/): every PromQL expression
of the Grafana dashboard names only metrics that /metrics exports, the panels the README lists are there,
Prometheus scrapes the API service, Grafana is provisioned with both; and the queue depth by lane."""

import ctypes.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_batches_api import auth, clean, request_line, upload  # noqa: F401 (clean is a fixture)

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana" / "dashboards" / "packscore.json").read_text())
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
# PromQL words that are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
            "inf", "nan"}


def exprs() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: identifiers that are not functions, keywords, labels
    (matchers, `by (...)` lists), ranges or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr)
    return {name for name in names if name.lower() not in KEYWORDS}


def test_metric_names_parser() -> None:
    assert metric_names('histogram_quantile(0.95, sum by (le, route) (rate(a_bucket{x="y(z)"}[5m])))') == {"a_bucket"}
    assert metric_names("rate(a_sum[$__rate_interval]) / rate(a_count[1m]) * 1e3") == {"a_sum", "a_count"}
    assert metric_names('sum without (status) (b_total{status=~"a|b"}) > bool 2') == {"b_total"}


# The series a family of each type is exposed as (prometheus_client's text format): a counter's TYPE line already
# names its _total series; a histogram's or summary's family name is never a series of its own.
SERIES = {"counter": ("",), "gauge": ("",), "untyped": ("",), "histogram": ("_bucket", "_sum", "_count"),
          "summary": ("_sum", "_count")}


def exported(client) -> set[str]:  # type: ignore[no-untyped-def]
    """Every series name /metrics exports, and those its families will export once they have samples (a labelled
    metric has none before its first use): only names Prometheus stores, so a dashboard that queries a bare
    histogram or counter family name (packscore_pass_seconds, packscore_jobs_finished) fails the test."""
    text = client.get("/metrics").text
    names = {re.match(r"[\w:]+", line).group(0) for line in text.splitlines() if line and not line.startswith("#")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"
        names |= {name + suffix for suffix in SERIES[kind]}
    return names


def test_every_dashboard_expression_names_exported_metrics(client) -> None:  # type: ignore[no-untyped-def]
    client.get("/healthz")  # so the request metrics have samples
    available = exported(client)
    assert {"packscore_pass_seconds_bucket", "packscore_jobs_finished_total", "packscore_workers"} <= available
    for expr in exprs():
        names = metric_names(expr)
        assert names, f"{expr!r} names no metric"
        assert names <= available, f"{expr!r} names {sorted(names - available)}, which /metrics does not export"
    # The check can fail: names /metrics does not export, and family names that are not series of their own.
    assert not {"packscore_made_up_total", "packscore_pass_seconds", "packscore_pass_items",
                "packscore_http_request_seconds", "packscore_jobs_finished", "packscore_http_requests",
                "packscore_passes_total_total"} & available


@pytest.mark.parametrize("title, metric", [
    ("Throughput (items/s)", "packscore_pass_items_sum"),
    ("Pass latency", "packscore_pass_seconds_bucket"),
    ("Queue depth by lane", "packscore_queue_depth_by_lane"),
    ("Jobs by status", "packscore_jobs_finished_total"),
    ("Webhook deliveries", "packscore_webhook_deliveries_finished_total"),
    ("Workers", "packscore_workers"),
    ("Attention path", "packscore_worker_attention"),
])
def test_dashboard_panels(title: str, metric: str) -> None:
    panels = {panel["title"]: panel for panel in DASHBOARD["panels"]}
    assert metric in set().union(*(metric_names(t["expr"]) for t in panels[title]["targets"]))
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "prometheus" for panel in panels.values() for t in panel["targets"])


def test_compose_monitoring_profile() -> None:
    services = COMPOSE["services"]
    monitoring = {name for name, service in services.items() if "monitoring" in service.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    # The default `docker compose up` is unchanged: no other service has a profile.
    assert all("profiles" not in service for name, service in services.items() if name not in monitoring)
    for name in monitoring:
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["uid"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/packscore.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert f"./monitoring/grafana/dashboards:{path}:ro" in services["grafana"]["volumes"]


def lane_depth(client) -> dict[str, float]:  # type: ignore[no-untyped-def]
    text = client.get("/metrics").text
    return {lane: float(value) for lane, value in
            re.findall(r'^packscore_queue_depth_by_lane\{lane="(\w+)"\} (\S+)$', text, re.M)}


def test_queue_depth_by_lane(client, make_key, clean) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert lane_depth(client) == {"interactive": 0, "batch": 0}
    for _ in range(2):
        client.post("/jobs", json={"query": "q", "items": ["a"], "label_token_ids": [1]}, headers=auth(key))
    assert upload(client, key, [request_line(i) for i in range(3)]).status_code == 201
    assert lane_depth(client) == {"interactive": 2, "batch": 3}
    assert re.search(r"^packscore_queue_depth 5\.0$", client.get("/metrics").text, re.M)


def test_a_worker_logs_what_its_memory_holds(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The memory log an operator (and benchmarks/soak.py) reads: RSS beside the bounded parts, and with
    TRACE_PYTHON_MEMORY the lines whose Python allocations grew since the last log."""
    import tracemalloc
    from types import SimpleNamespace

    from store.settings import Settings
    from worker import tasks

    monkeypatch.setattr(tasks, "get_scorer", lambda: SimpleNamespace(
        cached_prefix_bytes=3 << 20, prefix_cache_bytes=256 << 20, resident_programs=4, compiled_programs=21))
    settings = Settings(memory_log_seconds=1e-9, trace_python_memory=True)
    monkeypatch.setattr(tasks, "_traced", None)
    caplog.set_level("INFO", logger="worker.tasks")
    try:
        tasks._log_memory(settings)
        kept = [bytearray(4096) for _ in range(500)]  # 2 MB that the second log must name
        freed = [bytearray(4096) for _ in range(15000)]  # 60 MB freed below memory still in use: glibc keeps it
        pinned = bytearray(4096)
        del freed
        tasks._log_memory(settings)
    finally:
        tracemalloc.stop()
    lines = [r.getMessage() for r in caplog.records]
    first = re.match(r"memory: RSS ([\d.]+) MB \(([\d.]+) anonymous, ([\d.]+) of it in huge pages, ([\d.]+) "
                     r"file-backed; ([1-9]\d*) threads\); prefix cache 3\.0 of 256\.0 MB; 4 pass programs resident "
                     r"\(21 compiled\); Arrow's \w+ pool [\d.]+ MB", lines[0])
    assert first and 0 < float(first[2]) + float(first[4]) <= float(first[1]) + 1, lines[0]
    assert float(first[3]) <= float(first[2]), lines[0]
    handed_back = [float(m) for m in re.findall(r"([\d.]+) MB of freed memory handed back", "".join(lines))]
    assert len(handed_back) == 2 and handed_back[1] > 30, lines  # the second log's malloc_trim gave the 60 MB back
    blocks = [int(b) for b in re.findall(r"Python: (\d+) blocks allocated, \d+ modules", "".join(lines))]
    assert len(blocks) == 2 and blocks[1] - blocks[0] >= 500  # the 500 objects `kept` holds at the second log
    assert len(pinned) == 4096
    grew = [line for line in lines if "grew most" in line]
    assert len(grew) == 1 and "test_monitoring.py" in grew[0].split("|")[0], grew
    assert len(kept) == 500


def test_a_worker_on_jemalloc_logs_what_jemalloc_holds() -> None:
    # A worker process under the preload `packscore worker` gives it (WORKER_ALLOCATOR): the memory log names
    # jemalloc with its memory in use and resident; a process without it names glibc.
    library = ctypes.util.find_library("jemalloc")
    said = {}
    for preload in (library, None):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")}
        if preload:  # as worker_allocator_environment gives it: Python's objects from jemalloc too
            env |= {"LD_PRELOAD": preload, "PYTHONMALLOC": "malloc"}
        said[preload] = subprocess.run(
            [sys.executable, "-c", "from core import allocator; print(allocator.hand_back_freed_memory(), "
             "allocator._MALLOC_TRIM is None, '|', allocator.python_objects())"],
            env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    # The engine's trim after each pass is glibc's only: jemalloc hands pages back on its own. Python's blocks
    # are counted in its own arenas only; from the C allocator they are in jemalloc's figures.
    assert re.fullmatch(r"glibc False \| [1-9]\d* blocks allocated", said[None]), said
    if library is not None:  # Debian's libjemalloc2 (the image installs it); the suite's hosts have it
        match = re.fullmatch(r"jemalloc \(([\d.]+) MB in use, ([\d.]+) MB resident, ([\d.]+) MB of it metadata\) "
                             r"True \| objects from the C allocator", said[library])
        assert match and 0 < float(match[1]) <= float(match[2]) and 0 < float(match[3]) < float(match[2]), said


def test_a_worker_logs_an_outage_in_one_line_and_other_failures_with_their_traceback() -> None:
    """worker/tasks.py's WorkerTracebacks, on the handlers Celery sets up: a database that is down fails each
    background step every second, which logged a 75-line traceback each time; and the source lines tracebacks
    read stayed in memory for good (issue 47's soak)."""
    import io
    import linecache
    import logging

    import sqlalchemy.exc
    from celery.signals import after_setup_logger

    from worker import tasks

    linecache.clearcache()
    stream = io.StringIO()
    logger = logging.Logger("outage-test")
    logger.addHandler(logging.StreamHandler(stream))
    after_setup_logger.send(sender=None, logger=logger, loglevel=logging.INFO, logfile=None, format="%(message)s",
                            colorize=False)
    down = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("terminating connection\nDETAIL: more"))
    for error in (down, ConnectionRefusedError(111, "Connection refused"), ValueError("a bug")):
        try:
            raise error
        except Exception:  # noqa: BLE001
            logger.exception("background step %s failed", "_deliver")
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("background step _deliver failed (OperationalError: (builtins.Exception) terminating "
                        "connection)")
    assert lines[1] == "background step _deliver failed (ConnectionRefusedError: [Errno 111] Connection refused)"
    assert lines[2] == "background step _deliver failed" and lines[3] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: a bug" and stream.getvalue().count("Traceback") == 1
    assert any(isinstance(f, tasks.WorkerTracebacks) for f in logger.handlers[0].filters)
    # The traceback shows its source lines, but linecache keeps none of them (nor of sqlalchemy's, above).
    assert '    raise error' in lines and __file__ not in linecache.cache
