"""The app stands alone: it never imports the host project, finds the host's Celery app, and ships its own routes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from celery import Celery, current_app
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, override_settings
from django.urls import include, path

import scheduler
from scheduler.celery_app import celery_app

pytestmark = pytest.mark.django_db

#: A Celery app a host could name in ``SCHEDULER_CELERY_APP`` (not made current: only the setting finds it).
named_app = Celery("named-by-setting", set_as_current=False)

#: A host's URLconf that mounts the app under a prefix of its choosing.
urlpatterns = [path("ops/", include("scheduler.urls"))]


def _imported_modules(source: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_module_of_the_app_imports_the_host_project() -> None:
    sources = sorted(Path(scheduler.__file__).parent.rglob("*.py"))
    offenders = {
        str(source.relative_to(Path(scheduler.__file__).parent.parent)): sorted(
            name for name in _imported_modules(source) if name == "project" or name.startswith("project.")
        )
        for source in sources
    }
    assert {source: names for source, names in offenders.items() if names} == {}


def test_celery_app__is_the_current_app_unless_the_setting_names_one() -> None:
    assert celery_app() is current_app._get_current_object()
    with override_settings(SCHEDULER_CELERY_APP="tests.integration.test_standalone_app:named_app"):
        assert celery_app() is named_app
    with override_settings(SCHEDULER_CELERY_APP="tests.integration.test_standalone_app.named_app"):
        assert celery_app() is named_app


@pytest.mark.parametrize(
    "value",
    ["tests.no_such_module:app", "tests.integration.test_standalone_app:no_such_app", "scheduler.conf:settings"],
)
def test_celery_app__a_setting_that_names_no_celery_app_is_a_clear_error(value: str) -> None:
    with override_settings(SCHEDULER_CELERY_APP=value), pytest.raises(ImproperlyConfigured) as error:
        celery_app()
    assert f"SCHEDULER_CELERY_APP = {value!r}" in str(error.value)


@override_settings(ROOT_URLCONF=__name__)
def test_scheduler_urls__serve_the_probes_metrics_and_api_under_the_hosts_prefix() -> None:
    client = Client()
    assert client.get("/ops/healthz").status_code == 200
    assert client.get("/ops/leaderz").status_code in (200, 503)
    assert client.get("/ops/healthz/schedules").status_code == 200
    assert client.get("/ops/metrics").status_code == 200
    assert client.get("/ops/readyz").status_code in (200, 503)
    assert client.get("/ops/api/schema/").status_code == 200
    # The API answers there, asking for credentials, in JSON
    response = client.get("/ops/api/v1/schedules/")
    assert response.status_code in (401, 403)
    assert response["Content-Type"] == "application/json"
    assert client.get("/healthz").status_code == 404


def test_an_unguarded_task__cannot_be_scheduled_or_submitted() -> None:
    # Given: a task that opted out of the guard (its executions would never be recorded)
    from django.core.exceptions import ValidationError

    import tests.support.guard_tasks  # noqa: F401 -- registers the tasks in this process
    from scheduler.exceptions import SubmissionInvalid
    from scheduler.models import Execution, Schedule
    from scheduler.ops import operations
    from scheduler.tenancy import EVERY_TENANT

    schedule = Schedule(name="unguarded", task="tests.guard.opted_out", interval=60)
    # Then: the schedule is a field error on its task, and a submission is refused; nothing is recorded
    with pytest.raises(ValidationError) as error:
        operations.validate_schedule(schedule, app=celery_app(), scope=EVERY_TENANT)
    assert "not guarded" in str(error.value.message_dict["task"])
    with pytest.raises(SubmissionInvalid, match="not guarded"):
        scheduler.submit("tests.guard.opted_out", args=["x"])
    assert not Execution.objects.exists()
    # And a guarded one is accepted
    operations.validate_schedule(
        Schedule(name="guarded", task="tests.guard.per_task", interval=60), app=celery_app(), scope=EVERY_TENANT
    )


@override_settings(
    REST_FRAMEWORK={
        "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.BrowsableAPIRenderer"],
        "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
        "EXCEPTION_HANDLER": "tests.support.host_rest_settings.host_errors",
        "DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema",
    }
)
def test_api__a_hosts_session_only_browsable_rest_framework__changes_nothing() -> None:
    # The settings DRF reads per request (error handler, schema class) in this process; the ones it
    # binds at import are proven by tests/acceptance/test_api_host_settings.py, in a server started with them.
    from tests.integration.api_support import token_client

    browser = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,*/*;q=0.8"}
    anonymous = Client().get("/api/v1/schedules/", **browser)
    assert anonymous.status_code == 401 and anonymous["Content-Type"] == "application/json"
    assert set(anonymous.json()) == {"detail"}
    listed = token_client("eyes", role="viewer").get("/api/v1/schedules/", **browser)
    assert listed.status_code == 200 and listed["Content-Type"] == "application/json"
    assert set(listed.json()) == {"count", "next", "previous", "results"}
    assert "/api/v1/schedules/" in Client().get("/api/schema/?format=json").json()["paths"]


def test_check__a_celery_app_setting_that_names_no_app_is_a_startup_error() -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    with override_settings(SCHEDULER_CELERY_APP="tests.no_such_module:app"), pytest.raises(SystemCheckError) as error:
        call_command("check")
    assert "scheduler.E007" in str(error.value) and "SCHEDULER_CELERY_APP = 'tests.no_such_module:app'" in str(
        error.value
    )
    with override_settings(SCHEDULER_CELERY_APP="tests.integration.test_standalone_app:named_app"):
        call_command("check")
