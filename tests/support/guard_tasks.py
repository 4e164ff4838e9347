"""Tasks that choose their guard: one guarded per task, one plain, one opted out of a process-wide guard.

Each appends ``<task>:<label>`` to a Redis list, so a test sees every body that ran.
"""

from __future__ import annotations

from celery import shared_task

from scheduler.worker import ExecutionTask
from tests.support.tasks import _client

#: Redis list each body appends to.
BODIES_KEY = "tests:guard-bodies"


def _ran(task: str, label: str) -> str:
    _client().rpush(BODIES_KEY, f"{task}:{label}")
    return label


@shared_task(name="tests.guard.per_task", base=ExecutionTask)
def per_task(label: str) -> str:
    """Guarded on its own, whatever the app's task class."""
    return _ran("per_task", label)


@shared_task(name="tests.guard.plain")
def plain(label: str) -> str:
    """The app's task class: plain Celery on an app without the guard, guarded on the demo project."""
    return _ran("plain", label)


@shared_task(name="tests.guard.opted_out", guarded=False)
def opted_out(label: str) -> str:
    """Never guarded, even on an app whose task class is ``ExecutionTask``."""
    return _ran("opted_out", label)
