"""Limits on input size everywhere: request bodies, arguments, free text and backfill ranges.

Each refusal is a clear error (413 or a 400 field error in the API, a form
error in the admin, one line from a command) and changes no row.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.test import Client, override_settings
from django.test.client import RequestFactory
from rest_framework.request import Request

import scheduler
from scheduler import dbclock, limits
from scheduler.exceptions import SubmissionInvalid
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules
from scheduler.web.api.parsers import BoundedJSONParser, RequestTooLarge
from tests.integration.api_support import make_schedule, tables
from tests.integration.command_support import refused, run
from tests.support.admin_forms import schedule_form

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)
#: One level of nesting more than SCHEDULER_ARGS_MAX_DEPTH allows (32 by default).
TOO_DEEP = 33
#: Deep enough that ``json.loads`` itself would hit Python's recursion limit.
RECURSION_DEEP = 100_000


def nested(levels: int) -> list[Any]:
    """Return a list nested ``levels`` deep (``[]`` is one level), built without recursion."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def nested_object(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def compact_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


#: Arguments of exactly SCHEDULER_ARGS_MAX_BYTES (64 KiB) of compact JSON, and one byte more.
AT_SIZE = ["x" * (65536 - len('[""]'))]
OVER_SIZE = ["x" * (65536 - len('[""]') + 1)]


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    return client


def post_json(client: Client, url: str, body: str | bytes) -> Any:
    return client.generic("POST", url, body, content_type="application/json")


def schedule_body(**fields: Any) -> dict[str, Any]:
    return {"name": "limited", "task": "scheduler.echo", "interval": 60, **fields}


# --- request bodies ------------------------------------------------------------------


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
@pytest.mark.parametrize(
    "body", [json.dumps(schedule_body(description="d" * 1200)), "[" * 1500], ids=["json", "not-json"]
)
def test_api_body__larger_than_data_upload_max_memory_size_is_413_before_parsing(operator: Client, body: str) -> None:
    # Given: a body over DATA_UPLOAD_MAX_MEMORY_SIZE (valid JSON or not: it is never parsed)
    before = tables()

    # When: it is posted
    response = post_json(operator, "/api/v1/schedules/", body)

    # Then: 413 with a JSON error naming the limit, and nothing written
    assert response.status_code == 413, response.content
    assert response["Content-Type"] == "application/json"
    detail = response.json()["detail"]
    assert "1,000 bytes" in detail and "DATA_UPLOAD_MAX_MEMORY_SIZE" in detail
    assert tables() == before


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_api_body__at_the_limit_is_parsed(operator: Client) -> None:
    body = json.dumps(schedule_body())
    body = body[:-1] + " " * (1000 - len(body)) + "}"
    assert len(body) == 1000
    assert post_json(operator, "/api/v1/schedules/", body).status_code == 201


