"""A user's third hour: two embedded services on one account each get their own key, `wait-ready` and /readyz
wait for every model, the pins live in constraints.txt (pyproject names ranges), `packscore cancel`, the pair
table's options of `backfill`, and `packscore check` naming the attention setting as set."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from packscore import cli
from packscore.client import Client, PackscoreError, find_api_key, service_record
from tests.service_harness import REPO, free_port

# ---- two embedded services, two folders, one account -------------------------------------------------------------


def _serve(folder: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "serve.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "packscore.cli", "serve", "--embedded", "--port", str(port)],
                            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _packscore(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packscore.cli", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=120)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def two_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """`serve --embedded` from folders a and b on two ports, one config folder (one account); each folder's
    key, port and process."""
    root = tmp_path_factory.mktemp("two-services")
    env = {k: v for k, v in os.environ.items() if k not in (
        "DATABASE_URL", "REDIS_URL", "BROKER_URL", "BROKER_DIR", "PACKSCORE_HOME", "PACKSCORE_API_KEY",
        "PACKSCORE_URL")}
    env.update(XDG_CONFIG_HOME=str(root / "config"), PYTHONPATH=str(REPO))
    services = {}
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CONFIG_HOME", env["XDG_CONFIG_HOME"])  # where this process reads the services' records
    try:
        for name in ("a", "b"):
            port = free_port()
            services[name] = {"port": port, "proc": _serve(root / name, port, env), "folder": root / name,
                              "url": f"http://127.0.0.1:{port}"}
        for service in services.values():
            deadline = time.monotonic() + 180
            while not (service_record(service["url"]).exists() and _answers(service["url"])):
                assert service["proc"].poll() is None and time.monotonic() < deadline, \
                    (service["folder"] / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
            service["key"] = (service["folder"] / ".packscore" / "api_key").read_text().split()[0]
        yield root, {"env": env, **services}
    finally:
        for service in services.values():
            _stop(service["proc"])
        patch.undo()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_each_service_gets_its_own_key(two_services: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    root, services = two_services
    env, a, b = services["env"], services["a"], services["b"]
    assert a["key"] != b["key"]
    # From each folder, to its own service and to the other's: the key of the service at --url (a job that does
    # not exist is 404 with the right key, 401 with another).
    for cwd in (a["folder"], b["folder"], root):
        for service in (a, b):
            done = _packscore(cwd, env, "cancel", "job_none", "--url", service["url"], "--retry-seconds", "5")
            assert done.returncode == 1 and "404 not_found" in done.stderr, (cwd, service["url"], done.stderr)
    # The Python client too, from a's folder to b.
    monkeypatch.delenv("PACKSCORE_API_KEY", raising=False)
    monkeypatch.chdir(a["folder"])
    with Client(b["url"], max_retries=0) as client:
        assert str(b["folder"] / ".packscore" / "api_key") in client.key_source
        with pytest.raises(PackscoreError) as refused:
            client.get_job("job_none")
        assert refused.value.status == 404

    # A key refused: its message names where it came from and how to give another.
    done = _packscore(b["folder"], {**env, "PACKSCORE_API_KEY": "psk_wrong"}, "cancel", "job_none", "--url",
                      "http://localhost:1/", "--retry-seconds", "0")  # no service recorded there: the variable
    assert done.returncode == 1
    record = service_record(a["url"])
    saved = record.read_text()
    record.unlink()  # a service whose record is gone: this folder's key file, the last place looked in
    try:
        done = _packscore(b["folder"], env, "cancel", "job_none", "--url", a["url"], "--retry-seconds", "5")
        assert done.returncode == 1 and "401 unauthorized" in done.stderr, done.stderr
        assert f"(key from {b['folder'] / '.packscore' / 'api_key'}" in done.stderr, done.stderr
        assert "--api-key" in done.stderr and "$PACKSCORE_API_KEY" in done.stderr, done.stderr
        done = _packscore(b["folder"], {**env, "PACKSCORE_API_KEY": "psk_wrong"}, "cancel", "job_none", "--url",
                          a["url"], "--retry-seconds", "5")
        assert "(key from $PACKSCORE_API_KEY)" in done.stderr and "--api-key" in done.stderr, done.stderr
    finally:
        record.write_text(saved)


def test_a_port_held_by_another_folder_is_named(two_services: tuple[Path, dict]) -> None:
    root, services = two_services
    env, a = services["env"], services["a"]
    # `make run` on a's port from another folder: refused before anything is recorded, naming a's folder.
    third = _serve(root / "c", a["port"], env)
    try:
        assert third.wait(timeout=60) == 1
    finally:
        if third.poll() is None:
            _stop(third)
    said = (root / "c" / "serve.log").read_text()
    assert f"in use by the embedded service started from {a['folder']}" in said and "PORT=" in said, said
    assert json.loads(service_record(a["url"]).read_text())["home"] == str(a["folder"] / ".packscore")
    # `make wait-ready` from that folder: a's service is not its own.
    done = _packscore(root / "c", env, "wait-ready", "--embedded", "--url", a["url"], "--timeout", "30")
    assert done.returncode == 1 and f"started from {a['folder']}, not this folder's" in done.stderr, done.stderr
    assert "make wait-ready PORT=" in done.stderr


def test_a_stopped_service_leaves_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record whose process has ended (a crash) is not read; a clean stop removes its own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("PACKSCORE_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "other" / ".packscore"
    home.mkdir(parents=True)
    (home / "api_key").write_text("psk_other\nwhsec_x\n")
    url = "http://localhost:8123"
    record = service_record(url)
    assert record == service_record("http://127.0.0.1:8123/") != service_record("http://example.com:8123")
    record.parent.mkdir(parents=True)
    ended = subprocess.Popen(["true"])
    ended.wait()
    record.write_text(json.dumps({"home": str(home), "pid": ended.pid}))
    assert find_api_key(url) == (None, f"no key found (looked in $PACKSCORE_API_KEY, "
                                       f"{tmp_path / '.packscore' / 'api_key'})")
    record.write_text(json.dumps({"home": str(home), "pid": os.getpid()}))
    key, source = find_api_key(url)
    assert key == "psk_other" and str(home / "api_key") in source
    cli._release_address(record)
    assert not record.exists()


# ---- every model warm -----------------------------------------------------------------------------------------


@pytest.fixture
def two_model_api(database: str, redis_url: str) -> Iterator[Callable[[], httpx.Response]]:
    """/readyz of an API serving MODELS=small,judge (both the tiny model), and no live worker to begin with."""
    from fastapi.testclient import TestClient
    from sqlalchemy import delete

    from api.deps import get_models
    from api.main import create_app
    from store.db import session_scope
    from store.models import Worker
    from store.settings import get_settings

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODELS", "small=tiny-random,judge=tiny-random")
        get_settings.cache_clear()
        get_models.cache_clear()
        with session_scope() as session:
            session.execute(delete(Worker))
        try:
            with TestClient(create_app()) as client:
                yield lambda: client.get("/readyz")
        finally:
            with session_scope() as session:
                session.execute(delete(Worker))
            get_settings.cache_clear()
            get_models.cache_clear()


def test_ready_waits_for_every_model(two_model_api: Callable[[], httpx.Response], monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from store.settings import Settings
    from worker.drain import heartbeat

    small, judge = Settings(model="small"), Settings(model="judge")
    heartbeat("judge-1", "judge", judge, "xla", "ready")
    heartbeat("small-1", "small", small, "xla", "warming", (14, 21))
    answer = two_model_api()
    # The default model still compiling: not ready, though judge is.
    assert answer.status_code == 503 and answer.json()["status"] == "warming", answer.text
    assert cli._waiting_for(answer) == "warming: small 14/21 programs"
    monkeypatch.setattr(httpx, "get", lambda url, timeout: two_model_api())
    with pytest.raises(cli.CommandError, match="not ready after"):
        cli.wait_ready(argparse.Namespace(url="http://packscore", timeout=1.5, embedded=False))
    assert capsys.readouterr().err.splitlines() == ["warming: small 14/21 programs"]
    heartbeat("small-1", "small", small, "xla", "ready", (21, 21))
    assert two_model_api().status_code == 200
    cli.wait_ready(argparse.Namespace(url="http://packscore", timeout=5, embedded=False))
    assert capsys.readouterr().out == "http://packscore is ready\n"


def test_wait_ready_names_a_model_with_no_worker() -> None:
    """/readyz is 200 with one model served (the other's jobs wait queued); wait-ready waits for both."""
    body = {"status": "ready", "checks": {"database": True, "broker": True, "workers": 1, "warming": 0},
            "models": {"small": {"workers": 1, "warming": 0, "jobs_waiting": False},
                       "judge": {"workers": 0, "warming": 0, "jobs_waiting": True}},
            "device_groups": [{"host": "h", "device_group": None, "model": "small", "state": "ready"}]}
    assert cli._waiting_for(httpx.Response(200, json=body)) == "no worker yet for judge"
    body["models"]["judge"]["workers"] = 1
    assert cli._waiting_for(httpx.Response(200, json=body)) is None


# ---- pins and ranges --------------------------------------------------------------------------------------------


def test_constraints_pin_each_dependency_within_its_range() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in
                    [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]]
    requirements = [r for r in requirements if r.name != "packscore"]
    assert not [str(r) for r in requirements if any(s.operator in ("==", "===") for s in r.specifier)]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pinned = Requirement(line)
            [spec] = pinned.specifier
            assert spec.operator == "==", line
            pins[pinned.name] = spec.version
    for requirement in requirements:
        assert requirement.name in pins, f"constraints.txt pins no {requirement.name}"
        assert requirement.specifier.contains(pins[requirement.name]), (str(requirement), pins[requirement.name])
    core_imports = {"flax"}  # core/'s models: in the plain install, not only in the `jax` extra
    assert core_imports <= {Requirement(text).name for text in project["dependencies"]}
    makefile = (REPO / "Makefile").read_text()
    assert makefile.count("-c $(CONSTRAINTS)") >= 2 and "CONSTRAINTS := constraints.txt" in makefile


