"""The import rules of docs/architecture.md, as import-linter contracts in pyproject.toml: the CLI on top; api
(HTTP) and worker (Celery and the pass loop) side by side, never importing each other; store (the data layer)
under both; core (the engine) at the bottom, importing none of them; no import circle inside any package. And the
line length of pyproject's tool.ruff, over every Python file of the repository."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # lint-imports puts its working folder first on the import path: it reads the tree under `root`.
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300)


def test_import_rules_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_import_rules_catch_an_api_module_importing_the_worker(tmp_path: Path) -> None:
    # A copy of the tree with one forbidden import added: the same contracts must refuse it.
    for name in ("pyproject.toml", "api", "worker", "store", "core", "packscore", "migrations", "benchmarks", "tests"):
        source = REPO / name
        if source.is_dir():
            subprocess.run(["cp", "-r", str(source), str(tmp_path / name)], check=True)
        else:
            (tmp_path / name).write_text(source.read_text())
    deps = tmp_path / "api" / "deps.py"
    deps.write_text(deps.read_text() + "\nfrom worker.drain import heartbeat  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "api is not allowed to import worker" in result.stdout
    # A shipped module importing a benchmark is refused too.
    deps.write_text(deps.read_text().replace("from worker.drain import heartbeat", "from benchmarks import capacity"))
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "api is not allowed to import benchmarks" in result.stdout, result.stdout


def test_lines_fit_the_line_length() -> None:
    result = subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", "--no-cache", "--output-format",
                             "concise", "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
