"""During a burst the leader publishes on a thread of its own (``scheduler.beat.publishing``) while its next tick commits.

A real ``LeaderScheduler`` in this process, the suite's Redis: more
schedules due at once than one tick dispatches, ticked until none is due.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from django.db import connection

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from tests.support.factories import make_schedule
from tests.support.replicas import BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)

BATCH = 50
SCHEDULES = 3 * BATCH + 7  # four ticks' worth


def publishing_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "scheduler-publish"]


def test_a_burst__every_execution_sent_once_the_thread_publishing_beside_the_commits(
    redis_client: redis.Redis, settings: Any, beat_replica: BeatReplica
) -> None:
    # Given more schedules due now than one tick dispatches
    settings.SCHEDULER_DISPATCH_BATCH_SIZE = BATCH
    for number in range(SCHEDULES):
        make_schedule(f"burst-{number}", interval=3600)
    Schedule.objects.update(next_run_at=dbclock.now())
    beat = beat_replica()
    # When the leader ticks until every slot is sent
    for _ in range(20):
        beat.tick()
        if Execution.objects.filter(status=Execution.Status.QUEUED).count() == SCHEDULES:
            break
    thread_ran = bool(publishing_threads())
    beat.close()

    # Then every slot was committed and sent once, on PostgreSQL partly by the publishing thread
    assert Execution.objects.filter(status=Execution.Status.QUEUED).count() == SCHEDULES
    assert redis_client.llen("celery") == SCHEDULES
    assert thread_ran == connection.features.has_select_for_update
    # and closing the beat stopped the thread
    assert not [thread for thread in publishing_threads() if thread.is_alive()]
