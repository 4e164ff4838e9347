"""Calendars on the real database: backfill and the preview obey them; the admin, the API and the CLI keep them.

Excluded slots are not recorded at all (no ``skipped`` rows): the slot maths
steps over the days a schedule's calendars keep out, so the beat, backfill
and reconcile's audit all see the same slots.
"""

from __future__ import annotations

import io
import json
from datetime import date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
import time_machine
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from project.celery import app
from scheduler import dbclock
from scheduler.models import AuditEvent, Calendar, Execution
from scheduler.ops import audit, operations
from scheduler.ops.backfill import backfill
from scheduler.ops.reconcile import reconcile
from scheduler.owners import calendars as calendar_owner
from scheduler.tenancy import EVERY_TENANT, Scope
from tests.integration.api_support import TENANT_A, TENANT_B, make_schedule, token_client

pytestmark = pytest.mark.django_db(transaction=True)

NEW_YORK = ZoneInfo("America/New_York")


@pytest.fixture(autouse=True)
def _fresh_calendars() -> None:
    calendar_owner.forget()


def keep(name: str, rules: list[dict[str, Any]], *, tenant: str = "") -> Calendar:
    row = Calendar(name=name, tenant=tenant, rules=rules)
    scope = Scope(tenant=tenant) if tenant else EVERY_TENANT
    operations.save_calendar(row, actor=audit.CLI, scope=scope)
    return row


def business_days() -> None:
    keep("weekend", [{"weekdays": ["sat", "sun"]}])
    keep("us-holidays", [{"holidays": {"country": "US"}}])
    keep("business-days", [{"cron": "* * * * *"}, {"except": "weekend"}, {"except": "us-holidays"}])


def local_days(rows: Any) -> list[date]:
    return [row.scheduled_for.astimezone(NEW_YORK).date() for row in rows]


def test_backfill__an_hourly_schedule_excluding_a_holiday_on_a_dst_change_records_nothing_that_day(
    redis_client: redis.Redis,
) -> None:
    # Given an hourly schedule in New York excluding a company holiday on 2026-11-01, the day clocks go back
    keep("company-holidays", [{"dates": ["2026-11-01"]}])
    hourly = make_schedule(
        "hourly", cron="0 * * * *", timezone="America/New_York", exclude_calendars="company-holidays"
    )

    # When the three days around it are backfilled
    start = datetime(2026, 10, 31, tzinfo=NEW_YORK)
    end = datetime(2026, 11, 3, tzinfo=NEW_YORK) - timedelta(seconds=1)
    report = backfill(hourly, start=start, end=end, now=dbclock.now(), app=app)

    # Then every hour of the day before and the day after is recorded, and nothing on the holiday
    days = local_days(Execution.objects.filter(schedule=hourly))
    assert report.created == 48
    assert days.count(date(2026, 10, 31)) == 24 and days.count(date(2026, 11, 2)) == 24
    assert date(2026, 11, 1) not in days


def test_backfill__a_business_days_schedule_over_a_month_yields_exactly_its_business_days(
    redis_client: redis.Redis,
) -> None:
    # Given a 09:00 New York schedule that runs only on business days (no weekends, no US holidays)
    business_days()
    daily = make_schedule("daily", cron="0 9 * * *", timezone="America/New_York", only_calendar="business-days")

    # When October 2026 is backfilled
    start = datetime(2026, 10, 1, tzinfo=NEW_YORK)
    report = backfill(daily, start=start, end=datetime(2026, 11, 1, tzinfo=NEW_YORK), now=dbclock.now(), app=app)

    # Then its 22 weekdays are recorded, less Columbus Day (Monday 12)
    month = [start.date() + timedelta(days=n) for n in range(31)]
    expected = [day for day in month if day.weekday() < 5 and day != date(2026, 10, 12)]
    assert report.created == len(expected) == 21
    assert local_days(Execution.objects.filter(schedule=daily).order_by("scheduled_for")) == expected


