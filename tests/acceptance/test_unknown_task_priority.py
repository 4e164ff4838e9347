"""Real workers: a task no worker knows fails with the reason; message priority reaches the broker."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis

import scheduler
from project.celery import app
from scheduler import dbclock, outbox
from scheduler.models import Execution, Schedule
from scheduler.ops import audit, operations
from scheduler.owners import executions, schedules
from scheduler.tenancy import EVERY_TENANT
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
#: kombu's Redis transport keeps one list per priority step (0, 3, 6, 9), named ``<queue>\x06\x16<step>``.
PRIORITY_SEP = "\x06\x16"
UNKNOWN = "tests.nobody_registers_this"


def _publish(execution: Execution) -> None:
    outbox.publish(app, [executions.message_row(execution)], now=dbclock.now())


def _waiting_unknown(
    key: str, *, schedule: Schedule | None = None, status: str = Execution.Status.PENDING
) -> Execution:
    """Record an execution of a task no worker registers, as the ORM (no form validation) would."""
    return Execution.objects.create(
        idempotency_key=key,
        schedule=schedule,
        task=UNKNOWN,
        scheduled_for=dbclock.now(),
        status=status,
        celery_task_id=f"celery-{key}",
    )


def test_unknown_task__failed_with_the_reason_and_counted_on_its_schedule(celery_processes: Start) -> None:
    # Given a schedule whose task no worker registers (saved without form validation), pausing after one failure
    schedule = schedules.create(name="ghost", task=UNKNOWN, interval=3600, pause_after_failures=1)
    fire = executions.execution_for(schedule, dbclock.now(), status=Execution.Status.PENDING, now=dbclock.now())
    fire.save(force_insert=True)
    # And an ad-hoc execution of the same task, and one already finished (a late duplicate message)
    ad_hoc = _waiting_unknown("ad-hoc-ghost")
    finished = _waiting_unknown("finished-ghost", status=Execution.Status.SUCCEEDED)
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When their messages reach the worker
    for execution in (fire, ad_hoc, finished):
        _publish(execution)
    # Then within a minute both waiting executions are failed with a reason naming the task
    failed = wait_until(
        lambda: Execution.objects.filter(pk__in=[fire.pk, ad_hoc.pk], status=Execution.Status.FAILED).count() == 2,
        timeout=60,
        interval=0.2,
    )
    assert failed, worker.log()[-3000:]
    for execution in (fire, ad_hoc):
        execution.refresh_from_db()
        assert f"no worker has task '{UNKNOWN}' registered" in execution.error
        assert execution.finished_at is not None and execution.claim_expires_at is None
    # And the schedule counted the failure and tripped its circuit breaker
    schedule.refresh_from_db()
    assert (schedule.consecutive_failures, schedule.total_runs, schedule.last_status) == (1, 1, "failed")
    assert UNKNOWN in schedule.last_error
    assert schedule.paused_reason.startswith("Paused after 1 consecutive failures; last: ")
    assert schedule.next_run_at is None
    # And the finished execution's row was not overwritten by its late message
    worker.wait_for_log(r"finished-ghost", timeout=10)
    finished.refresh_from_db()
    assert (finished.status, finished.error) == (Execution.Status.SUCCEEDED, "")


def test_malformed_message__rejected_and_its_execution_failed_with_the_reason(celery_processes: Start) -> None:
    # Given a queued execution of a known task, and a worker
    execution = Execution.objects.create(
        idempotency_key="malformed",
        task="tests.record",
        scheduled_for=dbclock.now(),
        status=Execution.Status.QUEUED,
        celery_task_id="malformed-1",
    )
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When its message arrives with an eta Celery cannot parse (Celery rejects it as an invalid task)
    test_tasks.publish_record_by_hand(
        "malformed", "malformed-1", headers={"eta": "not a date", Execution.MESSAGE_HEADER: execution.pk}
    )
    # Then the execution is failed with the reason, not left queued
    done = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status=Execution.Status.FAILED).first(), timeout=60
    )
    assert done, worker.log()[-3000:]
    assert "rejected the message: InvalidTaskError" in done.error


def _messages_by_list(client: redis.Redis, queue: str = "celery") -> dict[str, list[dict]]:
    """Return {list name: raw messages, oldest first} of every priority list of ``queue``."""
    lists = {}
    for name in [queue] + [f"{queue}{PRIORITY_SEP}{step}" for step in (3, 6, 9)]:
        # Producers LPUSH and consumers RPOP: the right end is the oldest.
        lists[name] = [json.loads(raw) for raw in reversed(client.lrange(name, 0, -1))]
    return lists


def test_priority__carried_by_the_message_and_honoured_by_a_real_worker(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given executions sent before any worker runs: a schedule's run-now at priority 9, then
    # submissions at priority 4, none and 0
    schedule = schedules.create(name="low", task="tests.record", kwargs={"label": "p9"}, interval=3600, priority=9)
    p9 = operations.run_now(schedule, app=app, scope=EVERY_TENANT, actor=audit.CLI).execution
    p4 = scheduler.submit("tests.record", kwargs={"label": "p4"}, priority=4)
    unset = scheduler.submit("tests.record", kwargs={"label": "unset"})
    p0 = scheduler.submit("tests.record", kwargs={"label": "p0"}, priority=0)
    assert [e.priority for e in (p9, p4, unset, p0)] == [9, 4, None, 0]

    # Then each raw message carries its priority and sits in the list of its priority step
    lists = _messages_by_list(redis_client)
    placed = {
        name: [(m["headers"][Execution.MESSAGE_HEADER], m["properties"]["priority"]) for m in messages]
        for name, messages in lists.items()
    }
    assert placed == {
        "celery": [(unset.pk, 0), (p0.pk, 0)],  # no priority: kombu's default, 0
        f"celery{PRIORITY_SEP}3": [(p4.pk, 4)],
        f"celery{PRIORITY_SEP}6": [],
        f"celery{PRIORITY_SEP}9": [(p9.pk, 9)],
    }

    # When one worker with one pool process consumes them
    worker = celery_processes("worker", "w1", concurrency=1)
    # Then all run, lowest number first (Redis's order), the rest in the order sent
    ran = wait_until(lambda: len(test_tasks.runs(redis_client)) == 4, timeout=30, interval=0.1)
    assert ran, worker.log()[-3000:]
    assert [run["label"] for run in test_tasks.runs(redis_client)] == ["unset", "p0", "p4", "p9"]
    ids = [p9.pk, p4.pk, unset.pk, p0.pk]
    assert wait_until(
        lambda: Execution.objects.filter(pk__in=ids, status=Execution.Status.SUCCEEDED).count() == 4, timeout=10
    )
