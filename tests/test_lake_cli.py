"""`packscore backfill` as a new user meets it (issue 29, item 7): inputs that are not an uploadable JSONL file
are sent the right way or refused before anything is sent, in one line, never with a traceback; progress
without a terminal is plain lines."""

import gzip
import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packscore.backfill import LOG_EVERY_SECONDS, ProgressBar, input_kind, read_done, run_reference_backfill
from tests.service_harness import REPO, free_port
from tests.test_lake import LABELS, lake_settings, pair_table  # noqa: F401  (a fixture)


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


def test_a_jsonl_file_over_the_upload_limit_still_gives_its_result_lines(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Over the bytes limit, it went straight to a reference batch writing Parquet objects under --out (the
    lines file a folder); it goes as one over the lines limit does: objects under OUT.parts/, lines in --out."""
    import packscore.backfill as backfill

    (tmp_path / "big.jsonl").write_text('{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}\n')
    monkeypatch.setattr(backfill, "UPLOAD_MAX_BYTES", 10)
    assert input_kind(str(tmp_path / "big.jsonl")) == "upload"
    with pytest.raises(backfill.UploadTooLarge):
        backfill.run_backfill(None, tmp_path / "big.jsonl", tmp_path / "results.jsonl")  # type: ignore[arg-type]


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


def test_an_out_that_is_not_a_results_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    """--out naming the input cut its last line (no newline at the end) off the user's requests; a text file
    was a JSONDecodeError traceback. Only a results file's torn last line is cut."""
    request = '{"custom_id": "a", "query": "q", "items": ["i"], "label_token_ids": [1]}'
    (tmp_path / "req.jsonl").write_text(request + "\n" + request.replace('"a"', '"b"'))  # no newline at the end
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "tail.txt").write_text('{"custom_id": "x"}\nmy notes')
    for out, message in [("req.jsonl", "--out req.jsonl is the input file"),
                         ("notes.txt", "--out notes.txt is not a results file (line 1"),
                         ("tail.txt", "--out tail.txt is not a results file (its last line")]:
        before = (tmp_path / out).read_bytes()
        result = backfill("req.jsonl", "--out", out, cwd=tmp_path)
        assert result.returncode == 1 and message in result.stderr, (out, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert (tmp_path / out).read_bytes() == before
    (tmp_path / "results.jsonl").write_text('{"custom_id": "x", "scores": [[0.5]]}\n{"custom_id": "y", "sco')
    assert read_done(tmp_path / "results.jsonl") == {"x"}
    assert (tmp_path / "results.jsonl").read_text() == '{"custom_id": "x", "scores": [[0.5]]}\n'


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


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Scripted:
    """A client whose batch goes through these states (GET /batches/{id} answers the next one)."""

    def __init__(self, states: list[dict]) -> None:
        self.states = states

    def create_reference_batch(self, *args: object, **kwargs: object) -> dict:
        return self.states.pop(0)

    def get_batch(self, batch_id: str) -> dict:
        return self.states.pop(0)


def test_progress_line_marks_growing_chunks_and_ends_without_an_eta() -> None:
    def state(status: str, done: int, chunks: int, final: bool, eta: float | None) -> dict:
        return {"id": "batch_x", "status": status, "output": "file:///out/batch_x", "eta_seconds": eta,
                "rows": {"done": done, "failed": 0, "total": 50_000},
                "chunks": {"total": chunks, "total_final": final, "done": 1, "in_flight": 1, "failed": 0,
                           "cancelled": 0}}

    stream = Terminal()
    batch = run_reference_backfill(Scripted([state("in_progress", 0, 28, False, None),
                                             state("in_progress", 1200, 35, False, 10_556.0),
                                             state("cancelled", 1300, 35, True, None)]),  # type: ignore[arg-type]
                                   "pairs.parquet", "out", poll=0, stderr=stream)
    assert batch["status"] == "cancelled"
    drawn = [line.strip() for line in stream.getvalue().replace("\n", "\r").split("\r") if line.strip()]
    assert drawn[1].endswith("chunks 1/28+ in_progress") and "ETA 175:56" in drawn[2], drawn
    assert drawn[-2] == "[..............................] 1300/50000 rows  chunks 1/35 cancelled", drawn
    assert drawn[-1].startswith("cancelled: 1300 rows"), drawn


def test_the_same_backfill_command_again_reports_its_batch(client, make_key, empty_queue, lake_settings,  # type: ignore[no-untyped-def]
                                                           monkeypatch) -> None:
    from packscore.client import Client, PackscoreError
    from worker import drain as drain_module
    from worker.scorer import get_scorer

    key, _ = make_key()
    root = Path(lake_settings.batch_local_root)
    pq.write_table(pair_table(4, 10), root / "p.parquet", row_group_size=20)
    cli = Client("http://testserver", key, max_retries=0)
    cli._http.close()
    cli._http = client  # the app in this process
    monkeypatch.setitem(client.headers, "Authorization", f"Bearer {key}")
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            drain_module.drain(get_scorer(), "cli-worker", lake_settings)
            time.sleep(0.05)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()

    def run(**options: object) -> tuple[dict, str]:
        stream = io.StringIO()
        options = {"columns": {"query": "q", "item": "doc", "ids": ["pair_id"]}, **options}
        batch = run_reference_backfill(cli, str(root / "p.parquet"), str(root / "scores"), poll=0.05,
                                       label_token_ids=LABELS, stderr=stream, **options)  # type: ignore[arg-type]
        return batch, stream.getvalue()

    try:
        first, _ = run()
        again, said = run()  # the same command after it completed: that batch, reported done
        assert again["id"] == first["id"] and again["status"] == "completed", said
        assert f"batch {first['id']}" in said and said.splitlines()[-1].startswith("completed: 40 rows (0 errors)")
        assert [p.name for p in (root / "scores").iterdir()] == [first["id"]]  # nothing scored again
        try:
            run(columns={"query": "q", "item": "doc"})
            raise AssertionError("another input to that output was accepted")
        except PackscoreError as exc:
            assert exc.code == "output_in_use" and first["id"] in exc.message and "--overwrite" in exc.message
        redone, _ = run(overwrite=True)
        assert redone["id"] != first["id"] and redone["status"] == "completed"
        assert sorted(p.name for p in (root / "scores").iterdir()) == sorted([first["id"], redone["id"]])
    finally:
        stop.set()
        worker.join(60)
