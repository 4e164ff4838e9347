"""``@task`` functions of Django's tasks framework, run by real workers through ``SchedulerBackend``."""

from __future__ import annotations

from typing import Any

from django_tasks import TaskContext, task


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def describe(context: TaskContext, label: str) -> dict[str, Any]:
    return {"label": label, "attempt": context.attempt, "id": context.task_result.id}


def not_a_task() -> str:
    return "must never run from a message"
