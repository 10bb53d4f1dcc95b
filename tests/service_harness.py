"""A real job service in subprocesses (uvicorn API + Celery solo-pool workers) against a given Postgres and
Redis, for the end-to-end, reliability and security tests and for the load runner's `--start-service`.
Plain functions, no pytest: the load runner uses them outside the test suite too."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, make_url, text

from core import Scorer
from tests.load_runner import SCORE_RTOL

REPO = Path(__file__).resolve().parents[1]
TERMINAL = ("succeeded", "failed", "cancelled")


def stop_processes(procs: list[subprocess.Popen], seconds: float = 20) -> None:
    """SIGTERM to those still running, then SIGKILL to those that did not exit within `seconds`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, log: Path, seconds: float) -> None:
    """Until the service's /readyz answers 200; fails with its log if it exits or takes longer."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@contextmanager
def fresh_database(admin_url: str, name: str) -> Iterator[str]:
    """Creates database `name` on the server of `admin_url`, migrates it to head, yields its URL and drops it."""
    from migrations import upgrade

    admin_url = make_url(admin_url)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        raise RuntimeError(f"PostgreSQL at {admin_url.render_as_string()} is not usable: {exc}") from exc
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def wait_until(check, seconds: float, what: str, interval: float = 0.3) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Service:
    env: dict[str, str]
    logs: Path
    base_url: str = ""
    key: str = ""
    secret: str = ""
    api: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)

    def cli(self, *args: str, log: str, env: dict[str, str] | None = None,
            prefix: Sequence[str] = ()) -> subprocess.Popen:
        """`packscore <args>`; `prefix`: a command to run it under, which ends by running its own arguments
        (e.g. `unshare -m sh -c '...; exec "$@"' sh`)."""
        out = open(self.logs / log, "ab")
        return subprocess.Popen([*prefix, sys.executable, "-m", "packscore.cli", *args],
                                env={**self.env, **(env or {})}, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def create_key(self, name: str) -> tuple[str, str]:
        created = subprocess.run([sys.executable, "-m", "packscore.cli", "create-key", "--name", name], env=self.env,
                                 cwd=REPO, capture_output=True, text=True, check=True).stdout
        return re.search(r"api_key=(\S+)", created).group(1), re.search(r"webhook_secret=(\S+)", created).group(1)

    def start_api(self, seconds: float = 300) -> None:
        """Starts the API (on the same port after a restart) and waits until it answers /healthz."""
        if not self.base_url:
            self.base_url = f"http://127.0.0.1:{free_port()}"
        self.api = self.cli("serve", "--host", "127.0.0.1", "--port", self.base_url.rsplit(":", 1)[1], log="api.log")

        def up() -> bool:
            assert self.api.poll() is None, f"the API exited\n{self.tail()}"
            return httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200

        wait_until(up, seconds, "the API")

    def stop_api(self) -> None:
        self.api.terminate()
        self.api.wait(timeout=30)

    def start_worker(self, env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> subprocess.Popen:
        worker = self.cli("worker", log=f"worker{len(self.workers)}.log", env=env, prefix=prefix)
        self.workers.append(worker)
        return worker

    def kill_worker(self, worker: subprocess.Popen) -> None:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)

    def live_workers(self) -> list[subprocess.Popen]:
        return [w for w in self.workers if w.poll() is None]

    def pids(self) -> dict[str, int]:
        """Live processes by name, for the load runner's memory sampler."""
        named = {f"worker{i}": w.pid for i, w in enumerate(self.workers) if w.poll() is None}
        if self.api is not None and self.api.poll() is None:
            named["api"] = self.api.pid
        return named

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {key or self.key}"},
                            timeout=60)

    def wait_for_workers(self, n: int, seconds: float = 300) -> None:
        wait_until(lambda: httpx.get(f"{self.base_url}/readyz", timeout=10).json()["checks"]["workers"] >= n,
                   seconds, f"{n} ready workers; logs in {self.logs}")

    def wait_ready(self, seconds: float = 60) -> float:
        """Waits for /readyz 200; returns the seconds it took."""
        start = time.monotonic()
        wait_until(lambda: httpx.get(f"{self.base_url}/readyz", timeout=5).status_code == 200, seconds,
                   f"/readyz 200; logs in {self.logs}")
        return time.monotonic() - start

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.iterdir()))

    def close(self) -> None:
        stop_processes([p for p in [*self.workers, self.api] if p is not None])


