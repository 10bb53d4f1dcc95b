"""/metrics reads running totals and live rows only: its cost does not grow with the history of passes, jobs
and webhook deliveries (issue 12, item 9)."""

import json
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import sessionmaker

from migrations import upgrade
from store.counters import DatabaseCollector, count, count_pass

HISTORY = 200_000
SCAN_NODES = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Bitmap Index Scan"}


def scrape(sessions) -> dict[str, float]:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(sessions))
    return {f"{sample.name}{json.dumps(sample.labels, sort_keys=True) if sample.labels else ''}": sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def rows_read(plan: dict) -> float:
    here = plan["Actual Rows"] * plan["Actual Loops"] if plan["Node Type"] in SCAN_NODES else 0
    return here + sum(rows_read(child) for child in plan.get("Plans", []))


def seed_history(conn, n: int) -> None:  # type: ignore[no-untyped-def]
    """n finished jobs, n passes and n delivered webhooks, written straight to the tables (as years of
    traffic would have left them), plus a few live rows."""
    conn.execute(text("INSERT INTO api_keys (id, name, key_hash, webhook_secret, created_at) "
                      "VALUES ('key_history', 'history', 'hash', 'secret', now())"))
    job = ("INSERT INTO jobs (id, api_key_id, status, priority, model, request, return_logprobs, request_hash, "
           "items_total, items_done, prompt_tokens, attempts, cancel_requested, created_at) "
           "SELECT 'job_' || {prefix} || i, 'key_history', {status}, 0, 'm', '{{}}', false, '', 5, 5, 10, 0, false, "
           "now() FROM generate_series(1, {n}) AS i")
    conn.execute(text(job.format(prefix="'old'", status="'succeeded'", n=n)))
    conn.execute(text(job.format(prefix="'live'", status="CASE WHEN i % 2 = 0 THEN 'queued' ELSE 'running' END",
                                 n=7)))
    conn.execute(text("INSERT INTO passes (worker, n_jobs, n_items, tokens, padded_tokens, seconds, created_at) "
                      f"SELECT 'w', 1, 5, 100, 128, 0.2, now() FROM generate_series(1, {n})"))
    conn.execute(text("INSERT INTO webhook_deliveries (id, api_key_id, url, payload, status, attempts, "
                      "next_attempt_at, created_at) SELECT 'msg_' || i, 'key_history', 'http://x', '{}', "
                      "CASE WHEN i <= 3 THEN 'pending' ELSE 'delivered' END, 1, now(), now() "
                      f"FROM generate_series(1, {n}) AS i"))
    conn.execute(text("ANALYZE"))


def test_scrape_reads_no_history(database_factory, run_id: str) -> None:
    with database_factory(f"packscore_metrics_{run_id}") as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            seed_history(conn, HISTORY)
        statements: list[tuple[str, dict]] = []

        def record(conn, cursor, statement, params, context, many):  # type: ignore[no-untyped-def]
            statements.append((statement, params))

        event.listen(engine, "before_cursor_execute", record)
        metrics = scrape(sessionmaker(engine))
        event.remove(engine, "before_cursor_execute", record)
        assert metrics['packscore_jobs{"status": "queued"}'] == 3
        assert metrics['packscore_jobs{"status": "running"}'] == 4
        assert metrics["packscore_webhook_deliveries_pending"] == 3

        read = 0.0
        with engine.connect() as conn:
            for statement, params in [s for s in statements if s[0].lstrip().upper().startswith("SELECT")]:
                plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", params).scalar()
                read += rows_read(plan[0]["Plan"])
        engine.dispose()
    # Live rows and a few hundred counter rows, not the 600,000 rows of history.
    assert read < 2_000, f"a scrape read {read:.0f} rows"


@pytest.fixture
def sqlite_sessions(tmp_path):  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    upgrade(url)
    engine = create_engine(url)
    yield sessionmaker(engine)
    engine.dispose()


def test_totals_follow_committed_events_only(sqlite_sessions) -> None:  # type: ignore[no-untyped-def]
    for n_items, seconds in ((3, 0.02), (40, 0.7), (40, 12.0)):
        with sqlite_sessions.begin() as session:
            count_pass(session, n_items, tokens=10 * n_items, seconds=seconds, host_seconds=seconds / 4,
                       device_seconds=seconds / 2, device_idle_seconds=0.1)
            count(session, "jobs_finished", label="succeeded")
    with sqlite_sessions() as session:
        count_pass(session, 1000, tokens=1, seconds=1, host_seconds=1, device_seconds=1, device_idle_seconds=1)
        count(session, "jobs_finished", 5, label="failed")
        session.rollback()
        session.commit()  # nothing is left to write: the rolled-back counts are gone

    metrics = scrape(sqlite_sessions)
    assert metrics["packscore_passes_total"] == 3
    assert metrics["packscore_pass_tokens_total"] == 830
    assert metrics["packscore_pass_items_count"] == 3
    assert metrics["packscore_pass_items_sum"] == 83
    assert metrics['packscore_pass_items_bucket{"le": "4"}'] == 1
    assert metrics['packscore_pass_items_bucket{"le": "64"}'] == 3
    assert metrics['packscore_pass_seconds_bucket{"le": "1"}'] == 2
    assert metrics['packscore_pass_seconds_bucket{"le": "+Inf"}'] == 3
    assert metrics['packscore_pass_host_seconds_bucket{"le": "0.01"}'] == 1
    assert metrics['packscore_pass_device_seconds_bucket{"le": "0.25"}'] == 1
    assert metrics['packscore_pass_device_seconds_bucket{"le": "5"}'] == 2
    assert metrics["packscore_pass_host_seconds_count"] == metrics["packscore_pass_device_seconds_count"] == 3
    assert metrics["packscore_pass_host_seconds_sum"] == pytest.approx(12.72 / 4)
    assert metrics["packscore_device_idle_seconds_total"] == pytest.approx(0.3)
    assert metrics['packscore_jobs_finished_total{"status": "succeeded"}'] == 3
    assert metrics['packscore_jobs_finished_total{"status": "failed"}'] == 0


def test_histograms_add_per_bucket_counts_to_earlier_cumulative_ones(sqlite_sessions) -> None:  # type: ignore[no-untyped-def]
    """A pass counts in its own bucket only; the counts from before, one per bucket from the value up, still add."""
    from store.counters import SECONDS_BUCKETS

    with sqlite_sessions.begin() as session:  # two passes of 0.3 s, as the earlier versions counted them
        count(session, "passes", 2)
        for bucket in SECONDS_BUCKETS[SECONDS_BUCKETS.index(0.5):]:
            count(session, "pass_seconds_bucket", 2, label=str(bucket))
    with sqlite_sessions.begin() as session:
        count_pass(session, 5, tokens=50, seconds=0.02, host_seconds=0.01, device_seconds=0.01, device_idle_seconds=0)
    metrics = scrape(sqlite_sessions)
    assert metrics['packscore_pass_seconds_bucket{"le": "0.01"}'] == 0
    assert metrics['packscore_pass_seconds_bucket{"le": "0.025"}'] == 1
    assert metrics['packscore_pass_seconds_bucket{"le": "0.25"}'] == 1
    assert metrics['packscore_pass_seconds_bucket{"le": "0.5"}'] == 3
    assert metrics['packscore_pass_seconds_bucket{"le": "60"}'] == 3
    assert metrics['packscore_pass_seconds_bucket{"le": "+Inf"}'] == 3
    assert metrics['packscore_pass_host_seconds_bucket{"le": "0.01"}'] == 1
    assert metrics["packscore_pass_host_seconds_count"] == 1


def test_workers_report_their_attention_path(database: str) -> None:
    from store.settings import get_settings
    from worker.drain import heartbeat

    heartbeat("worker-metrics-tpu", "tiny-random", get_settings(), "pallas-tpu")
    heartbeat("worker-metrics-xla", "tiny-random", get_settings(), "xla")
    heartbeat("worker-metrics-xla", "tiny-random", get_settings(), "xla")  # an update, not a second worker
    metrics = scrape(None)
    assert metrics['packscore_worker_attention{"path": "pallas-tpu"}'] >= 1
    assert metrics['packscore_worker_attention{"path": "xla"}'] >= 1
    assert metrics["packscore_workers"] == sum(v for k, v in metrics.items()
                                               if k.startswith("packscore_worker_attention"))


def test_a_pass_reports_its_host_and_device_time() -> None:
    """On CPU the host launches a pass and the device runs it after: the two add up to about the pass's own
    time. The device's idle time before a pass is the time since the last pass's results."""
    from worker.scorer import get_scorer

    scorer = get_scorer()
    request = scorer.tokenize("a question of some length, to score", [f"item number {i}" for i in range(12)], [1, 2])
    scorer.launch([request], scorer.plan_pass([request])).result()  # its program compiled (host time)
    planned_from = time.perf_counter()
    time.sleep(0.2)
    result = scorer.launch([request], scorer.plan_pass([request]), planned_from=planned_from).result()
    assert result.host_seconds >= 0.2 and result.device_seconds > 0 and result.device_idle_seconds >= 0.2
    # Both end before the scores are collected: about the pass's own time, never more. "About": on a loaded host
    # the thread collecting the scores may wait for a core (75 of 119 ms once, beside the suite), so of a few
    # passes one at least; time missing from the accounting would be missing from all of them.
    results = [scorer.launch([request], scorer.plan_pass([request])).result() for _ in range(5)]
    for result in results:
        assert result.host_seconds > 0 and result.device_seconds > 0
        assert result.host_seconds + result.device_seconds <= result.seconds
    assert any(0.75 * r.seconds - 0.02 <= r.host_seconds + r.device_seconds for r in results), results


def test_passes_export_host_and_device_time(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import func, select

    from store.db import session_scope
    from store.models import Pass
    from store.settings import get_settings
    from worker import drain
    from worker.scorer import get_scorer

    key, _ = make_key()
    body = {"query": "Which of these answers is right?", "items": [f"answer number {i}" for i in range(200)],
            "label_token_ids": [5, 17]}
    assert client.post("/jobs", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 202
    before = scrape(None)
    assert drain.drain(get_scorer(), "worker-metrics", get_settings()) == 1
    after = scrape(None)
    with session_scope() as session:
        passes, seconds = session.execute(select(func.count(), func.sum(Pass.seconds))).one()
    assert passes >= 2  # one after another: the device waits for the host between them

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for measure in ("packscore_pass_host_seconds", "packscore_pass_device_seconds"):
        assert delta(f"{measure}_count") == delta('packscore_pass_seconds_bucket{"le": "+Inf"}') == passes
        assert delta(f'{measure}_bucket{{"le": "60"}}') == passes and delta(f"{measure}_sum") > 0
    host, device = delta("packscore_pass_host_seconds_sum"), delta("packscore_pass_device_seconds_sum")
    # The host's share counts the planning too, which the pass's own time does not.
    assert 0.75 * seconds - 0.02 * passes <= host + device <= 1.25 * seconds + 0.02 * passes
    assert 0 < delta("packscore_device_idle_seconds_total") < seconds


def test_a_scrape_while_the_database_is_down_still_answers() -> None:
    """The database's figures failed the whole scrape (a 500): the API's own request figures went with them,
    just when they say most. Now they come without the database's, and packscore_database_up says why."""
    from tests.service_harness import free_port

    down = sessionmaker(create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/packscore"))
    assert scrape(down) == {"packscore_database_up": 0.0}
