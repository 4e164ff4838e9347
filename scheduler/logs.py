"""Structured logging: JSON lines carrying the scheduler's context on every record.

``SCHEDULER_LOG_FORMAT=json`` (environment) switches the ``scheduler``
loggers to one JSON object per line. Whatever the format, every record gets
the context of the process that writes it: the beat replica's instance id
and lease token, or the execution id and schedule a worker is running.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

#: Keys a record may carry, from ``extra=`` or from the bound context.
CONTEXT_KEYS = ("action", "instance_id", "token", "execution_id", "schedule")

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("scheduler_log_context", default={})


def bind(**values: Any) -> None:
    """Add ``values`` to the context of every later log record of this thread."""
    _context.set({**_context.get(), **{key: value for key, value in values.items() if value is not None}})


def unbind(*keys: str) -> None:
    _context.set({key: value for key, value in _context.get().items() if key not in keys})


@contextmanager
def bound(**values: Any) -> Iterator[None]:
    """Bind ``values`` for the duration of a block."""
    token = _context.set({**_context.get(), **{key: value for key, value in values.items() if value is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copy the bound context onto each record (an explicit ``extra=`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context keys, exception."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value is not None:
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)
