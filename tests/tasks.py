"""Tasks used by the acceptance tests; workers load them with ``--include tests.tasks``."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import shared_task
from django.conf import settings

#: Redis list every run of ``tests.record`` appends to: the side-effect log.
RUNS_KEY = "tests:runs"


@shared_task(name="tests.record", bind=True)
def record(self: Any, label: str = "", seconds: float = 0.0) -> str:
    """Append one entry per run to the side-effect log, optionally after sleeping."""
    if seconds:
        time.sleep(seconds)
    client = redis.Redis.from_url(os.environ.get("TEST_RUNS_REDIS_URL") or settings.REDIS_URL)
    headers = self.request.headers or {}
    client.rpush(
        RUNS_KEY,
        json.dumps(
            {
                "task_id": self.request.id,
                "label": label,
                "execution_id": headers.get("execution_id", getattr(self.request, "execution_id", None)),
            }
        ),
    )
    client.close()
    return label


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    """Return the side-effect log, oldest first."""
    return [json.loads(item) for item in client.lrange(RUNS_KEY, 0, -1)]
