"""Message priority: validated on submit, copied to every execution, sent with the message (real Redis)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

import scheduler
from project.celery import app
from scheduler import dbclock, outbox
from scheduler.exceptions import SubmissionInvalid
from scheduler.models import Execution
from scheduler.ops import audit, operations
from scheduler.owners import executions, schedules
from scheduler.tenancy import EVERY_TENANT
from tests.support import tasks as test_tasks  # noqa: F401  (registers tests.record with the app)

pytestmark = pytest.mark.django_db

#: kombu's Redis transport keeps a list per priority step, named ``<queue>\x06\x16<step>``.
PRIORITY_SEP = "\x06\x16"


def _sent(client: redis.Redis, name: str) -> list[tuple[int, Any]]:
    """Return (execution id, priority property) of the messages in one Redis list, oldest first."""
    return [
        (message["headers"][Execution.MESSAGE_HEADER], message["properties"].get("priority"))
        for message in map(json.loads, reversed(client.lrange(name, 0, -1)))
    ]


@pytest.mark.parametrize("priority", [-1, 256, "5", 2.5, True])
def test_submit__bad_priority_refused_and_nothing_written(priority: Any, redis_client: redis.Redis) -> None:
    with pytest.raises(SubmissionInvalid, match=r"^priority must be a whole number from 0 to 255, got "):
        scheduler.submit("tests.record", priority=priority)
    assert not Execution.objects.exists()
    assert redis_client.keys("celery*") == []


def test_submit__priority_stored_and_sent(
    redis_client: redis.Redis, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        high = scheduler.submit("tests.record", priority=255, queue="prio")
        step = scheduler.submit("tests.record", priority=7, queue="prio")
    assert Execution.objects.get(pk=high.pk).priority == 255
    # Redis honours 0-9: 255 lands in the 9 list, 7 in the 6 list; the message keeps the value given
    assert _sent(redis_client, f"prio{PRIORITY_SEP}9") == [(high.pk, 255)]
    assert _sent(redis_client, f"prio{PRIORITY_SEP}6") == [(step.pk, 7)]


def test_execution_for__copies_the_schedule_priority() -> None:
    schedule = schedules.create(name="p", task="tests.record", interval=60, priority=3)
    now = dbclock.now()
    assert executions.execution_for(schedule, now, status=Execution.Status.PENDING, now=now).priority == 3


def test_pending_row_sent_by_the_leader__with_its_priority(redis_client: redis.Redis) -> None:
    # Given a pending execution of a schedule with priority 6 (the beat's fires are built this way)
    schedule = schedules.create(name="p", task="tests.record", interval=60, priority=6)
    now = dbclock.now()
    pending = executions.execution_for(schedule, now, status=Execution.Status.PENDING, now=now)
    pending.save(force_insert=True)
    # When the leader publishes pending rows
    assert outbox.publish_pending(app) == 1
    # Then the message carries the priority
    assert _sent(redis_client, f"celery{PRIORITY_SEP}6") == [(pending.pk, 6)]


def test_retry__carries_the_priority(
    redis_client: redis.Redis, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    # Given a failed execution sent with priority 9
    failed = Execution.objects.create(
        idempotency_key="failed",
        task="tests.record",
        status=Execution.Status.FAILED,
        priority=9,
        scheduled_for=dbclock.now(),
    )
    # When an operator retries it
    with django_capture_on_commit_callbacks(execute=True):
        retry = operations.retry_execution(failed, app=app, scope=EVERY_TENANT, actor=audit.CLI).execution
    # Then the new execution and its message have the same priority
    assert Execution.objects.get(pk=retry.pk).priority == 9
    assert _sent(redis_client, f"celery{PRIORITY_SEP}9") == [(retry.pk, 9)]
