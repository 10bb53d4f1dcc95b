"""The page at /ui in a real headless Chromium (Debian's `chromium`, driven by Playwright's Python client): sign in,
a running job's progress bar moving, a batch cancelled and settling, a reference batch's input, a worker with its
model, attention path and passes, a wrong key's 401 message, a second key seeing none of the first key's work, and
every request the page made being a public API route; and GET /workers itself. The service runs on PostgreSQL with
two models (MODELS) and one worker. A screenshot of each page is saved under the test results (ui-screenshots/);
docs/ui-batches.png is the batch list's."""

import json
import os
import shutil
import socket
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from starlette.routing import Mount, compile_path

from tests.service_harness import Service, running_service, wait_until

CHROMIUM = Path("/usr/bin/chromium")
# What Debian's chromium needs to run headless as root in a container, and nothing reaching outside the machine.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = Path(os.environ["PACKSCORE_TEST_CACHE"]).parent / "ui-screenshots"
SECONDS = 60  # for anything the page shows after a few of its polls (every 2 s)
JSONL = {"Content-Type": "application/jsonl"}
JOB_ITEMS = 5_000  # the test limit; 12 words each: about 350,000 tokens (limit 400,000), 700 passes, cancelled first


def _unavailable(reason: str) -> None:
    """Under CI a browser that cannot be had is a failure; on a developer's machine the test skips."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def install_chromium() -> Path:
    """Debian's chromium, installed with apt-get on first use (as tests/object_stores.py installs Azurite)."""
    if not CHROMIUM.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        # An old package list may no longer name the current build: read it again once.
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing and `apt-get install chromium` did not install it")
    return CHROMIUM


class Requests:
    """Every request the page sends, as (method, URL)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def watch(self, page) -> None:  # type: ignore[no-untyped-def]
        page.on("request", lambda request: self.seen.append((request.method, request.url)))


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BATCH_LOCAL_ROOT: where a reference batch's input is read and its output written."""
    return tmp_path_factory.mktemp("ui-lake")


@pytest.fixture(scope="module")
def service(redis_url: str, run_id: str, database_factory,  # type: ignore[no-untyped-def]
            tmp_path_factory: pytest.TempPathFactory, lake: Path) -> Iterator[Service]:
    name = f"packscore_ui_{run_id}_{uuid.uuid4().hex[:6]}"
    with database_factory(name) as url:
        # Two models, a worker for the first: the page lists both. Room for a job that runs long enough to watch.
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:{name}:",
               "MODELS": "small=tiny-random,other=tiny-random", "MODEL": "small", "MAX_TOKENS": "400000",
               "BATCH_LOCAL_ROOT": str(lake)}
        with running_service(env, tmp_path_factory.mktemp("ui-logs")) as running:
            # Not waited for here: the worker starts while the browser launches and the tests that need no worker run.
            running.start_worker()
            yield running


@pytest.fixture(scope="module")
def worker(service: Service) -> None:
    """The service's worker, ready."""
    service.wait_for_workers(1)


@pytest.fixture(scope="module")
def reference_batch(service: Service, lake: Path) -> str:
    """A reference batch of a two-row pair table, named by its path under BATCH_LOCAL_ROOT."""
    pq.write_table(pa.table({"q": ["Is the sky blue?"] * 2, "doc": ["yes", "no"]}), lake / "pairs.parquet")
    with service.http() as http:
        return created(http.post("/batches", json={"input": "pairs.parquet", "output": "out-pairs",
                                                   "columns": {"query": "q", "item": "doc"},
                                                   "label_token_ids": [1, 2]}))


@pytest.fixture(scope="module")
def requests() -> Requests:
    return Requests()


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    executable = install_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright's Python client is not installed (the `dev` extra has it)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser, requests: Requests):  # type: ignore[no-untyped-def]
    """A tab of its own (its own session storage), at a laptop's width."""
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    opened = context.new_page()
    requests.watch(opened)
    yield opened
    context.close()


