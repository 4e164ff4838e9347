"""Lock order: workers finishing runs and the leader cancelling them (``cancel_previous``) never deadlock.

A worker's finish writes the execution and its schedule's counters; the
leader's dispatch locks due schedules, then cancels their executions. Both
must take the schedule row first (issue 14, item 6), or PostgreSQL aborts
one of them with a deadlock: a leader that is the victim steps down, a
worker that is the victim loses a successful outcome.
"""
from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection

from scheduler import dispatch, executions, leases
from scheduler.executions import Claim
from scheduler.models import Execution, Schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
SCHEDULES = 12
WORKERS = 8
DURATION = 8.0  # seconds of contention
BOUND = 60.0  # seconds: every thread must have stopped by then


def on_own_connection(body: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test's assertion
            errors.append(exc)
        finally:
            connection.close()

    return run


def test_finishes_and_cancel_previous_ticks_at_once__no_deadlock_and_every_success_counted() -> None:
    # Given cancel_previous schedules firing every second, all due now
    for index in range(SCHEDULES):
        schedule = Schedule(name=f"busy-{index}", task="scheduler.echo", interval=1, overlap="cancel_previous")
        schedule.full_clean()
        schedule.save()
    lease = leases.acquire("beat", "stress-leader", ttl=BOUND)
    assert lease is not None
    stop = threading.Event()
    errors: list[BaseException] = []
    succeeded: list[int] = []
    passes: list[int] = []

    def leader() -> None:
        while not stop.is_set():
            dispatch.dispatch_due(lease)
            passes.append(1)
            time.sleep(0.01)

    def worker(number: int) -> None:
        identity = f"w{number}@stress:{number}"
        pick = random.Random(number)
        while not stop.is_set():
            waiting = Execution.objects.filter(status=Status.PENDING, held=False).order_by("?").first()
            execution = waiting and executions.claim(
                worker=identity, task=waiting.task, celery_task_id=waiting.celery_task_id, execution_id=waiting.pk
            )
            if not execution:
                time.sleep(0.005)
                continue
            # The body ends right around the next whole second, when every
            # schedule fires again and the leader cancels what still runs.
            time.sleep(max(0.0, math.ceil(time.time()) + pick.uniform(-0.02, 0.03) - time.time()))
            if executions.finish(Claim.of(execution), status=Status.SUCCEEDED, result=1):
                succeeded.append(execution.pk)

    threads = [threading.Thread(target=on_own_connection(leader, errors))]
    threads += [threading.Thread(target=on_own_connection(lambda n=n: worker(n), errors)) for n in range(WORKERS)]
    # When workers claim and finish the fired executions while the leader keeps ticking
    for thread in threads:
        thread.start()
    time.sleep(DURATION)
    stop.set()
    for thread in threads:
        thread.join(timeout=BOUND)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    # Then nothing raised: no deadlock victim, and the leader never stepped down
    assert not errors, errors
    assert passes and succeeded, (len(passes), len(succeeded))
    # And every run a worker recorded as succeeded is succeeded, and counted once on its schedule
    assert set(Execution.objects.filter(pk__in=succeeded).values_list("status", flat=True)) == {Status.SUCCEEDED}
    for schedule in Schedule.objects.all():
        done = Execution.objects.filter(schedule=schedule, status__in=Execution.FINAL_STATUSES - {Status.CANCELLED})
        assert schedule.total_runs == done.count(), schedule.name
        assert schedule.total_runs == Execution.objects.filter(schedule=schedule, pk__in=succeeded).count()
        if schedule.total_runs:
            assert (schedule.last_status, schedule.consecutive_failures) == (Status.SUCCEEDED, 0)
