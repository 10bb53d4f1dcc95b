"""`packscore backfill INPUT.jsonl --out RESULTS.jsonl`: runs a JSONL file as a batch and appends each
request's result line to the output exactly once.

Resumable: the output itself is the record of what is done (custom_ids already in it are skipped), and
`RESULTS.jsonl.batch` holds the id of the batch in flight, so a re-run after an interruption follows that
batch instead of submitting its requests again. Before the upload it holds a token sent as the batch's
metadata: a re-run after an upload whose answer never came finds that batch by it. A torn last line (the
process died mid-write) is dropped. --out must be a results file (or new), not the input.

Lines behave as POST /batches lines: a bad line becomes an error result whose message starts with its line
number in the file. Results are keyed by custom_id; a line without a usable one (none, not a string of 1 to
256 characters, already used on an earlier line, or a line that is not a JSON object) is keyed `line-N`, N
its line number, so every result line has a custom_id of its own. Results are appended as they finish, not
in the input's order: join on custom_id.

`packscore backfill s3://bucket/pairs/ --out s3://bucket/scores/ --input-format parquet --query-column q
--item-column doc --labels 9805,787` runs a reference batch instead: the data stays in storage (or in a local
file the service may read: embedded mode), the service reads it in chunks and writes result objects under
--out. Ctrl-C detaches (the batch goes on); the same command re-attaches, or once the batch has ended reports
it done (the service finds the key's batch of that input and output; `--overwrite` runs a completed one
again). A local file that is not JSONL (Parquet, CSV, .gz/.zst) goes the same way. A JSONL request file over
the upload limit does too, saying so: its result objects go under `OUT.parts/`, and its result lines into --out
when the batch ends. One the service cannot read is refused before anything is sent.
"""

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO

import httpx

from packscore.client import TERMINAL_BATCH, Client, PackscoreError
from store import storage

UPLOAD_CHUNK_BYTES = 256 * 1024
# The service's default upload limits (BATCH_MAX_REQUESTS, BATCH_MAX_BYTES): a file over them is a reference
# batch, or refused here, before it is sent.
UPLOAD_MAX_REQUESTS = 100_000
UPLOAD_MAX_BYTES = 200 * 1024 * 1024
# Without a terminal the bar is a line of its own at most this often (a log is not a screen).
LOG_EVERY_SECONDS = 10.0
# The service answers an upload only once it has ingested all of it (100,000 lines: a minute or more), so its
# answer is waited for as long as the service itself gives an upload (BATCH_UPLOAD_TIMEOUT_SECONDS' default), not
# for ever; connecting and sending keep the client's timeouts.
UPLOAD_TIMEOUT = httpx.Timeout(60.0, read=3600.0)
# The state file holds `upload-<hex>` while an upload's answer is awaited; the batch carries it as metadata.
UPLOAD_TOKEN_PREFIX = "upload-"
UPLOAD_TOKEN_KEY = "packscore_backfill"


class BackfillError(Exception):
    pass


class UploadTooLarge(BackfillError):
    """The file is over the upload limits: the CLI runs it as a reference batch if the service can read it."""


@dataclass
class InputLine:
    number: int  # in the file, from 1
    custom_id: str
    upload: bytes | None  # what to send (a missing custom_id filled in), or None: refused here, see `error`
    error: tuple[str, str] | None = None  # (code, message) of a line refused here


def _read_line(number: int, raw: bytes, seen: dict[str, int]) -> InputLine | None:
    if not raw.strip():
        return None
    line_id = f"line-{number}"
    try:
        value = json.loads(raw)
    except ValueError as exc:
        return InputLine(number, line_id, None, ("invalid_json", f"line {number}: not a JSON value: {exc}"))
    if not isinstance(value, dict):
        return InputLine(number, line_id, None, ("invalid_input", f"line {number}: the line is not a JSON object"))
    if "custom_id" not in value:
        value["custom_id"] = line_id
        return InputLine(number, line_id, json.dumps(value, ensure_ascii=False).encode() + b"\n")
    custom_id = value["custom_id"]
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 256 or "\x00" in custom_id:
        return InputLine(number, line_id, None, ("invalid_input", f"line {number}: custom_id must be a string of "
                                                                  "1 to 256 characters"))
    if custom_id in seen:
        return InputLine(number, line_id, None, ("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} "
                                                                        f"was already used on line {seen[custom_id]}"))
    seen[custom_id] = number
    return InputLine(number, custom_id, raw if raw.endswith(b"\n") else raw + b"\n")


