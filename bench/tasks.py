"""Tasks the benchmarks run; workers load them with ``--include bench.tasks``."""

from __future__ import annotations

from celery import Task, shared_task


@shared_task(name="bench.noop")
def noop() -> None:
    """Do nothing, under the execution guard (the project's default task base)."""


@shared_task(name="bench.noop_plain", base=Task)
def noop_plain() -> None:
    """Do nothing, as a plain Celery task: the baseline."""
