"""Built-in tasks: housekeeping the built-in schedules run, and small ones for demos and smoke checks.

Each is guarded (``base=ExecutionTask``) whatever the host app's task class,
so that their executions are recorded when the host guards only some tasks.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from celery import shared_task

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.exceptions import PruneRefused
from scheduler.ops import audit, operations
from scheduler.worker.task import ExecutionTask

#: Longest age a prune accepts: beyond it the cutoff would predate year 1.
MAX_PRUNE_DAYS = 365_000


def _count(value: Any, *, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum and value > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum else f"at least {minimum}"
        raise PruneRefused(f"{name} must be a whole number {bounds}, got {value!r}; nothing was deleted.")
    return value


@shared_task(name="scheduler.prune_executions", base=ExecutionTask)
def prune_executions(older_than_days: int | None = None, keep_last: int | None = None) -> dict[str, Any]:
    """Delete finished executions older than ``older_than_days``, keeping each schedule's newest ``keep_last``.

    Audit events older than ``older_than_days`` go too, never this prune's
    own: its event (by "system") is committed before the work, with the
    cutoff, and completed with both counts after.

    The built-in schedule "builtin: prune executions" runs this daily. Each
    argument, when given (in that schedule's kwargs), wins over its setting,
    ``SCHEDULER_PRUNE_OLDER_THAN_DAYS`` or ``SCHEDULER_PRUNE_KEEP_LAST``.
    Age is counted on the database clock, as by the ``prune_executions`` command.
    """
    days = _count(
        settings.PRUNE_OLDER_THAN_DAYS if older_than_days is None else older_than_days,
        name="older_than_days",
        minimum=1,
        maximum=MAX_PRUNE_DAYS,
    )
    keep = _count(settings.PRUNE_KEEP_LAST if keep_last is None else keep_last, name="keep_last", minimum=0)
    cutoff = dbclock.now() - timedelta(days=days)
    pruned = operations.prune_history(actor=audit.SYSTEM, older_than=cutoff, keep_last=keep, audit_events=True)
    return {
        "older_than": cutoff.isoformat(),
        "keep_last": keep,
        "deleted": pruned.report.deleted,
        "audit_events_deleted": pruned.audit_events_deleted,
    }


@shared_task(name="scheduler.echo", base=ExecutionTask)
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments it was called with."""
    return {"args": list(args), "kwargs": kwargs}


@shared_task(name="scheduler.sleep", base=ExecutionTask)
def sleep(seconds: float = 1.0) -> float:
    """Sleep for ``seconds`` and return it; handy for timeout and overlap demos."""
    time.sleep(seconds)
    return seconds


@shared_task(name="scheduler.django_task", base=ExecutionTask)
def django_task(path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run the ``@task`` function at ``path``: what ``SchedulerBackend.enqueue()`` sends (``scheduler.tasks_backend``)."""
    from scheduler import tasks_backend
    from scheduler.worker.task import current_execution

    running = current_execution()
    return tasks_backend.run(path, args, kwargs, execution_id=running.execution.pk if running else None)
