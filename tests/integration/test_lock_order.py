"""Lock order: workers finishing runs, the leader cancelling them (``cancel_previous``), operators deleting schedules
and concurrent final inserts never deadlock.

A worker's finish writes the execution and its schedule's counters; the
leader's dispatch locks due schedules, then cancels their executions; a
schedule's delete detaches its executions. All must take the schedule row
first (issue 14, item 6), or PostgreSQL aborts one of them with a deadlock:
a leader that is the victim steps down, a worker that is the victim loses a
successful outcome. The execution tallies take no row lock at all
(``scheduler.models.tally``), whatever order a statement's final rows come in.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, leases, schedules
from scheduler.owners.executions import Claim
from tests.integration.test_metrics_counters import scrape, total
from tests.support.factories import make_schedule
from tests.support.threads import on_own_connection, run_at_once

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
SCHEDULES = 12
WORKERS = 8
DURATION = 8.0  # seconds of contention
BOUND = 60.0  # seconds: every thread must have stopped by then


def test_finishes_and_cancel_previous_ticks_at_once__no_deadlock_and_every_success_counted(
    lease: leases.LeaseHandle,
) -> None:
    # Given cancel_previous schedules firing every second, all due now
    for index in range(SCHEDULES):
        make_schedule(f"busy-{index}", interval=1, overlap="cancel_previous")
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
            waiting = Execution.objects.filter(status=Status.PENDING, buffered=False).order_by("?").first()
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


def _set_lock_timeout() -> None:
    """Bound every lock wait of this connection: a test that would hang fails instead."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '10s'")


def test_final_inserts_whose_rows_meet_the_tallies_in_opposite_orders__no_deadlock_and_counted_exactly(
    client: Client,
) -> None:
    # Given two schedules of two tasks, and two committers (sharded leaders, or
    # the leader and ``reconcile --repair``) recording missed slots of both at
    # once, one listing alpha's rows first and the other beta's: every
    # statement's rows reach every tally of both tasks, in opposite orders
    alpha = make_schedule("alpha", task="tests.alpha")
    beta = make_schedule("beta", task="tests.beta")
    now = dbclock.now()
    rounds, per_task = 25, 40
    barrier = threading.Barrier(2, timeout=BOUND)
    errors: list[BaseException] = []

    def committer(number: int, first: Schedule, second: Schedule) -> Callable[[], None]:
        def body() -> None:
            _set_lock_timeout()
            for round_ in range(rounds):
                start = (round_ * 2 + number) * per_task
                rows = [
                    executions.execution_for(
                        schedule, now - timedelta(minutes=1 + start + n), status=Status.MISSED, now=now
                    )
                    for schedule in (first, second)
                    for n in range(per_task)
                ]
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    return  # the other one failed: its error is the report
                try:
                    with transaction.atomic():
                        executions.insert(rows)
                        time.sleep(0.01)  # both hold their tallies until commit, as a leader's commit does
                except BaseException:
                    barrier.abort()
                    raise

        return body

    # When both commit their batches, round after round, at the same instant
    run_at_once([committer(0, alpha, beta), committer(1, beta, alpha)], errors, timeout=BOUND)

    # Then neither was a deadlock victim (nor waited out its lock timeout)
    assert not errors, errors
    # And /metrics counts every missed row once
    samples = scrape(client)
    for schedule in (alpha, beta):
        stored = Execution.objects.filter(schedule=schedule, status=Status.MISSED).count()
        assert stored == rounds * 2 * per_task
        assert total(samples, "missed", task=schedule.task) == stored


def test_schedule_delete__locks_the_schedule_before_its_executions() -> None:
    # Given a schedule with a running execution, and a worker finishing it:
    # its transaction has locked the schedule row (schedule first, then the
    # execution: the documented lock order) and is about to write the execution
    target = make_schedule("doomed")
    now = dbclock.now()
    execution = executions.execution_for(target, now, status=Status.PENDING, now=now)
    execution.save()
    claimed = executions.claim(
        worker="w@host:1", task=execution.task, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    assert claimed is not None
    locked, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    finished: list[bool] = []

    def worker() -> None:
        _set_lock_timeout()
        with transaction.atomic():
            list(Schedule.objects.select_for_update().filter(pk=target.pk).values_list("pk", flat=True))
            locked.set()
            _wait_until_another_waits()
            finished.append(executions.finish(Claim.of(claimed), status=Status.SUCCEEDED, result=1))

    def operator() -> None:
        _set_lock_timeout()
        assert locked.wait(BOUND)
        schedules.delete(Schedule.objects.get(pk=target.pk))
        done.set()

    # When an operator deletes the schedule meanwhile
    run_at_once([worker, operator], errors, timeout=BOUND)

    # Then neither was a deadlock victim: the worker's outcome is recorded and the schedule is gone
    assert not errors, errors
    assert finished == [True] and done.is_set()
    assert not Schedule.objects.filter(pk=target.pk).exists()
    assert Execution.objects.values_list("status", "schedule_id").get(pk=execution.pk) == (Status.SUCCEEDED, None)


def test_schedule_queryset_delete__locks_the_schedules_before_their_executions() -> None:
    # Given two schedules with running executions, and a worker finishing one of them
    # (schedule row locked, execution about to be written)
    now = dbclock.now()
    targets, claims = [], []
    for name in ("doomed-1", "doomed-2"):
        target = make_schedule(name)
        execution = executions.execution_for(target, now, status=Status.PENDING, now=now)
        execution.save()
        claimed = executions.claim(
            worker="w@host:1", task=execution.task, celery_task_id=execution.celery_task_id, execution_id=execution.pk
        )
        assert claimed is not None
        targets.append(target)
        claims.append(Claim.of(claimed))
    locked = threading.Event()
    errors: list[BaseException] = []
    finished: list[bool] = []

    def worker() -> None:
        _set_lock_timeout()
        with transaction.atomic():
            list(Schedule.objects.select_for_update().filter(pk=targets[1].pk).values_list("pk", flat=True))
            locked.set()
            _wait_until_another_waits()
            finished.append(executions.finish(claims[1], status=Status.SUCCEEDED, result=1))

    def operator() -> None:
        _set_lock_timeout()
        assert locked.wait(BOUND)
        Schedule.objects.filter(pk__in=[target.pk for target in targets]).delete()  # the admin's bulk delete

    # When an operator deletes both at once meanwhile
    run_at_once([worker, operator], errors, timeout=BOUND)

    # Then neither was a deadlock victim
    assert not errors, errors
    assert finished == [True]
    assert not Schedule.objects.exists()
    assert Execution.objects.get(pk=claims[1].execution_id).status == Status.SUCCEEDED


def _wait_until_another_waits() -> None:
    """Return once another connection waits on a lock (PostgreSQL), or after a moment (SQLite: no view of it)."""
    if connection.vendor != "postgresql":
        time.sleep(0.3)
        return
    deadline = time.monotonic() + 10
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # inside a transaction the view is read once otherwise
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.01)
    raise AssertionError("the other connection never waited on a lock")
