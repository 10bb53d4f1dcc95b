"""`packscore serve | worker | check | migrate | create-key | wait-ready | score | rerank | submit | cancel |
wait-batch | backfill`."""

import argparse
import ctypes.util
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from packscore.client import Key, KeySource, embedded_home, find_key

if TYPE_CHECKING:
    from packscore.supervisor import DeviceGroup

# The embedded service's folder (packscore.client.embedded_home), as this process started.
EMBEDDED_DIR = embedded_home()
# How long a client command keeps retrying a service it cannot reach (or that answers 429/503).
DEFAULT_RETRY_SECONDS = 30.0
# Seconds `serve` gives the connections still open once asked to stop (README: it stops within 10 s).
API_STOP_SECONDS = 5


class CommandError(Exception):
    """A failure the CLI reports as one line (no traceback), exiting 1."""


def _embedded_environment() -> None:
    """SQLite and a filesystem broker under EMBEDDED_DIR: runs on a machine with no Postgres or Redis.
    Set before anything reads the settings; explicit environment variables still win."""
    EMBEDDED_DIR.mkdir(exist_ok=True)
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{(EMBEDDED_DIR / 'packscore.db').resolve()}")
    os.environ.setdefault("BROKER_URL", "filesystem://")
    os.environ.setdefault("BROKER_DIR", str((EMBEDDED_DIR / "broker").resolve()))
    os.environ.setdefault("COMPILE_CACHE_DIR", str((EMBEDDED_DIR / "compile-cache").resolve()))
    os.environ.setdefault("MODEL_CACHE_DIR", str((EMBEDDED_DIR / "model-cache").resolve()))
    # Reference batches may read and write local files under the folder the service was started in.
    os.environ.setdefault("BATCH_LOCAL_ROOT", str(Path.cwd().resolve()))
    # No accelerator on this host: the worker's JAX need not try a TPU backend (libtpu, installed by `make test`,
    # prints errors, then JAX logs "Unable to initialize backend 'tpu'"). A JAX_PLATFORMS given wins.
    if "JAX_PLATFORMS" not in os.environ:
        from packscore.supervisor import detect

        if detect().platform == "cpu":
            os.environ["JAX_PLATFORMS"] = "cpu"


def migrate(args: argparse.Namespace | None = None) -> None:
    from migrations import upgrade
    from store.settings import get_settings

    if args is not None and args.embedded:
        _embedded_environment()
    upgrade(get_settings().database_url)


def _new_key(name: str, storage_prefixes: list[str] | None = None) -> tuple[str, str]:
    from api.auth import create_api_key
    from store.db import session_scope

    with session_scope() as session:
        row, key = create_api_key(session, name)
        row.storage_prefixes = storage_prefixes or None
        return key, row.webhook_secret


def create_key(args: argparse.Namespace) -> None:
    if args.embedded:
        _embedded_environment()
    key, secret = _new_key(args.name, args.storage_prefix)
    print(f"api_key={key}")
    print(f"webhook_secret={secret}")


def _embedded_key() -> None:
    """A first key for the local service, so README's curl example works right after `make run`."""
    path = EMBEDDED_DIR / "api_key"
    if not path.exists():
        key, secret = _new_key("embedded")
        path.touch(mode=0o600)
        path.write_text(f"{key}\n{secret}\n")
    print(f"packscore: API key in {path.resolve()} (first line; the second is its webhook secret)", flush=True)


def _claim_address(host: str, port: int) -> Path | None:
    """Refuses an address another process serves (before anything is recorded for it), then records this
    folder's service there: the client commands find its key by the URL they are given. Returns the record."""
    from packscore.client import recorded_home, service_record

    url = f"http://{host}:{port}"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError as exc:
            other = recorded_home(url)
            by = f" by the embedded service started from {other.parent}" if other is not None else ""
            raise CommandError(f"{host}:{port} is in use{by} ({exc.strerror}): serve on another port, `make run "
                               f"PORT=8100` (`packscore serve --embedded --port 8100`)") from None
    if port == 0:
        return None
    record = service_record(url)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"home": str(EMBEDDED_DIR.resolve()), "pid": os.getpid()}) + "\n")
    except OSError as exc:  # a read-only home: the commands still find the key from this folder
        print(f"packscore: could not record {EMBEDDED_DIR.resolve()} in {record}: {exc}", flush=True)
        return None
    return record


def _release_address(record: Path | None) -> None:
    """Removes this process's record of its address (a later service there writes its own)."""
    try:
        if record is not None and json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
    except (OSError, ValueError):
        pass


