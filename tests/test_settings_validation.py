"""Settings and flags the service cannot run with are refused up front, as one line and a non-zero exit: counts and
durations where 0 or a negative value would break a loop (a sweeper spinning, retention deleting every result at
once, a results download breaking off), values that do not parse, MODEL outside MODELS, a DATABASE_URL that
SQLAlchemy cannot use or reach, a PACKSCORE_HOME that cannot be made, and negative --max-retries or --poll."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from packscore.cli import build_parser
from store.settings import Settings

PACKSCORE = str(Path(sys.executable).parent / "packscore")
# Reads every setting, starts nothing.
DRY_RUN = ["worker", "--devices", "all", "--platform", "cpu", "--chips", "1", "--dry-run"]


def packscore(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # In a folder of its own: no .env of the repository's is read.
    return subprocess.run([PACKSCORE, *args], env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def assert_one_line(result: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    # `packscore worker` logs its allocator on the line before.
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status and 1 <= len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[-1] for word in words), result.stderr
    return lines[-1]


# ---- the rules (in-process) -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "value"), [
    ("result_ttl_days", -1), ("pass_history_days", 0), ("lease_seconds", -5), ("sweep_interval_seconds", 0),
    ("batch_chunk_rows", 0), ("retention_chunk_rows", 0), ("retention_interval_seconds", 0), ("max_attempts", 0),
    ("api_threads", 0), ("pass_tokens", -1), ("batch_round_tokens", 0), ("max_items", 0), ("drain_max_jobs", 0),
    ("worker_stale_seconds", 0), ("score_poll_seconds", 0), ("webhook_poll_seconds", 0), ("webhook_per_host", 0),
    ("batch_chunk_seconds", 0), ("max_programs", 0), ("prefix_cache_bytes", -1), ("retry_after_seconds", -1),
    ("webhook_retry_schedule", [1, -2]), ("db_pool_size", -1), ("tensor_parallel", 0),
    ("database_url", "postgres://postgres@127.0.0.1/packscore"), ("database_url", "mysql://root@db/packscore"),
    ("database_url", "postgresql://postgres@[::1/packscore"),
])
def test_settings_that_break_the_service_are_refused(setting: str, value: object) -> None:
    with pytest.raises(ValidationError) as error:
        Settings(_env_file=None, **{setting: value})
    assert error.value.errors()[0]["loc"][0] == setting


def test_the_values_the_tests_and_benchmarks_use_are_accepted() -> None:
    # tests/conftest.py's, benchmarks/soak.py's (a 10-minute run), the tests' own; 0, -1 and None where they mean
    # something (no retries, SQLAlchemy's "no limit", the default).
    Settings(_env_file=None, lease_seconds=3, sweep_interval_seconds=0.1, score_timeout_seconds=0.3,
             webhook_timeout_seconds=0.5, webhook_retry_schedule=[0.2, 0, 0.1], batch_chunk_rows=2,
             memory_log_seconds=1e-9, result_ttl_days=10 / 3 / 1440, retention_interval_seconds=20,
             batch_chunk_rows_target=20, batch_chunk_bytes=6000, batch_chunk_seconds=0.1, retry_after_seconds=0,
             prefix_cache_bytes=0, db_pool_size=0, db_max_overflow=-1, db_pool_timeout_seconds=0,
             pass_tokens=None, batch_round_tokens=None, database_url="sqlite:///x.db")
    Settings(_env_file=None, webhook_retry_schedule=[], database_url="postgresql://postgres@127.0.0.1/packscore")


# ---- through the command line -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "words"), [
    ({"TENSOR_PARALLEL": "0"}, ["bad setting TENSOR_PARALLEL='0'", "greater than or equal to 1"]),
    ({"TENSOR_PARALLEL": "abc"}, ["bad setting TENSOR_PARALLEL='abc'", "integer"]),
    ({"MODELS": '{"a": '}, ["bad setting MODELS=", "Expecting value"]),
    ({"RESULT_TTL_DAYS": "-1", "SWEEP_INTERVAL_SECONDS": "0"},
     ["RESULT_TTL_DAYS='-1': Input should be greater than 0", "SWEEP_INTERVAL_SECONDS='0'"]),
])
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path: Path, env: dict[str, str], words: list[str]) -> None:
    assert_one_line(packscore(DRY_RUN, env, tmp_path), 2, "packscore worker: ", *words)


def test_model_outside_models_is_one_line(tmp_path: Path) -> None:
    result = packscore(["worker"], {"MODELS": "a=tiny-random", "MODEL": "b"}, tmp_path)
    assert_one_line(result, 2, "packscore worker: bad setting: MODEL='b' is not a name of MODELS (a)")


def test_a_database_url_sqlalchemy_cannot_use_is_one_line(tmp_path: Path) -> None:
    result = packscore(["create-key", "--name", "x"], {"DATABASE_URL": "postgres://postgres:hush@127.0.0.1/x"},
                       tmp_path)
    line = assert_one_line(result, 2, "packscore create-key: bad setting DATABASE_URL: not a PostgreSQL or SQLite URL")
    assert "hush" not in line
    result = packscore(["migrate"], {"DATABASE_URL": "postgresql+psycopg://postgres@[::1/x"}, tmp_path)
    assert_one_line(result, 2, "packscore migrate: bad setting DATABASE_URL: not a PostgreSQL or SQLite URL")
    # A driver SQLAlchemy does not know.
    result = packscore(["migrate"], {"DATABASE_URL": "postgresql+nodriver://postgres@127.0.0.1/x"}, tmp_path)
    assert_one_line(result, 2, "packscore migrate: bad setting DATABASE_URL: ", "postgresql.nodriver")


def test_an_unreachable_database_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # Port 1: nothing listens there, so the connection is refused at once.
    result = packscore(["create-key", "--name", "x"],
                       {"DATABASE_URL": "postgresql+psycopg://postgres:hush@127.0.0.1:1/x"}, tmp_path)
    line = assert_one_line(result, 1, "packscore create-key: the database at postgresql+psycopg://postgres:***@"
                                      "127.0.0.1:1/x failed: ", "Connection refused")
    assert "hush" not in line


def test_a_packscore_home_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "missing" / "home"
    result = packscore(["create-key", "--embedded", "--name", "x"], {"PACKSCORE_HOME": str(home)}, tmp_path)
    assert_one_line(result, 2, f"packscore create-key: {home} (the embedded service's folder, $PACKSCORE_HOME): "
                               "No such file or directory")


@pytest.mark.parametrize(("flag", "args"), [
    ("--max-retries", ["score", "--max-retries", "-1", "--query", "q", "--item", "i", "--labels", "1"]),
    ("--poll", ["submit", "--wait", "--poll", "-1", "--query", "q", "--item", "i", "--labels", "1"]),
])
def test_negative_retries_and_polls_are_usage_errors(tmp_path: Path, flag: str, args: list[str]) -> None:
    # No service there: the flag is refused before any call (-1 retries was an AssertionError in the client).
    result = packscore([*args, "--url", "http://127.0.0.1:1", "--retry-seconds", "0"], {}, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"error: argument {flag}: '-1' is not a " in result.stderr


@pytest.mark.parametrize("args", [
    ["wait-batch", "b", "--poll", "0"], ["backfill", "in.jsonl", "--out", "out.jsonl", "--poll", "-1"],
    ["score", "--retry-seconds", "-1", "--query", "q", "--item", "i", "--labels", "1"],
    ["score", "--max-retries", "1.5", "--query", "q", "--item", "i", "--labels", "1"],
    ["rerank", "--top-n", "-1", "--query", "q", "--document", "d"], ["wait-ready", "--timeout", "nan"],
    ["check", "--items", "0"], ["check", "--seed", "-1"], ["worker", "--devices", "all", "--chips", "0"],
    ["serve", "--port", "-1"],
])
def test_negative_numbers_are_refused_by_every_flag(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 2 and "error: argument" in capsys.readouterr().err