def test_check_names_the_attention_setting() -> None:
    from types import SimpleNamespace

    from core import check

    report = check.Report(echo=False)
    scorer = SimpleNamespace(attention_path="xla", attention="xla")
    assert check._path(report, "model", scorer, [], "auto") is False  # type: ignore[arg-type]
    check._path(report, "model", scorer, [], "xla")  # type: ignore[arg-type]
    said = [finding.text for finding in report.findings]
    assert said[0].startswith("attention: xla (ATTENTION=auto, xla on "), said
    assert said[1] == "attention: xla (ATTENTION=xla)" and not any("asked" in line for line in said), said


# ---- cancel, and a pair table's options -----------------------------------------------------------------------


def _mock_client(monkeypatch: pytest.MonkeyPatch, answer: Callable[[httpx.Request], httpx.Response]) -> list:
    """`_client` of the CLI answering from `answer`; the requests it got."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return answer(request)

    def client(args: argparse.Namespace) -> Client:
        made = Client("http://packscore", "psk_x", max_retries=0)
        made._http = httpx.Client(base_url="http://packscore", transport=httpx.MockTransport(handler))
        return made

    monkeypatch.setattr(cli, "_client", client)
    return sent


def test_cancel_a_job_or_a_batch(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/jobs/job_done/cancel":
            return httpx.Response(409, json={"error": {"code": "job_finished", "message": "already succeeded"}})
        if request.url.path == "/jobs/job_done":
            return httpx.Response(200, json={"id": "job_done", "status": "succeeded"})
        kind = request.url.path.split("/")[1]
        return httpx.Response(202, json={"id": request.url.path.split("/")[2], "object": kind,
                                         "status": "cancelling"})

    sent = _mock_client(monkeypatch, answer)
    parser = cli.build_parser()
    for target, path in (("job_1", "/jobs/job_1/cancel"), ("batch_2", "/batches/batch_2/cancel")):
        args = parser.parse_args(["cancel", target])
        args.func(args)
        assert (sent[-1].method, sent[-1].url.path) == ("POST", path)
        printed = capsys.readouterr()
        assert json.loads(printed.out)["status"] == "cancelling"
        assert f"{target}: cancel requested" in printed.err  # the job's own status is still its last
    args = parser.parse_args(["cancel", "job_done"])
    with pytest.raises(cli.CommandError, match="job job_done had already ended succeeded"):
        args.func(args)
    with pytest.raises(cli.CommandError, match="neither a job's id"):
        args = parser.parse_args(["cancel", "run_3"])
        args.func(args)


def test_backfill_sends_a_pair_tables_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    batch = {"id": "batch_1", "status": "completed", "output": "s3://b/out/batch_1/",
             "chunks": {"total": 1, "done": 1, "failed": 0}, "rows": {"done": 2, "failed": 0, "total": 2}}
    sent = _mock_client(monkeypatch, lambda request: httpx.Response(201, json=batch))
    parser = cli.build_parser()
    table = ["backfill", "s3://b/pairs/", "--out", "s3://b/out/", "--query-column", "q", "--item-column", "doc"]
    args = parser.parse_args([*table, "--label-column", "labels", "--softmax", "--item-first"])
    args.func(args)
    body = json.loads(sent[-1].content)
    assert body["columns"] == {"query": "q", "item": "doc", "ids": [], "label": "labels"}
    assert body["apply_softmax"] is True and body["item_first"] is True
    args = parser.parse_args([*table, "--labels", "9805,787"])
    args.func(args)
    body = json.loads(sent[-1].content)  # the defaults are not sent: the body an earlier run sent
    assert body["label_token_ids"] == [9805, 787] and "apply_softmax" not in body and "item_first" not in body
    (tmp_path / "r.jsonl").write_text('{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}\n')
    args = parser.parse_args(["backfill", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--softmax"])
    with pytest.raises(cli.CommandError, match="--softmax: a pair table's options"):
        args.func(args)


def test_each_client_command_names_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--model` reaches the request of every command that scores: score, submit, rerank, and backfill (a pair
    table's body, an upload's query parameter); left out, the body has no model (the service's default)."""
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/score":
            return httpx.Response(200, json={"scores": [[0.5, 0.5]]})
        if request.url.path == "/v1/rerank":
            return httpx.Response(200, json={"results": []})
        if request.url.path == "/jobs":
            return httpx.Response(202, json={"id": "job_1", "status": "queued"})
        return httpx.Response(201, json={"id": "batch_1", "status": "completed", "output": "s3://b/out/batch_1/",
                                         "chunks": {"total": 1, "done": 1, "failed": 0},
                                         "rows": {"done": 1, "failed": 0, "total": 1}})

    sent = _mock_client(monkeypatch, answer)
    parser = cli.build_parser()
    one = ["--query", "q", "--item", "i", "--labels", "1,2"]
    commands = [["score", *one], ["submit", *one], ["rerank", "--query", "q", "--document", "d"],
                ["backfill", "s3://b/pairs/", "--out", "s3://b/out/", "--query-column", "q", "--item-column", "d",
                 "--labels", "1"]]
    for command in commands:
        for model in (None, "tiny-random"):
            args = parser.parse_args(command + (["--model", model] if model else []))
            args.func(args)
            assert json.loads(sent[-1].content).get("model") == model, command
    upload = tmp_path / "r.jsonl"
    upload.write_text('{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}\n')
    args = parser.parse_args(["backfill", str(upload), "--out", str(tmp_path / "o.jsonl"), "--model", "tiny-random"])
    with pytest.raises(cli.CommandError, match="got no result"):  # the scripted service has no result lines
        args.func(args)
    created = [r for r in sent if r.url.path == "/batches" and r.method == "POST" and r.url.params]
    assert created and all(r.url.params["model"] == "tiny-random" for r in created)


def test_the_embedded_service_starts_a_worker_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --embedded` with MODELS runs each model's worker, so a request naming any of them is scored; with
    one model, its one worker as before."""
    from store.settings import get_settings

    monkeypatch.setenv("MODELS", "small=smollm2-135m,tiny-random")
    get_settings.cache_clear()
    groups = cli.embedded_workers({"LD_PRELOAD": "libjemalloc.so.2"})
    assert [(g.name, g.env) for g in groups] == [
        ("embedded-small", {"LD_PRELOAD": "libjemalloc.so.2", "MODEL": "small"}),
        ("embedded-tiny-random", {"LD_PRELOAD": "libjemalloc.so.2", "MODEL": "tiny-random"})]
    monkeypatch.delenv("MODELS")
    get_settings.cache_clear()
    assert [(g.name, g.env) for g in cli.embedded_workers({})] == [("embedded", {})]
    get_settings.cache_clear()