def read_input(path: Path) -> Iterator[InputLine]:
    """The input's non-blank lines, each with the custom_id its result will carry."""
    seen: dict[str, int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if (line := _read_line(number, raw, seen)) is not None:
                yield line


def _error_result(line: InputLine, format: str) -> dict:
    """A line refused here, as the service's result line for a line it refused (OpenAI: a 4xx response)."""
    code, message = line.error or ("internal_error", "")
    error = {"code": code, "message": message}
    if format == "openai":
        status = 422 if code in ("invalid_json", "invalid_input") else 400
        return {"id": None, "custom_id": line.custom_id, "error": None,
                "response": {"status_code": status, "request_id": None, "body": {"error": error}}}
    return {"custom_id": line.custom_id, "scores": None, "error": error}


def read_done(path: Path) -> set[str]:
    """custom_ids already in the output; cuts off a torn last line so that appending stays valid JSONL. A file
    that is not a results file is refused before anything in it is changed."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    done = set()
    for number, line in enumerate(data[:keep].splitlines(), 1):
        if not line.strip():
            continue
        try:
            result = json.loads(line)
        except ValueError:
            result = None
        if not isinstance(result, dict) or "custom_id" not in result:
            raise BackfillError(f"--out {path} is not a results file (line {number} is not a result line): give "
                                "a new file, or the one an earlier run of this backfill wrote")
        done.add(result["custom_id"])
    torn = data[keep:]
    if torn.strip():
        if not torn.lstrip().startswith(b"{"):  # what a result line written in part starts with
            raise BackfillError(f"--out {path} is not a results file (its last line is not a result line): give a "
                                "new file, or the one an earlier run of this backfill wrote")
        with path.open("r+b") as f:
            f.truncate(keep)
    return done


class ProgressBar:
    """Progress on stderr: done (lines written, or rows), the rate since `rebase` (results that were already
    done when a resumed run began arrive at once and are not a rate), ETA. On a terminal one line redrawn with
    \r; otherwise a plain line every LOG_EVERY_SECONDS."""

    def __init__(self, total: int | None, done: int, stream: IO[str], unit: str = "requests") -> None:
        self.total = total
        self.unit = unit
        self.stream = stream
        self.tty = stream.isatty() if hasattr(stream, "isatty") else False
        self.last_line = 0.0
        self.rebase(done)

    def rebase(self, done: int) -> None:
        self.start_done = done
        self.start = time.monotonic()

    def show(self, done: int, note: str = "", eta: float | None = None, ended: bool = False) -> None:
        """`ended`: the batch is over (the note says how); what is left of it will not run, so no rate nor ETA."""
        total = self.total if self.total is not None else 0
        done = min(done, total) if self.total is not None else done
        elapsed = time.monotonic() - self.start
        rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
        if eta is None and rate > 0 and self.total is not None:
            eta = (total - done) / rate
        eta_text = f"{int(eta) // 60}:{int(eta) % 60:02d}" if eta is not None else "?"
        of = f"/{total}" if self.total is not None else ""
        bar = f"[{'#' * int(30 * done / total)}{'.' * (30 - int(30 * done / total))}] " if total else ""
        pace = "" if ended else f"  {rate:.1f}/s  ETA {eta_text}"
        text = f"{bar}{done}{of} {self.unit}{pace}  {note}".rstrip()
        if self.tty:
            self.stream.write("\r" + text.ljust(80))
        elif time.monotonic() - self.last_line >= LOG_EVERY_SECONDS:
            self.stream.write(text + "\n")
            self.last_line = time.monotonic()
        else:
            return
        self.stream.flush()

    def finish(self, message: str) -> None:
        self.stream.write(f"\n{message}\n" if self.tty else f"{message}\n")
        self.stream.flush()


def _upload_chunks(path: Path, done: set[str]):  # type: ignore[no-untyped-def]
    """The input's lines not done yet, as chunks of bytes (a generator: the file is never all in memory). Every
    other line is sent blank, so the service's line numbers are the file's."""
    def chunks():  # type: ignore[no-untyped-def]
        buffer, size, number = [], 0, 0
        for line in read_input(path):
            buffer.append(b"\n" * (line.number - number - 1))
            number = line.number
            buffer.append(line.upload if line.upload is not None and line.custom_id not in done else b"\n")
            size += len(buffer[-1])
            if size >= UPLOAD_CHUNK_BYTES:
                yield b"".join(buffer)
                buffer, size = [], 0
        if buffer:
            yield b"".join(buffer)
    return chunks


def _download(client: Client, batch_id: str, out: IO[bytes], done: set[str], wanted: set[str], format: str) -> None:
    """Appends the batch's finished results that the output lacks. Cancelled requests are not written: a
    re-run submits them again."""
    for result in client.iter_batch_results(batch_id, format=format):
        custom_id = result.get("custom_id")
        if custom_id in done or custom_id not in wanted or (result.get("error") or {}).get("code") == "cancelled":
            continue
        out.write(json.dumps(result, separators=(",", ":")).encode() + b"\n")
        out.flush()
        done.add(custom_id)


def _follow(client: Client, batch_id: str, out: IO[bytes], done: set[str], wanted: set[str], every: set[str],
            bar: ProgressBar, poll: float, format: str) -> str:
    """Polls the batch until it ends, appending results as they come; returns its final status. Partial
    downloads (so an interruption keeps most of the work) are spaced out so they cost little. The bar counts
    `every` request of the input, the lines refused here included, so it ends where it says."""
    last_download, cost = 0.0, 0.0
    first = True
    while True:
        batch = client.get_batch(batch_id)
        terminal = batch["status"] in TERMINAL_BATCH
        if terminal or time.monotonic() - last_download >= max(10 * poll, 20 * cost):
            started = time.monotonic()
            _download(client, batch_id, out, done, wanted, format)
            last_download, cost = time.monotonic(), time.monotonic() - started
            if first:  # what was done before this run (a resume) is not this run's rate
                bar.rebase(len(done & every))
                first = False
        bar.show(len(done & every), batch["status"], ended=terminal)  # lines written, not requests finished
        if terminal:
            return batch["status"]
        time.sleep(poll)


def _find_upload(client: Client, token: str, state: Path) -> str:
    """The id of the batch uploaded with `token` as its metadata, or "" if the service has none (the upload
    never arrived). Newest first, down to an hour (clocks differ) before the token was written."""
    since = datetime.fromtimestamp(state.stat().st_mtime).astimezone() - timedelta(hours=1)
    cursor = None
    while True:
        page = client.list_batches(limit=100, cursor=cursor)
        for batch in page["data"]:
            if (batch.get("metadata") or {}).get(UPLOAD_TOKEN_KEY) == token:
                return batch["id"]
        cursor = page.get("next_cursor")
        if not cursor or not page["data"] or datetime.fromisoformat(page["data"][-1]["created_at"]) < since:
            return ""


def run_backfill(client: Client, input_path: Path, out_path: Path, *, poll: float = 1.0, format: str = "packscore",
                 model: str | None = None, stderr: IO[str] = sys.stderr) -> int:
    """Runs the backfill to the end; returns how many results (of all the input's requests) are in the output.
    `format`: the results' lines, this service's own ("packscore") or OpenAI Batch output lines ("openai");
    both carry the custom_id that resuming keys on. `model`: the batch's (None: the service's default)."""
    ids: list[str] = []
    wanted: set[str] = set()  # the lines the service scores; the others are refused here
    refused: list[InputLine] = []
    if out_path.exists() and input_path.exists() and os.path.samefile(input_path, out_path):
        raise BackfillError(f"--out {out_path} is the input file: results go to a file of their own")
    # Before anything else: the caller writes an upload too large into --out too.
    done = read_done(out_path)
    if input_path.stat().st_size > UPLOAD_MAX_BYTES:
        raise UploadTooLarge(f"{input_path} is over the upload limit ({UPLOAD_MAX_BYTES} bytes)")
    for line in read_input(input_path):
        ids.append(line.custom_id)
        if len(ids) > UPLOAD_MAX_REQUESTS:
            raise UploadTooLarge(f"{input_path} has more than {UPLOAD_MAX_REQUESTS} requests (line {line.number}), "
                                 "over the upload limit")
        if line.error is None:
            wanted.add(line.custom_id)
        else:
            refused.append(line)
    if not ids:
        raise BackfillError(f"{input_path} has no requests")
    state = Path(f"{out_path}.batch")
    every = set(ids)  # each line's custom_id is its own (a repeated one is refused as line-N)
    bar = ProgressBar(len(every), len(done & every), stderr)
    with out_path.open("ab") as out:
        for line in refused:
            if line.custom_id not in done:
                out.write(json.dumps(_error_result(line, format), separators=(",", ":")).encode() + b"\n")
                done.add(line.custom_id)
        out.flush()
        for _ in range(2):  # a second batch only if the input gained requests the first one did not have
            if not wanted - done:
                break
            batch_id = state.read_text().strip() if state.exists() else ""
            if batch_id.startswith(UPLOAD_TOKEN_PREFIX):
                batch_id = _find_upload(client, batch_id, state)
            if batch_id:
                try:
                    if client.get_batch(batch_id)["status"] in ("failed", "cancelled"):
                        batch_id = ""
                except PackscoreError as exc:
                    if exc.status != 404:
                        raise
                    batch_id = ""
            if batch_id:
                stderr.write(f"resuming batch {batch_id}\n")
            else:
                bar.show(len(done & every), "uploading")
                token = f"{UPLOAD_TOKEN_PREFIX}{uuid.uuid4().hex}"
                state.write_text(token + "\n")  # before the upload: its batch may exist though no answer comes
                try:
                    batch_id = client.create_batch(_upload_chunks(input_path, done), metadata={UPLOAD_TOKEN_KEY: token},
                                                   timeout=UPLOAD_TIMEOUT, model=model)["id"]
                except httpx.TransportError as exc:
                    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                        raise  # it never reached the service
                    raise BackfillError(f"no answer to the upload ({type(exc).__name__}: {exc}); its batch may exist: "
                                        "run the same command again, which follows that batch (found by the token in "
                                        f"{state}) or uploads again if there is none") from None
                state.write_text(batch_id + "\n")
            status = _follow(client, batch_id, out, done, wanted, every, bar, poll, format)
            if wanted - done and status != "completed":
                raise BackfillError(f"batch {batch_id} ended {status} with {len(wanted - done)} requests not done; "
                                    "run the same command again to submit them")
            state.unlink(missing_ok=True)
    missing = len(wanted - done)
    if missing:
        raise BackfillError(f"{missing} requests got no result")
    bar.finish(f"done: {len(ids)} results in {out_path}")
    return len(ids)


# ---- reference batches -------------------------------------------------------------------------------------


def input_kind(spec: str) -> str:
    """"reference" for data the service reads itself (a storage URI; a local Parquet, CSV or compressed file),
    "upload" for a JSONL file to send (one over the upload limits goes as a reference batch from `run_backfill`'s
    UploadTooLarge, its result lines written to --out all the same). A missing local file is an error here, not
    a traceback."""
    scheme = spec.split("://", 1)[0].lower() if "://" in spec else ""
    if storage.remote(scheme):
        return "reference"
    if scheme and scheme != "file":
        raise BackfillError(f"{spec}: only {storage.remote_schemes()} URIs and local files are served")
    path = Path(spec[len("file://"):] if spec.startswith("file://") else spec)
    if any(c in str(path) for c in "*?["):
        return "reference"
    if not path.exists():
        raise BackfillError(f"{path}: no such file")
    if path.is_dir():
        return "reference"
    with path.open("rb") as f:
        head = f.read(4)
    name = path.name.lower()
    if head == b"PAR1" or head[:2] == b"\x1f\x8b" or head == b"\x28\xb5\x2f\xfd" or \
            name.endswith((".parquet", ".csv", ".gz", ".zst", ".zstd")):
        return "reference"
    return "upload"


def _absolute(spec: str) -> str:
    """A local path as the service should see it (absolute: it may run from another folder)."""
    if "://" in spec:
        return spec
    return str(Path(spec).absolute())


def run_reference_backfill(client: Client, input_spec: str, output: str, *, poll: float = 1.0,
                           format: str | None = None, columns: dict | None = None,
                           label_token_ids: list[int] | None = None, output_format: str = "parquet",
                           overwrite: bool = False, apply_softmax: bool = False, item_first: bool = False,
                           model: str | None = None, dry_run: bool = False, stdout: IO[str] | None = None,
                           stderr: IO[str] = sys.stderr) -> dict:
    """Submits a reference batch and follows it to its end with a progress bar of rows; returns the batch. The
    service finds the batch already sent with this input and output (its key's, running or ended): the same
    call re-attaches, reports it done, or after a cancel or a failure resumes it from its committed chunks;
    `overwrite` runs it from row 0 as a new batch. Interrupted (KeyboardInterrupt), the batch goes on.
    `apply_softmax`, `item_first`: a pair table's, as the API takes them; `model`: the batch's. `dry_run`: prints
    the plan and an estimate of its time to `stdout` (default: sys.stdout) and returns the plan, creating nothing."""
    try:
        # Options left at their defaults are not sent: the body stays the one an earlier run sent.
        batch = client.create_reference_batch(_absolute(input_spec), _absolute(output), format=format,
                                              columns=columns, label_token_ids=label_token_ids,
                                              output_format=output_format, overwrite=overwrite or None,
                                              apply_softmax=apply_softmax or None, item_first=item_first or None,
                                              model=model, dry_run=dry_run)
    except PackscoreError as exc:
        if exc.code in ("local_paths_disabled", "path_outside_root"):
            # The message says which of input and output, and where local files may be.
            raise BackfillError(f"{exc.message} ({exc.code}): an embedded service reads and writes local files "
                                "only under the folder it runs in") from None
        raise
    if dry_run:
        (stdout or sys.stdout).write(describe_plan(batch))  # sys.stdout as it is now (a test may replace it)
        return batch
    stderr.write(f"batch {batch['id']}: {batch['chunks']['total']} chunks, results under {batch['output']}\n")
    if batch.get("resumed_from"):
        earlier = client.get_batch(batch["resumed_from"])["status"]
        stderr.write(f"resuming {earlier} batch {batch['resumed_from']}: its {batch['rows']['done']} rows committed "
                     "are kept, not scored again (--overwrite: from row 0)\n")
    rows = batch.get("rows") or {}
    bar = ProgressBar(rows.get("total"), rows.get("done", 0), stderr, unit="rows")
    while True:
        rows = batch.get("rows") or {}
        chunks = batch.get("chunks") or {}
        ended = batch["status"] in TERMINAL_BATCH
        # "+": a worker on CPU may still cut chunks into pieces (the rows stay the same)
        of = f"{chunks.get('total', 0)}{'' if chunks.get('total_final', True) else '+'}"
        bar.show(rows.get("done", 0), f"chunks {chunks.get('done', 0)}/{of} {batch['status']}",
                 batch.get("eta_seconds"), ended=ended)
        if ended:
            break
        time.sleep(poll)
        batch = client.get_batch(batch["id"])
    failed = f", {batch['chunks']['failed']} chunks failed" if batch["chunks"]["failed"] else ""
    again = "; the same command resumes it from its committed chunks" \
        if batch["status"] in ("cancelled", "failed") else ""
    bar.finish(f"{batch['status']}: {batch['rows']['done']} rows ({batch['rows']['failed']} errors{failed}); "
               f"results under {batch['output']} (_manifest.json){again}")
    return batch


# What the same command does with the batch already holding the output (POST /batches/plan's `earlier.then`).
THEN = {"follow": "the same command follows it", "report": "the same command reports it done (--overwrite: a new "
        "batch from row 0)", "resume": "the same command resumes it: its {rows} rows committed are kept "
        "(--overwrite: from row 0)", "replace": "the same command starts a new batch from row 0"}


def describe_plan(plan: dict) -> str:
    """POST /batches/plan's answer as lines: what would run, and how long it would take."""
    def many(n: int, what: str) -> str:
        return f"{n:,} {what}" if n == 1 else f"{n:,} {what}s"

    rows = many(plan["rows"], "row") if plan["rows"] is not None else \
        f"rows unknown until read ({plan['bytes'] or 0:,} bytes, planned by size)"
    lines = [f"plan: {rows} in {many(plan['chunks'], 'chunk')} from {many(plan['objects'], 'object')}, model "
             f"{plan['model']}",
             f"columns read: {', '.join(plan['columns'])}" if plan["columns"] else
             "columns read: none (each JSONL line is a request)",
             f"output: {plan['output']} (the batch's objects under {plan['output'].rstrip('/')}/BATCH_ID/)"]
    if earlier := plan["earlier"]:
        lines.append(f"earlier batch {earlier['id']} ({earlier['status']}) holds this output: "
                     + THEN[earlier["then"]].format(rows=f"{earlier['rows_committed']:,}"))
    rate = plan["rate"]
    if plan["estimate_seconds"] is not None:
        per = f"{rate['rows_per_second']:,.1f} rows/s" if plan["rows"] is not None else \
            f"{rate['bytes_per_second']:,.0f} bytes/s"
        lines.append(f"time: about {_duration(plan['estimate_seconds'])} at {per} (measured: {rate['basis']})")
    else:
        lines.append(f"time: no rate measured ({rate['basis']})")
        if plan["rows"] is not None:
            for d in rate["docs"]:
                fast, slow = _duration(plan["rows"] / d["high"]), _duration(plan["rows"] / d["low"])
                span = fast if fast == slow else f"{fast} to {slow}"
                lines.append(f"  estimate from docs: {span} at {d['low']:,.0f}-{d['high']:,.0f} rows/s, {d['where']}")
    return "".join(line + "\n" for line in lines)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{round(seconds / 60)} min"
    return f"{seconds // 3600} h {round(seconds % 3600 / 60)} min"
