"""The admin's buttons on a schedule's and an execution's page, its times, columns, trigger filter and search."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.integration.api_support import bind
from tests.support.admin_forms import schedule_form
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db

Status = Execution.Status
Trigger = Execution.Trigger


def _client(*, superuser: bool = False, group: str = "") -> Client:
    users = get_user_model().objects
    if superuser:
        user = users.create_superuser("root", "root@example.invalid", "pw")
    else:
        user = bind(users.create_user(group.replace(" ", "-"), password="pw", is_staff=True))
        user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def staff() -> Client:
    return _client(superuser=True)


@pytest.fixture
def schedule() -> Schedule:
    return make_schedule("often", interval=5)


def _act(client: Client, schedule: Schedule, action: str, **data: str) -> object:
    return client.post(f"/admin/scheduler/schedule/{schedule.pk}/act/{action}/", data, follow=True)


# --- schedule page buttons -------------------------------------------------------------


def press_the_only_button(client: Client, execution: Execution, action: str, *, not_offered: str) -> object:
    """Open ``execution``'s change page, check it offers ``action`` and not ``not_offered``, and press ``action``."""
    page = client.get(f"/admin/scheduler/execution/{execution.pk}/change/").content.decode()
    assert f'id="action-{action}"' in page and f'id="action-{not_offered}"' not in page
    return client.post(f"/admin/scheduler/execution/{execution.pk}/act/{action}/", follow=True)


def test_schedule_page__shows_its_buttons_and_a_backfill_link(staff: Client, schedule: Schedule) -> None:
    # When
    page = staff.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()
    # Then every button is a POST form with a CSRF token
    for action in ("run_now", "pause", "disable"):
        form = re.search(
            rf'<form method="post" action="[^"]+/act/{action}/" id="action-{action}">(.*?)</form>', page, re.S
        )
        assert form and "csrfmiddlewaretoken" in form.group(1), action
    assert 'name="reason"' in page
    assert 'id="action-resume"' not in page and 'id="action-enable"' not in page
    assert f'href="/admin/scheduler/schedule/{schedule.pk}/backfill/" id="action-backfill"' in page


def test_pause_button__with_a_reason_then_resume(staff: Client, schedule: Schedule) -> None:
    # When paused with a reason
    response = _act(staff, schedule, "pause", reason="vendor outage")
    # Then
    schedule.refresh_from_db()
    assert (schedule.paused_reason, schedule.next_run_at) == ("vendor outage", None)
    page = response.content.decode()
    assert "Schedule often paused: vendor outage" in page and 'id="action-resume"' in page
    # When resumed
    response = _act(staff, schedule, "resume")
    schedule.refresh_from_db()
    assert schedule.paused_reason == "" and schedule.next_run_at is not None
    assert "Schedule often resumed" in response.content.decode()


def test_pause_button__without_a_reason_names_the_user(staff: Client, schedule: Schedule) -> None:
    _act(staff, schedule, "pause")
    schedule.refresh_from_db()
    assert schedule.paused_reason == "Paused by root in the admin"


def test_disable_then_enable_buttons(staff: Client, schedule: Schedule) -> None:
    response = _act(staff, schedule, "disable")
    schedule.refresh_from_db()
    assert not schedule.enabled and "Schedule often disabled." in response.content.decode()
    assert 'id="action-enable"' in response.content.decode()
    _act(staff, schedule, "enable")
    schedule.refresh_from_db()
    assert schedule.enabled and schedule.next_run_at is not None


@pytest.mark.django_db(transaction=True)
def test_run_now_button__records_a_manual_execution_and_sends_it(
    staff: Client, schedule: Schedule, redis_url: str
) -> None:
    # When
    response = _act(staff, schedule, "run_now")
    # Then
    (execution,) = Execution.objects.filter(schedule=schedule)
    assert (execution.status, execution.trigger) == (Status.QUEUED, Trigger.MANUAL)
    assert execution.enqueued_at is not None
    assert (
        f'Execution <a href="/admin/scheduler/execution/{execution.pk}/change/">{execution.pk}</a> of often started.'
        in (response.content.decode())
    )


def test_buttons__a_get_changes_nothing(staff: Client, schedule: Schedule) -> None:
    assert staff.get(f"/admin/scheduler/schedule/{schedule.pk}/act/pause/").status_code == 405
    assert staff.post(f"/admin/scheduler/schedule/{schedule.pk}/act/explode/").status_code == 404
    schedule.refresh_from_db()
    assert schedule.paused_reason == ""


