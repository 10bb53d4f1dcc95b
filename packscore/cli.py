"""`packscore serve | worker | migrate | create-key | score | rerank | submit | backfill`."""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

EMBEDDED_DIR = Path(".packscore")


def _embedded_environment() -> None:
    """SQLite and a filesystem broker under ./.packscore: runs on a machine with no Postgres or Redis.
    Set before anything reads the settings; explicit environment variables still win."""
    EMBEDDED_DIR.mkdir(exist_ok=True)
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{(EMBEDDED_DIR / 'packscore.db').resolve()}")
    os.environ.setdefault("BROKER_URL", "filesystem://")
    os.environ.setdefault("BROKER_DIR", str((EMBEDDED_DIR / "broker").resolve()))
    os.environ.setdefault("COMPILE_CACHE_DIR", str((EMBEDDED_DIR / "compile-cache").resolve()))
    os.environ.setdefault("MODEL_CACHE_DIR", str((EMBEDDED_DIR / "model-cache").resolve()))


def migrate(args: argparse.Namespace | None = None) -> None:
    from api.settings import get_settings
    from migrations import upgrade

    if args is not None and args.embedded:
        _embedded_environment()
    upgrade(get_settings().database_url)


def _new_key(name: str) -> tuple[str, str]:
    from api.auth import create_api_key
    from api.db import session_scope

    with session_scope() as session:
        row, key = create_api_key(session, name)
        return key, row.webhook_secret


def create_key(args: argparse.Namespace) -> None:
    if args.embedded:
        _embedded_environment()
    key, secret = _new_key(args.name)
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


def worker_command(loglevel: str = "INFO") -> list[str]:
    from api.settings import get_settings

    # solo pool: the task runs in the worker's own process, which loaded the model; nothing forks after JAX.
    return [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo", "--concurrency", "1",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", get_settings().queue_name,
            "--loglevel", loglevel, "--hostname", f"packscore-{os.getpid()}@%h"]


def worker(args: argparse.Namespace) -> None:
    command = worker_command(args.loglevel)
    os.execv(command[0], command)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    child = None
    if args.embedded:
        _embedded_environment()
        migrate()
        _embedded_key()
        child = subprocess.Popen(worker_command())
        # uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM's default action would
        # then end this process without the `finally` below and leave the worker running. Raise instead.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        uvicorn.run("api.main:create_app", factory=True, host=args.host, port=args.port, log_level="info")
    finally:
        if child is not None:
            child.terminate()  # warm shutdown: a pass in progress finishes, unless it takes too long
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()  # its jobs' leases expire and they run again
                child.wait()


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from packscore.client import Client

    key = args.api_key or os.environ.get("PACKSCORE_API_KEY")
    if not key and (EMBEDDED_DIR / "api_key").exists():  # the local service of `serve --embedded`
        key = (EMBEDDED_DIR / "api_key").read_text().split()[0]
    return Client(args.url, key, max_retries=args.max_retries,
                  on_retry=lambda message: print(f"\npackscore: {message}", file=sys.stderr))


def _request_body(args: argparse.Namespace) -> dict:
    def parse(text: str) -> str | list[int]:
        # --ids: query and items are comma-separated token ids instead of text.
        return [int(t) for t in text.split(",") if t.strip()] if args.ids else text

    return {"query": parse(args.query), "items": [parse(item) for item in args.item],
            "label_token_ids": [int(t) for t in args.labels.split(",")], "apply_softmax": args.softmax,
            "item_first": args.item_first}


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
                           apply_softmax=body["apply_softmax"], item_first=body["item_first"])
    _print_table(body["items"], body["label_token_ids"], out["scores"])


def rerank(args: argparse.Namespace) -> None:
    with _client(args) as client:
        out = client.rerank(args.query, args.document, top_n=args.top_n, instruction=args.instruction)
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return
    print(f"{'rank':>4}  {'index':>5}  {'relevance':>9}  document")
    for rank, result in enumerate(out["results"], 1):
        text = json.dumps(result["document"]["text"], ensure_ascii=False)[:60]
        print(f"{rank:>4}  {result['index']:>5}  {result['relevance_score']:>9.4f}  {text}")


