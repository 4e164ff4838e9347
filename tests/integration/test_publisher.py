"""The publisher's fast path puts exactly send_task's messages into Redis; other brokers take send_task."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery, signals
from kombu import Connection
from kombu.exceptions import OperationalError as BrokerError

from project.celery import app
from scheduler import dispatch, executions, leases, policies, publisher, schedules
from scheduler.models import Execution
from tests import tasks as test_tasks  # noqa: F401  (registers tests.record with the app)

pytestmark = pytest.mark.django_db

#: kombu's Redis transport keeps a list per priority step, named ``<queue>\x06\x16<step>``.
PRIORITY_SEP = "\x06\x16"


def _rows() -> list[dict[str, Any]]:
    """Pending rows covering every option a message carries: queue, priority, time limit, jitter ETA, arguments."""
    now = leases.db_now()
    plain = schedules.create(name="plain", task="tests.record", interval=60, args=[1, "two"], kwargs={"k": [3]})
    routed = schedules.create(name="routed", task="tests.record", interval=60, queue="other", priority=7, timeout=5)
    jittered = schedules.create(name="jittered", task="tests.record", interval=60, jitter=86_400)
    rows = [
        executions.execution_for(s, now, status=Execution.Status.PENDING, now=now) for s in (plain, routed, jittered)
    ]
    executions.insert(rows)
    return executions.message_rows(Execution.objects.all())


def _messages(client: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    """Every message in Redis by list name, oldest first, without its random delivery tag."""
    found = {}
    for key in client.keys("*"):
        if client.type(key) != b"list":
            continue
        messages = [json.loads(raw) for raw in reversed(client.lrange(key, 0, -1))]
        for message in messages:
            message["properties"].pop("delivery_tag")
        found[key.decode()] = messages
    return found


def test_fast_path__messages_equal_send_tasks(redis_client: redis.Redis) -> None:
    # Given pending rows with every option, and one database time for both sends
    rows = _rows()
    now = leases.db_now()
    # When the fast path sends them, and then send_task sends them
    with publisher.connect(app) as sender:
        assert sender.fast
        sender.send(rows, now=now)
        fast = _messages(redis_client)
        redis_client.flushdb()
        sender.fast = False  # the fallback, as on a broker that is not Redis
        sender.send(rows, now=now)
        slow = _messages(redis_client)
    # Then the same lists hold the same messages, byte for byte but the delivery tag
    assert fast == slow
    assert sorted(fast) == ["celery", f"other{PRIORITY_SEP}6"]
    # and they carry what the worker needs: the execution header, limits, priority, ETA
    by_id = {m["headers"][Execution.MESSAGE_HEADER]: m for messages in fast.values() for m in messages}
    routed = next(row for row in rows if row["queue"] == "other")
    limits = publisher.time_limits(5)
    assert by_id[routed["id"]]["headers"]["timelimit"] == [limits["time_limit"], limits["soft_time_limit"]]
    assert by_id[routed["id"]]["properties"]["priority"] == 7
    jittered = next(row for row in rows if row["jitter"])
    eta = jittered["scheduled_for"] + timedelta(
        seconds=policies.jitter_offset(jittered["schedule_id"], jittered["scheduled_for"], jittered["jitter"])
    )
    assert by_id[jittered["id"]]["headers"]["eta"] == eta.isoformat()


def test_memory_broker__send_task_path_and_the_messages_arrive() -> None:
    # Given a Celery app on the in-memory broker, and pending rows
    memory = Celery("memory", broker="memory://", set_as_current=False)
    memory.conf.task_serializer = "json"
    rows = _rows()
    # When they are published through it
    with publisher.connect(memory) as sender:
        assert not sender.fast  # not Redis: send_task
    sent = dispatch.publish(memory, rows, now=leases.db_now())
    # Then every row is sent and queued, and each message is in its queue with its execution id
    assert sorted(sent) == sorted(row["id"] for row in rows)
    assert not Execution.objects.exclude(status=Execution.Status.QUEUED).exists()
    received: dict[str, list[int]] = {}
    with Connection("memory://") as conn:
        for queue in ("celery", "other"):
            with conn.SimpleQueue(queue) as simple:
                while simple.qsize():
                    message = simple.get(timeout=1)
                    received.setdefault(queue, []).append(message.headers[Execution.MESSAGE_HEADER])
                    assert message.headers["task"] == "tests.record"
                    message.ack()
    routed = next(row["id"] for row in rows if row["queue"] == "other")
    assert {queue: sorted(ids) for queue, ids in received.items()} == {
        "celery": sorted(set(sent) - {routed}),
        "other": [routed],
    }


def test_broker_error__stops_the_pass_earlier_batches_queued_the_rest_pending(redis_client: redis.Redis) -> None:
    # Given a first batch of pending rows for a working queue, then rows whose Redis list is unusable
    now = leases.db_now()
    good = schedules.create(name="good", task="tests.record", interval=60, queue="good")
    broken = schedules.create(name="broken", task="tests.record", interval=60, queue="broken")
    for schedule, count in ((good, dispatch.PUBLISH_BATCH), (broken, 10)):
        slots = [now - timedelta(seconds=n) for n in range(count)]
        executions.insert(
            [executions.execution_for(schedule, slot, status=Execution.Status.PENDING, now=now) for slot in slots]
        )
    redis_client.set("broken", "not a list")  # LPUSH answers WRONGTYPE
    # When a pass publishes them
    with pytest.raises(BrokerError, match="delivery uncertain"):
        dispatch.publish_pending(app, limit=1000)
    # Then the batch the broker took is queued, the failed one stays pending
    assert Execution.objects.filter(schedule=good, status=Execution.Status.QUEUED).count() == dispatch.PUBLISH_BATCH
    assert Execution.objects.filter(schedule=broken, status=Execution.Status.PENDING).count() == 10
    assert redis_client.llen("good") == dispatch.PUBLISH_BATCH


def test_publish_signals__sent_on_the_fast_path_when_something_listens(redis_client: redis.Redis) -> None:
    # Given receivers of Celery's publish signals, one of which adds a header
    seen: list[tuple[str, Any]] = []

    def before(headers: dict[str, Any], **_: Any) -> None:
        headers["added"] = "by a receiver"

    def after(sender: str, body: Any, **_: Any) -> None:
        seen.append((sender, body))

    signals.before_task_publish.connect(before)
    signals.after_task_publish.connect(after)
    try:
        rows = _rows()
        # When the fast path sends rows
        dispatch.publish(app, rows, now=leases.db_now())
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    # Then the header is in every message, and each publish was reported with Celery's body
    messages = [m for found in _messages(redis_client).values() for m in found]
    assert len(messages) == len(rows) and all(m["headers"]["added"] == "by a receiver" for m in messages)
    assert sorted(sender for sender, _ in seen) == ["tests.record"] * len(rows)
    assert all(isinstance(body, tuple) and len(body) == 3 for _, body in seen)