@pytest.mark.parametrize("action", ["run_now", "pause", "resume", "enable", "disable"])
def test_buttons__a_viewer_gets_403_and_sees_none(schedule: Schedule, action: str) -> None:
    # Given
    viewer = _client(group=VIEWER_GROUP)
    # When
    response = viewer.post(f"/admin/scheduler/schedule/{schedule.pk}/act/{action}/", {"reason": "x"})
    # Then
    assert response.status_code == 403
    schedule.refresh_from_db()
    assert (schedule.enabled, schedule.paused_reason) == (True, "")
    assert not Execution.objects.exists()
    assert 'id="object-actions"' not in viewer.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()


def test_buttons__an_operator_may_use_them(schedule: Schedule) -> None:
    operator = _client(group=OPERATOR_GROUP)
    assert 'id="action-pause"' in operator.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()
    assert _act(operator, schedule, "pause", reason="by the operator").status_code == 200
    schedule.refresh_from_db()
    assert schedule.paused_reason == "by the operator"


def test_buttons__need_the_csrf_token() -> None:
    # Given a client that enforces CSRF, as a browser session does
    schedule = make_schedule("s", interval=5)
    client = Client(enforce_csrf_checks=True)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    # When
    response = client.post(f"/admin/scheduler/schedule/{schedule.pk}/act/pause/", {"reason": "x"})
    # Then
    assert response.status_code == 403
    schedule.refresh_from_db()
    assert schedule.paused_reason == ""


# --- execution page buttons ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_retry_button__a_new_execution_linked_to_the_failed_one(staff: Client, redis_url: str) -> None:
    # Given
    failed = make_execution("bad", status=Status.FAILED, error="boom")
    # When
    response = press_the_only_button(staff, failed, "retry", not_offered="cancel")
    # Then it shows the new execution
    retry = Execution.objects.get(retry_of=failed)
    assert (retry.status, retry.trigger) == (Status.QUEUED, Trigger.RETRY)
    assert response.redirect_chain[-1][0] == f"/admin/scheduler/execution/{retry.pk}/change/"
    assert f"Execution {retry.pk} retries execution {failed.pk}." in response.content.decode()


@pytest.mark.django_db(transaction=True)
def test_cancel_button__cancels_a_running_execution(staff: Client, redis_url: str) -> None:
    running = make_execution("run", status=Status.RUNNING, celery_task_id="t-run")
    response = press_the_only_button(staff, running, "cancel", not_offered="retry")
    running.refresh_from_db()
    assert running.status == Status.CANCELLED
    assert f"Execution {running.pk} cancelled." in response.content.decode()


def test_cancel_button__a_finished_execution_is_refused_with_a_message(staff: Client) -> None:
    done = make_execution("done", status=Status.SUCCEEDED)
    response = staff.post(f"/admin/scheduler/execution/{done.pk}/act/cancel/", follow=True)
    assert "only pending, queued, running or retrying executions can be cancelled" in response.content.decode()
    done.refresh_from_db()
    assert done.status == Status.SUCCEEDED


@pytest.mark.parametrize("action", ["retry", "cancel"])
def test_execution_buttons__a_viewer_gets_403(action: str) -> None:
    viewer = _client(group=VIEWER_GROUP)
    failed = make_execution("bad", status=Status.FAILED)
    assert 'id="object-actions"' not in viewer.get(f"/admin/scheduler/execution/{failed.pk}/change/").content.decode()
    assert viewer.post(f"/admin/scheduler/execution/{failed.pk}/act/{action}/").status_code == 403
    assert Execution.objects.count() == 1


# --- times, columns, trigger, search ---------------------------------------------------------


