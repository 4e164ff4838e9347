"""docker/prometheus and docker/grafana: the alert rules pass promtool, the dashboard queries what /metrics exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.db.models.functions import Now
from django.test import Client

from scheduler import dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Execution, Instance, Schedule
from scheduler.owners import leases, schedules
from tests.support.processes import ROOT

PROMETHEUS = ROOT / "docker" / "prometheus"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "scheduler.json"
#: A metric name in a PromQL expression (the scheduler's own; ``up`` and functions are not).
METRIC_NAME = re.compile(r"\bscheduler_[a-z0-9_]+")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail(
            "promtool is missing: `bin/ensure-packages test` installs Debian's prometheus package", pytrace=False
        )
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def _bind(volume: str | dict[str, str]) -> tuple[Path, str]:
    """(host path, container path) of a volume as `config` prints it: "src:dst[:ro]" (compose v1) or a mapping (v2)."""
    if isinstance(volume, str):
        source, target = volume.split(":")[:2]
    else:
        source, target = volume["source"], volume["target"]
    return Path(source).resolve(), target


def test_alert_rules__promtool_check_rules_passes() -> None:
    result = _promtool("check", "rules", "docker/prometheus/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules__promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", "docker/prometheus/alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_rules__every_alert_fires_in_a_unit_test_and_one_case_does_not_fire() -> None:
    # Given the unit tests' expectations
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    # Then each alert is expected to fire somewhere, and at least one case expects silence
    assert {rule["alert"] for rule in _rules()} == fired
    assert silent


def test_alert_rules__each_has_severity_summary_description_and_runbook() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert re.fullmatch(r"docs/runbooks/[a-z0-9-]+\.md", annotations["runbook_url"]), rule["alert"]


def test_prometheus_config__scrapes_web_and_loads_the_rules(tmp_path: Path) -> None:
    # Given the files as the container sees them in /etc/prometheus: the configuration, the
    # rules, and the token file its entrypoint writes (empty without SCHEDULER_METRICS_TOKEN)
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(PROMETHEUS / name, tmp_path / name)
    (tmp_path / "metrics_token").write_text("")
    # promtool also checks the rule files and the credentials file the configuration names
    result = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    # The rules' up{job="scheduler"} names this job.
    assert job["job_name"] == "scheduler" and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["web:8000"]}]
    assert job["authorization"]["credentials_file"] == "metrics_token"


def test_compose__monitoring_profile_runs_prometheus_and_grafana_with_their_files(tmp_path: Path) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `apt-get install docker-compose`", pytrace=False)
    env = {
        **os.environ,
        "SECRET_KEY": "test-only",
        "POSTGRES_PASSWORD": "test-only",
        "GRAFANA_ADMIN_PASSWORD": "test-only",
    }
    compose = str(ROOT / "docker" / "compose.yaml")
    result = subprocess.run(
        [binary, "-f", compose, "--profile", "monitoring", "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"prometheus", "grafana", "flower"} <= set(services)
    mounts = {name: {_bind(volume) for volume in services[name]["volumes"]} for name in ("prometheus", "grafana")}
    assert (PROMETHEUS / "prometheus.yml", "/etc/prometheus/prometheus.yml") in mounts["prometheus"]
    assert (PROMETHEUS / "alerts.yml", "/etc/prometheus/alerts.yml") in mounts["prometheus"]
    assert (ROOT / "docker" / "grafana" / "provisioning", "/etc/grafana/provisioning") in mounts["grafana"]
    assert (DASHBOARD.parent, "/var/lib/grafana/dashboards") in mounts["grafana"]
    # Prometheus scrapes with Host "web" and the healthcheck asks 127.0.0.1: the web must accept
    # both, whatever ALLOWED_HOSTS the operator set.
    assert {"web", "127.0.0.1"} <= set(services["web"]["environment"]["ALLOWED_HOSTS"].split(","))


def test_grafana_provisioning__datasource_and_dashboard_provider_point_at_each_other() -> None:
    provisioning = ROOT / "docker" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "scheduler.yml").read_text())["providers"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {source["uid"]}


def test_dashboard__every_query_is_valid_promql(tmp_path: Path) -> None:
    # Given every panel query as a recording rule, which promtool parses
    rules = [{"record": f"dashboard:query_{n}", "expr": expr} for n, (_, expr) in enumerate(_dashboard_queries())]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    # When checked, Then every query parses
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_dashboard_and_rules__every_query_names_a_metric_that_metrics_exports(client: Client) -> None:
    # Given one row of every kind, so each family has samples: a leader, a worker's heartbeat,
    # a finished execution (counters, duration), a queued one (current, oldest age), a sent
    # scheduled slot (lag) and a schedule with a last success
    assert leases.acquire(scheduler_settings.LEASE_NAME, "host-1-abc", ttl=10) is not None
    now = dbclock.now()
    Instance.objects.create(instance_id="w-1", role="worker", hostname="h", pid=1, started_at=Now(), last_seen=Now())
    Execution.objects.create(
        idempotency_key="done",
        task="scheduler.echo",
        status=Execution.Status.SUCCEEDED,
        scheduled_for=now - timedelta(seconds=10),
        enqueued_at=now - timedelta(seconds=9),
        started_at=now - timedelta(seconds=8),
        finished_at=now - timedelta(seconds=7),
    )
    Execution.objects.create(
        idempotency_key="waiting",
        task="scheduler.echo",
        status=Execution.Status.QUEUED,
        scheduled_for=now - timedelta(seconds=5),
        enqueued_at=now - timedelta(seconds=5),
    )
    schedules.create(name="nightly", task="scheduler.echo", interval=60)
    Schedule.objects.filter(name="nightly").update(last_success_at=now)
    # When /metrics is scraped
    response = client.get("/metrics")
    assert response.status_code == 200
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in response.content.decode().splitlines()
        if line and not line.startswith("#")
    }
    # Then every panel queries at least one metric, and each one it names has samples
    missing = {}
    for title, expr in _dashboard_queries():
        names = set(METRIC_NAME.findall(expr))
        assert names, f"panel {title!r} queries no scheduler metric: {expr}"
        if names - exported:
            missing[title] = sorted(names - exported)
    # And so does every alert rule (SchedulerMetricsDown reads only Prometheus's own ``up``)
    for rule in _rules():
        names = set(METRIC_NAME.findall(rule["expr"]))
        if names - exported:
            missing[rule["alert"]] = sorted(names - exported)
    assert not missing, f"not exported by /metrics: {missing}"


def test_dashboard_and_rules__per_schedule_series_are_grouped_by_tenant_too() -> None:
    # A schedule's name is unique, but a reader needs to know whose it is (and may filter by it)
    exprs = [(title, expr) for title, expr in _dashboard_queries()]
    exprs += [(rule["alert"], rule["expr"]) for rule in _rules()]
    for title, expr in exprs:
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in grouping.split(",")}
            if "schedule" in labels:
                assert "tenant" in labels, (title, expr)
    per_schedule = [title for title, expr in exprs if "scheduler_schedule_last_success_timestamp_seconds" in expr]
    assert per_schedule, "the dashboard shows no per-schedule series"
