"""Admin pages, filters and actions through Django's test client."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.owners import leases
from tests.support.admin_forms import page_form
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db

Status = Execution.Status


@pytest.fixture
def made() -> dict[str, Schedule]:
    made = {
        "cron": make_schedule("nightly", cron="30 2 * * *", timezone="Europe/Berlin", queue="q1"),
        "interval": make_schedule("often", task="scheduler.sleep", interval=5, tenant="acme"),
        "paused": make_schedule("held", paused_reason="maintenance"),
        "off": make_schedule("off", enabled=False),
    }
    Schedule.objects.filter(pk=made["interval"].pk).update(last_status=Status.FAILED, last_run_at=dbclock.now())
    return made


def names(response: object) -> list[str]:
    return sorted(schedule.name for schedule in response.context["cl"].result_list)  # type: ignore[attr-defined]


def test_schedule_list__columns(staff: Client, made: dict[str, Schedule]) -> None:
    response = staff.get("/admin/scheduler/schedule/?queue=q1")
    page = response.content.decode()
    assert 'name="queue" value="q1"' in page  # the text-box filter keeps its value
    response = staff.get("/admin/scheduler/schedule/")
    page = response.content.decode()
    assert response.status_code == 200
    assert "At 02:30 (Europe/Berlin)" in page
    assert "every 5 seconds" in page
    assert (
        '<i aria-hidden="true"></i>active' in page
        and '<i aria-hidden="true"></i>paused' in page
        and '<i aria-hidden="true"></i>disabled' in page
    )
    assert ">failed<" in page
    assert "in " in page  # relative next run


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=active", ["nightly", "often"]),
        ("state=paused", ["held"]),
        ("state=disabled", ["off"]),
        ("last_status=failed", ["often"]),
        ("enabled__exact=0", ["off"]),
        ("queue=q1", ["nightly"]),
        ("tenant=acme", ["often"]),
        ("task=scheduler.sleep", ["often"]),
        ("q=nightly", ["nightly"]),
        ("q=scheduler.echo", ["held", "nightly", "off"]),
        ("q=nigh", []),  # exact match only: a substring search would scan every row
    ],
)
def test_schedule_list__filters_and_search(
    staff: Client, made: dict[str, Schedule], query: str, expected: list[str]
) -> None:
    response = staff.get(f"/admin/scheduler/schedule/?{query}")
    assert response.status_code == 200
    assert names(response) == expected


def test_schedule_change__next_fire_times_and_last_executions(staff: Client, made: dict[str, Schedule]) -> None:
    schedule = made["interval"]
    for n in range(25):
        make_execution(
            f"k{n}",
            schedule=schedule,
            task=schedule.task,
            status=Status.SUCCEEDED,
            scheduled_for=dbclock.now() - timedelta(minutes=n),
            error="boom" if n == 0 else "",
        )
    page = staff.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()
    assert page.count("UTC)</span></li>") == 5
    assert page.count("/admin/scheduler/execution/") >= 20
    assert page.count(">succeeded<") == 20
    assert "boom" in page


@pytest.mark.parametrize(
    ("action", "check"),
    [
        ("disable", lambda s: not s.enabled and s.next_run_at is None),
        ("pause", lambda s: s.paused_reason.startswith("Paused by root") and s.next_run_at is None),
    ],
)
def test_schedule_actions__disable_and_pause(
    staff: Client, made: dict[str, Schedule], action: str, check: object
) -> None:
    target = made["cron"]
    response = staff.post(
        "/admin/scheduler/schedule/", {"action": action, "_selected_action": [target.pk]}, follow=True
    )
    assert response.status_code == 200
    target.refresh_from_db()
    assert check(target)  # type: ignore[operator]
    assert "1 schedule" in response.content.decode()


def test_schedule_actions__enable_and_resume(staff: Client, made: dict[str, Schedule]) -> None:
    off, held = made["off"], made["paused"]
    staff.post("/admin/scheduler/schedule/", {"action": "enable", "_selected_action": [off.pk]})
    staff.post("/admin/scheduler/schedule/", {"action": "resume", "_selected_action": [held.pk]})
    off.refresh_from_db()
    held.refresh_from_db()
    assert off.enabled and off.next_run_at is not None
    assert held.paused_reason == "" and held.next_run_at is not None


@pytest.fixture
def executions(made: dict[str, Schedule]) -> list[Execution]:
    now = dbclock.now()
    return [
        make_execution(
            "ok",
            schedule=made["interval"],
            task="scheduler.sleep",
            status=Status.SUCCEEDED,
            scheduled_for=now,
            started_at=now,
            finished_at=now + timedelta(seconds=2),
            celery_task_id="t-ok",
        ),
        make_execution(
            "bad",
            task="scheduler.echo",
            status=Status.FAILED,
            scheduled_for=now - timedelta(days=3),
            error="RuntimeError: boom",
            traceback="Traceback (most recent call last):\n  <line>\nRuntimeError: boom",
        ),
    ]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", ["bad", "ok"]),
        ("status__exact=failed", ["bad"]),
        ("schedule__id__exact={schedule}", ["ok"]),
        ("scheduled_for__gte={today}T00:00:00%2B00:00", ["ok"]),
        ("q=bad", ["bad"]),
        ("q=t-ok", ["ok"]),
    ],
)
def test_execution_list__filters(
    staff: Client, executions: list[Execution], made: dict[str, Schedule], query: str, expected: list[str]
) -> None:
    today = dbclock.now().date().isoformat()
    response = staff.get("/admin/scheduler/execution/?" + query.format(schedule=made["interval"].pk, today=today))
    assert response.status_code == 200
    assert sorted(e.idempotency_key for e in response.context["cl"].result_list) == expected
    assert "2.00s" in response.content.decode() or "ok" not in expected


def test_execution_change__read_only_with_preformatted_traceback(staff: Client, executions: list[Execution]) -> None:
    failed = executions[1]
    response = staff.get(f"/admin/scheduler/execution/{failed.pk}/change/")
    page = response.content.decode()
    assert response.status_code == 200
    assert "<pre" in page and "RuntimeError: boom" in page
    assert 'name="_save"' not in page
    assert staff.post(f"/admin/scheduler/execution/{failed.pk}/change/", {}).status_code == 403


def test_execution_change__links_to_the_task_result(staff: Client, executions: list[Execution]) -> None:
    from django_celery_results.models import TaskResult

    TaskResult.objects.create(task_id="t-ok", status="SUCCESS")
    page = staff.get(f"/admin/scheduler/execution/{executions[0].pk}/change/").content.decode()
    assert "/admin/django_celery_results/taskresult/" in page and "t-ok (SUCCESS)" in page


def test_cluster_page__leader_token_expiry_and_heartbeats(staff: Client) -> None:
    handle = leases.acquire("beat", "host-1-abc", ttl=10)
    assert handle is not None
    Instance.objects.create(
        instance_id="host-1-abc", role="beat", hostname="h", pid=1, started_at=Now(), last_seen=Now(), is_leader=True
    )
    Instance.objects.create(instance_id="w@h-2", role="worker", hostname="h", pid=2, started_at=Now(), last_seen=Now())
    page = staff.get("/admin/scheduler/lease/").content.decode()
    assert 'id="cluster-leader">host-1-abc<' in page
    assert f"<td>{handle.token}</td>" in page
    assert "w@h-2" in page and "leader-warning" not in page


def test_cluster_page__warns_when_no_leader_renewed_in_time(staff: Client) -> None:
    assert "No beat replica holds the lease" in staff.get("/admin/scheduler/lease/").content.decode()
    handle = leases.acquire("beat", "host-1-abc", ttl=60)
    assert handle is not None
    Lease.objects.filter(name="beat").update(renewed_at=dbclock.now() - timedelta(seconds=30))
    page = staff.get("/admin/scheduler/lease/").content.decode()
    assert 'id="leader-warning"' in page and "may be stuck" in page


def test_instance_list(staff: Client) -> None:
    Instance.objects.create(instance_id="w@h-2", role="worker", hostname="h", pid=2, started_at=Now(), last_seen=Now())
    response = staff.get("/admin/scheduler/instance/?role__exact=worker")
    assert response.status_code == 200 and "w@h-2" in response.content.decode()


@pytest.mark.django_db(transaction=True)
def test_schedule_action__run_now_sends_an_execution(staff: Client, made: dict[str, Schedule], redis_url: str) -> None:
    target = made["interval"]
    response = staff.post(
        "/admin/scheduler/schedule/", {"action": "run_now", "_selected_action": [target.pk]}, follow=True
    )
    assert "1 execution started." in response.content.decode()
    (execution,) = Execution.objects.filter(schedule=target)
    assert execution.status == Status.QUEUED and ":manual:" in execution.idempotency_key


@pytest.mark.django_db(transaction=True)
def test_execution_actions__retry_finished_and_cancel_running(
    staff: Client, executions: list[Execution], redis_url: str
) -> None:
    finished = executions[1]
    running = make_execution(
        "run",
        task="scheduler.echo",
        status=Status.RUNNING,
        scheduled_for=dbclock.now(),
        celery_task_id="t-run",
    )
    staff.post("/admin/scheduler/execution/", {"action": "retry", "_selected_action": [finished.pk]})
    response = staff.post(
        "/admin/scheduler/execution/", {"action": "cancel", "_selected_action": [running.pk, finished.pk]}, follow=True
    )
    page = response.content.decode()
    retry = Execution.objects.get(retry_of=finished)
    assert retry.status == Status.QUEUED
    running.refresh_from_db()
    assert running.status == Status.CANCELLED and running.error == "Cancelled by an operator"
    assert "1 execution cancelled." in page and "only pending, queued, running or retrying" in page


@pytest.mark.django_db(transaction=True)
def test_backfill_form__preview_then_confirm(staff: Client, redis_url: str) -> None:
    schedule = make_schedule("hourly", interval=3600)
    url = f"/admin/scheduler/schedule/{schedule.pk}/backfill/"
    now = dbclock.now()
    start = (now - timedelta(hours=5, minutes=1)).strftime("%Y-%m-%d %H:%M:%S")  # 5 h long: 5 hourly slots
    end = (now - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    assert "Backfill a range" in staff.get(f"/admin/scheduler/schedule/{schedule.pk}/change/").content.decode()
    # Preview: a count, nothing written
    preview = staff.post(url, {"start": start, "end": end, "preview": "1"})
    assert preview.status_code == 200 and 'id="backfill-new-count">5<' in preview.content.decode()
    assert not Execution.objects.exists()
    # Confirm: recorded and sent
    done = staff.post(url, {"start": start, "end": end, "confirm": "1"}, follow=True)
    assert "5 execution(s) recorded" in done.content.decode()
    assert Execution.objects.filter(schedule=schedule).count() == 5


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        ("2026-01-02 00:00:00", "2026-01-01 00:00:00", "end"),
        ("2026-01-01 00:00:00", "2999-01-01 00:00:00", "future"),
        ("yesterday", "2026-01-01 00:00:00", "Enter a valid date/time"),
    ],
)
def test_backfill_form__bad_range_shows_the_error_and_writes_nothing(
    staff: Client, start: str, end: str, message: str
) -> None:
    schedule = make_schedule("hourly", interval=3600)
    response = staff.post(
        f"/admin/scheduler/schedule/{schedule.pk}/backfill/", {"start": start, "end": end, "confirm": "1"}
    )
    assert response.status_code == 200
    assert message in response.content.decode()
    assert 'class="errorlist' in response.content.decode()
    assert not Execution.objects.exists()


def _add_pages() -> list[str]:
    from django.contrib import admin

    # This app's pages (django-celery-beat's, installed in tests for the import, are not ours).
    return [
        f"/admin/scheduler/{model._meta.model_name}/add/"
        for model in admin.site._registry
        if model._meta.app_label == "scheduler"
    ]


@pytest.mark.parametrize("page", _add_pages())
def test_add_page__any_field_given_in_its_link_answers_without_a_500(staff: Client, page: str) -> None:
    # Given an add page (Django fills its form from its link's query: ?start_at=..., as bookmarks and other pages do)
    form = staff.get(page)
    if form.status_code != 200:
        return  # a page that adds nothing (a read-only list): 403
    fields = list(form.context["adminform"].form.fields)
    assert fields

    # When each of its fields is given text no field takes, a time, or a date that does not exist
    answers = {
        (field, value): staff.get(page, {field: value}).status_code
        for field in fields
        for value in ("2026-01-01 00:00:00", "99999-99-99", "\x00")
    }

    # Then each page answers
    assert {key: code for key, code in answers.items() if code != 200} == {}


def test_a_page_opened_before_runs_were_counted__saves_without_undoing_them(staff: Client) -> None:
    # Given an operator with a schedule's page open
    schedule = make_schedule("counted", interval=60)
    page = f"/admin/scheduler/schedule/{schedule.pk}/change/"
    opened = page_form(staff.get(page).content.decode())

    # When the workers count runs, and pause it after failures, meanwhile, and the operator changes its queue
    Schedule.objects.filter(pk=schedule.pk).update(total_runs=7, paused_reason="Paused after 3 consecutive failures")
    assert staff.post(page, {**opened, "queue": "slow"}).status_code == 302

    # Then the queue changed and what the workers wrote stands
    schedule.refresh_from_db()
    assert (schedule.queue, schedule.total_runs) == ("slow", 7)
    assert schedule.paused_reason == "Paused after 3 consecutive failures"


def test_run_it_now_on_a_one_offs_page__sets_its_time_to_now(staff: Client) -> None:
    # Given a one-off three days ahead, and its page
    schedule = make_schedule("once", interval=None, run_at=dbclock.now() + timedelta(days=3))
    page = f"/admin/scheduler/schedule/{schedule.pk}/change/"
    opened = page_form(staff.get(page).content.decode())

    # When its operator ticks "Run it now" and saves
    before = dbclock.now()
    assert staff.post(page, {**opened, "run_at_now": "on"}).status_code == 302

    # Then it is due now
    schedule.refresh_from_db()
    assert schedule.run_at is not None and before <= schedule.run_at <= dbclock.now()
