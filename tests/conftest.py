"""Fixtures for the job service tests: a real PostgreSQL database per test run (created, migrated with
Alembic, dropped afterwards) and a real Redis with a key prefix of its own. Nothing here skips: a service
that cannot be reached fails the test (CI=true or not)."""

import json
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import make_url, text

from tests.durations import FILE_SECONDS

# Kept in the environment so subprocesses (and a second import of this file) see the same run. Each
# pytest-xdist worker ("gw0", "gw1"...) has databases and Redis prefixes of its own.
_RUN = os.environ.setdefault("PACKSCORE_TEST_RUN_ID", uuid.uuid4().hex[:10])
RUN_ID = _RUN + os.environ.get("PYTEST_XDIST_WORKER", "")
_ADMIN_URL = make_url(os.environ.setdefault(
    "PACKSCORE_TEST_ADMIN_URL", os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")))
_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

# Settings are read from the environment once per process; set them before anything imports api/ or worker/.
# Subprocesses started by the end-to-end tests inherit them.
TEST_ENV = {
    "DATABASE_URL": _ADMIN_URL.set(database=f"packscore_test_{RUN_ID}").render_as_string(hide_password=False),
    "REDIS_URL": _REDIS_URL,
    "BROKER_KEY_PREFIX": f"packscore_test_{RUN_ID}:",
    "QUEUE_NAME": "packscore",
    "MODEL": "tiny-random",
    "MAX_ITEMS": "5000",
    "MAX_TOKENS": "100000",
    "PASS_TOKENS": "512",
    "MAX_BODY_BYTES": "2000000",
    "WEBHOOK_ALLOWLIST": "127.0.0.1",
    "WEBHOOK_RETRY_SCHEDULE": "0.2,0.4,0.8",
    "WEBHOOK_TIMEOUT_SECONDS": "2",
    "WEBHOOK_POLL_SECONDS": "0.5",  # an idle worker polls less (its CPU: 3% of a core at 0.2 s and a 0.5 s sweep)
    "LEASE_SECONDS": "3",
    "SWEEP_INTERVAL_SECONDS": "0.5",
    "SCORE_TIMEOUT_SECONDS": "30",
    # A worker compiles (or loads from the run's cache) a program when a pass first needs it, not the whole
    # shape ladder before it takes work: most service tests use two or three of its 12 programs, and the suite
    # starts about 40 workers (6-12 s of warm-up each on this machine type). The tests whose bounds assume warm
    # programs (latency, a score beside a backfill) set WARMUP=ladder; test_engine_tiny tests the ladder.
    "WARMUP": "none",
    # libtpu is installed for the compile-only TPU tests (tests/test_aot.py, which unset this): without it,
    # every JAX process of the suite would probe for a TPU and contend for libtpu's lockfile.
    "JAX_PLATFORMS": "cpu",
}
os.environ.update(TEST_ENV)

# A suite started in the background by a script (`make test &`, CI runners without job control) inherits SIGINT
# ignored, and so would every process the tests start: the CLI's Ctrl-C test then sent a signal that nothing
# heard. Python's own handler here means the children start with SIGINT's default, as from a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The tests' programs are compiled, and most run once: LLVM's full optimization of XLA's CPU code costs more than
# it saves. Measured on this machine type (tiny model, 21 programs compiled, then 25 requests of random traffic):
# default 58 + 31 s, level 1 47 + 28 s, level 0 39 + 58 s (its code runs twice as slow). Scores are the same to the
# contract's tolerances. Not for the TPU and GPU builds (tests/test_aot.py drops them). A test that sets
# XLA_FLAGS for its subprocesses keeps these (`os.environ["XLA_FLAGS"]` + its own).
# Once: a pytest-xdist worker imports this file again with the controller's environment, and a flag given twice
# is another key of the compilation cache (the alone phase found none of the first phase's programs).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# One JAX compilation cache and one converted-model cache for the whole run, shared by this process, the
# pytest-xdist workers and every API and worker process the tests start: a pass program is compiled once per
# run, not once per process (a worker's warm-up then loads it), and the bundled GGUF is converted once. A test
# that needs empty caches sets its own folders. `make test` names the folder (PACKSCORE_TEST_CACHE, kept across
# its two phases and cleared when it starts); otherwise the run makes one and removes it at the end.
_OWN_CACHE = "PACKSCORE_TEST_CACHE" not in os.environ
RUN_CACHE = Path(os.environ.setdefault("PACKSCORE_TEST_CACHE",
                                       str(Path(tempfile.gettempdir()) / f"packscore-test-{_RUN}"))).resolve()
# `make test` keeps the compiled programs across runs (PACKSCORE_TEST_COMPILE_CACHE, the Makefile says why).
COMPILE_CACHE = Path(os.environ.get("PACKSCORE_TEST_COMPILE_CACHE") or RUN_CACHE / "compile-cache").resolve()
for name, value in {"JAX_COMPILATION_CACHE_DIR": COMPILE_CACHE,
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # every program is worth keeping here
                    "JAX_COMPILATION_CACHE_MAX_SIZE": str(2 * 1024**3),  # least recently used dropped past it
                    "COMPILE_CACHE_DIR": COMPILE_CACHE,
                    "MODEL_CACHE_DIR": RUN_CACHE / "model-cache"}.items():
    os.environ.setdefault(name, str(value))

# The longest files first (their seconds in the last `make test-durations`; a file not there yet counts as a
# minute): pytest-xdist hands out files in this order, so no long file starts last and holds the run up alone.
NEW_FILE_SECONDS = 60


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.path.name, NEW_FILE_SECONDS))  # stable: a file's order kept


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the controller, not an xdist worker
        shutil.rmtree(RUN_CACHE, ignore_errors=True)