def test_execution_list__seconds_zone_lag_queue_wait_and_trigger(staff: Client, schedule: Schedule) -> None:
    # Given an execution sent 1.5 s after its slot, claimed 0.25 s later, run for 2 s
    slot = dbclock.now().replace(microsecond=0) - timedelta(minutes=1)
    make_execution(
        "k",
        schedule=schedule,
        task="scheduler.echo",
        status=Status.SUCCEEDED,
        scheduled_for=slot,
        enqueued_at=slot + timedelta(seconds=1.5),
        started_at=slot + timedelta(seconds=1.75),
        finished_at=slot + timedelta(seconds=3.75),
        trigger=Trigger.MANUAL,
    )
    # When
    page = staff.get("/admin/scheduler/execution/").content.decode()
    # Then
    assert f"{slot:%Y-%m-%d %H:%M:%S} UTC" in page
    assert 'class="column-lag"' in page and 'class="column-queue_wait"' in page
    assert ">1.50s<" in page and ">0.25s<" in page and ">2.00s<" in page
    assert 'class="field-trigger">manual (run now)<' in page


def test_execution_change__times_with_seconds_and_every_attempt_error(staff: Client) -> None:
    finished = dbclock.now().replace(microsecond=0)
    failed = make_execution(
        "bad",
        status=Status.FAILED,
        attempt=2,
        error="second boom",
        finished_at=finished,
        attempt_errors=[{"attempt": 1, "error": "first boom", "at": "2026-03-01T12:00:00+00:00"}],
    )
    page = staff.get(f"/admin/scheduler/execution/{failed.pk}/change/").content.decode()
    assert f"{finished:%Y-%m-%d %H:%M:%S} UTC" in page
    assert re.search(r"<li value='1'>first boom.*<li value='2'>second boom", page, re.S)


def test_schedule_page__times_with_seconds_and_a_link_to_its_executions(staff: Client, schedule: Schedule) -> None:
    slot = dbclock.now().replace(microsecond=0)
    make_execution("k", schedule=schedule, task="scheduler.echo", scheduled_for=slot)
    Schedule.objects.filter(pk=schedule.pk).update(last_run_at=slot)
    page = staff.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()
    assert page.count(f"{slot:%Y-%m-%d %H:%M:%S} UTC") >= 2  # last run and the recent execution
    link = f'href="/admin/scheduler/execution/?schedule__id__exact={schedule.pk}" id="all-executions"'
    assert link in page
    listed = staff.get(f"/admin/scheduler/execution/?schedule__id__exact={schedule.pk}")
    assert [e.idempotency_key for e in listed.context["cl"].result_list] == ["k"]


@pytest.mark.parametrize("trigger", Trigger.values)
def test_execution_list__trigger_filter(staff: Client, trigger: str) -> None:
    for value in Trigger.values:
        make_execution(f"key-{value}", status=Status.SUCCEEDED, trigger=value)
    response = staff.get(f"/admin/scheduler/execution/?trigger__exact={trigger}")
    assert [e.idempotency_key for e in response.context["cl"].result_list] == [f"key-{trigger}"]


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("schedule:4:", ["schedule:4:2026-01-01T00:00:00+00:00", "schedule:4:manual:x"]),
        ("schedule:4:manual:", ["schedule:4:manual:x"]),
        ("schedule:4", sorted(["schedule:4:2026-01-01T00:00:00+00:00", "schedule:4:manual:x", "schedule:40:x"])),
        ("plain-key", ["plain-key"]),  # no colon: still the exact match only
        ("plain", []),
        ("t-1", ["plain-key"]),  # a Celery task id, exactly
    ],
)
def test_execution_search__key_prefix(staff: Client, term: str, expected: list[str]) -> None:
    for key in ("schedule:4:2026-01-01T00:00:00+00:00", "schedule:4:manual:x", "schedule:40:x", "retry:4:x"):
        make_execution(key, status=Status.SUCCEEDED)
    make_execution("plain-key", status=Status.SUCCEEDED, celery_task_id="t-1")
    response = staff.get("/admin/scheduler/execution/", {"q": term})
    assert sorted(e.idempotency_key for e in response.context["cl"].result_list) == expected


