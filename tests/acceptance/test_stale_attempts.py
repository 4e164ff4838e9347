"""A stale attempt cannot act on its successor's claim: real workers, real pool children (issue 15).

Worker A claims an execution as attempt 1, then stops renewing (its renew
interval is longer than its claim), so its claim expires while its body
still runs; another worker B takes the execution over as attempt 2, with
the same Celery task id (as a re-send by reconcile would have). What A's
main process does afterwards on behalf of its pool child (record a hard
time limit, release the claim of a child that died) must leave B's row as
B wrote it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db.models import F
from django_celery_results.models import TaskResult

import scheduler
from scheduler import dbclock
from scheduler.models import Execution
from scheduler.owners import executions
from tests.support import tasks  # also registers the tasks submit() checks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
#: Worker A's claim runs out after a second and is never renewed in time.
EXPIRING = {"claim_seconds": 1, "claim_renew_seconds": 600}
SUCCESSOR = "b@elsewhere:4242"
#: Columns B's claim consists of.
CLAIM_STATE = ("status", "attempt", "worker", "claim_expires_at", "finished_at", "error")


def running_on(execution: Execution, worker: CeleryProcess) -> Execution:
    claimed = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status=Execution.Status.RUNNING).first(), timeout=20
    )
    assert claimed, worker.log()[-3000:]
    return claimed  # type: ignore[return-value]


def held_to_its_hard_limit(execution: Execution) -> None:
    """Wait for the worker's second UPDATE, which makes a claim with a timeout last to its hard limit.

    Cutting the claim short before it lands would be undone by it.
    """
    assert wait_until(
        lambda: Execution.objects.filter(
            pk=execution.pk, claim_expires_at__gte=F("started_at") + timedelta(seconds=3)
        ).exists(),
        timeout=10,
    ), claim_state(execution)


def taken_over(execution: Execution) -> dict[str, Any]:
    """Wait for A's claim to expire, claim the execution as worker B (attempt 2); return B's row state."""
    assert wait_until(lambda: Execution.objects.claimable().filter(pk=execution.pk).exists(), timeout=10)
    successor = executions.claim(
        worker=SUCCESSOR, task=execution.task, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    assert successor is not None and successor.attempt == 2
    return claim_state(execution)


def claim_state(execution: Execution) -> dict[str, Any]:
    return Execution.objects.filter(pk=execution.pk).values(*CLAIM_STATE).get()


def test_old_attempt_hard_time_limit__does_not_touch_the_successor(
    celery_processes: Start, settings: Any, redis_client: redis.Redis
) -> None:
    settings.SCHEDULER_TIMEOUT_GRACE_SECONDS = 1.0
    worker_a = celery_processes("worker", "a", **EXPIRING)
    worker_a.wait_for_log(r"ready\.")
    # Given attempt 1 on worker A, a body that ignores its soft limit and
    # will be killed by its hard limit (timeout 3 s + grace 1 s)
    execution = scheduler.submit("tests.stubborn", args=[30], timeout=3)
    running_on(execution, worker_a)
    held_to_its_hard_limit(execution)
    # When B takes the execution over as attempt 2 (forced: a claim with a
    # timeout lasts until its hard limit, so here A's claim is cut short, as a
    # worker configured with a shorter grace than A's would see it), and then
    # A's hard limit strikes
    Execution.objects.filter(pk=execution.pk).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))
    successor = taken_over(execution)
    worker_a.wait_for_log(r"hard time limit after its claim moved on; its outcome is its successor's")
    # Then B's row keeps B's claim: not timed out, not finished
    assert not wait_until(lambda: claim_state(execution) != successor, timeout=3), claim_state(execution)
    assert claim_state(execution)["status"] == Execution.Status.RUNNING
    # and no failure is stored for the task id, which is B's now: B's outcome will be
    assert not TaskResult.objects.filter(task_id=execution.celery_task_id).exists(), list(
        TaskResult.objects.values("result", "traceback", "worker")
    )
    # nor is a failure reported to task_failure receivers (nor errbacks, in the same path)
    assert not tasks.events(redis_client, tasks.FAILURES_KEY)


def test_old_attempt_lost_child__does_not_release_the_successors_claim(celery_processes: Start) -> None:
    worker_a = celery_processes("worker", "a", **EXPIRING)
    worker_a.wait_for_log(r"ready\.")
    # Given attempt 1 running in one of A's pool children
    execution = scheduler.submit("tests.record", kwargs={"label": "stale", "seconds": 30})
    child = int(running_on(execution, worker_a).worker.rsplit(":", 1)[1])
    # When B takes the execution over as attempt 2, and then A's child dies
    successor = taken_over(execution)
    os.kill(child, signal.SIGKILL)
    # Then A's main process leaves B's claim alone: the message Celery
    # requeues finds the execution held and is refused as a duplicate
    worker_a.wait_for_log(r"duplicate delivery of execution", timeout=30)
    assert claim_state(execution) == successor
