"""Rows the tests build: a valid schedule or execution, naming only the fields a test cares about."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, schedules

#: The fields that pick a schedule's timing; exactly one of them is set.
_TIMING_FIELDS = {"interval", "cron", "run_at"}


def make_schedule(name: str = "nightly", *, now: datetime | None = None, **fields: Any) -> Schedule:
    """Return a saved schedule of ``scheduler.echo`` every 60 s unless ``fields`` say otherwise.

    It passes ``full_clean`` first, as the admin and the API would, so a test
    never starts from a row those could not have written. It is written
    through ``scheduler.owners.schedules``, the one writer of schedule rows, which
    computes ``next_run_at`` from ``now`` (the database clock by default).
    """
    fields.setdefault("task", "scheduler.echo")
    if not _TIMING_FIELDS & fields.keys():
        fields["interval"] = 60
    schedule = Schedule(name=name, **fields)
    schedule.full_clean()
    schedules.save(schedule, now=now or dbclock.now())
    return schedule


def make_execution(key: str, **fields: Any) -> Execution:
    """Return a saved execution with idempotency key ``key``, due now on the database clock.

    Its task is its schedule's, or ``scheduler.echo`` when it has none.
    """
    schedule = fields.get("schedule")
    fields.setdefault("task", schedule.task if schedule is not None else "scheduler.echo")
    fields.setdefault("scheduled_for", dbclock.now())
    return Execution.objects.create(idempotency_key=key, **fields)


def make_past_execution(
    key: str,
    *,
    age_days: float,
    status: str = Execution.Status.SUCCEEDED,
    slot_age_days: float | None = None,
    **fields: Any,
) -> Execution:
    """Return an execution that finished ``age_days`` ago, due then too unless ``slot_age_days`` says otherwise.

    One still in flight has not finished, whatever its age: the history that pruning reads.
    """
    now = dbclock.now()
    return make_execution(
        key,
        status=status,
        scheduled_for=now - timedelta(days=age_days if slot_age_days is None else slot_age_days),
        finished_at=None if status in Execution.IN_FLIGHT_STATUSES else now - timedelta(days=age_days),
        **fields,
    )


def succeed(schedule: Schedule, key: str) -> None:
    """Run one execution of ``schedule`` to success through the worker's claim and finish."""
    execution, _ = executions.record_one(
        Execution(
            idempotency_key=key,
            task=schedule.task,
            schedule=schedule,
            scheduled_for=dbclock.now(),
            celery_task_id=key,
        )
    )
    claimed = executions.claim(worker="w:1", task=schedule.task, celery_task_id=key, execution_id=execution.pk)
    assert claimed is not None and executions.finish(executions.Claim.of(claimed), status=Execution.Status.SUCCEEDED)
