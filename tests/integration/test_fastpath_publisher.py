"""The publisher's fast path puts exactly send_task's messages into Redis; other brokers take send_task.

A Celery or kombu internal gone or changed sends by ``send_task``, with one warning and one count.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.app.amqp import AMQP
from kombu import Connection, Producer

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.fastpath import publisher
from scheduler.fastpath.guard import FastPath
from scheduler.models import Execution
from scheduler.owners import executions, schedules
from scheduler.timing import policies
from tests.integration.fastpath_support import fallback_warnings, fallbacks_counted, fresh
from tests.support import tasks as test_tasks  # noqa: F401  (registers tests.record with the app)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_path(monkeypatch: pytest.MonkeyPatch) -> FastPath:
    """The publisher's fast path as a new process has it: not yet checked."""
    return fresh(monkeypatch, publisher)


#: kombu's Redis transport keeps a list per priority step, named ``<queue>\x06\x16<step>``.
PRIORITY_SEP = "\x06\x16"


def _rows() -> list[dict[str, Any]]:
    """Pending rows covering every option a message carries: queue, priority, time limit, jitter ETA, arguments."""
    now = dbclock.now()
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


def test_fast_path__messages_equal_send_tasks(redis_client: redis.Redis, fast_path: FastPath) -> None:
    # Given pending rows with every option, and one database time for both sends
    rows = _rows()
    now = dbclock.now()
    # When the fast path sends them, and then send_task sends them
    with outbox.connect(app) as sender:
        assert sender.fast
        sender.send(rows, now=now)
        fast = _messages(redis_client)
        redis_client.flushdb()
        sender.fast = False  # the fallback, as on a broker that is not Redis
        sender.send(rows, now=now)
        slow = _messages(redis_client)
    # Then the same lists hold the same messages, byte for byte but the delivery tag
    assert fast == slow
    # and the self-check found the fast path alike kombu's producer
    assert not fast_path.fallen
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
    with outbox.connect(memory) as sender:
        assert not sender.fast  # not Redis: send_task
    sent = outbox.publish(memory, rows, now=dbclock.now())
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
        outbox.publish(app, rows, now=dbclock.now())
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    # Then the header is in every message, and each publish was reported with Celery's body
    messages = [m for found in _messages(redis_client).values() for m in found]
    assert len(messages) == len(rows) and all(m["headers"]["added"] == "by a receiver" for m in messages)
    assert sorted(sender for sender, _ in seen) == ["tests.record"] * len(rows)
    assert all(isinstance(body, tuple) and len(body) == 3 for _, body in seen)


def _consumed() -> dict[str, list[int]]:
    """Take every message off the queues ``_rows`` routes to, as a consumer does: {queue: execution ids}."""
    received: dict[str, list[int]] = {}
    with Connection(app.conf.broker_url) as conn:
        for queue in ("celery", "other"):
            with conn.SimpleQueue(queue) as simple:
                while True:
                    try:
                        message = simple.get(timeout=2)
                    except simple.Empty:
                        break
                    received.setdefault(queue, []).append(message.headers[Execution.MESSAGE_HEADER])
                    message.ack()
    return {queue: sorted(ids) for queue, ids in received.items()}


def _expected(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    return {
        "celery": sorted(row["id"] for row in rows if row["queue"] != "other"),
        "other": [row["id"] for row in rows if row["queue"] == "other"],
    }


def test_celery_internal_gone__sends_by_send_task_one_warning_one_count(
    redis_client: redis.Redis, fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Given a Celery whose AMQP.as_task_v2, which the fast path calls, is gone (send_task keeps its own
    # reference to it, as a renamed internal would be kept)
    monkeypatch.delattr(AMQP, "as_task_v2")
    rows = _rows()
    first, second = rows[:2], rows[2:]
    # When two passes publish the rows
    assert sorted(outbox.publish(app, first, now=dbclock.now())) == sorted(row["id"] for row in first)
    assert sorted(outbox.publish(app, second, now=dbclock.now())) == sorted(row["id"] for row in second)
    # Then every message is published by send_task and consumed from its queue, every row queued
    assert fast_path.fallen
    assert _consumed() == _expected(rows)
    assert not Execution.objects.exclude(status=Execution.Status.QUEUED).exists()
    # and the fallback was logged once and counted once
    [warning] = fallback_warnings(caplog)
    assert "publisher" in warning.getMessage() and "as_task_v2" in warning.getMessage()
    assert fallbacks_counted("publisher") == 1


def test_kombu_message_changed__self_check_sends_by_send_task(
    redis_client: redis.Redis, fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Given a kombu whose producer puts a property in every message that the fast path does not know of
    original = Producer.publish

    def publish(self: Producer, body: Any, **kwargs: Any) -> Any:
        return original(self, body, **kwargs, x_new_property="kombu 5.8")

    monkeypatch.setattr(Producer, "publish", publish)
    rows = _rows()
    # When a pass publishes the rows
    outbox.publish(app, rows, now=dbclock.now())
    # Then the self-check found the difference before anything was sent: every message is send_task's
    assert fast_path.fallen
    messages = [m for found in _messages(redis_client).values() for m in found]
    assert len(messages) == len(rows)
    assert all(m["properties"]["x_new_property"] == "kombu 5.8" for m in messages)
    assert _consumed() == _expected(rows)
    # and the fallback was logged once, naming the difference, and counted once
    [warning] = fallback_warnings(caplog)
    assert "x_new_property" in warning.getMessage()
    assert fallbacks_counted("publisher") == 1
    assert fallbacks_counted("bulk_insert") == 0


def test_a_schedules_message_options_go_out_with_its_messages_as_send_task_sends_them(
    redis_client: redis.Redis, fast_path: FastPath
) -> None:
    # Given a schedule with Celery's message options and one without, both due now
    now = dbclock.now()
    options = schedules.create(
        name="options",
        task="tests.record",
        interval=60,
        expires=30,
        headers={"x-team": "billing"},
        routing_key="celery",
    )
    plain = schedules.create(name="plain", task="tests.record", interval=60)
    executions.insert(
        [executions.execution_for(s, now, status=Execution.Status.PENDING, now=now) for s in (options, plain)]
    )
    sent: dict[str, dict[str, Any]] = {}

    def capture(sender: str, headers: dict[str, Any], routing_key: str, **_: Any) -> None:
        sent[headers["id"]] = {**headers, "routing_key": routing_key}

    signals.before_task_publish.connect(capture)
    try:
        # When they are sent (the one with options by send_task: the fast path expresses none of them)
        with outbox.connect(app) as sender:
            sender.send(executions.message_rows(Execution.objects.all()), now=now)
    finally:
        signals.before_task_publish.disconnect(capture)
    # Then the one with options went out by send_task with them; its own header names its execution
    row = Execution.objects.get(schedule=options)
    message = sent[row.celery_task_id]
    assert message["x-team"] == "billing" and message["execution_id"] == row.pk
    assert message["routing_key"] == "celery"
    assert message["expires"] == (row.scheduled_for + timedelta(seconds=30)).isoformat()
    # and the plain one has none of them
    assert "x-team" not in sent[Execution.objects.get(schedule=plain).celery_task_id]
    assert not fast_path.fallen
