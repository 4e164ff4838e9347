"""A body whose claim is gone stops: real workers, real pool children (issue 15, item 3).

Each test runs ``tests.steps``, a body that works in small steps and logs
every finished step (with its attempt and pid) to Redis, under a short
claim (3 s, renewed every 0.5 s). The claim then moves on while the body
still exists: a successor takes it over while the body's pool child is
frozen (SIGSTOP), or an operator cancels it. The body must stop within a
second of its process noticing, and record nothing.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from django_celery_results.models import TaskResult

import scheduler
from project.celery import app
from scheduler import dbclock
from scheduler.models import Execution
from scheduler.ops import reconcile
from scheduler.owners import executions
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, exited, wait_until, worker_argv

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
#: A claim short enough to run out while a test waits.
SHORT_CLAIM = {"claim_seconds": 3, "claim_renew_seconds": 0.5}
#: How long after its process resumes (or its claim is cancelled) a body may still finish a step.
STOP_WITHIN_SECONDS = 1.0
STEPS = 25
STEP_SECONDS = 0.2
Status = Execution.Status


def steps_of(redis_client: redis.Redis, execution: Execution, attempt: int) -> list[dict[str, Any]]:
    return [
        step
        for step in test_tasks.events(redis_client, test_tasks.STEPS_KEY)
        if step["execution_id"] == execution.pk and step["attempt"] == attempt
    ]


def running_steps(redis_client: redis.Redis, execution: Execution, attempt: int) -> Execution:
    """Wait until ``attempt`` of ``execution`` runs and has finished a step; return the row."""
    assert wait_until(lambda: steps_of(redis_client, execution, attempt), timeout=20), f"attempt {attempt} never ran"
    row = Execution.objects.get(pk=execution.pk)
    assert (row.status, row.attempt) == (Status.RUNNING, attempt)
    return row


def pool_child(row: Execution) -> int:
    """The pid of the pool process that holds ``row`` (its ``worker`` is ``name@host:pid``)."""
    return int(row.worker.rsplit(":", 1)[1])


def test_frozen_body__stops_on_resume_and_the_successors_outcome_is_recorded(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    workers = [celery_processes("worker", name, **SHORT_CLAIM) for name in ("a", "b")]
    for worker in workers:
        worker.wait_for_log(r"ready\.")
    # Given a body working in steps as attempt 1, in one pool child
    execution = scheduler.submit("tests.steps", args=[STEPS, STEP_SECONDS], max_retries=1)
    frozen = pool_child(running_steps(redis_client, execution, 1))
    # When that child is frozen past its claim, reconcile (as the leader runs it)
    # finds the claim expired, and the retry runs as attempt 2 elsewhere
    os.kill(frozen, signal.SIGSTOP)
    try:
        assert wait_until(lambda: Execution.objects.claimable().filter(pk=execution.pk).exists(), timeout=10)
        report = reconcile.reconcile(now=dbclock.now(), app=app)
        assert [change.kind for change in report.changes if change.execution_id == execution.pk] == ["lost_retrying"]
        successor = running_steps(redis_client, execution, 2)
        assert pool_child(successor) != frozen
    finally:
        # ... and then the frozen child resumes
        resumed_at = time.time()
        os.kill(frozen, signal.SIGCONT)
    # Then the resumed body stops: its child exits within a second, having finished no step after that
    assert wait_until(lambda: exited(frozen), timeout=10), "the resumed pool child went on"
    late = [step for step in steps_of(redis_client, execution, 1) if step["at"] > resumed_at + STOP_WITHIN_SECONDS]
    assert not late, late
    assert len(steps_of(redis_client, execution, 1)) < STEPS
    # And the successor's outcome is the one recorded; nothing failed
    done = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status__in=Execution.FINAL_STATUSES).first(), timeout=30
    )
    assert done, Execution.objects.get(pk=execution.pk).status
    assert (done.status, done.attempt, done.worker, done.result) == (Status.SUCCEEDED, 2, successor.worker, STEPS)
    assert len(steps_of(redis_client, execution, 2)) == STEPS
    assert not Execution.objects.filter(status=Status.FAILED).exists()
    # And whatever Celery does with the lost child's message (requeued at once,
    # or only after the broker's visibility timeout), it never runs a third attempt
    assert any("stopping its body" in worker.log() for worker in workers)
    assert not wait_until(lambda: steps_of(redis_client, execution, 3), timeout=5)
    assert Execution.objects.get(pk=execution.pk).attempt == 2


def test_cancelled_body__stops_without_the_revoke_and_records_nothing(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    worker = celery_processes("worker", "a", **SHORT_CLAIM)
    worker.wait_for_log(r"ready\.")
    # Given a body working in steps
    execution = scheduler.submit("tests.steps", args=[STEPS, STEP_SECONDS])
    child = pool_child(running_steps(redis_client, execution, 1))
    # When an operator cancels it, and no revoke reaches the worker (as when
    # duplicate messages share a task id): only the claim tells the body
    cancelled_at = time.time()
    assert executions.cancel(execution.pk, reason="Cancelled by an operator", now=dbclock.now())
    # Then the body stops within a renew interval and a second: its child exits
    assert wait_until(lambda: exited(child), timeout=10), worker.log()[-3000:]
    deadline = cancelled_at + SHORT_CLAIM["claim_renew_seconds"] + STOP_WITHIN_SECONDS
    late = [step for step in steps_of(redis_client, execution, 1) if step["at"] > deadline]
    assert not late, late
    # And the execution stays cancelled with no outcome; the requeued message is refused
    worker.wait_for_log(r"duplicate delivery of execution", timeout=30)
    row = Execution.objects.get(pk=execution.pk)
    assert (row.status, row.attempt, row.result, row.error) == (Status.CANCELLED, 1, None, "Cancelled by an operator")
    assert len(steps_of(redis_client, execution, 1)) < STEPS


def test_cancelled_body_in_a_threads_pool__gets_claim_lost_at_its_next_step(
    process_env: dict[str, str], tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Given a worker with the threads pool (no pool child to exit), running a body in steps
    argv = [("threads" if arg == "prefork" else arg) for arg in worker_argv("t")]
    env = {**process_env, **{f"SCHEDULER_{key.upper()}": str(value) for key, value in SHORT_CLAIM.items()}}
    worker = CeleryProcess("t", argv, env, tmp_path / "t.log").start()
    try:
        worker.wait_for_log(r"ready\.")
        execution = scheduler.submit("tests.steps", args=[STEPS, STEP_SECONDS])
        running_steps(redis_client, execution, 1)
        # When an operator cancels it (no revoke)
        cancelled_at = time.time()
        assert executions.cancel(execution.pk, reason="Cancelled by an operator", now=dbclock.now())
        # Then ClaimLost is raised in the body's thread and ends it; the worker lives on
        worker.wait_for_log(r"ClaimLost", timeout=10)
        deadline = cancelled_at + SHORT_CLAIM["claim_renew_seconds"] + STOP_WITHIN_SECONDS
        late = [step for step in steps_of(redis_client, execution, 1) if step["at"] > deadline]
        assert not late, late
        assert worker.alive()
        # And nothing is recorded: the execution stays cancelled
        row = Execution.objects.get(pk=execution.pk)
        assert (row.status, row.attempt, row.result) == (Status.CANCELLED, 1, None)
        # nor is a result stored for the task id: the attempt's ClaimLost is not the execution's outcome
        assert not TaskResult.objects.filter(task_id=row.celery_task_id).exists()
    finally:
        worker.stop()
