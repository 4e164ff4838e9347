"""/metrics and /healthz/schedules behind SCHEDULER_METRICS_TOKEN, and the tenant on every per-schedule series."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import Client

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler import checks, dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Schedule
from scheduler.owners import schedules

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-scrape-token"
#: Each machine endpoint and what it answers to an allowed request while the schedule below is overdue.
ENDPOINTS = [("/metrics", 200), ("/healthz/schedules", 503)]


@pytest.fixture
def overdue() -> Schedule:
    """A schedule of tenant "acme" that has not succeeded for an hour: both endpoints name it."""
    schedule = Schedule(name="acme-payroll", task="tests.record", interval=60, tenant="acme")
    schedule.full_clean()
    schedules.save(schedule, now=dbclock.now() - timedelta(hours=1))
    Schedule.objects.filter(pk=schedule.pk).update(last_success_at=dbclock.now() - timedelta(hours=1))
    return schedule


def _get(path: str, authorization: str | None = None) -> Any:
    headers = {} if authorization is None else {"Authorization": authorization}
    return Client().get(path, headers=headers)


@pytest.mark.parametrize(("path", "_allowed"), ENDPOINTS)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer", "Bearer ", f"Bearer{TOKEN}"],
)
def test_token_set__request_without_the_token_is_401_and_reveals_nothing(
    settings: Any, overdue: Schedule, path: str, _allowed: int, authorization: str | None
) -> None:
    # Given a token is configured
    settings.SCHEDULER_METRICS_TOKEN = TOKEN
    # When a request comes without it, or with anything else
    response = _get(path, authorization)
    # Then 401 with the challenge, and nothing of the schedules, tasks or tenants in it
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    body = response.content.decode()
    for secret in ("acme", "payroll", "tests.record", "scheduler_", TOKEN):
        assert secret not in body, body


@pytest.mark.parametrize(("path", "allowed"), ENDPOINTS)
@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_token_set__request_with_the_token_is_answered(
    settings: Any, overdue: Schedule, path: str, allowed: int, scheme: str
) -> None:
    settings.SCHEDULER_METRICS_TOKEN = TOKEN
    # When Prometheus sends the token (the scheme is case-insensitive, RFC 7235)
    response = _get(path, f"{scheme} {TOKEN}")
    # Then the endpoint answers as it always did, naming the schedule
    assert response.status_code == allowed
    assert "acme-payroll" in response.content.decode()


@pytest.mark.parametrize(("path", "allowed"), ENDPOINTS)
@pytest.mark.parametrize("authorization", [None, "Bearer anything"])
def test_token_unset__endpoints_stay_open(
    overdue: Schedule, path: str, allowed: int, authorization: str | None
) -> None:
    # Given no token (the default): Prometheus scrapes without credentials, as it expects to
    assert scheduler_settings.METRICS_TOKEN == ""
    response = _get(path, authorization)
    assert response.status_code == allowed
    assert "acme-payroll" in response.content.decode()


def test_token_set__probes_for_load_balancers_stay_open(settings: Any) -> None:
    # /healthz and /readyz name no schedule; load balancers and orchestrators send no header
    settings.SCHEDULER_METRICS_TOKEN = TOKEN
    for path in ("/healthz", "/readyz", "/leaderz"):
        assert _get(path).status_code != 401, path


def test_deploy_check__warns_when_debug_is_off_and_no_token_is_set(settings: Any) -> None:
    # Given production (DEBUG off) and no token
    settings.DEBUG = False
    settings.SCHEDULER_METRICS_TOKEN = ""
    # Then a deploy check warns that every tenant's schedule names are open
    assert [warning.id for warning in checks.check_metrics_token()] == ["scheduler.W002"]
    # And only among the deploy checks (`manage.py check --deploy`), not on every command
    assert "scheduler.W002" in {message.id for message in run_checks(include_deployment_checks=True)}
    assert "scheduler.W002" not in {message.id for message in run_checks()}
    # And not with a token, or while debugging
    settings.SCHEDULER_METRICS_TOKEN = TOKEN
    assert checks.check_metrics_token() == []
    settings.SCHEDULER_METRICS_TOKEN = ""
    settings.DEBUG = True
    assert checks.check_metrics_token() == []


def test_metrics__per_schedule_series_carry_the_tenant() -> None:
    # Given schedules of two tenants, with the same name (names are unique per tenant), and one
    # bound to no tenant, each with a success
    now = dbclock.now()
    named = (("payroll", "acme"), ("payroll", "globex"), ("cleanup", ""))
    for name, tenant in named:
        schedules.create(name=name, task="tests.record", interval=60, tenant=tenant)
    Schedule.objects.update(last_success_at=now)
    # When scraped
    text = Client().get("/metrics").content.decode()
    # Then each schedule has its own series, naming its tenant ("" for none)
    series = "scheduler_schedule_last_success_timestamp_seconds"
    for name, tenant in named:
        assert re.search(rf'^{series}{{schedule="{name}",tenant="{tenant}"}} \S+$', text, re.MULTILINE), text
    # And every series that names a schedule names its tenant too
    naming = [line for line in text.splitlines() if 'schedule="' in line and not line.startswith("#")]
    assert len(naming) == len(named)
    assert all('tenant="' in line for line in naming), naming
