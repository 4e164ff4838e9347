"""Tasks used by the acceptance tests; workers load them with ``--include tests.tasks``.

Each writes its side effects to Redis lists the test reads back, so a test can
tell how many times, and when, a body really ran.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

import scheduler

#: Redis list every run of ``tests.record`` appends to: the side-effect log.
RUNS_KEY = "tests:runs"
#: Redis list of ``{"event": "start"|"stop", ...}`` entries from ``tests.record``.
EVENTS_KEY = "tests:events"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("TEST_RUNS_REDIS_URL") or settings.REDIS_URL)


def _event(client: redis.Redis, key: str, **fields: Any) -> None:
    client.rpush(key, json.dumps({"at": time.time(), "pid": os.getpid(), **fields}))


@shared_task(name="tests.record", bind=True)
def record(self: Any, label: str = "", seconds: float = 0.0) -> str:
    """Log a start event, optionally sleep, log a stop event and one entry in the run log."""
    client = _client()
    execution = scheduler.current_execution()
    execution_id, attempt = (execution.pk, execution.attempt) if execution else (None, None)
    _event(client, EVENTS_KEY, event="start", label=label, execution_id=execution_id, attempt=attempt)
    if seconds:
        time.sleep(seconds)
    _event(client, EVENTS_KEY, event="stop", label=label, execution_id=execution_id, attempt=attempt)
    client.rpush(RUNS_KEY, json.dumps({"task_id": self.request.id, "label": label, "execution_id": execution_id}))
    client.close()
    return label


@shared_task(name="tests.stubborn")
def stubborn(seconds: float) -> None:
    """Sleep through the soft time limit, so only the hard limit can stop it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except SoftTimeLimitExceeded:
            pass


@shared_task(name="tests.flaky")
def flaky(key: str, failures: int) -> int:
    """Fail the first ``failures`` calls for ``key``, then succeed; log each attempt."""
    client = _client()
    _event(client, f"tests:attempts:{key}")
    calls = client.incr(f"tests:calls:{key}")
    client.close()
    if calls <= failures:
        raise RuntimeError(f"planned failure {calls} of {failures}")
    return calls


@shared_task(name="tests.fail")
def fail(message: str = "planned failure") -> None:
    """Always raise."""
    raise RuntimeError(message)


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    """Return the side-effect log, oldest first."""
    return [json.loads(item) for item in client.lrange(RUNS_KEY, 0, -1)]


def events(client: redis.Redis, key: str = EVENTS_KEY) -> list[dict[str, Any]]:
    """Return an event log, oldest first."""
    return [json.loads(item) for item in client.lrange(key, 0, -1)]
