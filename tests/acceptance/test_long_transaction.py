"""A body's own long write transaction costs no body its claim (issue 16, finding 4): real workers.

While one body holds a write transaction, the claim renewals of the other
bodies wait: on SQLite for the database's one write lock, up to the busy
timeout, and then fail with "database is locked"; on PostgreSQL the body's
``checkpoint()`` locks its own execution row until the transaction ends,
which the renewal of that very claim waits for. A renewal that fails only
because the database is busy must be tried again until the claim really
runs out, and a claim its own body's transaction holds must count as held:
no body is stopped while its claim is valid.

The settings make the window narrow enough to hit every time: renewals
every 5.1 s of a 10 s claim, four bodies started 1.3 s apart so their
renewals fall at different moments, and (SQLite) a busy timeout of 0.5 s
with a transaction of 3.4 s, which ends at least 1.5 s before any claim
runs out; (PostgreSQL) a transaction of 12 s, longer than the claim.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

import scheduler
from scheduler.models import Execution
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until, worker_argv

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
SETTINGS = {
    "SCHEDULER_CLAIM_SECONDS": "10",
    "SCHEDULER_CLAIM_RENEW_SECONDS": "5.1",
    "SQLITE_BUSY_TIMEOUT_SECONDS": "0.5",
}
#: How long the long body holds its transaction, per database.
HOLD_SECONDS = {"sqlite": 3.4, "postgresql": 12.0}
OTHERS = 4
STAGGER_SECONDS = 1.3
STEP_SECONDS = 0.2
#: The other bodies run well past the long transaction.
STEPS = 150


def steps_of(client: redis.Redis, execution: Execution) -> list[dict[str, Any]]:
    return [step for step in test_tasks.events(client, test_tasks.STEPS_KEY) if step["execution_id"] == execution.pk]


def test_long_write_transaction__no_body_is_stopped_and_the_long_one_runs_once(
    process_env: dict[str, str], tmp_path: Path, redis_client: redis.Redis, db_vendor: str
) -> None:
    env = {**process_env, **SETTINGS}
    worker = CeleryProcess("w", worker_argv("w", concurrency=OTHERS + 1), env, tmp_path / "w.log").start()
    try:
        worker.wait_for_log(r"ready\.", timeout=60)
        # Given four bodies working in steps, started 1.3 s apart (their claims renew at different moments)
        others = []
        for _ in range(OTHERS):
            execution = scheduler.submit("tests.steps", args=[STEPS, STEP_SECONDS])
            assert wait_until(lambda: steps_of(redis_client, execution), timeout=30), worker.log()[-3000:]
            others.append(execution)
            time.sleep(STAGGER_SECONDS)
        # When a fifth holds one write transaction (a checkpoint inside its atomic()) for longer than
        # SQLite's busy timeout, or on PostgreSQL for longer than the claim
        seconds = HOLD_SECONDS[db_vendor]
        long = scheduler.submit("tests.long_transaction", kwargs={"seconds": seconds})
        # Then it commits once, as its first attempt, and returns
        done = wait_until(
            lambda: Execution.objects.filter(pk=long.pk, status__in=Execution.FINAL_STATUSES).first(),
            timeout=seconds + 60,
        )
        assert done, worker.log()[-3000:]
        assert (done.status, done.attempt, done.result) == (Status.SUCCEEDED, 1, 1), worker.log()[-3000:]
        held = [
            entry
            for entry in test_tasks.events(redis_client, test_tasks.HOLDING_KEY)
            if entry["execution_id"] == long.pk
        ]
        assert [(entry["event"], entry["attempt"]) for entry in held] == [("started", 1), ("committed", 1)]
        # And every other body ran to its end as its first attempt: none was stopped
        for execution in others:
            row = wait_until(
                lambda: Execution.objects.filter(pk=execution.pk, status__in=Execution.FINAL_STATUSES).first(),
                timeout=STEPS * STEP_SECONDS + 60,
            )
            assert row, worker.log()[-3000:]
            assert (row.status, row.attempt, row.result) == (Status.SUCCEEDED, 1, STEPS), worker.log()[-3000:]
            assert {step["attempt"] for step in steps_of(redis_client, execution)} == {1}
            assert len(steps_of(redis_client, execution)) == STEPS
        assert "stopping its body" not in worker.log(), worker.log()[-3000:]
    finally:
        worker.stop()
