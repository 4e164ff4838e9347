"""Production configuration: settings refuse to start unsafe, deploy checks, system checks, permissions."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import warnings
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.checks import run_checks
from django.test import Client, override_settings

from scheduler import checks
from scheduler.models import Schedule
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.integration.api_support import bind
from tests.support.admin_forms import schedule_form
from tests.support.factories import make_schedule
from tests.support.processes import ROOT

PRODUCTION_ENV = {
    "DJANGO_DEBUG": "0",
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "scheduler.example.com",
    "REDIS_URL": "redis://redis.example.com:6379/0",
    "SCHEDULER_METRICS_TOKEN": secrets.token_urlsafe(32),
}


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in {"DJANGO_DEBUG", "SECRET_KEY", "ALLOWED_HOSTS"}}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy__clean_with_production_environment() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


@pytest.mark.parametrize(
    ("missing", "message"),
    [("SECRET_KEY", "SECRET_KEY is not set"), ("ALLOWED_HOSTS", "ALLOWED_HOSTS is not set")],
)
def test_settings__refuse_to_start_without_secrets_when_not_debugging(missing: str, message: str) -> None:
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != missing}
    result = manage("check", **env)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"error: {message}") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_settings__debug_off_means_secure_cookies_and_json_only() -> None:
    code = (
        "from django.conf import settings as s; "
        "print(s.DEBUG, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.CELERY_ACCEPT_CONTENT, s.CELERY_TASK_SERIALIZER)"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import django, os; os.environ['DJANGO_SETTINGS_MODULE']='project.settings'; django.setup(); {code}",
        ],
        cwd=ROOT,
        env={**os.environ, **PRODUCTION_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.split() == ["False", "True", "True", "['json']", "json"], result.stderr


@pytest.mark.parametrize(
    ("overrides", "check", "check_id"),
    [
        (
            {"SCHEDULER_LEASE_TTL_SECONDS": 4.0, "SCHEDULER_LEASE_RENEW_SECONDS": 2.0},
            checks.check_lease_timing,
            "scheduler.E001",
        ),
        ({"CELERY_BEAT_SCHEDULER": "celery.beat:PersistentScheduler"}, checks.check_beat_scheduler, "scheduler.E002"),
        ({"CELERY_BROKER_URL": ""}, checks.check_broker, "scheduler.E003"),
        ({"CELERY_TIMEZONE": "Mars/Olympus"}, checks.check_time_zones, "scheduler.E004"),
        ({"CELERY_TIMEZONE": "Europe"}, checks.check_time_zones, "scheduler.E004"),
        ({"USE_TZ": False}, checks.check_time_zones, "scheduler.E005"),
        ({"SCHEDULER_COMMIT_AHEAD_SECONDS": 0.6}, checks.check_commit_ahead, "scheduler.E008"),
        ({"SCHEDULER_COMMIT_AHEAD_SECONDS": -0.1}, checks.check_commit_ahead, "scheduler.E008"),
        ({"SCHEDULER_COMMIT_AHEAD_SECONDS": "0.2"}, checks.check_commit_ahead, "scheduler.E008"),
        ({"SCHEDULER_PREPARED_STATEMENTS": "false"}, checks.check_prepared_statements, "scheduler.E009"),
        ({"SCHEDULER_LEASE_NAME": ""}, checks.check_lease_name, "scheduler.E010"),
        ({"SCHEDULER_LEASE_NAME": "b" * 96}, checks.check_lease_name, "scheduler.E010"),
        ({"SCHEDULER_LEASE_NAME": "a\x00b"}, checks.check_lease_name, "scheduler.E010"),
        ({"SCHEDULER_LEASE_NAME": 5}, checks.check_lease_name, "scheduler.E010"),
        # read from the environment by a project's own settings: text
        ({"SCHEDULER_CLAIM_SECONDS": "30"}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_LEASE_TTL_SECONDS": "10"}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_DISPATCH_BATCH_SIZE": 0}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_DISPATCH_BATCH_SIZE": 500.0}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_RECONCILE_INTERVAL_SECONDS": -1}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_NOTIFY_TIMEOUT_SECONDS": float("inf")}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_LOST_RETRIES": True}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_BUILTIN_SCHEDULES": "false"}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_METRICS_TOKEN": 12345}, checks.check_setting_types, "scheduler.E011"),
        ({"SCHEDULER_API_THROTTLE_RATE": "1200 per minute"}, checks.check_setting_types, "scheduler.E011"),
    ],
)
def test_system_check__fires_on_its_misconfiguration(overrides: dict[str, Any], check: Any, check_id: str) -> None:
    assert check() == []
    with override_settings(**overrides):
        assert [error.id for error in check()] == [check_id]


def test_settings_of_the_wrong_type__every_check_runs_and_only_e011_names_them() -> None:
    # Given a TTL and a renew interval given as text, as an environment variable reads
    with override_settings(SCHEDULER_LEASE_TTL_SECONDS="10", SCHEDULER_LEASE_RENEW_SECONDS="2"):
        # When every check runs, the lease timing's comparison included
        found = [error for error in run_checks() if error.id.startswith("scheduler.")]
    # Then each wrong setting is named once, by its type check, and nothing raised
    assert sorted(error.msg for error in found) == [
        "SCHEDULER_LEASE_RENEW_SECONDS must be a number above 0, got '2'.",
        "SCHEDULER_LEASE_TTL_SECONDS must be a number above 0, got '10'.",
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"init_command": "PRAGMA journal_mode=WAL;"},
        {"transaction_mode": "IMMEDIATE", "init_command": "PRAGMA synchronous=NORMAL;"},
    ],
    ids=["startproject", "deferred", "rollback-journal"],
)
def test_system_check__warns_of_sqlite_shared_without_wal_and_immediate_transactions(options: dict[str, str]) -> None:
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}
    shared = {"transaction_mode": "immediate", "timeout": 20, "init_command": "PRAGMA journal_mode = WAL;"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Django warns that overriding DATABASES does not reach open connections
        with override_settings(DATABASES={"default": {**sqlite, "OPTIONS": shared}}):
            assert checks.check_sqlite_sharing() == []
        with override_settings(DATABASES={"default": {**sqlite, "OPTIONS": options}}):
            assert [warning.id for warning in checks.check_sqlite_sharing()] == ["scheduler.W004"]


def test_system_checks__reported_by_manage_check() -> None:
    result = manage("check", DJANGO_DEBUG="1", SCHEDULER_LEASE_TTL_SECONDS="3")
    assert result.returncode == 1
    assert "scheduler.E001" in result.stderr


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/leaderz", "/metrics"])
def test_https_redirect__spares_the_probes_and_metrics(path: str, redis_url: str) -> None:
    # Given HTTPS redirection on, as in production
    with override_settings(SECURE_SSL_REDIRECT=True):
        client = Client()
        # When a probe asks over plain HTTP, Then it gets its own answer, not a redirect
        assert client.get(path).status_code in {200, 503}
        # And the admin is still redirected
        assert client.get("/admin/login/").status_code == 301


# --- groups ---------------------------------------------------------------------


def _member_of(group: str) -> Client:
    user = bind(get_user_model().objects.create_user(f"{group.replace(' ', '-')}", password="pw", is_staff=True))
    user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def schedule(db: None) -> Schedule:
    return make_schedule("s")


def _change(client: Client, schedule: Schedule) -> int:
    data = schedule_form(name="renamed", interval="30")
    return client.post(f"/admin/scheduler/schedule/{schedule.pk}/change/", data).status_code


def test_viewer__sees_but_cannot_change_or_act(schedule: Schedule) -> None:
    viewer = _member_of(VIEWER_GROUP)
    assert viewer.get("/admin/scheduler/schedule/").status_code == 200
    assert viewer.get("/admin/scheduler/execution/").status_code == 200
    assert viewer.get("/admin/scheduler/lease/").status_code == 200
    assert _change(viewer, schedule) == 403
    response = viewer.post("/admin/scheduler/schedule/", {"action": "pause", "_selected_action": [schedule.pk]})
    assert response.status_code == 403
    schedule.refresh_from_db()
    assert (schedule.name, schedule.paused_reason) == ("s", "")


def test_operator__changes_schedules_and_runs_actions(schedule: Schedule) -> None:
    operator = _member_of(OPERATOR_GROUP)
    assert _change(operator, schedule) == 302
    response = operator.post("/admin/scheduler/schedule/", {"action": "pause", "_selected_action": [schedule.pk]})
    assert response.status_code == 302
    schedule.refresh_from_db()
    assert schedule.name == "renamed" and schedule.paused_reason.startswith("Paused by")
