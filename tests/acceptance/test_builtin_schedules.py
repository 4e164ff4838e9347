"""The built-in housekeeping schedules under a real beat and worker: created, editable, and they work."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from django_celery_results.models import TaskResult

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.ops.builtin_schedules import BACKEND_CLEANUP, PRUNE_EXECUTIONS
from scheduler.owners import schedules
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
BUILTINS = (PRUNE_EXECUTIONS, BACKEND_CLEANUP)


def _old_history() -> None:
    """A (disabled) schedule with executions 40-44 days old and one from yesterday; an old ad-hoc one."""
    now = dbclock.now()
    schedule = schedules.create(name="history", task="scheduler.echo", interval=3600, enabled=False)
    for key, days, owner in [
        *((f"old-{n}", 40 + n, schedule) for n in range(5)),
        ("recent", 1, schedule),
        ("adhoc-old", 45, None),
    ]:
        Execution.objects.create(
            idempotency_key=key,
            schedule=owner,
            task="scheduler.echo",
            status=Status.SUCCEEDED,
            scheduled_for=now - timedelta(days=days),
            finished_at=now - timedelta(days=days),
        )


def _finished(name: str) -> list[str]:
    return list(
        Execution.objects.filter(schedule__name=name)
        .exclude(status__in=Execution.IN_FLIGHT_STATUSES)
        .values_list("status", flat=True)
    )


def test_builtins__created_by_the_beat_kept_across_restarts_and_they_clean_up(celery_processes: Start) -> None:
    # Given old executions, a task result a week old and a fresh one,
    # and a worker configured to keep the newest 2 executions of each schedule
    _old_history()
    for task_id in ("expired", "fresh"):
        TaskResult.objects.create(task_id=task_id, status="SUCCESS")
    TaskResult.objects.filter(task_id="expired").update(date_done=dbclock.now() - timedelta(days=7))
    celery_processes("worker", "w1", prune_keep_last=2).wait_for_log(r"ready\.", timeout=30)

    # When a beat starts, the built-ins appear, daily
    beat = celery_processes("beat", "beat1", builtin_schedules=True)
    assert wait_until(lambda: Schedule.objects.filter(name__in=BUILTINS).count() == 2, timeout=30), beat.log()[-3000:]
    assert set(Schedule.objects.filter(name__in=BUILTINS).values_list("cron", flat=True)) == {"17 3 * * *", "0 4 * * *"}

    # ... and an operator edits them to run every 2 seconds, then the beat restarts
    for name in BUILTINS:
        builtin = Schedule.objects.get(name=name)
        builtin.cron, builtin.interval = "", 2
        schedules.save(builtin)
    beat.stop()
    beat = celery_processes("beat", "beat2", builtin_schedules=True)
    beat.wait_for_log(r"beat replica \S+ started")

    # Then the edits survive the restart, and each built-in runs and succeeds
    assert list(Schedule.objects.filter(name__in=BUILTINS).values_list("interval", "cron")) == [(2, ""), (2, "")]
    assert wait_until(lambda: all(Status.SUCCEEDED in _finished(name) for name in BUILTINS), timeout=30), beat.log()[
        -3000:
    ]
    for name in BUILTINS:
        # Slots that came due while no beat ran are recorded missed, as their misfire policy says, and
        # a slot due while the last run still ran (a slow prune on a loaded machine) skipped, as their
        # overlap policy says; nothing failed.
        assert set(_finished(name)) <= {Status.SUCCEEDED, Status.MISSED, Status.SKIPPED}, (name, _finished(name))

    # ... the prune removed what is older than 30 days, keeping the schedule's newest 2
    assert set(Execution.objects.filter(schedule__name="history").values_list("idempotency_key", flat=True)) == {
        "recent",
        "old-0",
    }
    assert not Execution.objects.filter(idempotency_key="adhoc-old").exists()
    # ... and Celery's cleanup removed the expired result only
    assert not TaskResult.objects.filter(task_id="expired").exists()
    assert TaskResult.objects.filter(task_id="fresh").exists()
