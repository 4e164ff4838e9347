"""backfill(): one execution per past slot under the beat's keys, idempotent, paced, refusing bad ranges."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from project.celery import app
from scheduler import dbclock
from scheduler.exceptions import BackfillRefused
from scheduler.models import Execution, Schedule
from scheduler.ops import backfill as backfill_module
from scheduler.ops.backfill import backfill
from scheduler.owners import executions
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db

Status = Execution.Status
HOUR = timedelta(hours=1)


def hourly(**fields: Any) -> Schedule:
    return make_schedule("hourly", interval=3600, **fields)


def five_hours(now: datetime) -> tuple[datetime, datetime, list[datetime]]:
    """A range holding the last five hourly slots before ``now``: (start, end, slots)."""
    end = now.replace(minute=0, second=0, microsecond=0)
    start = end - 4 * HOUR
    return start, end, [start + n * HOUR for n in range(5)]


def ran_slot(schedule: Schedule, slot: datetime, status: str) -> Execution:
    """Return the execution of ``schedule``'s ``slot``, under the beat's key, that ended ``status``."""
    return make_execution(executions.key(schedule, slot), schedule=schedule, scheduled_for=slot, status=status)


def sent_ids(client: redis.Redis, queue: str = "celery") -> list[int]:
    """Execution ids of the messages waiting in ``queue``."""
    return [json.loads(raw)["headers"][Execution.MESSAGE_HEADER] for raw in client.lrange(queue, 0, -1)]


def test_backfill__records_and_sends_the_slots_without_an_execution(redis_client: redis.Redis) -> None:
    # Given an hourly schedule whose third slot in the range already ran
    target = hourly(
        args=[1], kwargs={"a": 2}, queue="reports", tenant="acme", timeout=30, max_retries=2, retry_backoff=5
    )
    now = dbclock.now()
    start, end, slots = five_hours(now)
    ran = ran_slot(target, slots[2], Status.SUCCEEDED)

    # When backfilled
    report = backfill(target, start=start, end=end, now=now, app=app)

    # Then the four others were recorded under the beat's keys, copied from the schedule, and sent
    assert (report.created, report.already_present, report.published) == (4, 1, 4)
    assert [state.execution_id for state in report.slots] == [None, None, ran.pk, None, None]
    rows = list(Execution.objects.filter(schedule=target).exclude(pk=ran.pk).order_by("scheduled_for"))
    assert [row.scheduled_for for row in rows] == [slots[0], slots[1], slots[3], slots[4]]
    assert [row.idempotency_key for row in rows] == [executions.key(target, row.scheduled_for) for row in rows]
    for row in rows:
        assert (row.status, row.lease_token, row.task, row.args, row.kwargs) == (
            Status.QUEUED,
            None,
            "scheduler.echo",
            [1],
            {"a": 2},
        )
        assert (row.queue, row.tenant, row.timeout, row.max_retries, row.retry_backoff) == ("reports", "acme", 30, 2, 5)
    assert len({row.celery_task_id for row in rows}) == 4
    assert sorted(sent_ids(redis_client, "reports")) == [row.pk for row in rows]


def test_backfill__second_run_of_the_same_range_creates_nothing(redis_client: redis.Redis) -> None:
    # Given a range backfilled once
    target = hourly()
    now = dbclock.now()
    start, end, _ = five_hours(now)
    backfill(target, start=start, end=end, now=now, app=app)
    redis_client.flushdb()

    # When backfilled again
    report = backfill(target, start=start, end=end, now=now, app=app)

    # Then nothing new was recorded or sent
    assert (report.created, report.already_present, report.published) == (0, 5, 0)
    assert Execution.objects.count() == 5
    assert sent_ids(redis_client) == []


def test_backfill__dry_run_lists_the_slots_and_writes_nothing(redis_client: redis.Redis) -> None:
    target = hourly()
    now = dbclock.now()
    start, end, slots = five_hours(now)
    ran = ran_slot(target, slots[0], Status.MISSED)

    report = backfill(target, start=start, end=end, now=now, dry_run=True, app=app)

    assert [(s.scheduled_for, s.execution_id, s.status) for s in report.slots] == [
        (slots[0], ran.pk, Status.MISSED),
        *((slot, None, "") for slot in slots[1:]),
    ]
    assert (report.created, report.already_present, report.published) == (0, 1, 0)
    assert Execution.objects.count() == 1
    assert sent_ids(redis_client) == []


def test_backfill__rate_paces_batches_and_progress_is_reported(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a rate of 2 per second (slept time recorded, not waited) and progress every 2 slots
    sleeps: list[float] = []
    monkeypatch.setattr(backfill_module, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append))
    monkeypatch.setattr(backfill_module, "PROGRESS_EVERY", 2)
    progress: list[tuple[int, int]] = []
    target = hourly()
    now = dbclock.now()
    start, end, _ = five_hours(now)

    # When five slots are backfilled
    report = backfill(target, start=start, end=end, now=now, rate=2, progress=lambda *p: progress.append(p), app=app)

    # Then they went out two at a time, one and two seconds after the start
    assert report.published == 5
    assert sleeps == [pytest.approx(1.0, abs=0.5), pytest.approx(2.0, abs=0.5)]
    assert progress == [(2, 5), (4, 5)]


@pytest.mark.parametrize(
    ("bounds", "limit", "message"),
    [
        (lambda end, now: (end, end - 5 * HOUR), 1000, "must be after start"),
        (lambda end, now: (end, end), 1000, "must be after start"),
        (lambda end, now: (end - HOUR, now + HOUR), 1000, "is later than now .*only past slots can be backfilled"),
        (lambda end, now: (end - 14 * HOUR, end), 3, "the range holds 15 slots, more than the limit of 3"),
    ],
    ids=["reversed", "empty", "future", "over-limit"],
)
def test_backfill__bad_range_refused_and_nothing_written(
    bounds: Callable[[datetime, datetime], tuple[datetime, datetime]], limit: int, message: str
) -> None:
    target = hourly()
    now = dbclock.now()
    start, end = bounds(five_hours(now)[1], now)

    with pytest.raises(BackfillRefused, match=message):
        backfill(target, start=start, end=end, now=now, limit=limit, app=app)
    assert not Execution.objects.exists()
