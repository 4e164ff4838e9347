"""SCHEDULER_LOG_FORMAT=json: a real beat writes JSON lines with its instance id and lease token."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from scheduler.owners import schedules
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_beat_json_logs_carry_instance_id_and_token(celery_processes: Callable[..., CeleryProcess]) -> None:
    schedules.create(name="tick", task="scheduler.echo", interval=1)
    beat = celery_processes("beat", "beat1", log_format="json")

    def scheduler_lines() -> list[dict]:
        return [json.loads(line) for line in beat.log().splitlines() if line.startswith("{")]

    assert wait_until(lambda: any(line.get("action") == "dispatched" for line in scheduler_lines()), timeout=30), (
        beat.log()[-2000:]
    )
    lines = scheduler_lines()
    acquired = next(line for line in lines if line.get("action") == "lease_acquired")
    dispatched = next(line for line in lines if line.get("action") == "dispatched")
    assert acquired["instance_id"] == dispatched["instance_id"]
    assert dispatched["token"] == acquired["token"] and dispatched["schedule"] == "tick"
    assert all("instance_id" in line for line in lines)