def worker_allocator_environment(environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str]:
    """The variables that make the worker processes this command starts (or execs into) run on the C allocator
    WORKER_ALLOCATOR names (jemalloc through LD_PRELOAD, where the system has it), and what that gives them, for
    the log. An LD_PRELOAD already set is left as it is: an operator's choice (tcmalloc, a profiler) wins."""
    from store.settings import get_settings

    if environ.get("LD_PRELOAD"):
        return {}, f"LD_PRELOAD={environ['LD_PRELOAD']} (as set)"
    if get_settings().worker_allocator == "system":
        return {}, "the system's"
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        return {}, "the system's (WORKER_ALLOCATOR=jemalloc, but no libjemalloc here: Debian's libjemalloc2 has it)"
    # Arrow's tables (the lake's chunks) through the same allocator, not through Arrow's own bundled one; and
    # Python's small objects too, not through Python's own arenas, which a big batch's rows fragment for good
    # (docs/soak.md). An operator's value wins.
    variables = {"LD_PRELOAD": library, "ARROW_DEFAULT_MEMORY_POOL": environ.get("ARROW_DEFAULT_MEMORY_POOL", "system"),
                 "PYTHONMALLOC": environ.get("PYTHONMALLOC", "malloc")}
    return variables, f"jemalloc ({library}; Python's objects too: PYTHONMALLOC={variables['PYTHONMALLOC']})"


def worker_command(loglevel: str = "INFO", node: str | None = None) -> list[str]:
    from worker.celery_app import worker_argv

    return [sys.executable, "-m", "celery", "-A", "worker.tasks", *worker_argv(loglevel, node)]


def _worker_plan(args: argparse.Namespace, tensor_parallel: int):  # type: ignore[no-untyped-def]
    """The chips, their groups and the chips left idle of `worker --devices` (also `check`'s plan)."""
    from packscore.supervisor import DeviceError, detect, device_groups

    try:
        chips = detect(args.platform, args.chips)
        count = None if args.devices in (None, "all") else int(args.devices)
        groups, left = device_groups(chips, tensor_parallel, count)
    except DeviceError as exc:
        raise CommandError(str(exc)) from None
    return chips, groups, left


def worker(args: argparse.Namespace) -> None:
    if args.devices is None:
        if args.platform or args.chips or args.dry_run:
            args.parser.error("--platform, --chips and --dry-run go with --devices")
        allocator, said = worker_allocator_environment()
        print(f"packscore: worker allocator: {said}", file=sys.stderr, flush=True)
        command = worker_command(args.loglevel)
        os.execve(command[0], command, {**os.environ, **allocator})
    from packscore.supervisor import DeviceGroup, WorkerSupervisor, describe
    from store.settings import get_settings

    tensor_parallel = get_settings().tensor_parallel
    chips, groups, left = _worker_plan(args, tensor_parallel)
    plan = describe(chips, tensor_parallel, groups, left)
    if args.dry_run:
        print("\n".join(plan))
        return
    allocator, said = worker_allocator_environment()
    print(f"packscore: {plan[0]}; worker allocator: {said}", file=sys.stderr, flush=True)
    groups = [DeviceGroup(group.name, {**allocator, **group.env}) for group in groups]
    WorkerSupervisor(groups, lambda i: worker_command(args.loglevel, f"packscore-{os.getpid()}-{i}")).run()


def check(args: argparse.Namespace) -> None:
    """`packscore check`: this host before serving (core/check.py); the plan and a job through the service here."""
    from packscore.supervisor import describe
    from store.settings import get_settings

    settings = get_settings()
    try:
        chips, groups, left = _worker_plan(args, settings.tensor_parallel)
        plan = describe(chips, settings.tensor_parallel, groups, left)
    except CommandError as exc:
        chips, groups, plan = None, [], [str(exc)]
    if chips and chips.platform == "cpu" and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"  # as the plan's CPU workers get it: no probing for a TPU
    from core import check as engine  # JAX starts here, after the plan (which must not open the chips)
    from core.scorer import choose_xla_flags

    choose_xla_flags(settings.dtype)  # before the device check starts JAX's CPU backend (see core.scorer)
    report = engine.Report(echo=not args.json)
    report.add("plan", "ok" if chips else "fail", plan[0],
               groups=[{"name": g.name, "env": g.env} for g in groups], left=list(left) if chips else [])
    for line in plan[1:]:
        report.add("plan", "info", line)
    engine.check_devices(report)
    if chips:
        engine.check_plan_platform(report, chips.platform)
    engine.check_caches(report, settings.compile_cache_dir, settings.model_cache_dir,
                        list(settings.served_models.values()))
    shape = None
    if any(v is not None for v in (args.query_tokens, args.items, args.item_tokens)):
        shape = tuple(v if v is not None else d for v, d in zip((args.query_tokens, args.items, args.item_tokens),
                                                                 engine.CPU_SHAPE))
    options = engine.CheckOptions(
        workers_per_host=max(len(groups), 1), shape=shape, full_contract=args.full_contract, seed=args.seed,
        profile=args.profile, profile_dir=args.profile_dir,
        memory_bytes=int(args.memory_gb * 1e9) if args.memory_gb else None, tolerance=args.tolerance)
    for name, source in settings.served_models.items():
        engine.check_model(report, engine.ModelCheck(
            name, source, settings.model_cache_dir, settings.dtype, settings.attention, settings.tensor_parallel,
            settings.pass_tokens, settings.prefix_cache_bytes, settings.max_programs), options)
    _check_job(report, args, list(settings.served_models))
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.summary())
    if not report.ok:
        sys.exit(1)


