"""README's examples run as written: its ```sh blocks in order, as one shell session, and each of its ```python
blocks, against `packscore serve --embedded` with the bundled model, from the folder the service was started in
(where `make run` leaves `.packscore/`). A block preceded by `<!-- not run by tests/test_readme.py: why -->` is
left out; every other one must succeed. curl answers 4xx/5xx count as failures. And README's error tables name
every code the code answers with, and only those."""

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import ERROR_CODES
from store import errors
from tests.service_harness import free_port, wait_ready

REPO = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"<!-- not run by tests/test_readme\.py: [^>]+ -->\s*$")
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def readme_blocks(language: str) -> list[tuple[int, str]]:
    """(line number, text) of README's fenced blocks in `language`, without those marked as not run."""
    text = (REPO / "README.md").read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if match.group(1) == language and not SKIP.search(before):
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(2)))
    return blocks


def fresh_copy(folder: Path) -> None:
    """The repository as a fresh clone of it holds it: its tracked files and the new ones git does not ignore, as
    they are in the working tree (no .venv, no .packscore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)


def seed_venv(folder: Path) -> None:
    """The copy's .venv holding, as hard links, the packages this suite's .venv installed, all but packscore
    itself: `make run` then runs its whole install (pip resolves every requirement and installs the copy's
    packscore) in seconds, not the 85 s of unpacking the same wheels again. Installing from nothing is what
    `make test` does on CI's fresh clone, through the same Makefile targets."""
    subprocess.run([sys.executable, "-m", "venv", str(folder / ".venv")], check=True)
    site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    ours, theirs = Path(sys.prefix) / site, folder / ".venv" / site
    for entry in ours.iterdir():
        if "packscore" in entry.name or entry.name == "__pycache__" or (theirs / entry.name).exists():
            continue
        if entry.is_dir():
            shutil.copytree(entry, theirs / entry.name, copy_function=os.link)
        else:
            os.link(entry, theirs / entry.name)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, dict[str, str]]]:
    """README's quick start as written, on a fresh copy of the repository: `make run &` (the install into the
    copy's own .venv, seeded by `seed_venv`, then the service with the bundled model), and `make wait-ready`
    started at once beside it, which waits through the install and the warm-up (before, README's
    `.venv/bin/packscore wait-ready` did not exist yet: exit 127). Then the other examples run against that
    service, from that folder."""
    folder = tmp_path_factory.mktemp("readme") / "packscore"
    fresh_copy(folder)
    seed_venv(folder)
    port = free_port()
    # The bundled model, as `make run` serves it; nothing of the test suite's service settings, nor of the make
    # running the suite.
    env = {k: v for k, v in os.environ.items() if k not in (
        "DATABASE_URL", "REDIS_URL", "BROKER_URL", "BROKER_DIR", "BROKER_KEY_PREFIX", "MODEL", "MAX_ITEMS",
        "MAX_TOKENS", "PASS_TOKENS", "MAX_BODY_BYTES", "LEASE_SECONDS", "PACKSCORE_HOME", "PACKSCORE_API_KEY",
        "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    env.update(WARMUP="none", PATH=f"{Path(sys.executable).parent}:{env['PATH']}", PORT=str(port),
               PACKSCORE_URL=f"http://127.0.0.1:{port}", XDG_CONFIG_HOME=str(folder / "config"))
    quick_start = next(block for _, block in readme_blocks("sh") if "make run &" in block).splitlines()
    wait = quick_start[quick_start.index("make run &") + 1].split("#")[0].strip()
    log = open(folder.parent / "make-run.log", "wb")
    proc = subprocess.Popen(["make", "run"], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        waited = subprocess.run(["bash", "-c", wait], cwd=folder, env=env, capture_output=True, text=True,
                                timeout=900)
        make_log = (folder.parent / "make-run.log").read_text()[-3000:]
        assert waited.returncode == 0, f"{wait}: {waited.stderr[-2000:]}\n{make_log}"
        assert "is ready" in waited.stdout, waited.stdout
        yield folder, port, env
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in make run's terminal
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _errors_section() -> str:
    return (REPO / "README.md").read_text().split("### Errors", 1)[1].split("\n### ", 1)[0]


def documented_errors() -> set[tuple[int, str]]:
    """(status, code) pairs of README's error table."""
    section = _errors_section()
    pairs = set()
    for status, codes in re.findall(r"^\| (\d{3}) \| (.+?) \|", section, re.M):
        pairs.update((int(status), code) for code in re.findall(r"`(\w+)`", codes))
    return pairs


def test_readme_documents_every_error_the_api_answers() -> None:
    """Every (status, code) the API can answer is in README's table: the engine's codes, the job error mapping,
    the generic HTTP codes and every ServiceError raised in api/."""
    answered = {(400, code) for code in ERROR_CODES}
    answered |= {(e.status, e.code) for e in (errors.job_error("j", c, "") for c in ("worker_lost", "internal_error"))}
    answered |= {(status, code) for status, code in errors.HTTP_CODES.items()}
    answered |= {(500, "internal_error"), (503, "unavailable")}
    for folder in ("api", "store"):  # the data layer's refusals too (the lake's, batches')
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            answered |= {(int(s), c) for s, c in re.findall(r'ServiceError\(\s*(\d{3}),\s*"(\w+)"', text)}
            answered |= {(int(s), c) for s, c in re.findall(r'error_response\(\s*(\d{3}),\s*"(\w+)"', text)}
            answered |= {(int(s or 400), c) for c, s in
                         re.findall(r'refusal\(\s*"(\w+)",(?:[^()]|\([^()]*\))*?(?:, (\d{3}))?\)', text)}
    missing = answered - documented_errors()
    assert not missing, f"README's error table lacks {sorted(missing)}"


def test_readme_documents_every_code_a_batch_line_gets() -> None:
    """A bad line's codes (uploads, reference batches, and the ones `packscore backfill` refuses itself) besides
    the engine's, against README's table of line codes: each there, and none there that no line gets."""
    patterns = (r'LineError\(\s*"(\w+)"', r'errors\[\w+\] = \(\s*"(\w+)"', r'\(\s*"(\w+)", f"line \{number\}',
                r'\{"code": "(\w+)", "message"')
    given = set()
    for folder in ("store", "packscore"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            given |= {code for pattern in patterns for code in re.findall(pattern, text)}
    table = _errors_section().split("| Line code |", 1)[1].split("\n\n", 1)[0]
    documented = {code for row in re.findall(r"^\| (.+?) \|", table, re.M) for code in re.findall(r"`(\w+)`", row)}
    assert {"duplicate_custom_id", "unknown_url", "invalid_json", "cancelled"} <= given  # the patterns still find
    assert documented <= given, f"README's line codes that no line gets: {sorted(documented - given)}"
    assert given - set(ERROR_CODES) <= documented, f"README lacks the line codes {sorted(given - documented)}"


def as_run_here(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def test_readme_has_examples_to_run() -> None:
    assert len(readme_blocks("sh")) >= 5 and len(readme_blocks("python")) >= 3


def test_shell_examples(embedded: tuple[Path, int, dict[str, str]]) -> None:
    folder, port, env = embedded
    script = ["set -euo pipefail", "curl() { command curl --fail-with-body \"$@\"; }",
              "make() { [ \"$*\" != run ] || return 0; command make \"$@\"; }  # already running"]
    for line, block in readme_blocks("sh"):
        block = block.replace("make run &", "make run")
        script += [f"echo '--- README.md line {line}' >&2", as_run_here(block, port)]
    result = subprocess.run(["bash", "-c", "\n".join(script)], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{result.stderr[-4000:]}\n{result.stdout[-2000:]}"
    assert '"scores"' in result.stdout and '"results"' in result.stdout


@pytest.mark.parametrize("line", [line for line, _ in readme_blocks("python")])
def test_python_examples(embedded: tuple[Path, int, dict[str, str]], line: int) -> None:
    folder, port, env = embedded
    block = dict(readme_blocks("python"))[line]
    result = subprocess.run([sys.executable, "-c", as_run_here(block, port)], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"README.md line {line}:\n{result.stderr[-4000:]}"