def test_preview__the_admin_and_the_api_strike_the_excluded_slots_naming_their_calendar() -> None:
    # Given a daily schedule that excludes weekends
    keep("weekend", [{"weekdays": ["sat", "sun"]}])
    daily = make_schedule("daily", cron="0 9 * * *", exclude_calendars="weekend")
    from django.contrib.auth import get_user_model

    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", password="pw"))

    # When its page is read on a Wednesday afternoon (its five slots then hold the weekend) and its next fire times
    with time_machine.travel(datetime(2026, 11, 25, 12, tzinfo=ZoneInfo("UTC")), tick=False):
        page = admin.get(f"/admin/scheduler/schedule/{daily.pk}/change/").content.decode()
    answer = token_client("ops", role="operator").get(f"/api/v1/schedules/{daily.pk}/next/?n=7").json()

    # Then the page strikes through the two weekend slots and the API's week names the calendar on each
    assert page.count("excluded by calendar weekend") == 2 and page.count("<del>") == 2
    assert len(answer["times"]) == 7
    assert {entry["calendar"] for entry in answer["excluded"]} == {"weekend"}
    excluded_days = {datetime.fromisoformat(entry["utc"]).weekday() for entry in answer["excluded"]}
    assert excluded_days == {5, 6}


def test_editing_a_calendar_moves_the_next_slot_of_the_schedules_that_name_it() -> None:
    # Given a daily schedule excluding a calendar that holds no day yet
    quiet = keep("quiet", [{"dates": ["2000-01-01"]}])
    daily = make_schedule("daily", cron="0 9 * * *", exclude_calendars="quiet")
    due = daily.next_run_at
    assert due is not None

    # When the calendar comes to hold that day
    quiet.rules = [{"dates": [due.date().isoformat()]}]
    operations.save_calendar(quiet, actor=audit.CLI, scope=EVERY_TENANT)

    # Then the schedule's next slot is the next day's
    daily.refresh_from_db()
    assert daily.next_run_at == due + timedelta(days=1)


def test_api__tenants_keep_their_own_calendars_and_bad_input_changes_nothing() -> None:
    keep("weekend", [{"weekdays": ["sat", "sun"]}])
    keep("b-only", [{"yearly": ["07-04"]}], tenant=TENANT_B)
    a = token_client("a-ops", role="operator", tenant=TENANT_A)

    # A tenant's operator sees its own and every tenant's calendars, not another tenant's
    created = a.post(
        "/api/v1/calendars/",
        {"name": "closures", "rules": [{"dates": ["2026-12-24"]}]},
        content_type="application/json",
    )
    assert created.status_code == 201, created.json()
    assert created.json()["tenant"] == TENANT_A
    names = {row["name"] for row in a.get("/api/v1/calendars/").json()}
    assert names == {"weekend", "closures"}
    # Bad rules: a 400 naming the rule, and nothing written
    bad = a.post(
        "/api/v1/calendars/", {"name": "bad", "rules": [{"weekdays": ["funday"]}]}, content_type="application/json"
    )
    assert bad.status_code == 400 and "Rule 1 (weekdays)" in json.dumps(bad.json())
    loop = a.post("/api/v1/calendars/", {"name": "loop", "rules": [{"union": "loop"}]}, content_type="application/json")
    assert loop.status_code == 400 and "includes itself" in json.dumps(loop.json())
    assert not Calendar.objects.filter(name__in=["bad", "loop"]).exists()
    # Every tenant's calendar is not theirs to delete
    weekend = Calendar.objects.get(name="weekend")
    assert a.delete(f"/api/v1/calendars/{weekend.pk}/").status_code == 403
    # A schedule naming a calendar its tenant does not have is refused
    make_schedule("nightly", tenant=TENANT_A, cron="0 2 * * *")
    schedule = a.get("/api/v1/schedules/").json()["results"][0]
    refused = a.patch(
        f"/api/v1/schedules/{schedule['id']}/", {"exclude_calendars": "b-only"}, content_type="application/json"
    )
    assert refused.status_code == 400 and "No calendar 'b-only'" in json.dumps(refused.json())
    # One it has is taken, and the calendar may then not be deleted
    taken = a.patch(
        f"/api/v1/schedules/{schedule['id']}/",
        {"exclude_calendars": "closures; weekend"},
        content_type="application/json",
    )
    assert taken.status_code == 200, taken.json()
    closures = Calendar.objects.get(name="closures")
    in_use = a.delete(f"/api/v1/calendars/{closures.pk}/")
    assert in_use.status_code == 400 and "nightly" in json.dumps(in_use.json())
    assert AuditEvent.objects.filter(object_type="scheduler.calendar", action="create").count() == 3