def _check_job(report, args: argparse.Namespace, models: list[str]) -> None:  # type: ignore[no-untyped-def]
    """One small job per model through the service at --url, end to end; no service is a skip, not a failure."""
    import httpx

    from packscore.client import Client

    if not args.url:
        report.add("service", "skip", "no service: --url or $PACKSCORE_URL not given (no job sent)")
        return
    try:
        httpx.get(f"{args.url.rstrip('/')}/healthz", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        report.add("service", "skip", f"no service at {args.url} ({type(exc).__name__}: {exc}); no job sent")
        return
    key = api_key(args)
    if key.value is None:
        report.add("service", "skip", f"{key.where}: no job sent to {args.url}")
        return
    items = [[11, 12, 13], [14, 15], [16]]
    for model in models:
        try:
            with Client(args.url, key, max_retries=3, retry_seconds=30) as client:
                start = time.monotonic()
                job = client.submit_job({"model": model, "query": list(range(20, 40)), "items": items,
                                         "label_token_ids": [5, 6]})
                job = client.wait_job(job["id"], timeout=120)
        except Exception as exc:  # noqa: BLE001 - any failure of the round trip is the finding
            report.add("service", "fail", f"{model}: a job through {args.url} failed ({type(exc).__name__}: {exc})")
            continue
        ok = job["status"] == "succeeded" and len(job.get("scores") or []) == len(items)
        report.add("service", "ok" if ok else "fail", f"{model}: job {job['id']} {job['status']} through {args.url} "
                   f"in {time.monotonic() - start:.1f} s" + ("" if ok else f": {json.dumps(job)[:500]}"))


def embedded_workers(env: dict[str, str]) -> "list[DeviceGroup]":
    """The workers `serve --embedded` starts, each with `env`: one, or one per model of MODELS (each its MODEL),
    so that every model the API accepts has a worker to run it."""
    from packscore.supervisor import DeviceGroup
    from store.settings import get_settings

    models = list(get_settings().served_models)
    if len(models) == 1:
        return [DeviceGroup("embedded", env)]
    return [DeviceGroup(f"embedded-{name}", {**env, "MODEL": name}) for name in models]


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    # uvicorn, once it has shut down, re-raises the signal that stopped it with the handler it found (SIGTERM's
    # default would end this process without the `finally` below). A stop asked for is a clean end, exit 0, as
    # `worker` ends: `make run` runs this without a shell, so make prints no "Error 130" after a Ctrl-C.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: sys.exit(0))
    # Connections still open when stopping (a /v1/score call waiting for its job) are cut after this long: the
    # default waits for them, a minute or more.
    server = uvicorn.Server(uvicorn.Config("api.main:create_app", factory=True, host=args.host, port=args.port,
                                           log_level="info", timeout_graceful_shutdown=API_STOP_SECONDS))
    child, record = None, None
    try:
        if args.embedded:
            from packscore.supervisor import WorkerSupervisor

            record = _claim_address(args.host, args.port)
            _embedded_environment()
            migrate()
            _embedded_key()
            allocator, said = worker_allocator_environment()
            print(f"packscore: worker allocator: {said}", flush=True)
            # Started again if it fails: a crash must not leave the service accepting jobs that nothing runs.
            child = WorkerSupervisor(embedded_workers(allocator), lambda i: worker_command())
            child.start()
            child.watch(lambda: server.should_exit)  # Ctrl-C reaches the worker too: its exit 0 is no failure
        server.run()
    finally:
        if child is not None:
            child.stop()
        _release_address(record)


def api_key(args: argparse.Namespace) -> Key:
    """The key from --api-key, else the key of the service at --url (packscore.client.find_key), with its source
    for a 401's message."""
    if args.api_key:
        return Key(args.api_key, KeySource.OPTION)
    return find_key(args.url, EMBEDDED_DIR)


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from packscore.client import Client

    return Client(args.url, api_key(args), max_retries=args.max_retries, retry_seconds=args.retry_seconds,
                  on_retry=lambda message: print(f"\npackscore: {args.url}: {message}", file=sys.stderr))


def _storage_prefix(text: str) -> str:
    from store.lake.access import storage_prefix

    try:
        return storage_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids "
                                         "(e.g. 9805,787 for \" yes\" and \" no\" in SmolLM2)") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _devices(text: str) -> str:
    if text != "all" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: 'all' or a number of chips")
    return text


