"""A Celery task platform for Django with a leader-gated beat.

The public API is ``scheduler.submit(...)``, ``scheduler.current_execution()``
and ``scheduler.fenced()``.
They are resolved on first use so that importing this package loads no
models before Django's app registry is ready.
"""

from __future__ import annotations

from typing import Any

#: The release (PEP 440); CHANGELOG.md says what each one changed.
__version__ = "0.1.0"

_PUBLIC = {
    "submit": "scheduler.outbox.submissions",
    "current_execution": "scheduler.worker.task",
    "fenced": "scheduler.worker.task",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_PUBLIC[name]), name)
