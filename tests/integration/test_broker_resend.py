"""Re-sending after a broker restart, and lost attempts retried after the backoff (real database and Redis)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from project.celery import app
from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.exceptions import BrokerUnavailable
from scheduler.fastpath import publisher
from scheduler.models import Execution, Schedule
from scheduler.ops.reconcile import reconcile, resend_after_broker_restart, resend_unclaimed
from scheduler.outbox import broker
from scheduler.owners import executions, leases
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


def execution(key: str, **fields: Any) -> Execution:
    fields.setdefault("scheduled_for", dbclock.now() - timedelta(hours=1))
    return make_execution(key, celery_task_id=f"celery-{key}", **fields)


def messages(client: redis.Redis) -> dict[int, dict[str, Any]]:
    """{execution id: message headers} of the messages waiting in the default queue."""
    headers = [json.loads(raw)["headers"] for raw in client.lrange("celery", 0, -1)]
    return {header[Execution.MESSAGE_HEADER]: header for header in headers}


def eta(headers: dict[str, Any]) -> datetime | None:
    return datetime.fromisoformat(headers["eta"]) if headers.get("eta") else None


def confirmed_broker(now: datetime) -> None:
    """Let the leader look at the broker once with nothing waiting: it kept every message since."""
    assert resend_after_broker_restart(now=now, app=app).changes == ()


def test_broker_restarted__waiting_executions_sent_again_once(redis_client: redis.Redis) -> None:
    # Given a broker that lost its data (the suite's Redis, emptied), an
    # execution queued before, a retry due in 5 minutes, and one running
    now = dbclock.now()
    queued = execution("queued", status=Status.QUEUED, enqueued_at=now - timedelta(seconds=30))
    retry_due = now + timedelta(minutes=5)
    retrying = execution("retrying", status=Status.RETRYING, attempt=2, max_retries=3, enqueued_at=retry_due)
    execution("running", status=Status.RUNNING, enqueued_at=now - timedelta(seconds=30))

    # When the leader checks the broker, twice
    first = resend_after_broker_restart(now=now, app=app)
    second = resend_after_broker_restart(now=now + timedelta(seconds=5), app=app)

    # Then both waiting ones went out once, the retry's message not before it is due
    assert [(change.kind, change.execution_id) for change in first.changes] == [
        ("broker_lost", queued.pk),
        ("broker_lost", retrying.pk),
    ]
    assert second.changes == ()
    sent = messages(redis_client)
    assert set(sent) == {queued.pk, retrying.pk}
    assert eta(sent[queued.pk]) is None
    assert eta(sent[retrying.pk]) == retry_due
    # and the rows themselves are as they were
    retrying.refresh_from_db()
    assert (retrying.status, retrying.attempt, retrying.enqueued_at) == (Status.RETRYING, 2, retry_due)
    assert redis_client.get(broker.MARKER_KEY) == redis_client.info("server")["run_id"].encode()


def test_broker_kept_its_messages__long_queue_not_sent_again(redis_client: redis.Redis) -> None:
    # Given a broker the leader has looked at, and a long queue waiting on it
    now = dbclock.now()
    confirmed_broker(now)
    waiting = [execution(f"q{index}", status=Status.QUEUED, enqueued_at=now) for index in range(50)]

    # When the leader checks the broker again later
    report = resend_after_broker_restart(now=now + timedelta(minutes=5), app=app)

    # Then nothing is sent again
    assert report.changes == ()
    assert messages(redis_client) == {}
    assert Execution.objects.filter(pk__in=[row.pk for row in waiting], status=Status.QUEUED).count() == 50


def test_broker_flushed_after_a_check__queued_before_sent_again_queued_after_not(redis_client: redis.Redis) -> None:
    # Given a confirmed broker that then loses its data, with one execution
    # queued before the leader notices and one sent to the new broker after
    now = dbclock.now()
    confirmed_broker(now)
    before = execution("before", status=Status.QUEUED, enqueued_at=now + timedelta(seconds=1))
    redis_client.flushdb()
    first = resend_after_broker_restart(now=now + timedelta(seconds=5), app=app)
    execution("after", status=Status.QUEUED, enqueued_at=now + timedelta(seconds=6))

    # When the leader checks again
    second = resend_after_broker_restart(now=now + timedelta(seconds=10), app=app)

    # Then only the one queued before it noticed went out again
    assert [change.execution_id for change in first.changes] == [before.pk]
    assert second.changes == ()
    assert set(messages(redis_client)) == {before.pk}


def test_broker_restarted__a_plain_celery_call_its_worker_recorded_but_never_claimed_sent_again(
    redis_client: redis.Redis,
) -> None:
    # Given a confirmed broker, and a plain Celery call (``.delay()``) that a
    # worker recorded as its ad-hoc execution, then died before claiming
    now = dbclock.now()
    confirmed_broker(now)
    key = executions.record_ad_hoc(
        "plain-1", task="scheduler.echo", args=[1], kwargs={}, queue="", timeout=None, now=now
    )
    recorded = Execution.objects.get(idempotency_key=key)

    # When the broker loses its data (the message with it) and the leader checks it
    redis_client.flushdb()
    report = resend_after_broker_restart(now=dbclock.now() + timedelta(seconds=5), app=app)

    # Then the execution is sent again: it is queued since the worker recorded it
    assert recorded.status == Status.QUEUED and recorded.enqueued_at is not None
    assert [change.execution_id for change in report.changes] == [recorded.pk]
    assert messages(redis_client)[recorded.pk]["id"] == "plain-1"


def test_broker_unreachable__reported_and_nothing_changes(unreachable_app: Celery) -> None:
    # Given a queued execution and a broker nobody listens on
    now = dbclock.now()
    queued = execution("queued", status=Status.QUEUED, enqueued_at=now - timedelta(minutes=1))

    # When the leader checks the broker
    report = resend_after_broker_restart(now=now, app=unreachable_app)

    # Then it says why, and the row waits for the next check
    assert report.publish_error.startswith("broker unreachable")
    assert report.changes == ()
    queued.refresh_from_db()
    assert (queued.status, queued.enqueued_at) == (Status.QUEUED, now - timedelta(minutes=1))


@pytest.mark.parametrize(
    "call",
    [
        lambda app: broker.unconfirmed_run(app),
        lambda app: broker.confirm_run(app, "run"),
        lambda app: broker.queues_holding_messages(app, {"celery"}),
        lambda app: broker.revoke(app, ["celery-task"], once=True),
    ],
    ids=["unconfirmed_run", "confirm_run", "queues_holding_messages", "revoke"],
)
def test_broker_edge__a_broker_nobody_listens_on__broker_unavailable_caused_by_the_drivers_error(
    call: Callable[[Celery], object], unreachable_app: Celery
) -> None:
    # Given a broker nobody listens on
    # When the beat asks it something
    with pytest.raises(BrokerUnavailable) as raised:
        call(unreachable_app)
    # Then the caller sees the project's error, with the driver's words and its error as the cause
    cause = raised.value.__cause__
    assert cause is not None and not isinstance(cause, BrokerUnavailable)
    assert str(raised.value) == str(cause)


def test_lost__retried_after_the_backoff_not_at_once(redis_client: redis.Redis) -> None:
    # Given a running execution with a 60 s backoff whose worker stopped renewing its claim
    now = dbclock.now()
    lost = execution("lost", status=Status.RUNNING, worker="dead-host:1", max_retries=1, retry_backoff=60)
    Execution.objects.filter(pk=lost.pk).update(
        started_at=now - timedelta(minutes=5), claim_expires_at=now - timedelta(seconds=1)
    )

    # When reconciled
    reconcile(now=now, app=app)

    # Then attempt 2 is due after the backoff (60 s, plus up to half again), and its message waits until then
    lost.refresh_from_db()
    assert (lost.status, lost.attempt) == (Status.RETRYING, 2)
    assert now + timedelta(seconds=60) <= lost.enqueued_at <= now + timedelta(seconds=90)
    assert eta(messages(redis_client)[lost.pk]) == lost.enqueued_at


def test_lost__counts_as_in_flight_for_the_overlap_policies(lease: leases.LeaseHandle) -> None:
    # Given an overlap=skip schedule whose last execution is lost (reconcile is about to retry it)
    # (its slots from a second ago: the next is 9 s away, none comes due while the test runs)
    start = dbclock.now() - timedelta(seconds=1)
    target = make_schedule("s", interval=10, overlap="skip", start_at=start)
    execution("earlier", schedule=target, status=Status.LOST)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=start)

    # When its next slot comes due
    dispatch.dispatch_due(lease)

    # Then that slot is skipped, as while any execution is in flight
    slots = Execution.objects.filter(schedule=target).order_by("scheduled_for").values_list("status", flat=True)
    assert list(slots) == [Status.LOST, Status.SKIPPED]


def test_unclaimed__waiting_behind_other_messages__sent_again_only_once_its_queue_is_empty(
    redis_client: redis.Redis,
) -> None:
    # Given an execution queued five minutes ago and never claimed, with another message ahead of it in its queue
    now = dbclock.now()
    stale = execution("stale", status=Status.QUEUED, enqueued_at=now - timedelta(minutes=5))
    redis_client.lpush("celery", json.dumps({"headers": {Execution.MESSAGE_HEADER: 0}}))

    # When the leader looks for what waited too long
    behind = resend_unclaimed(now=now, app=app)
    # Then nothing is sent: its message most likely waits behind the other
    assert behind.changes == ()
    assert Execution.objects.get(pk=stale.pk).enqueued_at == now - timedelta(minutes=5)

    # When the queue is empty and it is still unclaimed
    redis_client.delete("celery")
    empty = resend_unclaimed(now=now, app=app)
    # Then it is sent again, once, and waits a full threshold for the next re-send
    assert [(change.kind, change.execution_id) for change in empty.changes] == [("republished", stale.pk)]
    assert set(messages(redis_client)) == {stale.pk}
    assert Execution.objects.get(pk=stale.pk).enqueued_at == now
    assert resend_unclaimed(now=now, app=app).changes == ()


def test_unclaimed__a_message_jitter_delays__waits_from_its_start_not_its_slot(redis_client: redis.Redis) -> None:
    # Given a schedule whose jitter starts a slot's message up to an hour late, and its
    # execution sent for a slot a minute ago (never claimed yet: its message starts later)
    jittered = make_schedule("jittered", interval=7200, jitter=3600)
    now = dbclock.now()
    slot = now - timedelta(minutes=1)
    while publisher.start_at({"schedule_id": jittered.pk, "scheduled_for": slot, "jitter": 3600}) < now + timedelta(
        minutes=5
    ):
        slot -= timedelta(seconds=1)  # a slot whose message starts well after now
    execution("jittered", schedule=jittered, scheduled_for=slot, status=Status.QUEUED, enqueued_at=slot)

    # When the leader looks for what waited too long
    report = resend_unclaimed(now=now, app=app)

    # Then it is left alone: its message has not started yet
    assert report.changes == ()
    assert messages(redis_client) == {}