def test_cli__set_show_list_and_delete_and_a_bad_rule_is_one_line() -> None:
    out = io.StringIO()
    call_command("calendars", "set", "weekend", "--rules", '[{"weekdays": ["sat", "sun"]}]', stdout=out)
    call_command("calendars", "show", "weekend", "--days", "4", "--json", stdout=(shown := io.StringIO()))
    days = [date.fromisoformat(day) for day in json.loads(shown.getvalue())["next_days"]]
    assert len(days) == 4 and all(day.weekday() >= 5 for day in days)
    call_command("calendars", "list", stdout=(listing := io.StringIO()))
    assert "weekend" in listing.getvalue()
    with pytest.raises(CommandError, match=r"Rule 1 \(holidays\): no country 'XX'"):
        call_command("calendars", "set", "bad", "--rules", '[{"holidays": {"country": "XX"}}]')
    with pytest.raises(CommandError, match="--rules is not valid JSON"):
        call_command("calendars", "set", "bad", "--rules", "[{")
    call_command("calendars", "delete", "weekend", stdout=out)
    assert not Calendar.objects.exists()


def test_admin__an_operator_adds_a_calendar_and_bad_rules_are_a_form_error_that_changes_nothing() -> None:
    from django.contrib.auth import get_user_model

    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", password="pw"))
    bad = admin.post("/admin/scheduler/calendar/add/", {"name": "x", "tenant": "", "rules": '[{"yearly": ["02-30"]}]'})
    assert (
        bad.status_code == 200 and "Rule 1 (yearly): &#x27;02-30&#x27; is not a month and day" in bad.content.decode()
    )
    assert not Calendar.objects.exists()
    admin.post("/admin/scheduler/calendar/add/", {"name": "x", "tenant": "", "rules": '[{"yearly": ["12-25"]}]'})
    assert Calendar.objects.get().rules == [{"yearly": ["12-25"]}]
    assert AuditEvent.objects.filter(object_type="scheduler.calendar", action="create").count() == 1


def test_reconcile_audit__obeys_calendars_a_slot_on_a_day_kept_out_is_not_missing(redis_client: redis.Redis) -> None:
    # Given two minutely schedules created an hour ago, none of whose slots ran, one excluding today (and yesterday)
    now = dbclock.now()
    days = [(now - timedelta(days=1)).date().isoformat(), now.date().isoformat()]
    keep("these-days", [{"dates": days}])
    hour_ago, last = now - timedelta(hours=1), now.replace(second=0, microsecond=0)
    plain = make_schedule("plain", cron="* * * * *", catchup_window=180)
    kept_out = make_schedule("kept-out", cron="* * * * *", catchup_window=180, exclude_calendars="these-days")
    for schedule in (plain, kept_out):
        type(schedule).objects.filter(pk=schedule.pk).update(
            created_at=hour_ago, owed_since=hour_ago, next_run_at=last + timedelta(minutes=1)
        )

    # When reconcile audits them, repairing
    report = reconcile(now=now, repair=True, app=app)

    # Then the plain one's missing slots are recorded, and the other has none missing
    recorded = {change.schedule_id for change in report.changes if change.kind == "slot_recorded"}
    assert plain.pk in recorded and kept_out.pk not in recorded
    assert not Execution.objects.filter(schedule=kept_out).exists()
