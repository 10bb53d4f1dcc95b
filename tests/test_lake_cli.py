"""`packscore backfill` as a new user meets it (issue 29, item 7): inputs that are not an uploadable JSONL file
are sent the right way or refused before anything is sent, in one line, never with a traceback; progress
without a terminal is plain lines."""

import gzip
import io
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from packscore.backfill import LOG_EVERY_SECONDS, ProgressBar, input_kind
from tests.service_harness import REPO, free_port


def backfill(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # No service listens there: whatever is refused here is refused before anything is sent.
    return subprocess.run([sys.executable, "-m", "packscore.cli", "backfill", *args, "--url",
                           f"http://127.0.0.1:{free_port()}", "--api-key", "psk_test", "--retry-seconds", "1"],
                          cwd=cwd, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO),
                                                                                      "PATH": "/usr/bin:/bin"})


def test_inputs_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}\n')
    pq.write_table(pa.table({"q": ["x"], "doc": ["y"]}), tmp_path / "data.bin")  # Parquet by its magic bytes
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    assert input_kind(str(tmp_path / "a.jsonl")) == "upload"
    assert input_kind(str(tmp_path / "data.bin")) == "reference"
    assert input_kind(str(tmp_path / "a.jsonl.gz")) == "reference"
    assert input_kind("s3://my-bucket/requests.jsonl") == "reference"


def test_wrong_inputs_end_in_one_line_not_a_traceback(tmp_path: Path) -> None:
    pq.write_table(pa.table({"q": ["x"], "doc": ["y"]}), tmp_path / "pairs.parquet")
    for args, message in [(["missing.jsonl"], "missing.jsonl: no such file"),
                          (["pairs.parquet"], "give --query-column and --item-column"),
                          (["http://example.com/x.jsonl"], "only s3://, gs://, az:// URIs and local files"),
                          # --format is the result lines'; the input's is --input-format, and the error says so.
                          (["pairs.parquet", "--format", "parquet"], "the input's format is --input-format parquet")]:
        result = backfill(*args, "--out", "out.jsonl", cwd=tmp_path)
        assert result.returncode == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr and message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / "out.jsonl").exists()
    # s3:// goes to the service as a reference batch (here: none listening, so a one-line connection error).
    result = backfill("s3://my-bucket/requests.jsonl", "--out", "s3://my-bucket/out/", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "cannot reach" in result.stderr


def test_a_file_over_the_upload_limit_is_refused_before_sending(tmp_path: Path) -> None:
    line = b'{"query": [1], "items": [[2]], "label_token_ids": [1]}\n'
    (tmp_path / "big.jsonl").write_bytes(line * 150_000)
    started = time.monotonic()
    result = backfill("big.jsonl", "--out", "out.jsonl", cwd=tmp_path)
    seconds = time.monotonic() - started
    # Nothing of the file was sent: it would be run as a reference batch (here no service answers).
    assert result.returncode == 1 and "line 100001" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "running it as a reference batch" in result.stderr and "cannot reach" in result.stderr
    assert "result lines into out.jsonl" in result.stderr  # and where the results go
    assert not (tmp_path / "out.jsonl").exists()
    print(f"\n150,000-line file refused in {seconds:.1f} s")
    assert seconds < 30


def test_progress_without_a_terminal_is_plain_lines() -> None:
    stream = io.StringIO()
    bar = ProgressBar(100, 0, stream, unit="rows")
    for done in range(0, 101, 10):
        bar.show(done, "in_progress")
    bar.last_line -= LOG_EVERY_SECONDS
    bar.show(100, "completed")
    bar.finish("completed: 100 rows")
    text = stream.getvalue()
    assert "\r" not in text
    assert text.splitlines()[0].startswith("[") and len(text.splitlines()) == 3  # first, after 10 s, the end
