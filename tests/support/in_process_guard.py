"""A body run in the test process under the real execution guard (Celery's ``apply``).

``before_start`` claims the execution, ``__call__`` records the outcome,
exactly as in a worker's pool process; ``apply`` passes the body a callable
as is, unserialised, so a test says what the body does in a lambda. The
acceptance tests do the same with real workers. A module of such tests
uses the ``no_background_renewal`` fixture (``tests/integration/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import shared_task

from scheduler import dbclock
from scheduler.models import Execution


@shared_task(name="tests.integration.body")
def body(step: Callable[[], Any]) -> Any:
    """Run ``step`` as the task's body."""
    return step()


def queued(**fields: Any) -> Execution:
    """An execution of ``body``, queued and due now."""
    key = f"in-process:{Execution.objects.count()}"
    return Execution.objects.create(
        idempotency_key=key,
        task=body.name,
        celery_task_id=key,
        scheduled_for=dbclock.now(),
        status=Execution.Status.QUEUED,
        **fields,
    )


def run(execution: Execution, step: Callable[[], Any]) -> Any:
    """Run ``step`` as the body of ``execution`` under the guard; return its value or raise its error."""
    headers = {Execution.MESSAGE_HEADER: execution.pk}
    return body.apply(kwargs={"step": step}, task_id=execution.celery_task_id, headers=headers, throw=True).get()


def fresh(execution: Execution) -> Execution:
    """The execution's row as the database holds it now."""
    return Execution.objects.get(pk=execution.pk)