def fresh_database(name: str):  # type: ignore[no-untyped-def]
    """Creates database `name` on the test server, migrates it to head; a context manager yielding its URL
    and dropping the database afterwards."""
    from tests.service_harness import fresh_database as create

    return create(_ADMIN_URL.render_as_string(hide_password=False), name)


@pytest.fixture(scope="session")
def database_factory():  # type: ignore[no-untyped-def]
    """`fresh_database` for tests that need a database of their own (e.g. one per end-to-end service)."""
    return fresh_database


@pytest.fixture(scope="session")
def run_id() -> str:
    return RUN_ID


@pytest.fixture(scope="session")
def database() -> Iterator[str]:
    """The run's database (DATABASE_URL points at it), migrated by Alembic."""
    from store.db import get_engine

    with fresh_database(f"packscore_test_{RUN_ID}") as url:
        yield url
        get_engine().dispose()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(_REDIS_URL)
    try:
        client.ping()
    except Exception as exc:
        pytest.fail(f"Redis at {_REDIS_URL} is not reachable: {exc}")
    yield _REDIS_URL
    for key in client.scan_iter(match=f"{TEST_ENV['BROKER_KEY_PREFIX']}*"):
        client.delete(key)
    client.close()


@pytest.fixture
def empty_queue(database: str) -> None:
    """No jobs left over from other tests (worker tests drain everything that is queued)."""
    from store.db import session_scope

    with session_scope() as session:
        for table in ("webhook_deliveries", "job_results", "jobs", "passes", "workers"):
            session.execute(text(f"DELETE FROM {table}"))


@pytest.fixture
def make_key(database: str):  # type: ignore[no-untyped-def]
    """Creates an API key; returns (key, webhook_secret)."""
    from api.auth import create_api_key
    from store.db import session_scope

    def make(name: str = "test") -> tuple[str, str]:
        with session_scope() as session:
            row, key = create_api_key(session, name)
            return key, row.webhook_secret

    return make


@pytest.fixture(scope="session")
def client(database: str, redis_url: str):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from api.main import create_app

    with TestClient(create_app()) as test_client:
        yield test_client


class WebhookReceiver:
    """A threaded HTTP server on 127.0.0.1 recording POSTs; `responses` scripts the status codes to answer
    (then 200), e.g. [500, 302] for a failure and a redirect first."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler

        receiver = self
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.responses: list[int] = []
        self.location = "http://10.0.0.1/internal"  # where 3xx answers point
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("content-length", 0))
                body = self.rfile.read(length)
                if len(body) < length:  # its sender died mid-request (a worker SIGKILLed): no delivery, as for a
                    self.close_connection = True  # real server
                    return
                with receiver.lock:
                    receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver.responses.pop(0) if receiver.responses else 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", receiver.location)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self._serve(0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def _serve(self, port: int) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def come_back(self) -> None:
        """After close(): listens again on the same port (a receiver that was down, for the chaos tests)."""
        self._serve(self.server.server_address[1])


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def live_service(redis_url: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real service (uvicorn API + one Celery worker, tiny-random) on a database of its own, for a module of
    security tests (fuzzing, attacks, tenant isolation). Per module, not per run: pytest-xdist runs the two
    modules in two processes anyway, and a service kept to the end of the run burns CPU polling meanwhile."""
    from tests.service_harness import running_service

    name = f"packscore_live_{RUN_ID}_{uuid.uuid4().hex[:6]}"  # a database and broker keys per module
    with fresh_database(name) as url:
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{RUN_ID}:{name}:"}
        with running_service(env, tmp_path_factory.mktemp("live-logs"), workers=1) as service:
            yield service
