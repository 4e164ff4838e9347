"""A schedule whose stored zone is no longer in the tzdata (removed by an upgrade) is shown and reported, never a 500.

The beat already skips such a schedule (``timing.zone_is_valid``); every
page, API answer and command that shows its times must say what is wrong.
"""

from __future__ import annotations

import html
import io

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db

GONE = "Mars/Olympus_Mons"


@pytest.fixture
def schedule() -> Schedule:
    made = make_schedule("martian", cron="0 * * * *")
    # As if a tzdata upgrade dropped its zone, and its slot came.
    Schedule.objects.filter(pk=made.pk).update(timezone=GONE, next_run_at=dbclock.now())
    return Schedule.objects.get(pk=made.pk)


def test_beat__pauses_it_saying_why(schedule: Schedule, lease: leases.LeaseHandle) -> None:
    dispatch.dispatch_due(lease)
    schedule.refresh_from_db()
    assert schedule.paused_reason == f"Invalid timing: Unknown timezone {GONE!r}"
    assert not Execution.objects.exists()


def test_admin__list_and_change_page_name_the_zone(staff: Client, schedule: Schedule) -> None:
    listed = staff.get("/admin/scheduler/schedule/")
    assert listed.status_code == 200 and "martian" in listed.content.decode()
    page = staff.get(f"/admin/scheduler/schedule/{schedule.pk}/change/")
    assert page.status_code == 200
    assert html.escape(f"Invalid timing: Unknown timezone {GONE!r}") in page.content.decode()


def test_api__detail_and_next_name_the_zone(operator: Client, schedule: Schedule) -> None:
    detail = operator.get(f"/api/v1/schedules/{schedule.pk}/")
    assert detail.status_code == 200 and detail.json()["timezone"] == GONE
    upcoming = operator.get(f"/api/v1/schedules/{schedule.pk}/next/")
    assert upcoming.status_code == 200
    assert upcoming.json()["times"] == [] and upcoming.json()["note"].startswith(f"Unknown timezone {GONE!r}")
    backfilled = operator.post(
        f"/api/v1/schedules/{schedule.pk}/backfill/",
        {"start": "2026-01-01T00:00:00Z", "end": "2026-01-01T05:00:00Z"},
        content_type="application/json",
    )
    assert backfilled.status_code == 400 and f"Unknown timezone {GONE!r}" in str(backfilled.json())


@pytest.mark.parametrize("argv", [["schedules", "show", "martian"], ["schedules", "list"]])
def test_cli__lists_and_shows_it(schedule: Schedule, argv: list[str]) -> None:
    out = io.StringIO()
    call_command(*argv, stdout=out, stderr=io.StringIO())
    assert "martian" in out.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["schedules", "next", "martian"],
        ["backfill", "martian", "--start", "2026-01-01T00:00:00Z", "--end", "2026-01-01T05:00:00Z"],
    ],
)
def test_cli__times_name_the_zone(schedule: Schedule, argv: list[str]) -> None:
    with pytest.raises(CommandError, match=f"Unknown timezone {GONE!r}"):
        call_command(*argv, stdout=io.StringIO(), stderr=io.StringIO())
