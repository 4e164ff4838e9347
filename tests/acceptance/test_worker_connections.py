"""A worker keeps its database connection across tasks, and replaces one the server dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

import scheduler
from scheduler.models import Execution
from tests.processes import CeleryProcess, wait_until
from tests.tasks import connection_uses

pytestmark = pytest.mark.django_db(transaction=True)


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
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        # Then the next task runs on a new connection, and is recorded
        done = run(connection_uses)
        assert (done.status, done.result) == (Execution.Status.SUCCEEDED, 1)
        assert "Traceback" not in worker.log(), worker.log()[-3000:]
