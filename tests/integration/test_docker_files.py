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

from tests.support.processes import ROOT

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
    # A worker's health is its consumer taking its own probe off the broker, not its process answering.
    assert services["worker"]["healthcheck"]["test"][1:6] == ["python", "manage.py", "alive", "--role", "worker"]
    assert "alive" in services["beat"]["healthcheck"]["test"]


def test_no_secret_is_hard_coded(compose: dict[str, Any]) -> None:
    env = compose["x-app"]["environment"]
    assert env["SECRET_KEY"].startswith("${SECRET_KEY:?")
    assert "${POSTGRES_PASSWORD:?" in env["DATABASE_URL"]
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    example = (DOCKER / ".env.example").read_text()
    assert re.search(r"^SECRET_KEY=$", example, re.MULTILINE) and re.search(
        r"^POSTGRES_PASSWORD=$", example, re.MULTILINE
    )
    # Grafana's password may be unset in the file (compose v1 interpolates every profile), but
    # Grafana itself refuses to start without it: test_grafana__refuses_to_start_without_its_password.
    grafana = compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert grafana == "${GRAFANA_ADMIN_PASSWORD:-}" and re.search(r"^GRAFANA_ADMIN_PASSWORD=$", example, re.MULTILINE)


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
        pytest.fail(
            "docker-compose is not installed: `apt-get install docker-compose` (.ci/run installs it)", pytrace=False
        )
    env = {
        **os.environ,
        "SECRET_KEY": "test-only",
        "POSTGRES_PASSWORD": "test-only",
        "GRAFANA_ADMIN_PASSWORD": "test-only",
    }
    result = subprocess.run(
        [binary, "-f", str(DOCKER / "compose.yaml"), "config"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # Without the secrets it refuses to start instead of running with defaults.
    bare = {
        k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    }
    refused = subprocess.run(
        [binary, "-f", str(DOCKER / "compose.yaml"), "config"], env=bare, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "set POSTGRES_PASSWORD" in refused.stderr + refused.stdout


#: The secrets every run needs; GRAFANA_ADMIN_PASSWORD only matters with the monitoring profile.
REQUIRED = {"SECRET_KEY": "test-only", "POSTGRES_PASSWORD": "test-only"}
#: Services of the monitoring profile that publish a port.
MONITORING = {"flower", "prometheus", "grafana"}


def _config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(
            "docker-compose is not installed: `apt-get install docker-compose` (.ci/run installs it)", pytrace=False
        )
    bare = {k: v for k, v in os.environ.items() if k not in {"GRAFANA_ADMIN_PASSWORD", "SCHEDULER_METRICS_TOKEN"}}
    return subprocess.run(
        [binary, "-f", str(DOCKER / "compose.yaml"), *args, "config"],
        env={**bare, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _monitoring_services(env: dict[str, str] | None = None) -> dict[str, Any]:
    result = _config("--profile", "monitoring", env={**REQUIRED, **(env or {})})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@pytest.mark.parametrize("profile", [[], ["--profile", "monitoring"]])
def test_docker_compose_config__passes_without_the_grafana_password(profile: list[str]) -> None:
    # Given the secrets every run needs and no GRAFANA_ADMIN_PASSWORD
    # When the file is loaded, with or without the monitoring profile
    result = _config(*profile, env=REQUIRED)
    # Then it loads: nobody needs Grafana's password to run the scheduler
    assert result.returncode == 0, result.stderr


def test_monitoring_ports__published_on_loopback_only() -> None:
    # Flower and Prometheus have no login; Grafana's dashboards name every tenant's schedules.
    services = _monitoring_services()
    published = {name: services[name].get("ports", []) for name in MONITORING}
    assert all(published.values()), published
    for name, ports in published.items():
        for port in ports:
            assert _host_ip(port) == "127.0.0.1", (name, port)
    # And in the file itself, whatever the environment sets the port numbers to
    raw = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    for name in MONITORING:
        assert all(str(port).startswith("127.0.0.1:") for port in raw[name]["ports"]), (name, raw[name]["ports"])


def _host_ip(port: str | dict[str, Any]) -> str:
    """The address a port is published on as `config` prints it ("" for every interface)."""
    if isinstance(port, dict):
        return str(port.get("host_ip", ""))
    parts = port.split("/")[0].split(":")  # [host_ip:]published:target[/protocol]
    return ":".join(parts[:-2])


def _run_entrypoint(service: dict[str, Any], **replace: str) -> subprocess.CompletedProcess[str]:
    """Run a service's rendered ``sh -c`` entrypoint and command here, with container paths swapped for local ones."""
    shell, flag, script, *args = [*service["entrypoint"], *service.get("command", [])]
    assert (shell, flag) == ("/bin/sh", "-c"), service["entrypoint"]
    script = script.replace("$$", "$")  # `config` prints compose's escape; the container gets one "$"
    for container_path, local_path in replace.items():
        script = script.replace(container_path, local_path)
    env = {"PATH": os.environ["PATH"], **service["environment"]}
    return subprocess.run(["/bin/sh", "-c", script, *args], env=env, capture_output=True, text=True, timeout=30)


def test_grafana__refuses_to_start_without_its_password(tmp_path: Path) -> None:
    # Given Grafana's container as compose renders it without GRAFANA_ADMIN_PASSWORD
    grafana = _monitoring_services()["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""
    # When its entrypoint runs (/run.sh stands in for Grafana's own)
    run = tmp_path / "run.sh"
    run.write_text('#!/bin/sh\necho "grafana started with $*"\n')
    run.chmod(0o755)
    refused = _run_entrypoint(grafana, **{"/run.sh": str(run)})
    # Then it stops before Grafana starts, saying what to set (an empty password would mean "admin")
    assert refused.returncode != 0 and "grafana started" not in refused.stdout
    assert "set GRAFANA_ADMIN_PASSWORD" in refused.stderr
    # And with the password, Grafana starts with its usual arguments
    grafana = _monitoring_services({"GRAFANA_ADMIN_PASSWORD": "test-only"})["grafana"]
    started = _run_entrypoint(grafana, **{"/run.sh": str(run)})
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("grafana started with")


@pytest.mark.parametrize("token", ["", "s3cret-scrape-token"])
def test_prometheus__scrapes_with_the_token_the_web_checks(tmp_path: Path, token: str) -> None:
    # Given the web and Prometheus as compose renders them, with or without SCHEDULER_METRICS_TOKEN
    services = _monitoring_services({"SCHEDULER_METRICS_TOKEN": token} if token else {})
    assert services["web"]["environment"].get("SCHEDULER_METRICS_TOKEN", "") == token
    prometheus = services["prometheus"]
    # When Prometheus's entrypoint runs (/bin/prometheus and /etc/prometheus swapped for local stand-ins)
    binary = tmp_path / "prometheus"
    binary.write_text('#!/bin/sh\necho "prometheus started with $*"\n')
    binary.chmod(0o755)
    etc = tmp_path / "etc"
    etc.mkdir()
    started = _run_entrypoint(prometheus, **{"/bin/prometheus": str(binary), "/etc/prometheus/": f"{etc}/"})
    # Then Prometheus starts with its command, and the file its scrape config reads holds the token
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == "prometheus started with " + " ".join(prometheus["command"])
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "metrics_token"}
    written = etc / "metrics_token"
    assert written.read_text() == token
    assert written.stat().st_mode & 0o077 == 0  # readable by Prometheus's user only
