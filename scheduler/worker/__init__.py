"""The worker side: the guard every task runs under, its claim renewer, the running execution, the heartbeat.

``scheduler.worker.ExecutionTask`` is the name a Celery app's ``task_cls``
gives; the class lives in ``scheduler.worker.task`` and is loaded on first
use, so that importing a module of this package loads no models before
Django's app registry is ready.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.worker.task import ExecutionTask

__all__ = ["ExecutionTask"]


def __getattr__(name: str) -> Any:
    if name != "ExecutionTask":
        raise AttributeError(f"module 'scheduler.worker' has no attribute {name!r}")
    from scheduler.worker.task import ExecutionTask

    return ExecutionTask
