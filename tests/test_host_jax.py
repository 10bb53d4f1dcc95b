"""A host that brings its own JAX (TPU VM images, CUDA containers): installing packscore the documented way
(README, Accelerators: `pip install -c host-jax.txt .`) keeps that host's jax, jaxlib, flax and numpy, and a
worker's JAX compilation cache is on by default, in a folder per host.

The install is checked with pip's own resolver, offline (`--dry-run --no-index`), on a venv whose jax, jaxlib, flax
and numpy are other versions than the pins: 0.11.2 and 0.12.10, what an H200's CUDA image brought, and an older
numpy. That venv holds them as metadata only (what pip reads to decide whether to replace them), first on its path;
the project's other dependencies it sees through a .pth file naming this venv's site-packages, so pip needs to
download nothing."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from store.settings import Settings

REPO = Path(__file__).resolve().parents[1]
HOST_JAX = {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.10", "numpy": "2.3.5"}


def host_python(root: Path) -> str:
    """A venv holding HOST_JAX's versions of jax, jaxlib, flax and numpy, and this venv's other packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    ours = Path(sysconfig.get_path("purelib"))
    for name, version in HOST_JAX.items():
        pinned = next(ours.glob(f"{name}-*.dist-info"))
        old = pinned.name.removeprefix(f"{name}-").removesuffix(".dist-info")
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        # The pinned release's metadata under the host's version (jax names its own jaxlib's version too).
        (info / "METADATA").write_text((pinned / "METADATA").read_text().replace(old, version))
    (site / "project-packages.pth").write_text(f"{ours}\n")
    return python


def dry_run(python: str, requirement: str, report: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--disable-pip-version-check", "--report", str(report), *options, requirement],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def readme_host_constraints(python: str, path: Path) -> None:
    """README's first command of the accelerator install, `pip freeze | grep -iE '...' > host-jax.txt`, on that
    venv (its grep pattern, applied here)."""
    block = (REPO / "README.md").read_text().split("## Accelerators", 1)[1].split("```sh\n", 1)[1].split("```")[0]
    pattern = re.search(r"grep -iE '([^']+)' > host-jax\.txt", block).group(1)
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--disable-pip-version-check"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    path.write_text("".join(f"{line}\n" for line in frozen if re.match(pattern, line, re.I)))
    assert "pip install -c host-jax.txt ." in block


def test_install_keeps_the_hosts_jax(tmp_path: Path) -> None:
    python = host_python(tmp_path / "host")
    shown = subprocess.run([python, "-m", "pip", "show", *HOST_JAX], capture_output=True, text=True, check=True)
    assert [line.split()[1] for line in shown.stdout.splitlines() if line.startswith("Version:")] == \
        list(HOST_JAX.values())

    # The documented install: packscore and nothing else is installed, so the host's JAX and numpy stay as they were.
    readme_host_constraints(python, tmp_path / "host-jax.txt")
    kept = {line.split("==")[0].lower(): line.split("==")[1] for line in
            (tmp_path / "host-jax.txt").read_text().splitlines()}
    assert {name: kept.get(name) for name in HOST_JAX} == HOST_JAX
    done = dry_run(python, ".", tmp_path / "report.json", "-c", str(tmp_path / "host-jax.txt"))
    assert done.returncode == 0, done.stderr
    installs = json.loads((tmp_path / "report.json").read_text())["install"]
    assert [item["metadata"]["name"] for item in installs] == ["packscore"]

    # The pinned install (`make`'s, with constraints.txt) would replace them: with no index to fetch the pins
    # from, pip says so.
    pinned = dry_run(python, ".[jax]", tmp_path / "pinned.json", "-c", "constraints.txt")
    assert pinned.returncode != 0
    assert "jax" in pinned.stderr or "numpy" in pinned.stderr


def test_compile_cache_is_per_host_by_default(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The run's own folder (tests/conftest.py) is what this process and the workers it starts use.
    assert Settings().compile_cache_dir == os.environ["COMPILE_CACHE_DIR"]
    monkeypatch.delenv("COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert Settings().compile_cache_dir == str(tmp_path / "cache" / "packscore" / "compile")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Settings().compile_cache_dir == str(tmp_path / "home" / ".cache" / "packscore" / "compile")
    monkeypatch.setenv("COMPILE_CACHE_DIR", "")  # none
    assert not Settings().compile_cache_dir