def submit(args: argparse.Namespace) -> None:
    body = _request_body(args)
    body.update(return_logprobs=args.logprobs, webhook_url=args.webhook_url,
                metadata=json.loads(args.metadata) if args.metadata else None)
    with _client(args) as client:
        job = client.submit_job(body, idempotency_key=args.idempotency_key)
        if args.wait:
            job = client.wait_job(job["id"], poll=args.poll)
    print(json.dumps(job, indent=2))
    if args.wait and job["status"] != "succeeded":
        sys.exit(1)


def backfill(args: argparse.Namespace) -> None:
    from packscore.backfill import BackfillError, run_backfill
    from packscore.client import PackscoreError

    try:
        with _client(args) as client:
            run_backfill(client, Path(args.input), Path(args.out), poll=args.poll, format=args.format)
    except (BackfillError, PackscoreError) as exc:
        print(f"\npackscore backfill: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        sys.exit(130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packscore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the HTTP API")
    p.add_argument("--embedded", action="store_true",
                   help="SQLite + filesystem broker under ./.packscore, migrations applied, one worker started")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=serve)

    p = commands.add_parser("worker", help="run a scoring worker (one per accelerator)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=worker)

    p = commands.add_parser("migrate", help="apply database migrations")
    p.add_argument("--embedded", action="store_true", help="the embedded SQLite database under ./.packscore")
    p.set_defaults(func=migrate)

    p = commands.add_parser("create-key", help="create an API key and print it with its webhook secret")
    p.add_argument("--name", required=True)
    p.add_argument("--embedded", action="store_true", help="in the embedded SQLite database under ./.packscore")
    p.set_defaults(func=create_key)

    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--url", default=os.environ.get("PACKSCORE_URL", "http://127.0.0.1:8000"),
                            help="the service (default $PACKSCORE_URL or http://127.0.0.1:8000)")
    connection.add_argument("--api-key", help="default $PACKSCORE_API_KEY, else ./.packscore/api_key")
    connection.add_argument("--max-retries", type=int, default=30,
                            help="retries on 429, 503 and connection errors, with backoff (Retry-After honoured)")
    request = argparse.ArgumentParser(add_help=False)
    request.add_argument("--query", required=True)
    request.add_argument("--item", action="append", required=True, help="repeat for each item")
    request.add_argument("--labels", required=True, help="label token ids, comma-separated")
    request.add_argument("--softmax", action="store_true", help="apply_softmax over the labels")
    request.add_argument("--item-first", action="store_true")
    request.add_argument("--ids", action="store_true", help="query and items are comma-separated token ids")

    p = commands.add_parser("score", parents=[connection, request], help="score one request, print a table")
    p.set_defaults(func=score)

    p = commands.add_parser("rerank", parents=[connection], help="rank documents by relevance to a query (/v1/rerank)")
    p.add_argument("--query", required=True)
    p.add_argument("--document", action="append", required=True, help="repeat for each document")
    p.add_argument("--top-n", type=int, help="only the N most relevant")
    p.add_argument("--instruction", help="the task, in the template's words (default: the template's)")
    p.add_argument("--json", action="store_true", help="print the API's answer as JSON instead of a table")
    p.set_defaults(func=rerank)

    p = commands.add_parser("submit", parents=[connection, request], help="submit one job, print it as JSON")
    p.add_argument("--wait", action="store_true", help="wait until the job has finished")
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--logprobs", action="store_true", help="return_logprobs")
    p.add_argument("--webhook-url")
    p.add_argument("--metadata", help="a JSON object, echoed back")
    p.add_argument("--idempotency-key")
    p.set_defaults(func=submit)

    p = commands.add_parser("backfill", parents=[connection],
                            help="run a JSONL file as a batch, resumably; results to --out, progress to stderr")
    p.add_argument("input", help="JSONL: one request per line, each with a unique custom_id")
    p.add_argument("--out", required=True, help="results JSONL; appended to, custom_ids in it are skipped")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between progress checks")
    p.add_argument("--format", choices=("packscore", "openai"), default="packscore",
                   help="result lines: this service's own, or OpenAI Batch API output lines")
    p.set_defaults(func=backfill)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
