"""JSON log lines carry the bound scheduler context."""

from __future__ import annotations

import json
import logging

from scheduler import logs


def _record(message: str = "dispatch x", **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("scheduler.beat", logging.INFO, __file__, 1, message, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_line__has_message_level_and_bound_context() -> None:
    with logs.bound(instance_id="host-1-abc", token=7):
        record = _record(action="dispatched")
        logs.ContextFilter().filter(record)
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["message"] == "dispatch x" and line["level"] == "INFO" and line["logger"] == "scheduler.beat"
    assert (line["instance_id"], line["token"], line["action"]) == ("host-1-abc", 7, "dispatched")
    assert "execution_id" not in line


def test_explicit_extra_wins_over_the_bound_context() -> None:
    with logs.bound(schedule=3):
        record = _record(schedule="nightly")
        logs.ContextFilter().filter(record)
    assert json.loads(logs.JsonFormatter().format(record))["schedule"] == "nightly"


def test_bind_and_unbind() -> None:
    with logs.bound():
        logs.bind(execution_id=5, schedule=None)
        record = _record()
        logs.ContextFilter().filter(record)
        assert record.execution_id == 5 and not hasattr(record, "schedule")
        logs.unbind("execution_id")
        later = _record()
        logs.ContextFilter().filter(later)
        assert not hasattr(later, "execution_id")


def test_exception_included() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        import sys

        record = logging.LogRecord("scheduler", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: bad" in json.loads(logs.JsonFormatter().format(record))["exception"]