@contextmanager
def running_service(env: dict[str, str], logs: Path, workers: int = 0) -> Iterator[Service]:
    """An API (and `workers` ready workers) on a free loopback port, with one API key; `env` overrides the
    environment (DATABASE_URL of a migrated database, REDIS_URL, BROKER_KEY_PREFIX, MODEL...)."""
    service = Service(env={**os.environ, **env}, logs=logs)
    try:
        service.key, service.secret = service.create_key("service")
        service.start_api()
        for _ in range(workers):
            service.start_worker()
        if workers:
            service.wait_for_workers(workers)
        yield service
    except BaseException:
        print(service.tail())
        raise
    finally:
        service.close()
        create_engine(env["DATABASE_URL"]).dispose()


def wait_terminal(client: httpx.Client, job_ids: list[str], seconds: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + seconds
    jobs: dict[str, dict] = {}
    while time.monotonic() < deadline:
        for job_id in job_ids:
            if job_id not in jobs:
                job = client.get(f"/jobs/{job_id}").json()
                if job["status"] in TERMINAL:
                    jobs[job_id] = job
        if len(jobs) == len(job_ids):
            return jobs
        time.sleep(0.2)
    raise AssertionError(f"jobs not terminal in time: {set(job_ids) - set(jobs)}")


def assert_scores(job: dict, body: dict, reference: Scorer) -> None:
    expected = reference.score(body["query"], body["items"], body["label_token_ids"],
                               body.get("apply_softmax", False), body.get("item_first", False))
    np.testing.assert_allclose(job["scores"], expected, rtol=SCORE_RTOL, atol=0)


class PrivateRedis:
    """A redis-server of its own on a free loopback port, so chaos tests can restart it without disturbing the
    shared one."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--daemonize", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        wait_until(lambda: redis.Redis(port=self.port, socket_timeout=1).ping(), 20, "the private redis")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


class PrivatePostgres:
    """A PostgreSQL instance of its own (initdb into a temp dir, pg_ctl on a free port), so a chaos test can
    stop it without stopping the shared cluster. Run as the `postgres` OS user when we are root (initdb
    refuses root)."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not bins:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql")
        self.bin = bins[-1]
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="packscore-pg-"))
        self.data = self.dir / "data"
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.dir)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync")
        self.start()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.dir, ignore_errors=True)


def assert_exactly_once(database_url: str, job_ids: list[str], tag: str, may_be_gone: Collection[str] = ()) -> None:
    """Every job of a load run (metadata.load_tag == tag) is one the clients know (retried submissions made no
    second job), is terminal, has a result row if and only if it succeeded, with every item done, and at most
    one webhook message. `may_be_gone`: jobs that retention may have deleted by now (absent or checked)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, status FROM jobs WHERE metadata->>'load_tag' = :tag"),
                                {"tag": tag}).all()
            outcomes = conn.execute(text(
                "SELECT j.id, j.status, j.items_done = j.items_total,"
                " EXISTS (SELECT 1 FROM job_results r WHERE r.job_id = j.id),"
                " (SELECT count(*) FROM webhook_deliveries w WHERE w.job_id = j.id)"
                " FROM jobs j WHERE j.metadata->>'load_tag' = :tag"), {"tag": tag}).all()
    finally:
        engine.dispose()
    found = {r.id for r in rows}
    assert found <= set(job_ids) and set(job_ids) - found <= set(may_be_gone), \
        "jobs in the database differ from the jobs clients got"
    assert all(r.status in TERMINAL for r in rows), [r for r in rows if r.status not in TERMINAL]
    wrong = [o for o in outcomes if (o.status == "succeeded") != o[3] or (o.status == "succeeded" and not o[2])
             or o[4] > 1]
    assert not wrong, f"(id, status, all items done, has a result, webhook messages): {wrong}"
