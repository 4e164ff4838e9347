"""Real worker: a run now with other arguments, queue and priority runs the body once with them, and records them."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis

from scheduler.models import AuditEvent, Execution
from tests.integration.command_support import run
from tests.support import tasks as test_tasks
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]


def test_run_now_with_overrides__the_body_runs_once_with_them_and_the_execution_records_them(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given a schedule of the default queue, and a worker that consumes only the queue "urgent"
    schedule = make_schedule("report", task="tests.record", kwargs={"label": "stored"}, interval=3600)
    worker = celery_processes("worker", "w1", queues="urgent")
    worker.wait_for_log(r"ready\.")

    # When an operator runs it now with other keyword arguments, on "urgent", at priority 3
    arguments = ("--kwargs", '{"label": "override"}', "--queue", "urgent", "--priority", "3")
    recorded = json.loads(run("schedules", "run-now", "report", *arguments, "--json"))["execution"]

    # Then the body runs once, with the overridden arguments (it could only be reached on "urgent")
    assert wait_until(
        lambda: Execution.objects.filter(pk=recorded["id"], status=Execution.Status.SUCCEEDED).exists(), timeout=30
    ), worker.log()[-3000:]
    assert [(run["label"], run["execution_id"]) for run in test_tasks.runs(redis_client)] == [
        ("override", recorded["id"])
    ]
    # and the execution records what it ran with, while the schedule keeps its own values
    execution = Execution.objects.get(pk=recorded["id"])
    assert (execution.kwargs, execution.queue, execution.priority) == ({"label": "override"}, "urgent", 3)
    schedule.refresh_from_db()
    assert (schedule.kwargs, schedule.queue, schedule.priority) == ({"label": "stored"}, "", None)
    # and the audit event says what was replaced, and by what
    event = AuditEvent.objects.get(action="run_now")
    assert event.changes == {
        "execution": [None, execution.pk],
        "kwargs": [{"label": "stored"}, {"label": "override"}],
        "queue": ["", "urgent"],
        "priority": [None, 3],
    }
