"""Real beat and worker: a pause holds scheduled and ad-hoc work it matches while the rest runs; resume releases it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import scheduler
import tests.support.tasks  # noqa: F401 -- registers the test tasks with the Celery app, as submit() checks
from scheduler.models import Execution, Schedule
from tests.integration.command_support import run
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
#: How long the held work is watched not running while the rest runs.
HELD_FOR_SECONDS = 6

#: For each kind of pause: its options, and the (queue, task, tenant) of the held work and of the free work.
KINDS = {
    "queue": (("--queue", "held"), ("held", "tests.record", ""), ("free", "tests.record", "")),
    "task": (("--task", "tests.rec*"), ("free", "tests.record", ""), ("free", "tests.steps", "")),
    "tenant": (("--tenant", "acme"), ("free", "tests.record", "acme"), ("free", "tests.record", "")),
    "all": (("--all",), ("free", "tests.record", "acme"), None),
}


def _work(label: str, queue: str, task: str, tenant: str) -> tuple[Schedule, Execution]:
    """An every-second schedule and one ad-hoc submission of that queue, task and tenant."""
    kwargs = {"count": 1, "seconds": 0} if task == "tests.steps" else {"label": label}
    schedule = make_schedule(f"every-second-{label}", task=task, queue=queue, tenant=tenant, interval=1, kwargs=kwargs)
    submitted = scheduler.submit(task, kwargs=kwargs, queue=queue or None, tenant=tenant)
    return schedule, submitted


def _succeeded(schedule: Schedule) -> int:
    return Execution.objects.filter(schedule=schedule, status=Status.SUCCEEDED).count()


def _status(execution: Execution) -> str:
    return Execution.objects.get(pk=execution.pk).status


@pytest.mark.parametrize("kind", KINDS)
def test_pause__holds_what_it_matches_while_the_rest_runs_and_resume_releases_it(
    celery_processes: Start, kind: str
) -> None:
    options, held_shape, free_shape = KINDS[kind]
    celery_processes("worker", "w1", queues="held,free", concurrency=2).wait_for_log(r"ready\.")
    # Given work the pause will match, paused before it starts
    run("pause", *options, "--reason", "test")
    held_schedule, held_submission = _work("held", *held_shape)
    free = _work("free", *free_shape) if free_shape else None
    celery_processes("beat", "beat1")

    # When the beat and the worker run for a while
    if free is not None:
        free_schedule, free_submission = free
        # Then the free work runs: its schedule fires and succeeds, its submission succeeds
        assert wait_until(lambda: _succeeded(free_schedule) >= 3, timeout=30)
        assert wait_until(lambda: _status(free_submission) == Status.SUCCEEDED, timeout=30)
    else:
        time.sleep(HELD_FOR_SECONDS)
    # while the held work does not: no slot of its schedule is recorded, its submission waits queued
    assert not Execution.objects.filter(schedule=held_schedule).exists()
    assert _status(held_submission) == Status.QUEUED

    # When the pause is lifted
    out = run("resume", *options)
    assert out.splitlines()[-1] == "1 held execution(s) sent again."
    # Then the held submission runs once, and the schedule fires again
    assert wait_until(lambda: _status(held_submission) == Status.SUCCEEDED, timeout=30)
    assert wait_until(lambda: _succeeded(held_schedule) >= 2, timeout=30)
    assert Execution.objects.get(pk=held_submission.pk).attempt == 1