def _number(convert: Callable[[str], float], positive: bool) -> Callable[[str], float]:
    """An argparse type for a count or a number of seconds: a negative one would fail deep in the command (an
    AssertionError in the client's retries, a ValueError from sleep); with `positive`, 0 too (a busy loop)."""
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'positive' if positive else 'non-negative'} "
                                             f"{'whole number' if convert is int else 'number'}")
        return value
    return parse


_count, _positive_count = _number(int, False), _number(int, True)
_non_negative, _positive = _number(float, False), _number(float, True)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _request_body(args: argparse.Namespace) -> dict:
    def parse(text: str, what: str) -> str | list[int]:
        # --ids: query and items are comma-separated token ids instead of text.
        if not args.ids:
            return text
        try:
            return _token_ids(text)
        except argparse.ArgumentTypeError as exc:
            args.parser.error(f"{what} with --ids: {exc}")

    return {"query": parse(args.query, "--query"), "items": [parse(item, "--item") for item in args.item],
            "label_token_ids": args.labels, "apply_softmax": args.softmax, "item_first": args.item_first,
            **({"model": args.model} if args.model else {})}


def _waiting_for(response) -> str | None:  # type: ignore[no-untyped-def]
    """What a /readyz answer says the service still waits for, as one line, or None once it serves every model:
    the workers' warm-ups (programs compiled or loaded, of how many), a model with no worker yet, or the check
    that fails."""
    try:
        body = response.json()
    except ValueError:
        return None if response.status_code == 200 else f"/readyz answered {response.status_code}"
    warming = [g for g in body.get("device_groups", []) if g.get("state") == "warming"]
    models = body.get("models", {})
    unready = [name for name, model in models.items() if not model.get("workers")]
    if response.status_code == 200 and not unready:
        return None
    said = []
    if warming:
        said.append("warming: " + ", ".join(
            f"{g['model']} {g['programs']['done']}/{g['programs']['total']} programs" if "programs" in g
            else f"{g['model']} loading" for g in warming if g["model"] in unready or not models))
    if without := [name for name in unready if not models[name].get("warming")]:
        said.append(f"no worker yet for {', '.join(without)}")
    checks = body.get("checks", {})
    if down := [name for name in ("database", "broker") if checks.get(name) is False]:
        said.append(f"waiting for {' and '.join(down)}")
    return "; ".join(said) or "waiting for a worker"


def _not_this_folders(url: str) -> str | None:
    """Why the service at `url` is not the embedded service of this folder, or None (it is, or none is recorded
    there: then nothing tells)."""
    from packscore.client import recorded_home

    home = recorded_home(url)
    if home is None or home.resolve() == EMBEDDED_DIR.resolve():
        return None
    return (f"{url} is the embedded service started from {home.parent}, not this folder's ({EMBEDDED_DIR.resolve()}): "
            "serve this folder's on another port and wait for it there (`make run PORT=8100` and `make wait-ready "
            "PORT=8100`, or `--url`)")


def wait_ready(args: argparse.Namespace) -> None:
    """Polls /readyz until the service answers 200 and each of its models has a ready worker, or gives up. With
    --embedded, a service another folder started at that address is refused at once, not waited for."""
    import httpx

    deadline = time.monotonic() + args.timeout
    last, shown = "no answer yet", None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{args.url.rstrip('/')}/readyz", timeout=5)
            if getattr(args, "embedded", False) and (other := _not_this_folders(args.url)):
                raise CommandError(other)
            waiting = _waiting_for(response)
            if waiting is None:
                print(f"{args.url} is ready")
                return
            last = f"/readyz answered {response.status_code}: {response.text[:200]}"
            if waiting != shown:  # on stderr: stdout keeps the one answer
                print(waiting, file=sys.stderr, flush=True)
                shown = waiting
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1)
    raise CommandError(f"{args.url} was not ready after {args.timeout:.0f} s ({last})")


def _print_table(items: list, labels: list[int], scores: list[list[float]]) -> None:
    shown = [json.dumps(item, ensure_ascii=False)[:40] for item in items]
    width = max([len("item"), *map(len, shown)])
    print("item".ljust(width) + "".join(f"  {f'label {label}':>12}" for label in labels))
    for text, row in zip(shown, scores):
        print(text.ljust(width) + "".join(f"  {value:>12.6g}" for value in row))


def score(args: argparse.Namespace) -> None:
    body = _request_body(args)
    with _client(args) as client:
        out = client.score(body["query"], body["items"], body["label_token_ids"],
                           apply_softmax=body["apply_softmax"], item_first=body["item_first"],
                           model=body.get("model"))
    _print_table(body["items"], body["label_token_ids"], out["scores"])


