"""The API's own behaviour: shared validation messages, backfill preview then confirm, sessions, throttling, submit(tenant=)."""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.test import Client, override_settings

from project.celery import app
from scheduler import dbclock
from scheduler.exceptions import SubmissionInvalid
from scheduler.models import Execution, OperatorProfile, Schedule
from scheduler.ops import operations
from scheduler.outbox import submissions
from scheduler.tenancy import EVERY_TENANT
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.integration.api_support import (
    TENANT_A,
    TENANT_B,
    bind,
    make_execution,
    make_schedule,
    tables,
    token_client,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


def model_errors(**fields: Any) -> dict[str, list[str]]:
    """Return the messages the admin's and the CLI's validation gives for a schedule with ``fields``."""
    try:
        operations.validate_schedule(Schedule(**fields), app=app, scope=EVERY_TENANT)
    except ValidationError as exc:
        return {("non_field_errors" if key == "__all__" else key): value for key, value in exc.message_dict.items()}
    return {}


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "a", "task": "scheduler.echo", "cron": "61 * * * *"},
        {"name": "a", "task": "scheduler.echo", "interval": 60, "timezone": "Mars/Olympus"},
        {"name": "a", "task": "no.such.task", "interval": 60},
        {"name": "a", "task": "scheduler.echo", "interval": 60, "args": {"not": "a list"}},
        {"name": "a", "task": "scheduler.echo", "interval": 60, "catchup_window": 0},
        {"name": "a", "task": "scheduler.echo"},
        {
            "name": "a",
            "task": "scheduler.echo",
            "interval": 60,
            "start_at": "2026-01-02T00:00:00Z",
            "end_at": "2026-01-01T00:00:00Z",
        },
    ],
)
def test_schedule_create__bad_input_is_400_with_the_admins_messages(operator: Client, fields: dict[str, Any]) -> None:
    # Given: a schedule the model's validation refuses
    expected = model_errors(**fields)
    assert expected
    before = tables()

    # When: it is posted
    response = operator.post("/api/v1/schedules/", fields, content_type="application/json")

    # Then: 400 with the same messages by field, and nothing written
    assert response.status_code == 400, response.content
    assert response.json() == expected
    assert tables() == before


