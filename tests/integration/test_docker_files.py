"""docker/: the compose file's services, commands, replicas and healthchecks, and no secret in it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.processes import ROOT

DOCKER = ROOT / "docker"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_services_and_their_commands(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "web", "worker", "beat", "flower"} <= set(services)
    assert services["migrate"]["command"] == ["python", "manage.py", "migrate", "--noinput"]
    assert services["web"]["command"][:2] == ["gunicorn", "project.wsgi:application"]
    assert services["worker"]["command"][:4] == ["celery", "-A", "project", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "project", "beat"]
    assert services["beat"]["deploy"]["replicas"] >= 2
    assert services["flower"]["profiles"] == ["monitoring"]


def test_app_services_wait_for_healthy_services_and_the_migration(compose: dict[str, Any]) -> None:
    for name in ("web", "worker", "beat"):
        depends = compose["services"][name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy"
        assert depends["redis"]["condition"] == "service_healthy"
        assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_every_long_running_service_restarts_and_has_a_healthcheck(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        if name == "migrate":
            assert service["restart"] == "no"
            continue
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"], name
    # The web's health is its readiness (database, broker), never the beat's leadership.
    assert "/readyz" in " ".join(services["web"]["healthcheck"]["test"])
    assert "/leaderz" not in " ".join(services["web"]["healthcheck"]["test"])
    assert "inspect ping" in " ".join(services["worker"]["healthcheck"]["test"])
    assert "alive" in services["beat"]["healthcheck"]["test"]


def test_no_secret_is_hard_coded(compose: dict[str, Any]) -> None:
    env = compose["x-app"]["environment"]
    assert env["SECRET_KEY"].startswith("${SECRET_KEY:?")
    assert "${POSTGRES_PASSWORD:?" in env["DATABASE_URL"]
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    example = (DOCKER / ".env.example").read_text()
    assert re.search(r"^SECRET_KEY=$", example, re.MULTILINE) and re.search(r"^POSTGRES_PASSWORD=$", example, re.MULTILINE)
    grafana = compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert grafana.startswith("${GRAFANA_ADMIN_PASSWORD:?") and re.search(r"^GRAFANA_ADMIN_PASSWORD=$", example, re.MULTILINE)


def test_dockerfile__slim_non_root_pinned_static_and_healthcheck() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert "pip install -r requirements.txt" in dockerfile
    assert "collectstatic" in dockerfile
    assert re.search(r"^USER scheduler$", dockerfile, re.MULTILINE)
    assert re.search(r"^HEALTHCHECK ", dockerfile, re.MULTILINE)
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert "==" in line, f"unpinned requirement: {line}"


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `apt-get install docker-compose` (.ci/run installs it)", pytrace=False)
    env = {**os.environ, "SECRET_KEY": "test-only", "POSTGRES_PASSWORD": "test-only", "GRAFANA_ADMIN_PASSWORD": "test-only"}
    result = subprocess.run([binary, "-f", str(DOCKER / "compose.yaml"), "config"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # Without the secrets it refuses to start instead of running with defaults.
    bare = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}}
    refused = subprocess.run([binary, "-f", str(DOCKER / "compose.yaml"), "config"], env=bare, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "set POSTGRES_PASSWORD" in refused.stderr + refused.stdout
