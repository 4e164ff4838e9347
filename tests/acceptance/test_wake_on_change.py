"""A schedule created or moved to fire sooner than the leader's next look fires on time.

The leader sleeps until the next slot it knows of, its lease renewal, or
``SCHEDULER_MAX_INTERVAL_SECONDS``. On PostgreSQL both bounds are long here
(30 s and 60 s), so a schedule the leader did not know of when it went to
sleep would fire up to half a minute late unless the write wakes it
(NOTIFY). SQLite has no NOTIFY: there the leader keeps its 1 s
``MAX_INTERVAL_SECONDS`` (its lease still renewed only every 30 s), and
its next look must find the schedule on time.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules
from tests.acceptance.test_beat_replicas import Start, leader_process
from tests.support.factories import make_schedule
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: A leader that looks again only every 30 s (its lease renewal) when nothing is due, per database:
#: on SQLite, with no NOTIFY to wake it, the 1 s default max interval is what keeps it on time.
SLEEPY = {"lease_ttl_seconds": 90, "lease_renew_seconds": 30}
MAX_INTERVAL = {"postgresql": 60, "sqlite": 1}
#: How late a slot may be sent: a few ticks, far below the 30 s the leader would sleep.
ON_TIME_SECONDS = 3.0


def sent_late_by(schedule: Schedule, *, timeout: float = 40.0) -> float:
    """Seconds between the schedule's first slot and its message going out."""
    found = wait_until(
        lambda: Execution.objects.filter(schedule=schedule, enqueued_at__isnull=False).first(), timeout=timeout
    )
    assert found, f"{schedule.name} was never sent"
    return (found.enqueued_at - found.scheduled_for).total_seconds()


def test_leader__sends_on_time_a_schedule_created_or_moved_to_fire_sooner(
    celery_processes: Start, db_vendor: str
) -> None:
    # Given a leader with nothing due, asleep until its next lease renewal half a minute away
    # (on SQLite: until its next look, 1 s away)
    beat = celery_processes("beat", "leader", max_interval_seconds=MAX_INTERVAL[db_vendor], **SLEEPY)
    leader_process([beat])

    # When a one-off schedule is created to fire in 2 s
    created = make_schedule("soon", task="tests.record", run_at=dbclock.now() + timedelta(seconds=2))
    # Then it is sent on time, not at the leader's next look
    assert sent_late_by(created) < ON_TIME_SECONDS

    # And when an hourly schedule is moved to fire in 2 s, after the leader went back to sleep
    hourly = make_schedule("hourly", task="tests.record", interval=3600, start_at=dbclock.now() + timedelta(hours=1))
    hourly.start_at = dbclock.now() + timedelta(seconds=2)
    schedules.save(hourly)
    assert sent_late_by(hourly) < ON_TIME_SECONDS