def screenshot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def sign_in(page, service: Service, key: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(f"{service.base_url}/ui/")
    page.fill("#key", key)
    page.keyboard.press("Enter")  # the keyboard alone signs in


def created(response) -> str:  # type: ignore[no-untyped-def]
    assert response.status_code in (201, 202), response.text
    return response.json()["id"]


def accept_next_dialog(page) -> None:  # type: ignore[no-untyped-def]
    page.once("dialog", lambda dialog: dialog.accept())


def test_the_page_ships_in_the_package() -> None:
    """A non-editable install (the Docker image's) carries every file of api/ui/: pyproject's package data names
    them (setuptools ships no other file than Python modules)."""
    from api.main import UI_DIR

    pyproject = tomllib.loads((UI_DIR.parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["api"]
    files = [PurePosixPath(p.relative_to(UI_DIR.parent).as_posix()) for p in UI_DIR.rglob("*") if p.is_file()]
    assert {"ui/index.html", "ui/app.js", "ui/style.css"} <= {str(f) for f in files}
    assert all(any(f.match(pattern) for pattern in patterns) for f in files), (files, patterns)


# The service before the page: the browser launches while the worker starts.
def test_a_wrong_key_shows_the_401_message(service: Service, page) -> None:  # type: ignore[no-untyped-def]
    with service.http("psk_not-a-key") as http:
        answer = http.get("/v1/models")
    assert answer.status_code == 401
    sign_in(page, service, "psk_not-a-key")
    error = page.locator("#error")
    error.wait_for(state="visible", timeout=SECONDS * 1000)
    assert error.inner_text() == answer.json()["error"]["message"]
    assert page.locator("h1").inner_text() == "Sign in"
    screenshot(page, "sign-in-wrong-key")


def test_jobs_batches_and_workers(page, service: Service, worker: None) -> None:  # type: ignore[no-untyped-def]
    sign_in(page, service, service.key)
    page.get_by_role("heading", name="Jobs and batches").wait_for(timeout=SECONDS * 1000)
    with service.http() as http:
        small = "".join(json.dumps({"custom_id": f"done-{i}", "query": "Is the sky blue?", "items": ["yes", "no"],
                                    "label_token_ids": [1, 2]}) + "\n" for i in range(3))
        finished = created(http.post("/batches", content=small, headers=JSONL))
        wait_until(lambda: http.get(f"/batches/{finished}").json()["status"] == "completed", SECONDS, "a batch")
        # About 1,000 passes of PASS_TOKENS=512: progress to watch, cancelled long before its end.
        job = created(http.post("/jobs", json={"query": "Which is best?", "label_token_ids": [1, 2],
                                               "items": [f"candidate {i} " * 12 for i in range(JOB_ITEMS)]}))
        lines = "".join(json.dumps({"custom_id": f"line-{i}", "query": "Is the sky blue?",
                                    "items": [f"answer {i} " * 8] * 50, "label_token_ids": [1, 2]}) + "\n"
                        for i in range(40))
        batch = created(http.post("/batches", content=lines, headers=JSONL))

        # The running job's bar moves: two readings between none and all of its items, the second further on.
        bar = page.locator(f'tr[data-id="{job}"] progress')
        seen: list[int] = []
        deadline = time.monotonic() + SECONDS
        while len(seen) < 2 and time.monotonic() < deadline:
            value = int(bar.get_attribute("value", timeout=SECONDS * 1000) or 0)
            if 0 < value < JOB_ITEMS and (not seen or value != seen[-1]):
                seen.append(value)
            time.sleep(0.2)
        assert len(seen) == 2 and seen[0] < seen[1], seen
        assert page.locator(f'tr[data-id="{finished}"] .status').inner_text() == "completed"
        screenshot(page, "batches")

        # A batch: cancelled from its page after a confirmation, then settled.
        # By keyboard: the link keeps its focus through the list's next poll, and Enter opens the batch.
        page.focus(f'a[href="#/batches/{batch}"]')
        time.sleep(2.5)
        assert page.evaluate("document.activeElement.getAttribute('href')") == f"#/batches/{batch}"
        page.keyboard.press("Enter")
        accept_next_dialog(page)
        page.get_by_role("button", name="Cancel batch").click()
        page.locator("#batch .status", has_text="cancelled").first.wait_for(timeout=SECONDS * 1000)
        assert http.get(f"/batches/{batch}").json()["status"] == "cancelled"
        assert not page.get_by_role("button", name="Cancel batch").count()
        screenshot(page, "batch")

        # The job: its page, its bar, cancelled there too (it need not run to its end).
        page.goto(f"{service.base_url}/ui/#/jobs/{job}")
        page.locator("#job progress").wait_for(timeout=SECONDS * 1000)
        assert page.locator("h1").inner_text() == f"Job {job}"
        accept_next_dialog(page)
        page.get_by_role("button", name="Cancel job").click()
        wait_until(lambda: http.get(f"/jobs/{job}").json()["status"] == "cancelled", SECONDS, "the job's cancel")
        page.locator("#job .status", has_text="cancelled").first.wait_for(timeout=SECONDS * 1000)
        assert "null" not in page.locator("#job").inner_text().split()  # no missing part shown as a word
        screenshot(page, "job")

        # A finished job's page shows its scores.
        done = http.post("/jobs", json={"query": "Is the sky blue?", "items": ["yes", "no"],
                                        "label_token_ids": [1, 2], "model": "small"}).json()["id"]
        page.goto(f"{service.base_url}/ui/#/jobs/{done}")
        page.locator("#job .status", has_text="succeeded").wait_for(timeout=SECONDS * 1000)
        scores = http.get(f"/jobs/{done}").json()["scores"]
        assert page.locator("#job tbody tr").nth(1).inner_text().split() == ["1", *(f"{s:.4f}" for s in scores[1])]

    # The workers: the one worker with its model, host, device (none known: a CPU worker started alone on XLA),
    # chips, attention path, dtype, state and the last minute's passes (the job above's); both models, the second
    # with no worker.
    page.click('nav a[href="#/workers"]')
    worker = page.locator("#workers tbody tr", has_text=socket.gethostname()).first
    worker.wait_for(timeout=SECONDS * 1000)
    cells = worker.locator("td").all_inner_texts()
    assert cells[:7] == ["small", socket.gethostname(), "cpu", "the host's own", "xla", "float32", "ready"], cells
    assert float(cells[7]) > 0 and float(cells[8]) > 0 and cells[9].endswith("%"), cells  # passes/s, items/s, busy
    models = page.get_by_role("region", name="Models").locator("tbody tr")
    assert [row.locator("td").all_inner_texts()[:2] for row in models.all()] == [["small", "1"], ["other", "0"]]
    page.get_by_text("Attention paths").wait_for()
    assert "xla × 1" in page.locator("dd", has_text="×").inner_text()
    # The chart: the hour's items/s per minute from GET /workers, shown at once (not after some readings).
    page.locator(".chart svg polyline").wait_for(state="attached", timeout=SECONDS * 1000)
    assert "last 1 h 0 min" in page.locator(".chart figcaption").inner_text()
    screenshot(page, "workers")

    # A phone's width: the list still fits, each row's fields stacked.
    page.set_viewport_size({"width": 390, "height": 800})
    page.goto(f"{service.base_url}/ui/#/")
    status = page.locator(f'tr[data-id="{batch}"] .status')
    status.wait_for(timeout=SECONDS * 1000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = status.bounding_box()
    assert box is not None and box["x"] + box["width"] <= 390  # each row's fields in view, not scrolled off
    screenshot(page, "batches-phone")
    page.emulate_media(color_scheme="dark")  # the system's dark mode
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(21, 24, 28)"
    screenshot(page, "batches-phone-dark")


def test_a_reference_batchs_page_shows_its_input(page, service: Service,  # type: ignore[no-untyped-def]
                                               reference_batch: str) -> None:
    sign_in(page, service, service.key)
    page.get_by_role("heading", name="Jobs and batches").wait_for(timeout=SECONDS * 1000)
    page.goto(f"{service.base_url}/ui/#/batches/{reference_batch}")
    page.locator("#batch dt", has_text="Input").wait_for(timeout=SECONDS * 1000)
    fields = dict(zip(page.locator("#batch dt").all_inner_texts(), page.locator("#batch dd").all_inner_texts()))
    assert fields["Input"] == "pairs.parquet" and "out-pairs" in fields["Output"], fields
    screenshot(page, "reference-batch")


def test_workers_route_lists_the_worker_with_its_passes(service: Service, worker: None,
                                                        reference_batch: str) -> None:
    """GET /workers (no browser): the live worker with the last minute's passes of a job it just ran, the hour's
    items/s per minute, nothing of a job, batch or key; and a reference batch's input as the user gave it."""
    with service.http("psk_not-a-key") as http:
        assert http.get("/workers").status_code == 401
    with service.http() as http:
        job = created(http.post("/jobs", json={"query": "Is the sky blue?", "items": ["yes", "no", "maybe"],
                                               "label_token_ids": [1, 2]}))
        wait_until(lambda: http.get(f"/jobs/{job}").json()["status"] == "succeeded", SECONDS, "the job")
        answer = http.get("/workers")
        assert http.get(f"/batches/{reference_batch}").json()["input"] == "pairs.parquet"
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert job not in answer.text and reference_batch not in answer.text and service.key not in answer.text
    [worker] = body["data"]
    assert {k: worker[k] for k in ("model", "host", "device_group", "device_kind", "attention", "dtype", "state",
                                   "programs")} == {"model": "small", "host": socket.gethostname(),
                                                    "device_group": None, "device_kind": "cpu", "attention": "xla",
                                                    "dtype": "float32", "state": "ready", "programs": None}
    assert worker["passes_per_second"] > 0 and worker["items_per_second"] >= 3 / 60 and 0 < worker["busy"] <= 1
    assert body["history_seconds"] == 3600 and len(body["throughput"]) == 60
    assert sum(point["items_per_second"] for point in body["throughput"][-2:]) > 0  # the job's minute (or two)
    minutes = [point["minute"] for point in body["throughput"]]
    assert minutes == sorted(minutes) and minutes[-1].endswith("Z")


def test_a_second_key_sees_none_of_the_first_keys_work(page, service: Service) -> None:  # type: ignore[no-untyped-def]
    with service.http() as http:
        job = http.post("/jobs", json={"query": "mine", "items": ["a"], "label_token_ids": [1]}).json()["id"]
    other, _ = service.create_key("second")
    sign_in(page, service, other)
    page.get_by_text("No jobs.").wait_for(timeout=SECONDS * 1000)
    assert page.get_by_text("No batches.").is_visible()
    assert page.locator("tr[data-id]").count() == 0
    page.goto(f"{service.base_url}/ui/#/jobs/{job}")
    with service.http(other) as http:
        message = http.get(f"/jobs/{job}").json()["error"]["message"]
    page.locator("#error", has_text=message).wait_for(timeout=SECONDS * 1000)
    screenshot(page, "second-key")


def test_the_page_calls_only_public_api_routes(requests: Requests, service: Service) -> None:
    """Run last in this file: the requests of every page above. Each is a file of the app's /ui mount or a route
    of its public API (the operations of its OpenAPI schema, what /docs lists for any client), on the service's
    own origin: nothing from elsewhere."""
    from api.main import create_app

    app = create_app()
    assert [route.path for route in app.routes if isinstance(route, Mount) and route.name == "ui"] == ["/ui"]
    operations = [(method.upper(), path, compile_path(path)[0]) for path, methods in app.openapi()["paths"].items()
                  for method in methods]
    assert requests.seen, "no page ran before this test"
    origin = urlsplit(service.base_url)
    called = set()
    for method, url in requests.seen:
        parts = urlsplit(url)
        assert (parts.scheme, parts.netloc) == (origin.scheme, origin.netloc), url
        if method == "GET" and parts.path.startswith("/ui/"):
            continue
        matched = [(verb, path) for verb, path, pattern in operations if verb == method and pattern.match(parts.path)]
        assert matched, f"{method} {url} is not a route of the API"
        called.update(matched)
    assert {("GET", "/jobs"), ("GET", "/batches"), ("GET", "/v1/models"), ("POST", "/batches/{batch_id}/cancel"),
            ("POST", "/jobs/{job_id}/cancel"), ("GET", "/readyz"), ("GET", "/metrics"),
            ("GET", "/workers")} <= called, called
