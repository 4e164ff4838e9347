"""Small built-in tasks for demos and smoke checks."""
from __future__ import annotations

import time
from typing import Any

from celery import shared_task


@shared_task(name="scheduler.echo")
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments it was called with."""
    return {"args": list(args), "kwargs": kwargs}


@shared_task(name="scheduler.sleep")
def sleep(seconds: float = 1.0) -> float:
    """Sleep for ``seconds`` and return it; handy for timeout and overlap demos."""
    time.sleep(seconds)
    return seconds
