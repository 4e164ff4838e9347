"""A backend for Django's tasks framework: ``@task`` functions run as guarded executions.

Django 6 has the framework as ``django.tasks``; Django 5.2 gets it from the
``django-tasks`` backport (``pip install django-leader-beat[tasks]``)::

    TASKS = {"default": {"BACKEND": "scheduler.tasks_backend.SchedulerBackend"}}

``.enqueue()`` goes through ``scheduler.submit()``: the call is recorded as
an Execution (visible in the admin and the API, retried and reconciled like
any other), sent after the transaction commits, and run by a Celery worker
under the guard. Every ``@task`` runs through one Celery task,
``scheduler.django_task``, which imports the function by its path and runs
it only if that path names a ``@task``: a message cannot make a worker run
an arbitrary function. The result's id is the Execution's id, so
``get_result()`` works from any process.

An idempotency key, which the framework has no word for, comes from the
block around the call: ``with idempotency_key("receipt-42"): send.enqueue()``
records one execution however many times it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from django.utils import timezone
from django.utils.module_loading import import_string

try:  # Django 6
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
except ImportError:  # Django 5.2 and the backport
    from django_tasks import TaskContext, TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued

from scheduler.models import Execution

#: The Celery task every ``@task`` runs through (reserved: no tenant may schedule it).
CELERY_TASK = "scheduler.django_task"
#: The framework's default queue is Celery's default queue.
DEFAULT_QUEUE = "default"

_STATUS: dict[str, Any] = {
    Execution.Status.PENDING: TaskResultStatus.READY,
    Execution.Status.QUEUED: TaskResultStatus.READY,
    Execution.Status.RETRYING: TaskResultStatus.READY,
    # Reconcile runs a lost attempt again or fails it: not finished yet.
    Execution.Status.LOST: TaskResultStatus.READY,
    Execution.Status.RUNNING: TaskResultStatus.RUNNING,
    Execution.Status.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
}

_idempotency_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("idempotency_key", default=None)


@contextlib.contextmanager
def idempotency_key(key: str) -> Iterator[None]:
    """Give the ``.enqueue()`` calls in this block the idempotency key ``key``."""
    token = _idempotency_key.set(key)
    try:
        yield
    finally:
        _idempotency_key.reset(token)


class SchedulerBackend(BaseTaskBackend):
    """Enqueues through ``scheduler.submit()``; reads results back from the Execution."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    # Celery's priorities mean different things on each broker (``submit()``): none is promised here.
    supports_priority = False

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        from scheduler.outbox.submissions import submit

        self.validate_task(task)
        countdown = None
        if task.run_after is not None:
            countdown = max(0.0, (task.run_after - timezone.now()).total_seconds())
        execution = submit(
            CELERY_TASK,
            [task.module_path, list(args), dict(kwargs)],
            idempotency_key=_idempotency_key.get(),
            queue=None if task.queue_name == DEFAULT_QUEUE else task.queue_name,
            countdown=countdown,
        )
        result = _result(task, execution, self.alias)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        execution = None
        if str(result_id).isdigit():
            execution = Execution.objects.filter(pk=int(result_id), task=CELERY_TASK).first()
        if execution is None:
            raise TaskResultDoesNotExist(result_id)
        return _result(task_at(execution.args[0]), execution, self.alias)


def task_at(path: str) -> Task:
    """Return the ``@task`` at the dotted ``path``; raise ``InvalidTaskError`` if there is none."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise InvalidTaskError(f"{path!r} cannot be imported: {exc}") from None
    if not isinstance(found, Task):
        raise InvalidTaskError(f"{path!r} is not a task (decorate it with @task)")
    return found


def run(path: str, args: list[Any], kwargs: dict[str, Any], *, execution_id: int | None) -> Any:
    """Run the ``@task`` at ``path`` (the body of ``scheduler.django_task``)."""
    task = task_at(path)
    if task.takes_context:
        # None finds no row: Execution.DoesNotExist, as for a deleted execution.
        execution = Execution.objects.get(pk=execution_id)  # type: ignore[misc]
        context = TaskContext(task_result=_result(task, execution, task.backend))
        return task.call(context, *args, **kwargs)
    return task.call(*args, **kwargs)


def _result(task: Task, execution: Execution, backend: str) -> TaskResult:
    status = _STATUS.get(execution.status, TaskResultStatus.FAILED)
    result = TaskResult(
        task=task,
        id=str(execution.pk),
        status=status,
        enqueued_at=execution.created_at,
        started_at=execution.started_at,
        finished_at=execution.finished_at if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
        last_attempted_at=execution.started_at,
        args=list(execution.args[1]),
        kwargs=dict(execution.args[2]),
        backend=backend,
        errors=[_error(entry, execution) for entry in execution.attempt_history()],
        worker_ids=[execution.worker] if execution.worker else [],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        # The framework's results are frozen; its own database backend sets the value the same way.
        object.__setattr__(result, "_return_value", execution.result)
    return result


def _error(entry: dict[str, Any], execution: Execution) -> TaskError:
    """One failed attempt as the framework's error: the exception's class path and its traceback.

    The worker stores ``"ExceptionName: message"``; the last attempt also its
    traceback, whose last line names the class with its module (but for builtins).
    """
    last = entry.get("attempt") == execution.attempt and execution.traceback
    text = execution.traceback if last else entry.get("error", "")
    final_line = (text.strip().splitlines() or [""])[-1] if last else text
    name = final_line.split(":", 1)[0].strip() or "Exception"
    return TaskError(exception_class_path=name if "." in name else f"builtins.{name}", traceback=text)