def test_execution_search__a_key_prefix_is_an_index_scan(staff: Client) -> None:
    # Given 200 schedules' worth of slots, with statistics
    now = dbclock.now()
    Execution.objects.bulk_create(
        Execution(
            idempotency_key=f"schedule:{n % 200}:{now - timedelta(minutes=n)}",
            task="scheduler.echo",
            status=Status.SUCCEEDED,
            scheduled_for=now - timedelta(minutes=n),
        )
        for n in range(20_000)
    )
    # When the admin searches a key prefix
    with CaptureQueriesContext(connection) as queries:
        response = staff.get("/admin/scheduler/execution/", {"q": "schedule:7:"})
    # Then it found that schedule's rows
    assert len(response.context["cl"].result_list) == 50
    assert all(e.idempotency_key.startswith("schedule:7:") for e in response.context["cl"].result_list)
    listing = next(q["sql"] for q in queries.captured_queries if "LIKE" in q["sql"] and "LIMIT" in q["sql"])
    if connection.vendor == "postgresql":
        # And PostgreSQL reads it through an index, not the whole table
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE scheduler_execution")
            cursor.execute(f"EXPLAIN {listing}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "Index" in plan and "Seq Scan on scheduler_execution" not in plan, plan
        # the key's varchar_pattern_ops index (Django adds it), or its unique index where the collation is C
        assert re.search(r"Index Cond: .*idempotency_key.*'schedule:7:'", plan), plan


# --- the schedule form -------------------------------------------------------------------


def _add(client: Client, **fields: str) -> str:
    data = schedule_form(interval="") | fields  # no timing unless a test gives one
    response = client.post("/admin/scheduler/schedule/add/", data)
    return response.content.decode() if response.status_code == 200 else f"saved ({response.status_code})"


def test_schedule_form__no_timing_is_one_message_without_internal_names(staff: Client) -> None:
    page = _add(staff)
    assert page.count("Set exactly one of cron, interval or run at.") == 1
    assert "schedule_exactly_one_timing" not in page and "Constraint" not in page
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("interval", ["-5", "0"])
def test_schedule_form__an_interval_below_1_is_one_consistent_message(staff: Client, interval: str) -> None:
    page = _add(staff, interval=interval)
    assert page.count("Ensure this value is greater than or equal to 1.") == 1
    assert "greater than or equal to 0" not in page
    assert "Set exactly one of" not in page and "Constraint" not in page
    assert not Schedule.objects.exists()


def test_schedule_form__add_page_hides_the_running_state(staff: Client) -> None:
    page = staff.get("/admin/scheduler/schedule/add/").content.decode()
    for field in ("last_run_at", "total_runs", "consecutive_failures", "recent_executions", "next_fire_times"):
        assert f"field-{field}" not in page, field
    assert 'name="enabled"' in page and 'name="paused_reason"' in page


def test_schedule_form__suggests_registered_task_names(staff: Client) -> None:
    page = staff.get("/admin/scheduler/schedule/add/").content.decode()
    assert 'list="task-suggestions"' in page
    suggestions = re.search(r'<datalist id="task-suggestions">(.*?)</datalist>', page, re.S)
    assert suggestions is not None
    names = re.findall(r'<option value="([^"]+)">', suggestions.group(1))
    assert "scheduler.echo" in names and "celery.backend_cleanup" in names
    assert not [name for name in names if name.startswith("celery.") and name != "celery.backend_cleanup"]
    # and still checks the name
    assert "Unknown task" in _add(staff, task="no.such.task", interval="5")


def test_schedule_form__a_one_off_in_the_past_is_refused(staff: Client) -> None:
    page = _add(staff, run_at_0="2020-01-01", run_at_1="00:00:00")
    assert "The one-off time 2020-01-01 00:00:00 UTC is in the past" in page
    assert "tick “Run it now”" in page
    assert not Schedule.objects.exists()


def test_schedule_form__run_it_now_sets_the_one_off_to_now(staff: Client) -> None:
    before = dbclock.now()
    assert _add(staff, run_at_0="2020-01-01", run_at_1="00:00:00", run_at_now="on") == "saved (302)"
    created = Schedule.objects.get()
    assert created.run_at is not None and created.run_at >= before - timedelta(seconds=1)
    assert created.next_run_at == created.run_at


def test_schedule_form__a_future_one_off_is_accepted(staff: Client) -> None:
    assert _add(staff, run_at_0="2999-01-01", run_at_1="00:00:00") == "saved (302)"


def test_schedule_list__state_icons_are_drawn_without_special_glyphs(staff: Client, schedule: Schedule) -> None:
    make_schedule("off", interval=5, enabled=False)
    make_schedule("held", interval=5, paused_reason="x")
    page = staff.get("/admin/scheduler/schedule/").content.decode()
    assert 'class="state state-disabled"' in page and 'class="state state-paused"' in page
    assert 'class="state state-active"' in page
    assert "⏹" not in page and "⏸" not in page
    assert "scheduler/admin.css" in page