class EndlessBody(io.RawIOBase):
    """A body with no Content-Length that never ends (a chunked upload), counting what was read."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        assert size is not None and size >= 0, "an unbounded read of an endless body"
        self.read_bytes += size
        return b"[" * size


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_parser__a_body_without_content_length_is_read_only_up_to_the_limit() -> None:
    # Given: a request with no Content-Length whose body never ends
    django_request = RequestFactory().post("/api/v1/schedules/", content_type="application/json")
    del django_request.META["CONTENT_LENGTH"]
    stream = EndlessBody()

    # When: the API's parser reads it
    with pytest.raises(RequestTooLarge, match="more than 1,000 bytes"):
        BoundedJSONParser().parse(stream, "application/json", {"request": Request(django_request)})

    # Then: it stopped one byte past the limit
    assert stream.read_bytes == 1001


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_parser__a_content_length_over_the_limit_is_refused_before_reading() -> None:
    django_request = RequestFactory().post("/api/v1/schedules/", data=b"[" * 1001, content_type="application/json")
    stream = EndlessBody()
    with pytest.raises(RequestTooLarge, match="is 1,001 bytes; at most 1,000 bytes"):
        BoundedJSONParser().parse(stream, "application/json", {"request": Request(django_request)})
    assert stream.read_bytes == 0


def test_schema__every_operation_with_a_body_may_answer_413(client: Client) -> None:
    paths = client.get("/api/schema/?format=json").json()["paths"]
    assert paths
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert ("413" in operation["responses"]) == (method in ("post", "patch")), (method, path)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[" * RECURSION_DEEP + "]" * RECURSION_DEEP, "nested more than 64 levels"),
        (json.dumps({"args": nested(65)}), "nested more than 64 levels"),
        ('{"name": ', "JSON parse error"),
        ('{"name": NaN}', "JSON parse error"),
    ],
    ids=["past-recursion-limit", "past-depth-limit", "truncated", "nan"],
)
def test_api_body__deep_or_invalid_json_is_400(operator: Client, body: str, message: str) -> None:
    before = tables()
    response = post_json(operator, "/api/v1/schedules/", body)
    assert response.status_code == 400, response.content
    assert message in response.json()["detail"]
    assert tables() == before


def refused_by_the_api(operator: Client, fields: dict[str, Any], field: str, message: str) -> Schedule:
    """Assert that creating a schedule with ``fields``, and changing an existing one to them, are both refused.

    Each answer is a 400 whose only field error, on ``field``, says ``message``, and no row changes.
    Returns the existing schedule.
    """
    existing = make_schedule("existing")
    before = tables()
    created = operator.post("/api/v1/schedules/", schedule_body(**fields), content_type="application/json")
    changed = operator.patch(f"/api/v1/schedules/{existing.pk}/", fields, content_type="application/json")
    for response in (created, changed):
        assert response.status_code == 400, response.content
        assert list(response.json()) == [field]
        assert message in response.json()[field][0]
    assert tables() == before
    return existing


# --- args and kwargs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"args": OVER_SIZE}, "args", "65,537 bytes as JSON; at most 65,536 (SCHEDULER_ARGS_MAX_BYTES)"),
        (
            {"kwargs": {"k": "x" * (65537 - len('{"k":""}'))}},
            "kwargs",
            "65,537 bytes as JSON; at most 65,536 (SCHEDULER_ARGS_MAX_BYTES)",
        ),
        ({"args": nested(TOO_DEEP)}, "args", "more than 32 levels deep; at most 32 (SCHEDULER_ARGS_MAX_DEPTH)"),
        (
            {"kwargs": nested_object(TOO_DEEP)},
            "kwargs",
            "more than 32 levels deep; at most 32 (SCHEDULER_ARGS_MAX_DEPTH)",
        ),
    ],
    ids=["args-size", "kwargs-size", "args-depth", "kwargs-depth"],
)
def test_api_schedule__arguments_over_the_limits_are_a_field_error(
    operator: Client, fields: dict[str, Any], field: str, message: str
) -> None:
    # Given: a schedule whose arguments pass one limit by one byte or one level
    # When: it is created, or an existing schedule is changed to it
    # Then: 400 with a field error naming the limit, and nothing written
    refused_by_the_api(operator, fields, field, message)


def test_api_schedule__arguments_at_the_limits_are_accepted(operator: Client) -> None:
    assert compact_size(AT_SIZE) == 65536
    response = operator.post(
        "/api/v1/schedules/", schedule_body(args=AT_SIZE, kwargs=nested_object(32)), content_type="application/json"
    )
    assert response.status_code == 201, response.content
    deep = operator.patch(
        f"/api/v1/schedules/{response.json()['id']}/", {"args": nested(32)}, content_type="application/json"
    )
    assert deep.status_code == 200, deep.content


@override_settings(SCHEDULER_ARGS_MAX_BYTES=100, SCHEDULER_ARGS_MAX_DEPTH=3)
def test_arguments_limits__follow_the_settings() -> None:
    assert limits.argument_problem(["x" * 95], label="args") is None
    assert "101 bytes" in limits.argument_problem(["x" * 97], label="args")
    assert limits.argument_problem(nested(3), label="args") is None
    assert "more than 3 levels" in limits.argument_problem(nested(4), label="args")
    # Lists, tuples and objects all count as levels; any depth is walked without recursion.
    assert "more than 3 levels" in limits.argument_problem({"a": ({"b": [1]},)}, label="kwargs")
    assert "more than 3 levels" in limits.argument_problem(nested(RECURSION_DEEP), label="args")


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"args": json.dumps(OVER_SIZE)}, "args", "at most 65,536 (SCHEDULER_ARGS_MAX_BYTES)"),
        ({"kwargs": json.dumps(nested_object(TOO_DEEP))}, "kwargs", "at most 32 (SCHEDULER_ARGS_MAX_DEPTH)"),
        ({"args": "[" * 5000 + "]" * 5000}, "args", "at most 32 (SCHEDULER_ARGS_MAX_DEPTH)"),
        ({"description": "d" * 2001}, "description", "at most 2000 characters (it has 2001)"),
        ({"paused_reason": "p" * 501}, "paused_reason", "at most 500 characters (it has 501)"),
    ],
    ids=["args-size", "kwargs-depth", "args-past-recursion-limit", "description", "paused-reason"],
)
def test_admin_form__over_a_limit_is_a_field_error_and_writes_nothing(
    staff: Client, overrides: dict[str, str], field: str, message: str
) -> None:
    existing = make_schedule("existing")
    before = tables()
    added = staff.post("/admin/scheduler/schedule/add/", schedule_form(name="from admin", **overrides))
    changed = staff.post(
        f"/admin/scheduler/schedule/{existing.pk}/change/", schedule_form(name="existing", **overrides)
    )
    for response in (added, changed):
        assert response.status_code == 200  # the form again, with the error
        errors = response.context["adminform"].form.errors
        assert list(errors) == [field], errors
        assert message in errors[field][0]
    assert tables() == before


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--args", json.dumps(OVER_SIZE), "args: Arguments are 65,537 bytes as JSON; at most 65,536"),
        ("--kwargs", json.dumps(nested_object(TOO_DEEP)), "kwargs: Keyword arguments nest more than 32 levels"),
        ("--args", "[" * 500 + "]" * 500, "args: Arguments nest more than 32 levels"),
        ("--description", "d" * 2001, "description: Ensure this value has at most 2000 characters"),
    ],
    ids=["args-size", "kwargs-depth", "args-very-deep", "description"],
)
def test_command_schedules__over_a_limit_is_refused_and_changes_nothing(option: str, value: str, message: str) -> None:
    make_schedule("existing")
    before = tables()
    assert message in refused(
        "schedules", "create", "limited", "--task", "scheduler.echo", "--every", "60", option, value
    )
    assert message in refused("schedules", "update", "existing", option, value)
    assert tables() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"args": OVER_SIZE}, "args are 65,537 bytes as JSON; at most 65,536 (SCHEDULER_ARGS_MAX_BYTES)"),
        ({"kwargs": {"k": nested(TOO_DEEP)}}, "kwargs nest more than 32 levels deep"),
        ({"args": (nested(RECURSION_DEEP),)}, "args nest more than 32 levels deep"),
    ],
    ids=["args-size", "kwargs-depth", "args-very-deep"],
)
def test_submit__arguments_over_the_limits_are_refused_before_anything_is_written(
    call: dict[str, Any], message: str
) -> None:
    with pytest.raises(SubmissionInvalid, match=message.replace("(", r"\(").replace(")", r"\)")):
        scheduler.submit("scheduler.echo", **call)
    assert not Execution.objects.exists()


# --- description and paused_reason ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"description": "d" * 2001}, "description", "at most 2000 characters (it has 2001)"),
        ({"paused_reason": "p" * 501}, "paused_reason", "at most 500 characters (it has 501)"),
    ],
)
def test_api_schedule__text_over_its_cap_is_a_field_error(
    operator: Client, fields: dict[str, Any], field: str, message: str
) -> None:
    existing = refused_by_the_api(operator, fields, field, message)
    at_cap = {key: value[:-1] for key, value in fields.items()}
    assert (
        operator.patch(f"/api/v1/schedules/{existing.pk}/", at_cap, content_type="application/json").status_code == 200
    )


def test_pause__a_reason_over_its_cap_is_refused_everywhere(operator: Client, staff: Client) -> None:
    # Given: an active schedule and a reason one character too long
    schedule = make_schedule("nightly")
    reason = "r" * 501
    before = tables()

    # When: it is paused with it through the API, the admin's button and the command line
    api = operator.post(f"/api/v1/schedules/{schedule.pk}/pause/", {"reason": reason}, content_type="application/json")
    admin = staff.post(f"/admin/scheduler/schedule/{schedule.pk}/act/pause/", {"reason": reason}, follow=True)
    cli = refused("schedules", "pause", "nightly", "--reason", reason)

    # Then: each refuses with the cap, and the schedule is still active
    assert api.status_code == 400 and "no more than 500 characters" in api.json()["reason"][0]
    assert "at most 500 characters (it has 501)" in admin.content.decode()
    assert "paused_reason: Ensure this value has at most 500 characters (it has 501)" in cli
    assert tables() == before
    assert not Schedule.objects.get(pk=schedule.pk).is_paused

    # And a reason at the cap pauses it
    assert (
        operator.post(
            f"/api/v1/schedules/{schedule.pk}/pause/", {"reason": reason[:-1]}, content_type="application/json"
        ).status_code
        == 200
    )
    assert Schedule.objects.get(pk=schedule.pk).paused_reason == reason[:-1]


# --- backfill --------------------------------------------------------------------------


@pytest.fixture
def hourly() -> Schedule:
    schedule = Schedule(name="hourly", task="scheduler.echo", interval=3600)
    schedule.full_clean()
    schedules.save(schedule, now=dbclock.now())
    return schedule


def fifteen_slots() -> tuple[str, str]:
    """Return (start, end) in ISO-8601 of a past range holding 15 slots of an hourly schedule."""
    now = dbclock.now()
    end = now.replace(minute=0, second=0, microsecond=0) - HOUR
    return (end - 14 * HOUR).isoformat(), end.isoformat()


@override_settings(SCHEDULER_BACKFILL_MAX_SLOTS=10)
@pytest.mark.parametrize("dry_run", [True, False])
def test_api_backfill__a_range_over_the_cap_is_a_field_error_and_writes_nothing(
    operator: Client, hourly: Schedule, dry_run: bool
) -> None:
    start, end = fifteen_slots()
    before = tables()
    url = f"/api/v1/schedules/{hourly.pk}/backfill/"
    response = operator.post(url, {"start": start, "end": end, "dry_run": dry_run}, content_type="application/json")
    assert response.status_code == 400, response.content
    assert (
        "the range holds 15 slots, more than the 10 one backfill may record (SCHEDULER_BACKFILL_MAX_SLOTS)"
        in (response.json()["end"][0])
    )
    assert tables() == before


@override_settings(SCHEDULER_BACKFILL_MAX_SLOTS=10)
def test_api_backfill__a_limit_over_the_cap_is_a_field_error(operator: Client, hourly: Schedule) -> None:
    start, end = fifteen_slots()
    before = tables()
    response = operator.post(
        f"/api/v1/schedules/{hourly.pk}/backfill/",
        {"start": start, "end": end, "dry_run": False, "limit": 11},
        content_type="application/json",
    )
    assert response.status_code == 400, response.content
    assert response.json() == {"limit": ["At most 10 (SCHEDULER_BACKFILL_MAX_SLOTS)."]}
    assert tables() == before


def test_api_backfill__the_cap_defaults_to_ten_thousand(operator: Client, hourly: Schedule) -> None:
    start, end = fifteen_slots()
    response = operator.post(
        f"/api/v1/schedules/{hourly.pk}/backfill/",
        {"start": start, "end": end, "limit": 10_001},
        content_type="application/json",
    )
    assert response.json() == {"limit": ["At most 10,000 (SCHEDULER_BACKFILL_MAX_SLOTS)."]}


@override_settings(SCHEDULER_BACKFILL_MAX_SLOTS=10)
def test_admin_backfill__a_range_over_the_cap_is_a_field_error_and_writes_nothing(
    staff: Client, hourly: Schedule
) -> None:
    start, end = fifteen_slots()
    before = tables()
    for button in ("preview", "confirm"):
        response = staff.post(
            f"/admin/scheduler/schedule/{hourly.pk}/backfill/", {"start": start, "end": end, button: "1"}
        )
        assert response.status_code == 200
        errors = response.context["form"].errors
        assert "more than the 10 one backfill may record (SCHEDULER_BACKFILL_MAX_SLOTS)" in errors["end"][0]
    assert tables() == before


@override_settings(SCHEDULER_BACKFILL_MAX_SLOTS=10)
def test_command_backfill__a_range_over_the_cap_is_refused_unless_raised_for_the_call(
    hourly: Schedule, redis_client: object
) -> None:
    start, end = fifteen_slots()
    before = tables()
    # Refused, whatever --limit says: the cap bounds what one call records.
    for extra in ((), ("--limit", "100")):
        message = refused("backfill", "hourly", "--start", start, "--end", end, *extra)
        assert (
            "the range holds 15 slots, more than the 10 one backfill may record (SCHEDULER_BACKFILL_MAX_SLOTS)"
            in message
        )
        assert "--max-slots" in message
    assert "more than the 14" in refused("backfill", "hourly", "--start", start, "--end", end, "--max-slots", "14")
    assert tables() == before

    # With the cap raised for this call, the 15 slots are recorded.
    output = json.loads(run("backfill", "hourly", "--start", start, "--end", end, "--max-slots", "15", "--json"))
    assert output["created"] == 15
    assert Execution.objects.filter(schedule=hourly, trigger=Execution.Trigger.BACKFILL).count() == 15