def rerank(args: argparse.Namespace) -> None:
    with _client(args) as client:
        out = client.rerank(args.query, args.document, top_n=args.top_n, instruction=args.instruction,
                            model=args.model)
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return
    print(f"{'rank':>4}  {'index':>5}  {'relevance':>9}  document")
    for rank, result in enumerate(out["results"], 1):
        text = json.dumps(result["document"]["text"], ensure_ascii=False)[:60]
        print(f"{rank:>4}  {result['index']:>5}  {result['relevance_score']:>9.4f}  {text}")


def submit(args: argparse.Namespace) -> None:
    body = _request_body(args)
    body.update(return_logprobs=args.logprobs, webhook_url=args.webhook_url, metadata=args.metadata)
    with _client(args) as client:
        job = client.submit_job(body, idempotency_key=args.idempotency_key)
        if args.wait:
            job = client.wait_job(job["id"], poll=args.poll)
    print(json.dumps(job, indent=2))
    if args.wait and job["status"] != "succeeded":
        sys.exit(1)


def cancel(args: argparse.Namespace) -> None:
    """Cancels a job or a batch, by its id's kind; prints it as JSON. Exit 1 if it had already ended."""
    from packscore.client import PackscoreError

    kind = args.id.split("_", 1)[0]
    if kind not in ("job", "batch"):
        raise CommandError(f"{args.id!r} is neither a job's id (job_...) nor a batch's (batch_...)")
    with _client(args) as client:
        try:
            found = client.cancel_job(args.id) if kind == "job" else client.cancel_batch(args.id)
        except PackscoreError as exc:
            if exc.code not in ("job_finished", "batch_finished"):
                raise
            found = client.get_job(args.id) if kind == "job" else client.get_batch(args.id)
            print(json.dumps(found, indent=2))
            raise CommandError(f"{kind} {args.id} had already ended {found['status']}") from None
    print(json.dumps(found, indent=2))
    if found["status"] in ("running", "cancelling"):  # a 202: it stops at its next pass or chunk boundary
        follow = f"packscore wait-batch {args.id}" if kind == "batch" else f"GET /jobs/{args.id}"
        print(f"{kind} {args.id}: cancel requested; it stops at its next pass, within seconds ({follow} shows it "
              "cancelled)", file=sys.stderr)


def wait_batch(args: argparse.Namespace) -> None:
    with _client(args) as client:
        batch = client.wait_batch(args.batch_id, poll=args.poll)
    print(json.dumps(batch, indent=2))
    if batch["status"] != "completed":
        sys.exit(1)


INPUT_FORMATS = ("jsonl", "parquet", "csv")
MODEL_HELP = "one of the service's MODELS (GET /v1/models; default: its first)"
RESULT_FORMATS = ("packscore", "openai")


def _reference_failed(batch: dict) -> bool:
    """A failed chunk is whole objects unscored (missing, corrupt), though the batch still completes: a script
    running the command must see it."""
    return batch["status"] != "completed" or bool(batch["chunks"]["failed"])


