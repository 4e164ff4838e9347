"""Exactly-once effects and checkpoints with real workers, frozen and killed pool children (issue 15).

Worker A's pool child is frozen (SIGSTOP) past its claim while it runs
``tests.fenced_invoice``; worker B takes the execution over as attempt 2 and
commits its invoice; then A resumes. Where A freezes depends on the database:

- PostgreSQL: inside its fenced block, after its INSERT, with its
  transaction open (an INSERT into a table without constraints blocks no one);
- SQLite: just before the block. SQLite's IMMEDIATE transaction holds the
  whole database's write lock from the start of the block, so while A froze
  inside it no one else could write at all: B could not even claim.

Either way A's block must not commit: it is refused with ``ClaimLost`` and
rolled back, or A's child is stopped before it gets there, or (PostgreSQL)
the server already ended A's session, idle inside the block's transaction
past its bound (``scheduler.session_limits``), which rolled the block back.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import redis

import scheduler
from scheduler.models import Execution
from tests.acceptance.test_worker_guard import publish_again, wait_final, worker_pid
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, exited, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
#: Claims run out 2 s after the last renewal, renewed twice a second.
SHORT_CLAIM = {"claim_seconds": 2, "claim_renew_seconds": 0.5}


def fenced_events(client: redis.Redis, event: str, attempt: int) -> list[dict[str, Any]]:
    logged = test_tasks.events(client, test_tasks.FENCED_KEY)
    return [entry for entry in logged if (entry["event"], entry["attempt"]) == (event, attempt)]


def test_fenced_invoice__frozen_attempt_and_its_successor__invoiced_once(
    side_effect_table: None, celery_processes: Start, redis_client: redis.Redis, db_vendor: str
) -> None:
    hold = "inside" if db_vendor == "postgresql" else "before"
    worker_a = celery_processes("worker", "a", queues="a", **SHORT_CLAIM)
    worker_b = celery_processes("worker", "b", queues="b", **SHORT_CLAIM)
    for worker in (worker_a, worker_b):
        worker.wait_for_log(r"ready\.")
    # Given attempt 1 on worker A, holding at its fenced block (PostgreSQL: inside it, its INSERT done)
    execution = scheduler.submit("tests.fenced_invoice", kwargs={"hold": hold}, queue="a", max_retries=1)
    assert wait_until(lambda: fenced_events(redis_client, "holding", 1), timeout=20), worker_a.log()[-3000:]
    pid_a = worker_pid(execution)
    # When A's pool child freezes past its claim
    os.kill(pid_a, signal.SIGSTOP)
    try:
        assert test_tasks.side_effects() == []  # A's INSERT, if any, is not committed
        assert wait_until(lambda: Execution.objects.claimable().filter(pk=execution.pk).exists(), timeout=10), (
            Execution.objects.filter(pk=execution.pk).values("status", "attempt", "claim_expires_at").get()
        )
        # And the execution is delivered to worker B, which runs it as attempt 2
        publish_again(execution, queue="b")
        done = wait_final(execution, timeout=20)
        # (the result is stored by a second statement, just after the block's commit)
        assert wait_until(lambda: Execution.objects.filter(pk=execution.pk, result__isnull=False).exists(), timeout=10)
        done.refresh_from_db()
        assert (done.status, done.attempt, done.result) == ("succeeded", 2, "invoiced"), worker_b.log()[-3000:]
    finally:
        # Then A resumes and is let through its block
        redis_client.set(test_tasks.GO_KEY, "1")
        os.kill(pid_a, signal.SIGCONT)
    # Then A's block is refused and rolled back (or A's child was stopped first, or its session ended)
    assert wait_until(
        lambda: (
            fenced_events(redis_client, "claim lost", 1)
            or fenced_events(redis_client, "session ended", 1)
            or exited(pid_a)
        ),
        timeout=20,
    ), worker_a.log()[-3000:]
    assert not fenced_events(redis_client, "committed", 1)
    # And the invoice exists once, B's; the recorded outcome is B's
    pid_b = worker_pid(execution)
    assert test_tasks.side_effects() == [(execution.pk, 2, pid_b)]
    done = Execution.objects.get(pk=execution.pk)
    assert (done.status, done.attempt, done.result) == ("succeeded", 2, "invoiced")


def test_checkpointed_task__killed_mid_way__next_attempt_resumes_after_the_last_checkpoint(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    items, killed_after = 6, 3
    worker = celery_processes("worker", "w1", claim_seconds=600)
    worker.wait_for_log(r"ready\.")
    # Given a task that processes 6 items, checkpointing after each, with one retry allowed
    execution = scheduler.submit(
        "tests.checkpointed", kwargs={"items": items, "pause_after": killed_after}, max_retries=1
    )
    # When its pool child is killed after it checkpointed item 3
    assert wait_until(lambda: test_tasks.events(redis_client), timeout=20), worker.log()[-3000:]
    assert Execution.objects.get(pk=execution.pk).progress == {"done": killed_after}
    os.kill(worker_pid(execution), signal.SIGKILL)
    # Then the requeued message runs attempt 2, which goes on from item 4
    done = wait_final(execution, timeout=30)
    assert (done.status, done.attempt, done.progress) == ("succeeded", 2, {"done": items}), worker.log()[-3000:]
    logged = [json.loads(entry) for entry in redis_client.lrange(test_tasks.ITEMS_KEY, 0, -1)]
    processed = [(entry["item"], entry["attempt"]) for entry in logged]
    # Each item once: 1-3 by attempt 1, 4-6 by attempt 2
    assert processed == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