def test_schedule_create__duplicate_name_and_past_one_off(operator: Client) -> None:
    make_schedule("taken")
    response = operator.post(
        "/api/v1/schedules/",
        {"name": "taken", "task": "scheduler.echo", "interval": 5},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert response.json() == {"name": ["Schedule with this Name already exists."]}
    past = (dbclock.now() - timedelta(hours=1)).isoformat()
    response = operator.post(
        "/api/v1/schedules/",
        {"name": "once", "task": "scheduler.echo", "run_at": past},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert "is in the past" in response.json()["run_at"][0]


def test_schedule_update__a_new_timing_replaces_the_old_one(operator: Client) -> None:
    schedule = make_schedule("retimed")
    response = operator.patch(
        f"/api/v1/schedules/{schedule.pk}/", {"cron": "0 3 * * *"}, content_type="application/json"
    )
    assert response.status_code == 200
    assert (response.json()["cron"], response.json()["interval"]) == ("0 3 * * *", None)


def test_schedule_backfill__preview_then_confirm(operator: Client, redis_client: object) -> None:
    # Given: a schedule firing every minute, and a past half hour
    schedule = make_schedule("filled")
    now = dbclock.now().replace(second=0, microsecond=0)
    span = {"start": (now - timedelta(minutes=40)).isoformat(), "end": (now - timedelta(minutes=31)).isoformat()}

    # When: previewed (the default); Then: the slots, nothing recorded
    preview = operator.post(f"/api/v1/schedules/{schedule.pk}/backfill/", span, content_type="application/json").json()
    assert preview["dry_run"] is True and len(preview["slots"]) == 10 and preview["created"] == 0
    assert not Execution.objects.exists()

    # When: confirmed; Then: one execution per slot, with the backfill trigger
    done = operator.post(
        f"/api/v1/schedules/{schedule.pk}/backfill/", {**span, "dry_run": False}, content_type="application/json"
    ).json()
    assert done["created"] == 10
    assert Execution.objects.filter(schedule=schedule, trigger=Execution.Trigger.BACKFILL).count() == 10

    # And a range in the future is refused with the CLI's message
    ahead = {"start": now.isoformat(), "end": (now + timedelta(hours=1)).isoformat()}
    refused = operator.post(f"/api/v1/schedules/{schedule.pk}/backfill/", ahead, content_type="application/json")
    assert refused.status_code == 400 and "only past slots can be backfilled" in refused.json()["detail"]


def test_sessions__staff_roles_csrf_and_tenant() -> None:
    # Given: a staff viewer, a staff operator bound to tenant A (group member), and a non-staff user
    users = get_user_model().objects
    viewer = bind(users.create_user("vic", password="pw", is_staff=True))
    viewer.groups.add(Group.objects.get(name=VIEWER_GROUP))
    operator = users.create_user("opal", password="pw", is_staff=True)
    operator.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    OperatorProfile.objects.create(user=operator, tenant=TENANT_A)
    outsider = users.create_user("otto", password="pw")
    mine, theirs = make_schedule("mine", tenant=TENANT_A), make_schedule("theirs", tenant=TENANT_B)

    def client(user: Any) -> Client:
        c = Client(enforce_csrf_checks=True)
        c.force_login(user)
        return c

    # Then: the viewer reads and may not write
    assert client(viewer).get("/api/v1/schedules/").status_code == 200
    assert client(viewer).post(f"/api/v1/schedules/{mine.pk}/pause/").status_code == 403
    # And a user who is not staff gets nothing
    assert client(outsider).get("/api/v1/schedules/").status_code == 403
    # And the operator's write needs the CSRF token
    session = client(operator)
    assert session.post(f"/api/v1/schedules/{mine.pk}/pause/").status_code == 403
    session.get("/admin/")  # its logout form sets the CSRF cookie
    csrf = session.cookies["csrftoken"].value
    pause = {"data": {"reason": "by hand"}, "content_type": "application/json", "HTTP_X_CSRFTOKEN": csrf}
    assert session.post(f"/api/v1/schedules/{mine.pk}/pause/", **pause).status_code == 200
    # And it sees only its tenant
    assert session.post(f"/api/v1/schedules/{theirs.pk}/pause/", **pause).status_code == 404
    assert [row["name"] for row in session.get("/api/v1/schedules/").json()["results"]] == ["mine"]


@override_settings(SCHEDULER_API_THROTTLE_RATE="3/minute")
def test_throttle__per_token() -> None:
    # Given: two tokens and a rate of 3 a minute
    first, second = token_client("one", role="viewer"), token_client("two", role="viewer")

    # When: the first makes 4 requests; Then: the 4th is 429, and the second token is unaffected
    statuses = [first.get("/api/v1/cluster/").status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    assert second.get("/api/v1/cluster/").status_code == 200


def test_anonymous__401_with_the_bearer_challenge() -> None:
    response = Client().get("/api/v1/schedules/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_docs_and_schema__served_without_a_cdn() -> None:
    docs = Client().get("/api/docs/")
    assert docs.status_code == 200
    page = docs.content.decode()
    assert "swagger-ui" in page and "cdn" not in page.lower() and "//unpkg" not in page
    assert Client().get("/api/schema/").status_code == 200


def test_submit__takes_a_tenant() -> None:
    execution = submissions.submit("scheduler.echo", tenant=TENANT_A)
    assert execution.tenant == TENANT_A
    with pytest.raises(SubmissionInvalid, match="tenant"):
        submissions.submit("scheduler.echo", tenant="x" * 101)
    # And an API token of tenant B does not see it
    assert (
        token_client("b", role="viewer", tenant=TENANT_B).get(f"/api/v1/executions/{execution.pk}/").status_code == 404
    )


@pytest.mark.parametrize(
    "query",
    [
        "/api/v1/audit-events/?since=0874-05-01T21:19:28-17:01",  # found by schemathesis: PostgreSQL refused the offset
        "/api/v1/executions/?scheduled_after=9999-12-31T23:00:00%2B01:00",
        "/api/v1/stats/?since=0001-01-01T00:00:00%2B05:00",
        "/api/v1/executions/?status=nope",
        "/api/v1/executions/?schedule=1.5",
        "/api/v1/executions/?schedule=99999999999999999999",  # past 64 bits: SQLite could not bind it
        "/api/v1/executions/?schedule=0",
        "/api/v1/executions/?schedule=" + "9" * 5000,
        "/api/v1/schedules/?name=a%00b",
        "/api/v1/schedules/{pk}/next/?n=0",
        "/api/v1/schedules/{pk}/next/?n=1001",
    ],
)
def test_bad_query__400_never_500(operator: Client, query: str) -> None:
    schedule = make_schedule("one")
    assert operator.get(query.format(pk=schedule.pk)).status_code == 400


@pytest.mark.parametrize("endpoint", ["executions", "audit-events"])
@pytest.mark.parametrize(
    "position",
    ["2026-13-45", "99999-01-01", "1.5", "-1", "0", "99999999999999999999", "9" * 5000, "\u0663", "1\x00"],
)
def test_forged_cursor__404_invalid_cursor_never_500(operator: Client, endpoint: str, position: str) -> None:
    # Given a page cursor whose position is no id (the cursor is the caller's to write: base64 of a query string)
    make_schedule("one")
    cursor = base64.b64encode(urlencode({"p": position}).encode()).decode()

    # When it is asked for, Then the answer is DRF's own for a bad cursor
    answer = operator.get(f"/api/v1/{endpoint}/", {"cursor": cursor})
    assert (answer.status_code, answer.json()) == (404, {"detail": "Invalid cursor"})


def test_cursor__the_next_page_still_follows(operator: Client) -> None:
    schedule = make_schedule("one")
    for attempt in range(3):
        make_execution(schedule, f"key-{attempt}", Execution.Status.SUCCEEDED)
    first = operator.get("/api/v1/executions/", {"page_size": 2}).json()
    second = operator.get(first["next"]).json()
    assert len(first["results"]) == 2 and len(second["results"]) == 1


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"headers": ["x"]}, "headers", "Must be a JSON object."),
        (
            {"headers": {"execution_id": 1, "x": 2}},
            "headers",
            "Celery or the scheduler sets these headers: execution_id.",
        ),
        ({"expires": 0}, "expires", "greater than or equal to 1"),
    ],
)
def test_message_options__bad_ones_are_400s_naming_the_field_and_change_nothing(
    options: dict[str, Any], field: str, message: str
) -> None:
    operator = token_client("root", role="operator")
    before = tables()
    body = {"name": "made", "task": "scheduler.echo", "interval": 60, **options}
    answer = operator.post("/api/v1/schedules/", body, content_type="application/json")
    assert answer.status_code == 400 and any(message in text for text in answer.json()[field]), answer.content
    assert tables() == before


def test_message_options__are_read_and_written_like_the_other_fields() -> None:
    operator = token_client("root", role="operator")
    body = {
        "name": "made",
        "task": "scheduler.echo",
        "interval": 60,
        "expires": 30,
        "headers": {"x-team": "billing"},
        "exchange": "billing",
        "routing_key": "billing.made",
    }
    created = operator.post("/api/v1/schedules/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    shown = operator.get(f"/api/v1/schedules/{created.json()['id']}/").json()
    assert {name: shown[name] for name in ("expires", "headers", "exchange", "routing_key")} == {
        "expires": 30,
        "headers": {"x-team": "billing"},
        "exchange": "billing",
        "routing_key": "billing.made",
    }
