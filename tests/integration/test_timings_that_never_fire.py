"""A timing that would never fire is refused, with the same message, by the admin, the API and the CLI.

An end in the past, or a cron expression that matches no date (30
February): such a schedule would be saved enabled and never run. A
schedule that has since passed its end stays editable otherwise.
"""

from __future__ import annotations

import html
import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from scheduler import dbclock
from scheduler.models import Schedule
from tests.support.admin_forms import schedule_form
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db

REFUSED = "The end 2020-01-01 00:00:00 UTC is in the past"


def _ended_yesterday() -> Schedule:
    schedule = make_schedule("ended", interval=60, end_at=dbclock.now() + timedelta(days=1))
    Schedule.objects.filter(pk=schedule.pk).update(end_at=dbclock.now() - timedelta(days=1))
    return Schedule.objects.get(pk=schedule.pk)


def test_admin__a_new_schedule_ending_in_the_past_is_refused(staff: Client) -> None:
    response = staff.post(
        "/admin/scheduler/schedule/add/", schedule_form(name="new", end_at_0="2020-01-01", end_at_1="00:00")
    )
    assert response.status_code == 200
    assert REFUSED in response.content.decode()
    assert not Schedule.objects.exists()


def test_admin__moving_the_end_into_the_past_is_refused_and_other_edits_are_not(staff: Client) -> None:
    schedule = make_schedule("later", interval=60, end_at=dbclock.now() + timedelta(days=1))
    url = f"/admin/scheduler/schedule/{schedule.pk}/change/"
    response = staff.post(url, schedule_form(name="later", end_at_0="2020-01-01", end_at_1="00:00"))
    assert response.status_code == 200 and REFUSED in response.content.decode()
    assert Schedule.objects.get(pk=schedule.pk).end_at == schedule.end_at

    ended = _ended_yesterday()
    end = timezone.localtime(ended.end_at)
    response = staff.post(
        f"/admin/scheduler/schedule/{ended.pk}/change/",
        schedule_form(name="ended", description="kept", end_at_0=f"{end:%Y-%m-%d}", end_at_1=f"{end:%H:%M:%S}"),
    )
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert Schedule.objects.get(pk=ended.pk).description == "kept"


def test_api__create_and_update_with_a_past_end_are_refused(operator: Client) -> None:
    response = operator.post(
        "/api/v1/schedules/",
        {"name": "new", "task": "scheduler.echo", "interval": 60, "end_at": "2020-01-01T00:00:00Z"},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert response.json()["end_at"][0].startswith(REFUSED)
    assert not Schedule.objects.exists()

    ended = _ended_yesterday()
    response = operator.patch(
        f"/api/v1/schedules/{ended.pk}/", {"description": "kept"}, content_type="application/json"
    )
    assert response.status_code == 200, response.content
    response = operator.patch(
        f"/api/v1/schedules/{ended.pk}/", {"end_at": "2020-01-01T00:00:00Z"}, content_type="application/json"
    )
    assert response.status_code == 400 and response.json()["end_at"][0].startswith(REFUSED)
    assert Schedule.objects.get(pk=ended.pk).end_at == ended.end_at


def test_cli__create_and_update_with_a_past_end_are_refused() -> None:
    def schedules(*argv: str) -> None:
        call_command("schedules", *argv, stdout=io.StringIO(), stderr=io.StringIO())

    with pytest.raises(CommandError) as refused:
        schedules("create", "new", "--task", "scheduler.echo", "--every", "60", "--end", "2020-01-01T00:00:00Z")
    assert str(refused.value).startswith(REFUSED) and "leave it empty" in str(refused.value)
    assert not Schedule.objects.exists()

    ended = _ended_yesterday()
    schedules("update", "ended", "--description", "kept")
    assert Schedule.objects.get(pk=ended.pk).description == "kept"
    with pytest.raises(CommandError, match="is in the past"):
        schedules("update", "ended", "--end", "2020-01-01T00:00:00Z")
    assert Schedule.objects.get(pk=ended.pk).end_at == ended.end_at


NO_DATE = "'0 0 30 2 *' matches no date (no such day in those months): it would never fire."


def test_a_cron_matching_no_date__is_refused_everywhere(staff: Client, operator: Client) -> None:
    page = staff.post("/admin/scheduler/schedule/add/", schedule_form(name="new", interval="", cron="0 0 30 2 *"))
    assert page.status_code == 200 and html.escape(NO_DATE) in page.content.decode()
    response = operator.post(
        "/api/v1/schedules/",
        {"name": "new", "task": "scheduler.echo", "cron": "0 0 30 2 *"},
        content_type="application/json",
    )
    assert response.status_code == 400 and response.json()["cron"] == [NO_DATE]
    with pytest.raises(CommandError, match="matches no date"):
        call_command(
            "schedules", "create", "new", "--task", "scheduler.echo", "--cron", "0 0 30 2 *", stdout=io.StringIO()
        )
    assert not Schedule.objects.exists()
    # and a leap day is a date
    response = operator.post(
        "/api/v1/schedules/",
        {"name": "leap", "task": "scheduler.echo", "cron": "0 0 29 2 *"},
        content_type="application/json",
    )
    assert response.status_code == 201, response.content
