"""dispatch_due and publish_pending against the real database: overlap, limits, completion, pause."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
import redis

from scheduler import dbclock, outbox
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


def schedule(name: str, *, slots_from: float = 1, **fields: object) -> Schedule:
    """A schedule every 10 s unless ``fields`` time it otherwise; an interval's slots start ``slots_from`` s ago.

    So its last slot (``last_slot``) is that many seconds old and its next
    one is the interval ahead of it, whatever the clock reads: a slot the
    clock reaches while a test runs would add a row the test does not count.
    """
    if not {"cron", "run_at"} & fields.keys():
        fields.setdefault("interval", 10)
        fields.setdefault("start_at", dbclock.now() - timedelta(seconds=slots_from))
    return make_schedule(name, **fields)


def due_at(target: Schedule, slot: datetime) -> None:
    Schedule.objects.filter(pk=target.pk).update(next_run_at=slot)


def last_slot(target: Schedule) -> datetime:
    """The latest slot of interval schedule ``target`` at or before the database clock."""
    assert target.start_at is not None and target.interval is not None
    interval = timedelta(seconds=target.interval)
    return target.start_at + (dbclock.now() - target.start_at) // interval * interval


def statuses(target: Schedule) -> list[str]:
    return list(Execution.objects.filter(schedule=target).order_by("scheduled_for").values_list("status", flat=True))


def in_flight(target: Schedule, status: str = Status.RUNNING) -> Execution:
    return Execution.objects.create(
        idempotency_key=f"earlier:{target.pk}:{status}",
        schedule=target,
        task=target.task,
        scheduled_for=dbclock.now() - timedelta(minutes=5),
        status=status,
        celery_task_id=f"celery-{status}",
    )


@pytest.mark.parametrize(
    ("policy", "expected", "cancelled"),
    [
        ("allow", [Status.RUNNING, Status.PENDING], []),
        ("skip", [Status.RUNNING, Status.SKIPPED], []),
        ("buffer_one", [Status.RUNNING, Status.PENDING], []),
        ("cancel_previous", [Status.CANCELLED, Status.PENDING], ["celery-running"]),
    ],
)
def test_overlap__due_slot_while_one_runs(
    lease: leases.LeaseHandle, policy: str, expected: list[str], cancelled: list[str]
) -> None:
    # Given a schedule with one execution running
    target = schedule("s", overlap=policy)
    in_flight(target)
    due_at(target, last_slot(target))
    # When its next slot is dispatched
    report = dispatch.dispatch_due(lease)
    # Then the policy decided
    assert statuses(target) == expected
    assert report.cancelled_task_ids == cancelled
    held = Execution.objects.filter(schedule=target, buffered=True).count()
    assert held == (1 if policy == "buffer_one" else 0)


def test_buffer_one__held_until_the_running_one_ends_then_sent(lease: leases.LeaseHandle, redis_url: str) -> None:
    from project.celery import app

    target = schedule("s", overlap="buffer_one")
    running = in_flight(target)
    due_at(target, last_slot(target))
    dispatch.dispatch_due(lease)
    # While one runs, the buffered row is not sent
    assert outbox.publish_pending(app) == 0
    # When the running one ends, the buffered one goes out on the next pass
    Execution.objects.filter(pk=running.pk).update(status=Status.SUCCEEDED)
    assert outbox.publish_pending(app) == 1
    assert statuses(target) == [Status.SUCCEEDED, Status.QUEUED]


def test_buffer_one__a_second_waiting_slot_is_skipped(lease: leases.LeaseHandle) -> None:
    target = schedule("s", overlap="buffer_one", interval=10, slots_from=11)
    in_flight(target)
    due_at(target, last_slot(target) - timedelta(seconds=10))
    dispatch.dispatch_due(lease)
    assert statuses(target) == [Status.RUNNING, Status.PENDING, Status.SKIPPED]


def test_cancelled_execution__cannot_be_claimed(lease: leases.LeaseHandle) -> None:
    target = schedule("s", overlap="cancel_previous")
    running = in_flight(target, Status.QUEUED)
    due_at(target, last_slot(target))
    dispatch.dispatch_due(lease)
    running.refresh_from_db()
    assert running.status == Status.CANCELLED and running.finished_at is not None
    assert "cancel_previous" in running.error
    assert not Execution.objects.claimable().filter(pk=running.pk).exists()


def test_max_runs__disables_itself_after_its_last_run(lease: leases.LeaseHandle) -> None:
    # Given a schedule allowed 3 runs whose beat already sent 2
    target = schedule("s", max_runs=3)
    Schedule.objects.filter(pk=target.pk).update(slots_committed=2)
    due_at(target, last_slot(target))
    # When its next slot fires
    report = dispatch.dispatch_due(lease)
    # Then that was the last one: it is off, with the reason
    target.refresh_from_db()
    assert len(report.fired) == 1
    assert (target.enabled, target.next_run_at) == (False, None)
    assert target.disabled_reason == "Used all 3 runs (max_runs)"
    assert report.completed == [("s", "Used all 3 runs (max_runs)")]


def test_one_off__runs_once_then_disabled(lease: leases.LeaseHandle) -> None:
    run_at = dbclock.now() - timedelta(seconds=1)
    target = schedule("once", run_at=run_at)
    assert target.next_run_at == run_at
    dispatch.dispatch_due(lease)
    target.refresh_from_db()
    assert statuses(target) == [Status.PENDING]
    assert not target.enabled and target.disabled_reason.startswith("One-off: its slot at")
    # Enabled again by hand: the reason goes, and the same slot cannot run twice
    target.enabled = True
    schedules.save(target)
    assert target.disabled_reason == ""
    dispatch.dispatch_due(lease)
    assert statuses(target) == [Status.PENDING]


def test_end_at__disables_itself_when_no_slot_is_left(lease: leases.LeaseHandle) -> None:
    target = schedule("ending", end_at=dbclock.now() + timedelta(seconds=4))
    due_at(target, last_slot(target))
    dispatch.dispatch_due(lease)
    target.refresh_from_db()
    assert not target.enabled and target.disabled_reason.startswith("Past its end at")


def test_missed_slots__counted_on_the_schedule(lease: leases.LeaseHandle) -> None:
    target = schedule("late", interval=1, catchup_window=5, slots_from=61)
    due_at(target, last_slot(target) - timedelta(seconds=60))
    report = dispatch.dispatch_due(lease)
    target.refresh_from_db()
    assert target.total_missed == report.missed + report.missed_not_recorded >= 54
    assert Execution.objects.filter(schedule=target, status=Status.MISSED).count() == report.missed


def test_pause_and_resume__keep_history_and_owe_nothing_for_the_pause(lease: leases.LeaseHandle) -> None:
    # Given a schedule with history, paused
    target = schedule("p", interval=1)
    in_flight(target, Status.SUCCEEDED)
    target.consecutive_failures = 2
    schedules.pause(target, "maintenance window")
    assert (target.next_run_at, target.paused_reason) == (None, "maintenance window")
    # While paused nothing is due
    assert dispatch.dispatch_due(lease).schedules == 0
    # When resumed, it continues from the next slot after now: no burst, no missed rows
    before = dbclock.now()
    schedules.resume(target)
    target.refresh_from_db()
    assert target.next_run_at > before - timedelta(seconds=1)
    assert (target.paused_reason, target.consecutive_failures) == ("", 0)
    assert Execution.objects.filter(schedule=target).count() == 1
    report = dispatch.dispatch_due(lease)
    assert report.missed == report.missed_not_recorded == 0


def test_jitter__message_delayed_by_the_slots_offset(lease: leases.LeaseHandle, redis_client: redis.Redis) -> None:
    from project.celery import app
    from scheduler.timing.policies import jitter_offset

    # A day of jitter: the offset is all but surely later than the slot's few seconds of lateness.
    target = schedule("j", interval=10, jitter=86_400)
    slot = last_slot(target)
    due_at(target, slot)
    dispatch.dispatch_due(lease)
    assert outbox.publish_pending(app) == 1
    (sent,) = [json.loads(raw) for raw in redis_client.lrange("celery", 0, -1)]
    assert sent["headers"]["eta"] == (slot + timedelta(seconds=jitter_offset(target.pk, slot, 86_400))).isoformat()
