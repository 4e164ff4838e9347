"""Every rule of Schedule validation, through the model and through the admin form."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.test import Client

from scheduler.models import Schedule
from scheduler.owners import schedules
from tests.support.admin_forms import schedule_form

pytestmark = pytest.mark.django_db

START = datetime(2030, 1, 1, tzinfo=timezone.utc)

#: (case, field values, field expected to carry the error)
BAD_INPUT = [
    ("invalid cron", {"cron": "61 * * * *"}, "cron"),
    ("cron with 3 fields", {"cron": "* * *"}, "cron"),
    ("unknown timezone", {"interval": 5, "timezone": "Mars/Olympus"}, "timezone"),
    ("no timing", {}, NON_FIELD_ERRORS),
    ("two timings", {"cron": "* * * * *", "interval": 5}, NON_FIELD_ERRORS),
    ("three timings", {"cron": "* * * * *", "interval": 5, "run_at": START}, NON_FIELD_ERRORS),
    ("args not a list", {"interval": 5, "args": {"a": 1}}, "args"),
    ("kwargs not an object", {"interval": 5, "kwargs": [1, 2]}, "kwargs"),
    ("zero interval", {"interval": 0}, "interval"),
    ("negative interval", {"interval": -5}, "interval"),
    ("zero max_runs", {"interval": 5, "max_runs": 0}, "max_runs"),
    ("zero timeout", {"interval": 5, "timeout": 0}, "timeout"),
    ("negative catchup_window", {"interval": 5, "catchup_window": -1}, "catchup_window"),
    ("negative jitter", {"interval": 5, "jitter": -1}, "jitter"),
    ("negative max_retries", {"interval": 5, "max_retries": -1}, "max_retries"),
    ("zero pause_after_failures", {"interval": 5, "pause_after_failures": 0}, "pause_after_failures"),
    ("end before start", {"interval": 5, "start_at": START, "end_at": START.replace(year=2029)}, "end_at"),
    ("unknown overlap", {"interval": 5, "overlap": "sometimes"}, "overlap"),
    ("unknown misfire", {"interval": 5, "misfire": "maybe"}, "misfire"),
    ("unknown dst_gap", {"interval": 5, "dst_gap": "ignore"}, "dst_gap"),
    ("unknown dst_fold", {"interval": 5, "dst_fold": "middle"}, "dst_fold"),
]


@pytest.mark.parametrize(("values", "field"), [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_full_clean__rejects_bad_input_on_the_right_field(values: dict, field: str) -> None:
    schedule = Schedule(name="bad", task="scheduler.echo", **values)
    with pytest.raises(ValidationError) as excinfo:
        schedule.full_clean()
    assert field in excinfo.value.message_dict, excinfo.value.message_dict
    assert Schedule.objects.count() == 0


def test_full_clean__messages_are_specific() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Schedule(name="bad", task="t", cron="61 * * * *", timezone="Mars/Olympus").full_clean()
    messages = excinfo.value.message_dict
    assert "61 * * * *" in messages["cron"][0]
    assert "Mars/Olympus" in messages["timezone"][0]


@pytest.mark.parametrize(
    "values",
    [{"cron": "*/5 * * * *"}, {"cron": "*/10 * * * * *"}, {"interval": 5}, {"run_at": START}],
    ids=["cron", "cron with seconds", "interval", "one-off"],
)
def test_save__computes_next_run_at(values: dict) -> None:
    schedule = Schedule(name="ok", task="scheduler.echo", **values)
    schedule.full_clean()
    schedules.save(schedule)
    assert schedule.next_run_at is not None


def test_save__recomputes_next_run_at_only_when_timing_changes() -> None:
    schedule = Schedule(name="ok", task="scheduler.echo", interval=3600)
    schedules.save(schedule)
    first = schedule.next_run_at
    Schedule.objects.filter(pk=schedule.pk).update(next_run_at=None)
    schedule.refresh_from_db()

    schedule.description = "no timing change"
    schedules.save(schedule)
    schedule.refresh_from_db()
    assert schedule.next_run_at is None  # untouched: the beat owns it

    schedule.interval = 60
    schedules.save(schedule)
    assert schedule.next_run_at is not None and schedule.next_run_at <= first

    schedule.enabled = False
    schedules.save(schedule)
    assert schedule.next_run_at is None


# --- the admin shows the same errors, never a 500 ------------------------------


@pytest.fixture
def admin_client_logged_in() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.invalid", "pw")
    client = Client()
    client.force_login(user)
    return client


ADMIN_BAD_INPUT = [
    ("invalid cron", {"cron": "61 * * * *"}, "61 * * * *"),
    ("unknown task", {"interval": "5", "task": "no.such.task"}, "Unknown task no.such.task"),
    ("unknown timezone", {"interval": "5", "timezone": "Mars/Olympus"}, "Mars/Olympus"),
    ("a folder of zones", {"interval": "5", "timezone": "Europe"}, "Unknown timezone 'Europe'"),
    ("no timing", {}, "exactly one of"),
    ("two timings", {"cron": "* * * * *", "interval": "5"}, "exactly one of"),
    ("non-JSON args", {"interval": "5", "args": "[1,"}, "valid JSON"),
    ("args not a list", {"interval": "5", "args": '{"a": 1}'}, "JSON list"),
    ("kwargs not an object", {"interval": "5", "kwargs": "[1]"}, "JSON object"),
    ("negative interval", {"interval": "-5"}, "greater than or equal to"),
    ("zero timeout", {"interval": "5", "timeout": "0"}, "greater than or equal to 1"),
    (
        "end before start",
        {
            "interval": "5",
            "start_at_0": "2030-01-02",
            "start_at_1": "00:00:00",
            "end_at_0": "2030-01-01",
            "end_at_1": "00:00:00",
        },
        "End must be after start",
    ),
    ("unknown overlap", {"interval": "5", "overlap": "sometimes"}, "Select a valid choice"),
    ("unknown misfire", {"interval": "5", "misfire": "maybe"}, "Select a valid choice"),
]


@pytest.mark.parametrize(
    ("overrides", "message"), [case[1:] for case in ADMIN_BAD_INPUT], ids=[case[0] for case in ADMIN_BAD_INPUT]
)
def test_admin_add__bad_input_shows_the_error_and_writes_nothing(
    admin_client_logged_in: Client, overrides: dict, message: str
) -> None:
    response = admin_client_logged_in.post(
        "/admin/scheduler/schedule/add/", schedule_form(name="from admin", interval="") | overrides
    )
    assert response.status_code == 200  # the form again, not a redirect and not a 500
    errors = response.context["adminform"].form.errors
    assert any(message in error for field_errors in errors.values() for error in field_errors), errors
    assert 'class="errorlist' in response.content.decode()
    assert Schedule.objects.count() == 0


def test_admin_add__valid_schedule_is_saved_with_next_run(admin_client_logged_in: Client) -> None:
    response = admin_client_logged_in.post(
        "/admin/scheduler/schedule/add/", schedule_form(name="from admin", interval="", cron="*/5 * * * *")
    )
    assert response.status_code == 302
    schedule = Schedule.objects.get(name="from admin")
    assert schedule.next_run_at is not None


@pytest.mark.parametrize("model", ["schedule", "execution", "lease", "instance"])
def test_admin_changelists_render(admin_client_logged_in: Client, model: str) -> None:
    assert admin_client_logged_in.get(f"/admin/scheduler/{model}/").status_code == 200
