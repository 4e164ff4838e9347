"""The outbox: committed ``pending`` rows are sent and marked ``queued``; a failing broker is ``BrokerUnavailable``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.exceptions import BrokerUnavailable
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, schedules
from tests.support import tasks as test_tasks  # noqa: F401  (registers tests.record with the app)

pytestmark = pytest.mark.django_db

Status = Execution.Status


def pending(schedule: Schedule, count: int) -> list[Execution]:
    now = dbclock.now()
    rows = [
        executions.execution_for(schedule, now - timedelta(seconds=n), status=Status.PENDING, now=now)
        for n in range(count)
    ]
    executions.insert(rows)
    return rows


def test_publish_pending__sends_every_pending_row_once_and_marks_it_queued(redis_client: redis.Redis) -> None:
    # Given more pending rows than one batch
    schedule = schedules.create(name="many", task="tests.record", interval=60)
    pending(schedule, outbox.PUBLISH_BATCH + 10)
    # When one pass publishes them, and a second one runs
    sent = outbox.publish_pending(app, limit=10_000)
    again = outbox.publish_pending(app, limit=10_000)
    # Then each was sent once and is queued
    assert (sent, again) == (outbox.PUBLISH_BATCH + 10, 0)
    assert not Execution.objects.exclude(status=Status.QUEUED).exists()
    assert redis_client.llen("celery") == outbox.PUBLISH_BATCH + 10


def test_broker_error__stops_the_pass_earlier_batches_queued_the_rest_pending(redis_client: redis.Redis) -> None:
    # Given a first batch of pending rows for a working queue, then rows whose Redis list is unusable
    good = schedules.create(name="good", task="tests.record", interval=60, queue="good")
    broken = schedules.create(name="broken", task="tests.record", interval=60, queue="broken")
    pending(good, outbox.PUBLISH_BATCH)
    pending(broken, 10)
    redis_client.set("broken", "not a list")  # LPUSH answers WRONGTYPE
    # When a pass publishes them
    with pytest.raises(BrokerUnavailable, match="delivery uncertain") as raised:
        outbox.publish_pending(app, limit=1000)
    # Then the caller sees the project's error, kombu's behind it
    assert isinstance(raised.value.__cause__, OperationalError)
    # and the batch the broker took is queued, the failed one stays pending
    assert Execution.objects.filter(schedule=good, status=Status.QUEUED).count() == outbox.PUBLISH_BATCH
    assert Execution.objects.filter(schedule=broken, status=Status.PENDING).count() == 10
    assert redis_client.llen("good") == outbox.PUBLISH_BATCH


def test_publish_pending__broker_nobody_listens_on__broker_unavailable_and_rows_stay_pending(
    unreachable_app: Celery,
) -> None:
    # Given pending rows, and a broker that refuses connections
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    pending(schedule, 3)
    # When a pass publishes them
    with pytest.raises(BrokerUnavailable) as raised:
        outbox.publish_pending(unreachable_app)
    # Then the error is the project's, with the driver's words and its error as the cause
    cause = raised.value.__cause__
    assert isinstance(cause, (OperationalError, OSError)) and not isinstance(cause, BrokerUnavailable)
    assert str(raised.value) == str(cause)
    # and every row waits for the next pass
    assert list(Execution.objects.values_list("status", flat=True)) == [Status.PENDING] * 3


def test_publish__broker_nobody_listens_on__broker_unavailable_and_nothing_marked_queued(
    unreachable_app: Celery,
) -> None:
    # Given pending rows, and a broker that refuses connections
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    pending(schedule, 2)
    rows = executions.message_rows(Execution.objects.all())
    # When they are published
    with pytest.raises(BrokerUnavailable) as raised:
        outbox.publish(unreachable_app, rows, now=dbclock.now())
    # Then the cause is the driver's error, and nothing claims to be sent
    assert isinstance(raised.value.__cause__, (OperationalError, OSError))
    assert not Execution.objects.filter(status=Status.QUEUED).exists()


def test_publish_pending__keeps_its_connection_and_replaces_a_dead_one_at_once(redis_client: redis.Redis) -> None:
    # Given a pass that published, so its thread keeps the broker connection
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    pending(schedule, 2)
    assert outbox.publish_pending(app) == 2
    kept = outbox._kept.publisher
    assert kept is not None
    # When the broker drops that connection (as a restart does) and the next pass publishes
    channel = kept.connection.default_channel
    redis_client.client_kill_filter(_id=channel.client.client_id())
    pending(schedule, 3)
    sent = outbox.publish_pending(app)
    # Then the pass sent every row, with no error for the caller, on a live connection kept again
    assert sent == 3
    assert Execution.objects.filter(status=Status.QUEUED).count() == 5
    assert redis_client.llen("celery") == 5
    assert outbox._kept.publisher is not None
