"""The per-schedule dead man's switch: deadlines on save and success, and where overdue schedules show."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime, timedelta, timezone

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, schedules
from tests.integration.api_support import token_client
from tests.support.factories import make_schedule, succeed

pytestmark = pytest.mark.django_db

UTC = timezone.utc
T0 = datetime(2026, 3, 2, 12, 0, 30, tzinfo=UTC)
FIRST_SLOT = datetime(2026, 3, 2, 12, 1, tzinfo=UTC)  # an every-60-s schedule started at T0


def make(name: str, *, now: datetime = T0, **fields: object) -> Schedule:
    """A schedule of ``tests.record`` every 60 s unless ``fields`` say otherwise, saved at ``now`` (T0 by default)."""
    fields.setdefault("task", "tests.record")
    return make_schedule(name, now=now, **fields)


def test_save__deadline_is_two_intervals_after_the_first_slot() -> None:
    # Given a new schedule every 60 s, saved at T0
    schedule = make("s")
    # Then its cadence is 2 intervals, counted from its first slot
    assert schedule.cadence == 120
    assert schedule.overdue_at == FIRST_SLOT + timedelta(seconds=120)


def test_save__alert_after_overrides_the_cadence_and_an_edit_moves_the_deadline() -> None:
    schedule = make("s", alert_after=30)
    assert schedule.overdue_at == FIRST_SLOT + timedelta(seconds=30)
    # When the window is changed
    schedule.alert_after = 600
    schedules.save(schedule, now=T0 + timedelta(minutes=5))
    # Then the deadline follows (same first slot: the timing did not change)
    schedule.refresh_from_db()
    assert schedule.overdue_at == FIRST_SLOT + timedelta(seconds=600)
    # When it is removed, the cadence applies again
    schedule.alert_after = None
    schedules.save(schedule, now=T0 + timedelta(minutes=5))
    schedule.refresh_from_db()
    assert schedule.overdue_at == FIRST_SLOT + timedelta(seconds=120)


def test_save__one_off_has_no_cadence_and_is_never_overdue() -> None:
    schedule = make("once", interval=None, run_at=T0 + timedelta(hours=1))
    assert (schedule.cadence, schedule.overdue_at) == (None, None)


def test_resume__gives_a_full_window_from_the_next_slot() -> None:
    # Given a schedule paused for a day
    schedule = make("s")
    schedules.pause(schedule, "maintenance", now=T0 + timedelta(minutes=1))
    # When it is resumed a day later
    resumed_at = T0 + timedelta(days=1)
    schedules.resume(schedule, now=resumed_at)
    # Then it has 2 intervals from its first slot after resuming
    schedule.refresh_from_db()
    assert schedule.overdue_at == FIRST_SLOT + timedelta(days=1) + timedelta(seconds=120)


def test_success__moves_the_deadline_one_window_past_the_success() -> None:
    # Given a schedule long overdue (created an hour ago, never succeeded)
    schedule = make("s", now=dbclock.now() - timedelta(hours=1))
    assert Schedule.objects.overdue(now=dbclock.now()).filter(pk=schedule.pk).exists()
    # When a run succeeds
    succeed(schedule, "a")
    # Then its last success is stamped and the deadline is 2 intervals later; it is no longer overdue
    schedule.refresh_from_db()
    assert schedule.last_success_at is not None
    assert schedule.overdue_at == schedule.last_success_at + timedelta(seconds=120)
    assert not Schedule.objects.overdue(now=dbclock.now()).exists()


def test_failure__leaves_the_deadline_where_the_last_success_put_it() -> None:
    schedule = make("s", now=dbclock.now())
    succeed(schedule, "a")
    schedule.refresh_from_db()
    deadline = schedule.overdue_at
    execution, _ = executions.record_one(
        Execution(
            idempotency_key="b",
            task=schedule.task,
            schedule=schedule,
            scheduled_for=dbclock.now(),
            celery_task_id="b",
        )
    )
    claimed = executions.claim(worker="w:1", task=schedule.task, celery_task_id="b", execution_id=execution.pk)
    assert claimed is not None
    assert executions.finish(executions.Claim.of(claimed), status=Execution.Status.FAILED, error="boom")
    schedule.refresh_from_db()
    assert schedule.overdue_at == deadline and schedule.last_status == "failed"


@pytest.fixture
def late() -> dict[str, Schedule]:
    """One overdue schedule, the same overdue but paused or disabled, and one on time."""
    an_hour_ago = dbclock.now() - timedelta(hours=1)
    made = {
        "late": make("late", now=an_hour_ago),
        "paused": make("paused-late", now=an_hour_ago),
        "off": make("off-late", now=an_hour_ago),
        "fine": make("fine", now=dbclock.now()),
    }
    schedules.pause(made["paused"], "maintenance", now=an_hour_ago)
    made["off"].enabled = False
    schedules.save(made["off"], now=an_hour_ago)
    return made


def test_overdue__shows_in_admin_cli_metrics_and_probe_and_never_when_paused_or_disabled(
    late: dict[str, Schedule],
) -> None:
    staff = Client()
    staff.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))

    # Admin: the filter lists only the late one, and the list shows its badge
    filtered = staff.get("/admin/scheduler/schedule/?overdue=yes").content.decode()
    assert (
        ">late<" in filtered
        and "paused-late" not in filtered
        and "off-late" not in filtered
        and ">fine<" not in filtered
    )
    listing = staff.get("/admin/scheduler/schedule/").content.decode()
    assert listing.count('class="overdue"') == 1

    # CLI: --overdue lists it; the plain list flags it
    out = io.StringIO()
    call_command("schedules", "list", "--overdue", "--json", stdout=out)
    assert [row["name"] for row in json.loads(out.getvalue())] == ["late"]
    out = io.StringIO()
    call_command("schedules", "list", stdout=out)
    flagged = [line.split()[0] for line in out.getvalue().splitlines()[1:] if line.rstrip().endswith("OVERDUE")]
    assert flagged == ["late"]

    # API: the filter lists only the late one, and each schedule says whether it is overdue
    api = token_client("viewer", role="viewer")
    assert [row["name"] for row in api.get("/api/v1/schedules/?overdue=true").json()["results"]] == ["late"]
    flags = {row["name"]: row["overdue"] for row in api.get("/api/v1/schedules/").json()["results"]}
    assert flags == {"late": True, "paused-late": False, "off-late": False, "fine": False}

    # /metrics: one overdue
    metrics = Client().get("/metrics").content.decode()
    assert re.search(r"^scheduler_schedules_overdue 1\.0$", metrics, re.MULTILINE)

    # /healthz/schedules: 503 naming it; /readyz does not look
    response = Client().get("/healthz/schedules")
    assert response.status_code == 503
    assert (response.json()["overdue"], response.json()["failed"]) == (["late"], ["schedules"])

    # When it succeeds again, Then nothing is overdue anywhere
    succeed(late["late"], "recovered")
    assert staff.get("/admin/scheduler/schedule/").content.decode().count('class="overdue"') == 0
    response = Client().get("/healthz/schedules")
    assert (response.status_code, response.json()["overdue"]) == (200, [])
    assert api.get("/api/v1/schedules/?overdue=true").json()["results"] == []
    metrics = Client().get("/metrics").content.decode()
    assert re.search(r"^scheduler_schedules_overdue 0\.0$", metrics, re.MULTILINE)
    assert 'scheduler_schedule_last_success_timestamp_seconds{schedule="late",tenant=""}' in metrics


def test_last_success_series__switched_off_above_the_limit(settings: object, late: dict[str, Schedule]) -> None:
    succeed(late["fine"], "a")
    series = 'scheduler_schedule_last_success_timestamp_seconds{schedule="fine",tenant=""}'
    assert series in Client().get("/metrics").content.decode()
    # When there are more schedules than the limit
    settings.SCHEDULER_METRICS_PER_SCHEDULE_LIMIT = 3  # type: ignore[attr-defined]
    # Then no per-schedule series is exposed (the overdue count still is)
    text = Client().get("/metrics").content.decode()
    assert "scheduler_schedule_last_success_timestamp_seconds{" not in text
    assert "scheduler_schedules_overdue " in text


def test_overdue_count__stops_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given three overdue schedules and a cap of two
    from scheduler.web import metrics

    for name in ("a", "b", "c"):
        make(name, now=dbclock.now() - timedelta(hours=1))
    monkeypatch.setattr(metrics, "COUNT_CAP", 2)
    # Then the scrape counts two: a bounded scan, whatever the backlog
    text = Client().get("/metrics").content.decode()
    assert re.search(r"^scheduler_schedules_overdue 2\.0$", text, re.MULTILINE)