def backfill(args: argparse.Namespace) -> None:
    from packscore.backfill import BackfillError, UploadTooLarge, input_kind, run_backfill, run_reference_backfill

    if args.format not in RESULT_FORMATS:
        hint = f"; the input's format is --input-format {args.format}" if args.format in INPUT_FORMATS else ""
        raise CommandError(f"--format is the result lines' format ({' or '.join(RESULT_FORMATS)}){hint}")
    try:
        reference = args.input_format is not None or args.query_column is not None or \
            input_kind(args.input) == "reference"
        table_options = [flag for flag, given in (("--labels", args.labels), ("--label-column", args.label_column),
                                                  ("--softmax", args.softmax), ("--item-first", args.item_first))
                         if given]
        if args.dry_run and not reference:
            raise CommandError(f"--dry-run plans data the service reads (a pair table, a folder, a URI); "
                               f"{args.input} is a JSONL request file, sent as an upload")
        if table_options and not reference:
            raise CommandError(f"{', '.join(table_options)}: a pair table's options; the lines of {args.input} are "
                               "requests, each with its own label_token_ids, apply_softmax and item_first")
        with _client(args) as client:
            if not reference:
                try:
                    run_backfill(client, Path(args.input), Path(args.out), poll=args.poll, format=args.format,
                                 model=args.model)
                    return
                except UploadTooLarge as exc:
                    # Nothing was sent: the service may read the file itself (embedded mode, BATCH_LOCAL_ROOT).
                    parts = f"{args.out}.parts"
                    print(f"{exc}: running it as a reference batch instead (the service reads the file itself, in "
                          f"chunks); result objects go under {parts}/, and the result lines into {args.out} when "
                          "it ends", file=sys.stderr)
                    try:
                        batch = run_reference_backfill(client, args.input, parts, poll=args.poll,
                                                       format="jsonl", output_format="jsonl",
                                                       overwrite=args.overwrite, model=args.model)
                    except BackfillError as refused:  # its message names the input or the output refused
                        raise CommandError(f"{exc}, and the service refused it as a reference batch ({refused}): "
                                           "split it, or put it where the service can read it (README: Backfills "
                                           "from object storage)") from None
                    lines = 0
                    with open(args.out, "w") as out:  # the result lines, as an upload's would be
                        for line in client.iter_batch_results(batch["id"], format=args.format):
                            out.write(json.dumps(line, separators=(",", ":")) + "\n")
                            lines += 1
                    print(f"{lines} result lines in {args.out}", file=sys.stderr)
                    if _reference_failed(batch):
                        sys.exit(1)
                    return
            columns = None
            if args.query_column or args.item_column:
                if not (args.query_column and args.item_column):
                    raise CommandError("a pair table needs both --query-column and --item-column")
                columns = {"query": args.query_column, "item": args.item_column, "ids": args.id_column or [],
                           **({"label": args.label_column} if args.label_column else {})}
            elif not args.input.lower().split("?")[0].endswith((".jsonl", ".json", ".ndjson", ".gz", ".zst")) \
                    and args.input_format != "jsonl":
                raise CommandError(f"{args.input} is not a JSONL file: give --query-column and --item-column for a "
                                   "pair table")
            batch = run_reference_backfill(
                client, args.input, args.out, poll=args.poll, format=args.input_format, columns=columns,
                label_token_ids=args.labels, output_format=args.output_format, overwrite=args.overwrite,
                apply_softmax=args.softmax, item_first=args.item_first, model=args.model, dry_run=args.dry_run)
            if not args.dry_run and _reference_failed(batch):
                sys.exit(1)
    except BackfillError as exc:
        raise CommandError(str(exc)) from None
    except KeyboardInterrupt:
        print("\ninterrupted: a reference batch goes on (run the same command again to re-attach); an upload "
              "resumes from its output when run again", file=sys.stderr)
        sys.exit(130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packscore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the HTTP API")
    p.add_argument("--embedded", action="store_true",
                   help="SQLite + filesystem broker under ./.packscore, migrations applied, one worker started")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_count, default=8000)
    p.set_defaults(func=serve)

    p = commands.add_parser("worker", help="run a scoring worker; with --devices, one per group of chips")
    p.add_argument("--loglevel", default="INFO")
    p.add_argument("--devices", type=_devices, help="'all' or a count: this host's chips (TPU, GPU) to use, one "
                   "worker process per TENSOR_PARALLEL of them, each given its own chips; failed ones restarted")
    p.add_argument("--platform", choices=("tpu", "cuda", "cpu"), help="with --devices: the chips' platform "
                   "(default: found from the host's device files)")
    p.add_argument("--chips", type=_positive_count, help="with --devices: how many chips the host has (default: found)")
    p.add_argument("--dry-run", action="store_true", help="with --devices: print the workers and their chips' "
                   "variables; start nothing")
    p.set_defaults(func=worker)

    p = commands.add_parser("check", help="check this host before serving: devices, the worker plan, and per model "
                            "fit, attention path, scores against the CPU's float32, speed; exits 1 on a failure")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument("--profile", action="store_true", help="device time per op kind (JAX's profiler)")
    p.add_argument("--profile-dir", help="with --profile: keep the trace (Perfetto, TensorBoard) and the programs' "
                   "HLO in this folder")
    p.add_argument("--query-tokens", "-P", type=_positive_count, help="a request shape (as benchmarks.bench's; "
                   "unset ones from 500,100,20): the scored request, and timed besides the contract's")
    p.add_argument("--items", "-N", type=_positive_count)
    p.add_argument("--item-tokens", "-L", type=_positive_count)
    p.add_argument("--full-contract", action="store_true", help="time the contract's 2,000-token query and 500 "
                   "items on a CPU too (minutes; a CPU times 500,100,20 by default)")
    p.add_argument("--tolerance", type=_non_negative, help="max |log-prob difference| from the CPU's float32 (default: "
                   "docs/score-semantics.md's bfloat16 rule)")
    p.add_argument("--memory-gb", type=_positive,
                   help="a worker's memory, instead of what its chips (or the host) say")
    p.add_argument("--seed", type=_count, default=0)
    p.add_argument("--platform", choices=("tpu", "cuda", "cpu"), help="as worker --devices")
    p.add_argument("--chips", type=_positive_count, help="as worker --devices")
    p.add_argument("--url", default=os.environ.get("PACKSCORE_URL"),
                   help="a service to send one job through (default $PACKSCORE_URL; none: skipped)")
    p.add_argument("--api-key", help="as for the client commands: default the key of the service at --url")
    p.set_defaults(func=check, devices="all")

    p = commands.add_parser("migrate", help="apply database migrations")
    p.add_argument("--embedded", action="store_true", help="the embedded SQLite database under ./.packscore")
    p.set_defaults(func=migrate)

    p = commands.add_parser("create-key", help="create an API key and print it with its webhook secret")
    p.add_argument("--name", required=True)
    p.add_argument("--storage-prefix", action="append", type=_storage_prefix,
                   help="a URI prefix (s3://bucket/team/) the key's reference batches may read and write (repeat)")
    p.add_argument("--embedded", action="store_true", help="in the embedded SQLite database under ./.packscore")
    p.set_defaults(func=create_key)

    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--url", default=os.environ.get("PACKSCORE_URL", "http://127.0.0.1:8000"),
                            help="the service (default $PACKSCORE_URL or http://127.0.0.1:8000)")
    connection.add_argument("--api-key", help="default: the key file of the embedded service serving --url, else "
                                              "$PACKSCORE_API_KEY, else this folder's ($PACKSCORE_HOME/api_key)")
    connection.add_argument("--max-retries", type=_count, default=30,
                            help="retries on 429, 503 (not worker_lost) and connection errors, with backoff "
                                 "(Retry-After honoured)")
    connection.add_argument("--retry-seconds", type=_non_negative, default=DEFAULT_RETRY_SECONDS,
                            help="give up on a call after retrying it this long (default %(default)s s)")
    request = argparse.ArgumentParser(add_help=False)
    request.add_argument("--query", required=True)
    request.add_argument("--item", action="append", required=True, help="repeat for each item")
    request.add_argument("--labels", required=True, type=_token_ids,
                         help="label token ids, comma-separated (9805,787 are \" yes\",\" no\" in SmolLM2)")
    request.add_argument("--softmax", action="store_true", help="apply_softmax over the labels")
    request.add_argument("--item-first", action="store_true")
    request.add_argument("--model", help=MODEL_HELP)
    request.add_argument("--ids", action="store_true", help="query and items are comma-separated token ids")

    p = commands.add_parser("wait-ready", help="wait until the service is ready (/readyz answers 200) and each of "
                            "its models (MODELS) has a ready worker")
    p.add_argument("--url", default=os.environ.get("PACKSCORE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--embedded", action="store_true", help="the embedded service of this folder: another folder's "
                   "at --url is an error, not waited for")
    p.add_argument("--timeout", type=_non_negative, default=300.0, help="seconds (default %(default)s)")
    p.set_defaults(func=wait_ready)

    p = commands.add_parser("score", parents=[connection, request], help="score one request, print a table")
    p.set_defaults(func=score)

    p = commands.add_parser("rerank", parents=[connection], help="rank documents by relevance to a query (/v1/rerank)")
    p.add_argument("--query", required=True)
    p.add_argument("--document", action="append", required=True, help="repeat for each document")
    p.add_argument("--top-n", type=_count, help="only the N most relevant")
    p.add_argument("--instruction", help="the task, in the template's words (default: the template's)")
    p.add_argument("--json", action="store_true", help="print the API's answer as JSON instead of a table")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(func=rerank)

    p = commands.add_parser("submit", parents=[connection, request], help="submit one job, print it as JSON")
    p.add_argument("--wait", action="store_true", help="wait until the job has finished")
    p.add_argument("--poll", type=_positive, default=0.5)
    p.add_argument("--logprobs", action="store_true", help="return_logprobs")
    p.add_argument("--webhook-url")
    p.add_argument("--metadata", type=_json_object, help="a JSON object, echoed back")
    p.add_argument("--idempotency-key")
    p.set_defaults(func=submit)

    p = commands.add_parser("cancel", parents=[connection], help="cancel a job or a batch (a lake batch too): print "
                            "it as JSON; exit 1 if it had already ended")
    p.add_argument("id", metavar="JOB_OR_BATCH", help="a job's id (job_...) or a batch's (batch_...)")
    p.set_defaults(func=cancel)

    p = commands.add_parser("wait-batch", parents=[connection], help="wait until a batch has ended; print it as JSON")
    p.add_argument("batch_id")
    p.add_argument("--poll", type=_positive, default=1.0, help="seconds between checks")
    p.set_defaults(func=wait_batch)

    p = commands.add_parser("backfill", parents=[connection],
                            help="run a JSONL file as a batch, resumably; results to --out, progress to stderr")
    p.add_argument("input", help="JSONL: one request per line, each with a unique custom_id; or data the service "
                                 "reads itself: s3://, gs://, az:// URIs, folders, globs; pair tables (Parquet, CSV, "
                                 "JSONL)")
    p.add_argument("--out", required=True, help="results JSONL (appended to, custom_ids in it are skipped); for "
                                                "data in storage, the URI prefix for the result objects")
    p.add_argument("--poll", type=_positive, default=1.0, help="seconds between progress checks")
    p.add_argument("--format", default="packscore", metavar="{packscore,openai}",
                   help="the result lines written to --out: this service's own, or OpenAI Batch API output lines")
    p.add_argument("--input-format", choices=INPUT_FORMATS,
                   help="the input's format, for data the service reads (default: from its name; a pair table "
                        "in any of them takes --query-column and --item-column)")
    p.add_argument("--query-column", help="a pair table's query column")
    p.add_argument("--item-column", help="a pair table's item (document) column")
    p.add_argument("--id-column", action="append", help="a column passed through to the output (repeat)")
    p.add_argument("--labels", type=_token_ids, help="label token ids for a pair table, comma-separated")
    p.add_argument("--label-column", help="a pair table's column of each row's label token ids (instead of --labels)")
    p.add_argument("--softmax", action="store_true", help="a pair table's apply_softmax over the labels")
    p.add_argument("--item-first", action="store_true", help="a pair table's item_first: the item before the query")
    p.add_argument("--output-format", choices=("parquet", "jsonl"), default="parquet",
                   help="the result objects written under --out for data the service reads")
    p.add_argument("--overwrite", action="store_true",
                   help="for data the service reads: start afresh, from row 0, as a new batch, though an earlier batch "
                        "of the same command wrote to --out (without it, the same command reports a completed batch, "
                        "and resumes a cancelled one from its committed chunks)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="for data the service reads: print the plan (rows, chunks, columns read, output) and an "
                        "estimate of its time at this deployment's measured rate; create nothing")
    p.set_defaults(func=backfill)
    return parser


def main(argv: list[str] | None = None) -> None:
    import httpx

    from packscore.client import PackscoreError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.parser = parser
    # A script's background job (`packscore backfill ... &`, `setsid`) starts with SIGINT ignored: Ctrl-C and
    # `kill -INT` must still stop every command as from a terminal (`serve` and `worker` set their own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    name = f"packscore {args.command}"
    try:
        args.func(args)
    except PackscoreError as exc:
        _fail(f"{name}: {exc.status} {exc.code}: {exc.message}")
    except httpx.TransportError as exc:
        _fail(f"{name}: cannot reach {args.url} ({type(exc).__name__}: {exc}); gave up after "
              f"{args.retry_seconds:.0f} s of retries. Is the service running? (--url or $PACKSCORE_URL)")
    except CommandError as exc:
        _fail(f"{name}: {exc}")
    except KeyboardInterrupt:
        _fail(f"{name}: interrupted", 130)
    except OSError as exc:
        if exc.filename != str(EMBEDDED_DIR):
            raise
        _fail(f"{name}: {EMBEDDED_DIR} (the embedded service's folder, $PACKSCORE_HOME): {exc.strerror}", 2)
    except Exception as exc:  # a bad setting or a failing database, else raised as it is
        failure = _settings_failure(exc)
        if failure is None:
            raise
        _fail(f"{name}: {failure[0]}", failure[1])


def _settings_failure(exc: Exception) -> tuple[str, int] | None:
    """One line and the exit status for a bad setting (2) or a failing database (1); None for anything else.
    Its imports only once something failed: SQLAlchemy alone would add a tenth of a second to every client
    command."""
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, OperationalError

    from store.settings import SettingsError, get_settings

    if isinstance(exc, ValidationError):
        if exc.title != "Settings":
            return None
        problems = []
        for error in exc.errors(include_url=False):
            setting = str(error["loc"][0]).upper() if error["loc"] else "settings"
            value = "" if setting.endswith("_URL") else f"={error['input']!r}"  # a URL may hold a password
            problems.append(f"{setting}{value}: {error['msg'].removeprefix('Value error, ')}")
        return "bad setting " + "; ".join(problems) + " (from the environment or .env)", 2
    if isinstance(exc, SettingsError):
        return f"bad setting: {exc}", 2
    if isinstance(exc, ArgumentError):  # NoSuchModuleError too: a URL SQLAlchemy cannot parse or has no driver for
        return f"bad setting DATABASE_URL: {exc}", 2
    if isinstance(exc, OperationalError):
        url = make_url(get_settings().database_url).render_as_string(hide_password=True)
        return f"the database at {url} failed: {str(exc.orig or exc).strip().splitlines()[0]}", 1
    return None


def _fail(message: str, status: int = 1) -> None:
    print(f"\n{message}" if sys.stderr.isatty() else message, file=sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
