"""Messages published in batches (one Redis pipeline per batch) run on an unmodified worker as sent.

``dispatch.publish`` pushes its messages through kombu's publish batch; the
messages themselves are Celery's own. Here more rows than one batch holds go
out in one pass, with every option the beat sets (execution id header,
queue, priority, time limits, an ETA from jitter), and a plain
``celery -A project worker`` runs them: each is claimed by its header, its
ETA and time limit are honoured, and its result is stored.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import pytest
import redis
from django_celery_results.models import TaskResult

from project.celery import app
from scheduler import dispatch, executions, leases, policies
from scheduler.models import Execution, Schedule
from tests import tasks as test_tasks
from tests.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
QUEUE = "batched"
ROWS = dispatch.PUBLISH_BATCH + 150  # more than one batch
JITTER = 4  # seconds


def pending(schedule: Schedule, slot, *, now) -> Execution:  # noqa: ANN001 -- datetimes
    return executions.execution_for(schedule, slot, status=Status.PENDING, now=now)


def test_batched_messages__run_on_a_plain_worker_with_header_queue_priority_limits_and_eta(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    now = leases.db_now().replace(microsecond=0)
    # Given many pending executions on one queue, with a priority ...
    plain = Schedule.objects.create(name="plain", task="tests.record", interval=3600, queue=QUEUE, priority=3)
    rows = [pending(plain, now - timedelta(seconds=n), now=now) for n in range(ROWS)]
    # ... one delayed by its schedule's jitter (a slot whose offset is at least 2 s) ...
    jittered = Schedule.objects.create(name="jittered", task="tests.record", interval=3600, queue=QUEUE, jitter=JITTER)
    slot = next(now + timedelta(seconds=n) for n in range(1000) if policies.jitter_offset(jittered.pk, now + timedelta(seconds=n), JITTER) >= 2)
    rows.append(pending(jittered, slot, now=now))
    # ... and one with a time limit it overruns
    limited = Schedule.objects.create(
        name="limited", task="tests.stubborn", interval=3600, queue=QUEUE, timeout=1, kwargs={"seconds": 30}
    )
    rows.append(pending(limited, now, now=now))
    executions.insert(rows)

    # When one publishing pass sends them all, and a plain worker consumes the queue
    assert dispatch.publish_pending(app, limit=len(rows)) == len(rows)
    assert not Execution.objects.filter(status=Status.PENDING).exists()
    worker = celery_processes("worker", "w1", queues=QUEUE, concurrency=4)

    # Then every one ran once, claimed through its header (no ad-hoc row was made for it)
    assert wait_until(
        lambda: not Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists(), timeout=120, interval=0.5
    ), worker.log()[-3000:]
    assert not Execution.objects.exclude(schedule__isnull=False).exists(), "a message lost its execution id header"
    statuses = Counter(Execution.objects.values_list("status", flat=True))
    assert statuses == {Status.SUCCEEDED: ROWS + 1, Status.TIMED_OUT: 1}, statuses
    runs = Counter(run["task_id"] for run in test_tasks.runs(redis_client))
    assert set(runs.values()) == {1} and len(runs) == ROWS + 1
    # its result is stored by django-celery-results
    ids = Execution.objects.filter(status=Status.SUCCEEDED).values_list("celery_task_id", flat=True)
    assert TaskResult.objects.filter(task_id__in=list(ids), status="SUCCESS").count() == ROWS + 1
    # the jittered one did not start before its slot plus its offset (the ETA)
    delayed = Execution.objects.get(schedule=jittered)
    assert delayed.started_at >= slot + timedelta(seconds=policies.jitter_offset(jittered.pk, slot, JITTER))
    # and the time limit stopped the one that overran it
    assert "time limit" in Execution.objects.get(schedule=limited).error.lower()
