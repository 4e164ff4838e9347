"""A worker keeps its database connection across tasks, and replaces one the server dropped or a task left in a transaction.

A body the server cut off from its database did not fail: it is run again
as a lost attempt, which does not count against ``max_retries``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.db import connection

import scheduler
from scheduler.models import Execution
from scheduler.owners import schedules
from tests.acceptance.test_fenced_and_checkpoint import fenced_events
from tests.acceptance.test_worker_guard import wait_final, worker_pid
from tests.support import tasks as test_tasks
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until
from tests.support.tasks import connection_uses, interrupted_in_transaction

pytestmark = pytest.mark.django_db(transaction=True)


def end_other_sessions() -> None:
    """End every other session on the test database, as a server restart or ``pg_terminate_backend`` would."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def run(task: Any) -> Execution:
    execution = scheduler.submit(task)
    done = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status__in=Execution.FINAL_STATUSES).first(), timeout=30
    )
    assert done, f"execution {execution.pk} did not finish"
    return done


def test_worker_connection__kept_across_tasks_and_replaced_when_dropped(
    celery_processes: Callable[..., CeleryProcess],
) -> None:
    # Given a worker with one pool process
    worker = celery_processes("worker", "w1", concurrency=1)
    worker.wait_for_log(r"ready\.")

    # When it runs three tasks one after the other
    results = [run(connection_uses) for _ in range(3)]

    # Then all three ran on the same database connection
    assert [(done.status, done.result) for done in results] == [(Execution.Status.SUCCEEDED, n) for n in (1, 2, 3)]

    if connection.vendor == "postgresql":
        # When the server drops the worker's connections between two tasks
        end_other_sessions()
        # Then the next task runs on a new connection, and is recorded
        done = run(connection_uses)
        assert (done.status, done.result) == (Execution.Status.SUCCEEDED, 1)
        assert "Traceback" not in worker.log(), worker.log()[-3000:]


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="PostgreSQL only: a SQLite file has no server to end a session"
)
def test_fenced_body_cut_off_from_its_database__runs_again_and_invoices_once(
    side_effect_table: None, celery_processes: Callable[..., CeleryProcess], redis_client: redis.Redis
) -> None:
    worker = celery_processes("worker", "w1", concurrency=1)
    worker.wait_for_log(r"ready\.")
    # Given attempt 1 inside its fenced block, its INSERT done, with no retries of its own
    execution = scheduler.submit("tests.fenced_invoice", kwargs={"hold": "inside"}, max_retries=0)
    assert wait_until(lambda: fenced_events(redis_client, "holding", 1), timeout=20), worker.log()[-3000:]
    # When the server ends its sessions, then the body goes on to commit
    end_other_sessions()
    redis_client.set(test_tasks.GO_KEY, "1")
    # Then its block rolled back, and attempt 2 runs and commits the one invoice
    done = wait_final(execution, timeout=30)
    assert fenced_events(redis_client, "session ended", 1), worker.log()[-3000:]
    assert (done.status, done.attempt) == (Execution.Status.SUCCEEDED, 2), (done.error, worker.log()[-3000:])
    assert test_tasks.side_effects() == [(execution.pk, 2, worker_pid(execution))]
    assert [entry["error"] for entry in done.attempt_errors] == ["Database connection lost during attempt 1"]


def test_a_transaction_left_open_by_a_task_is_rolled_back_before_the_next_task(
    celery_processes: Callable[..., CeleryProcess], redis_client: redis.Redis
) -> None:
    # Given a worker with one pool process, and a task that leaves its connection in a transaction holding a lock
    worker = celery_processes("worker", "w1", concurrency=1)
    worker.wait_for_log(r"ready\.")
    schedule = make_schedule("locked", interval=3600)
    interrupted_in_transaction.delay(schedule.pk)
    assert wait_until(lambda: redis_client.llen(test_tasks.LEFT_OPEN_KEY), timeout=20), worker.log()[-3000:]
    # Then the next task on that process runs and is recorded, and the lock is gone: others write again
    done = run(connection_uses)
    assert done.status == Execution.Status.SUCCEEDED, (done.error, worker.log()[-3000:])
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET lock_timeout = '5s'")
    schedule.name = "written"
    schedules.save(schedule)
    assert "a transaction was left open on this process's database connection" in worker.log()
