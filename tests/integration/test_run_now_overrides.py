"""Run now with other arguments, queue or priority, from the API, the CLI and the admin: checked, scoped, recorded."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.cache import cache
from django.test import Client

from scheduler.models import AuditEvent, Execution, Schedule
from scheduler.web.permissions import OPERATOR_GROUP
from tests.integration.api_support import TENANT_A, TENANT_B, bind, make_schedule, tables, token_client
from tests.integration.command_support import refused, run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


@pytest.fixture
def schedule() -> Schedule:
    return make_schedule("report", tenant=TENANT_A, args=["stored"], kwargs={"label": "stored"}, interval=3600)


def _run_now(client: Client, schedule: Schedule, body: dict[str, Any]) -> Any:
    return client.post(f"/api/v1/schedules/{schedule.pk}/run-now/", body, content_type="application/json")


# --- API ------------------------------------------------------------------------------


def test_api__overrides_are_recorded_on_the_execution_and_the_rest_is_the_schedules(
    schedule: Schedule, redis_url: str
) -> None:
    client = token_client("ops", role="operator", tenant=TENANT_A)
    response = _run_now(client, schedule, {"kwargs": {"label": "once"}, "priority": 7})
    assert response.status_code == 201, response.content
    execution = Execution.objects.get(pk=response.json()["execution"]["id"])
    assert (execution.args, execution.kwargs, execution.queue, execution.priority) == (
        ["stored"],
        {"label": "once"},
        "",
        7,
    )
    assert response.json()["execution"]["kwargs"] == {"label": "once"}
    assert AuditEvent.objects.get(action="run_now").changes == {
        "execution": [None, execution.pk],
        "kwargs": [{"label": "stored"}, {"label": "once"}],
        "priority": [None, 7],
    }


def test_api__no_body_runs_with_the_stored_values(schedule: Schedule, redis_url: str) -> None:
    client = token_client("ops", role="operator", tenant=TENANT_A)
    # As `curl -X POST` sends it: no body, no content type
    response = client.generic("POST", f"/api/v1/schedules/{schedule.pk}/run-now/")
    assert response.status_code == 201, response.content
    execution = Execution.objects.get()
    assert (execution.args, execution.kwargs) == (["stored"], {"label": "stored"})


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"args": {"not": "a list"}}, "args", "Arguments must be a JSON list"),
        ({"kwargs": [1, 2]}, "kwargs", "Keyword arguments must be a JSON object"),
        ({"queue": "q" * 201}, "queue", "at most 200 characters"),
        ({"priority": -1}, "priority", "greater than or equal to 0"),
        ({"priority": "high"}, "priority", "A valid integer is required"),
    ],
)
def test_api__a_value_the_schedule_could_not_hold_is_a_400_by_field_and_changes_nothing(
    schedule: Schedule, body: dict[str, Any], field: str, message: str
) -> None:
    client = token_client("ops", role="operator", tenant=TENANT_A)
    before = tables()
    response = _run_now(client, schedule, body)
    assert response.status_code == 400, response.content
    assert message in " ".join(response.json()[field])
    assert tables() == before


def test_api__another_tenants_schedule_is_a_404_and_a_viewer_a_403(schedule: Schedule) -> None:
    before = tables()
    other = token_client("other", role="operator", tenant=TENANT_B)
    assert _run_now(other, schedule, {"args": ["theirs"]}).status_code == 404
    viewer = token_client("viewer", role="viewer", tenant=TENANT_A)
    assert _run_now(viewer, schedule, {"args": ["mine"]}).status_code == 403
    assert tables() == before


# --- CLI ------------------------------------------------------------------------------


def test_cli__dry_run_shows_the_overrides_and_records_nothing(schedule: Schedule) -> None:
    out = run("schedules", "run-now", "report", "--args", '["other"]', "--queue", "urgent", "--dry-run")
    assert out == "Would run schedule 'report' now (task tests.record, args [\"other\"], queue urgent).\n"
    assert not Execution.objects.exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("--args", '{"a": 1}'), "--args must be a JSON list"),
        (("--kwargs", "not json"), "--kwargs"),
        (("--queue", "q" * 201), "queue: Ensure this value has at most 200 characters (it has 201)."),
        (("--priority", "-1"), "priority: Ensure this value is greater than or equal to 0."),
    ],
)
def test_cli__bad_overrides_are_refused_in_one_line_and_change_nothing(
    schedule: Schedule, arguments: tuple[str, ...], message: str
) -> None:
    before = tables()
    assert message in refused("schedules", "run-now", "report", *arguments)
    assert tables() == before


# --- admin ----------------------------------------------------------------------------


def _operator(tenant: str) -> Client:
    user = bind(get_user_model().objects.create_user(f"op-{tenant}", password="pw", is_staff=True), tenant)
    user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    client = Client()
    client.force_login(user)
    return client


def test_admin__the_form_shows_the_stored_values_and_runs_with_the_changed_ones(
    schedule: Schedule, redis_url: str
) -> None:
    admin = _operator(TENANT_A)
    page = admin.get(f"/admin/scheduler/schedule/{schedule.pk}/run/").content.decode()
    assert "&quot;stored&quot;" in page  # the stored arguments, to edit
    response = admin.post(
        f"/admin/scheduler/schedule/{schedule.pk}/run/",
        {"args": '["stored"]', "kwargs": '{"label": "admin"}', "queue": "", "priority": ""},
        follow=True,
    )
    execution = Execution.objects.get()
    assert f'Execution <a href="/admin/scheduler/execution/{execution.pk}/change/">' in response.content.decode()
    assert (execution.args, execution.kwargs, execution.queue, execution.priority) == (
        ["stored"],
        {"label": "admin"},
        "",
        None,
    )
    # Only what changed is an override
    assert AuditEvent.objects.get(action="run_now").changes == {
        "execution": [None, execution.pk],
        "kwargs": [{"label": "stored"}, {"label": "admin"}],
    }


def test_admin__a_bad_value_is_a_form_error_and_changes_nothing(schedule: Schedule) -> None:
    admin = _operator(TENANT_A)
    before = tables()
    response = admin.post(
        f"/admin/scheduler/schedule/{schedule.pk}/run/",
        {"args": '{"a": 1}', "kwargs": "{", "queue": "", "priority": ""},
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "Arguments must be a JSON list" in page or "Enter a valid JSON" in page
    assert tables() == before


def test_admin__another_tenants_schedule_is_a_404(schedule: Schedule) -> None:
    other = _operator(TENANT_B)
    before = tables()
    assert other.get(f"/admin/scheduler/schedule/{schedule.pk}/run/").status_code == 404
    assert other.post(f"/admin/scheduler/schedule/{schedule.pk}/run/", {"args": "[]"}).status_code == 404
    assert tables() == before
