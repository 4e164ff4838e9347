"""Django's tasks framework on this platform: ``.enqueue()`` runs a ``@task`` on a real worker, as an Execution.

The framework's own API does everything here: ``enqueue``, ``refresh``,
``get_result``, ``status``, ``return_value``, ``errors``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django_tasks import TaskResult, TaskResultStatus, task_backends

import scheduler
from scheduler.models import Execution
from scheduler.tasks_backend import CELERY_TASK, SchedulerBackend, idempotency_key
from tests.support import framework_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def finished(result: TaskResult, timeout: float = 30.0) -> TaskResult:
    def done() -> bool:
        result.refresh()
        return result.is_finished

    assert wait_until(done, timeout=timeout, interval=0.1), f"result {result.id} still {result.status}"
    return result


def test_tasks_backend__enqueue_runs_the_task_on_a_worker_and_reads_back_its_result(
    celery_processes: Callable[..., CeleryProcess],
) -> None:
    assert isinstance(task_backends["default"], SchedulerBackend)
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When a task is enqueued through the framework
    result = framework_tasks.add.enqueue(2, 3)
    # Then it is an Execution, ready at once, then run by the worker
    assert result.status == TaskResultStatus.READY
    execution = Execution.objects.get(pk=int(result.id))
    assert (execution.task, execution.trigger) == (CELERY_TASK, Execution.Trigger.SUBMIT)
    finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert (result.args, result.kwargs) == ([2, 3], {})
    assert result.started_at <= result.finished_at and result.worker_ids
    # And any process reads it back by id through the framework
    again = framework_tasks.add.get_result(result.id)
    assert (again.status, again.return_value) == (TaskResultStatus.SUCCESSFUL, 5)


def test_tasks_backend__errors_context_and_idempotency(celery_processes: Callable[..., CeleryProcess]) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # A task that raises fails with the framework's error: its exception class and traceback
    failed = finished(framework_tasks.explode.enqueue("boom"))
    assert failed.status == TaskResultStatus.FAILED
    [error] = failed.errors
    assert error.exception_class is ValueError
    assert "boom" in error.traceback and "Traceback" in error.traceback
    # A task that takes the context sees its attempt and its own result id
    described = finished(framework_tasks.describe.enqueue(label="x"))
    assert described.return_value == {"label": "x", "attempt": 1, "id": described.id}
    # One idempotency key, one execution, however often it is enqueued
    with idempotency_key("receipt-42"):
        first = framework_tasks.add.enqueue(1, 1)
        second = framework_tasks.add.enqueue(1, 1)
    assert first.id == second.id
    assert Execution.objects.filter(idempotency_key="receipt-42").count() == 1
    assert finished(first).return_value == 2


def test_tasks_backend__a_message_naming_a_plain_function_runs_nothing(
    celery_processes: Callable[..., CeleryProcess],
) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # Given a message of the backend's Celery task naming a function that is not a @task
    execution = scheduler.submit(CELERY_TASK, ["tests.support.framework_tasks.not_a_task", [], {}])
    # Then the worker refuses to run it
    assert wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status=Execution.Status.FAILED).exists(), timeout=30
    )
    execution.refresh_from_db()
    assert "is not a task" in execution.error
    assert execution.result is None
