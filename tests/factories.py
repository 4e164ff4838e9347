"""Rows the tests build: a valid schedule or execution, naming only the fields a test cares about."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules

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
