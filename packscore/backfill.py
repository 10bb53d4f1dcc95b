"""`packscore backfill INPUT.jsonl --out RESULTS.jsonl`: runs a JSONL file as a batch and appends each
request's result line to the output exactly once.

Resumable: the output itself is the record of what is done (custom_ids already in it are skipped), and
`RESULTS.jsonl.batch` holds the id of the batch in flight, so a re-run after an interruption follows that
batch instead of submitting its requests again. A torn last line (the process died mid-write) is dropped.
"""

import json
import sys
import time
from pathlib import Path
from typing import IO

from packscore.client import TERMINAL_BATCH, Client, PackscoreError

UPLOAD_CHUNK_BYTES = 256 * 1024


class BackfillError(Exception):
    pass


def read_input_ids(path: Path) -> list[str]:
    """The custom_ids of the input, checked here because resuming keys on them: present, strings, unique."""
    ids, seen = [], set()
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                custom_id = json.loads(line)["custom_id"]
            except (ValueError, KeyError, TypeError):
                raise BackfillError(f"{path}:{number}: not a JSON object with a custom_id") from None
            if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 256 or "\x00" in custom_id:
                raise BackfillError(f"{path}:{number}: custom_id must be a string of 1 to 256 characters")
            if custom_id in seen:
                raise BackfillError(f"{path}:{number}: custom_id {custom_id!r} appears twice")
            seen.add(custom_id)
            ids.append(custom_id)
    return ids


def read_done(path: Path) -> set[str]:
    """custom_ids already in the output; cuts off a torn last line so that appending stays valid JSONL."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    return {json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()}


class ProgressBar:
    """One line on stderr: requests done, requests/s over this run, ETA."""

    def __init__(self, total: int, done: int, stream: IO[str]) -> None:
        self.total = total
        self.start_done = done
        self.start = time.monotonic()
        self.stream = stream

    def show(self, done: int, note: str = "") -> None:
        done = min(done, self.total)
        elapsed = time.monotonic() - self.start
        rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
        eta = f"{int((self.total - done) / rate) // 60}:{int((self.total - done) / rate) % 60:02d}" if rate > 0 else "?"
        filled = int(30 * done / self.total) if self.total else 30
        self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} requests  "
                          f"{rate:.1f}/s  ETA {eta}  {note}".rstrip().ljust(80))
        self.stream.flush()

    def finish(self, message: str) -> None:
        self.stream.write(f"\n{message}\n")
        self.stream.flush()


def _upload_chunks(path: Path, done: set[str]):  # type: ignore[no-untyped-def]
    """The input's lines not done yet, as chunks of bytes (a generator: the file is never all in memory)."""
    def chunks():  # type: ignore[no-untyped-def]
        buffer, size = [], 0
        with path.open("rb") as f:
            for line in f:
                if not line.strip() or json.loads(line)["custom_id"] in done:
                    continue
                buffer.append(line if line.endswith(b"\n") else line + b"\n")
                size += len(line)
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


def _follow(client: Client, batch_id: str, out: IO[bytes], done: set[str], wanted: set[str], bar: ProgressBar,
            poll: float, format: str) -> str:
    """Polls the batch until it ends, appending results as they come; returns its final status. Partial
    downloads (so an interruption keeps most of the work) are spaced out so they cost little."""
    base = len(done & wanted)
    last_download, cost = time.monotonic(), 0.0
    while True:
        batch = client.get_batch(batch_id)
        counts = batch["counts"]
        terminal = batch["status"] in TERMINAL_BATCH
        if terminal or time.monotonic() - last_download >= max(10 * poll, 20 * cost):
            started = time.monotonic()
            _download(client, batch_id, out, done, wanted, format)
            last_download, cost = time.monotonic(), time.monotonic() - started
        bar.show(max(len(done & wanted), base + counts["succeeded"] + counts["failed"]), batch["status"])
        if terminal:
            return batch["status"]
        time.sleep(poll)


def run_backfill(client: Client, input_path: Path, out_path: Path, *, poll: float = 1.0, format: str = "packscore",
                 stderr: IO[str] = sys.stderr) -> int:
    """Runs the backfill to the end; returns how many results (of all the input's requests) are in the output.
    `format`: the results' lines, this service's own ("packscore") or OpenAI Batch output lines ("openai");
    both carry the custom_id that resuming keys on."""
    ids = read_input_ids(input_path)
    wanted = set(ids)
    done = read_done(out_path)
    state = Path(f"{out_path}.batch")
    bar = ProgressBar(len(ids), len(done & wanted), stderr)
    with out_path.open("ab") as out:
        for _ in range(2):  # a second batch only if the input gained requests the first one did not have
            if not wanted - done:
                break
            batch_id = state.read_text().strip() if state.exists() else ""
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
                bar.show(len(done & wanted), "uploading")
                batch_id = client.create_batch(_upload_chunks(input_path, done))["id"]
                state.write_text(batch_id + "\n")
            status = _follow(client, batch_id, out, done, wanted, bar, poll, format)
            if wanted - done and status != "completed":
                raise BackfillError(f"batch {batch_id} ended {status} with {len(wanted - done)} requests not done; "
                                    "run the same command again to submit them")
            state.unlink(missing_ok=True)
    missing = len(wanted - done)
    if missing:
        raise BackfillError(f"{missing} requests got no result")
    bar.finish(f"done: {len(ids)} results in {out_path}")
    return len(ids)
