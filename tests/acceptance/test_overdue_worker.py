"""The dead man's switch end to end: a real beat and worker run a schedule whose task starts failing."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]


def overdue_names() -> set[str]:
    return set(Schedule.objects.overdue(now=dbclock.now()).values_list("name", flat=True))


def test_overdue__task_that_starts_failing_is_overdue_after_two_intervals(celery_processes: Start) -> None:
    # Given a schedule every 2 s that succeeds, and two that fail and would be long overdue, one paused, one disabled
    flips = make_schedule("flips", task="tests.record", interval=2)
    an_hour_ago = dbclock.now() - timedelta(hours=1)
    schedules.pause(
        make_schedule("paused-failing", task="tests.fail", interval=1, now=an_hour_ago), "maintenance", now=an_hour_ago
    )
    make_schedule("off-failing", task="tests.fail", interval=1, enabled=False, now=an_hour_ago)
    celery_processes("worker", "w1").wait_for_log(r"ready\.")
    celery_processes("beat", "beat1")
    assert wait_until(lambda: Schedule.objects.get(pk=flips.pk).last_success_at is not None, timeout=30)
    assert overdue_names() == set()

    # When its task starts failing
    Schedule.objects.filter(pk=flips.pk).update(task="tests.fail")
    assert wait_until(
        lambda: Execution.objects.filter(schedule=flips, status=Execution.Status.FAILED).exists(), timeout=30
    )
    seen: list[set[str]] = []

    def overdue_now() -> bool:
        seen.append(overdue_names())
        return "flips" in seen[-1]

    # Then it becomes overdue, 2 intervals after its last success, while it keeps running and failing
    assert wait_until(overdue_now, timeout=30)
    flips.refresh_from_db()
    assert flips.last_success_at is not None and flips.last_status == Execution.Status.FAILED
    assert flips.overdue_at == flips.last_success_at + timedelta(seconds=4)
    assert dbclock.now() >= flips.last_success_at + timedelta(seconds=4)
    # And the paused and disabled ones never were
    assert all(names <= {"flips"} for names in seen)

    # And it shows in the admin, the CLI and /metrics
    staff = Client()
    staff.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    page = staff.get("/admin/scheduler/schedule/?overdue=yes").content.decode()
    assert ">flips<" in page and 'class="overdue"' in page and "failing" not in page
    out = io.StringIO()
    call_command("schedules", "list", "--overdue", "--json", stdout=out)
    assert [row["name"] for row in json.loads(out.getvalue())] == ["flips"]
    metrics = Client().get("/metrics").content.decode()
    assert re.search(r"^scheduler_schedules_overdue 1\.0$", metrics, re.MULTILINE)
    stamp = re.search(
        r'^scheduler_schedule_last_success_timestamp_seconds\{schedule="flips",tenant=""\} (\S+)$', metrics, re.M
    )
    assert stamp and abs(float(stamp[1]) - flips.last_success_at.timestamp()) < 0.01
    failed = re.search(
        r'^scheduler_executions_total\{status="failed",task="tests.fail",trigger="scheduled"\} (\S+)$', metrics, re.M
    )
    assert failed and float(failed[1]) >= 1
