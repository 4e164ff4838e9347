"""A rate limit across real workers: 100 executions under 10 starts a second start no faster, and none fail.

Two workers of four pool processes each run ``tests.limited`` executions
(one short step each); each body keeps its step's start in its execution's
checkpoint. Without the limit the 100 would all start within a second or two.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django_celery_results.models import TaskResult

import scheduler
from scheduler.models import Execution, RateLimit
from scheduler.owners import work_rules
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
STARTS_PER_SECOND = 10
EXECUTIONS = 100


def starts_in_busiest_second(starts: list[float]) -> int:
    """The most starts inside one window of a second, [t, t + 1)."""
    return max(sum(1 for other in starts if start <= other < start + 1) for start in starts)


def test_hundred_executions_under_ten_a_second__start_no_faster_across_two_workers_and_none_fail(
    celery_processes: Start,
) -> None:
    # Given 10 starts a second for the task, and two workers of four processes
    work_rules.save_limit(
        RateLimit(name="ten a second", every_tenant=True, task="tests.limited", starts=STARTS_PER_SECOND, per_seconds=1)
    )
    workers = [celery_processes("worker", f"rated{n}", concurrency=4) for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.", timeout=60)

    # When 100 executions are submitted at once
    ids = [
        scheduler.submit(test_tasks.limited, kwargs={"customer": n, "steps": 1, "seconds": 0}).pk
        for n in range(EXECUTIONS)
    ]

    # Then all succeed, none failed or retried
    assert wait_until(
        lambda: Execution.objects.filter(pk__in=ids, status=Status.SUCCEEDED).count() == EXECUTIONS, timeout=120
    ), sorted(set(Execution.objects.filter(pk__in=ids).values_list("status", flat=True)))
    assert not Execution.objects.filter(pk__in=ids, attempt__gt=1).exists()

    # and they started no faster than 10 a second, by the bodies' own records
    starts = sorted(spans[0][0] for spans in Execution.objects.filter(pk__in=ids).values_list("progress", flat=True))
    took = starts[-1] - starts[0]
    busiest = starts_in_busiest_second(starts)
    print(f"{EXECUTIONS} starts over {took:.2f}s; the busiest second held {busiest}")
    # 99 intervals of 0.1 s. A body begins at its turn or after it, never before, late by its claim's time: a
    # late one shares a second with the next ten on time. Under the suite's load (two databases' tests at once
    # on two cores) a claim can take longer than an interval, so two may; a limit that let starts through
    # early or at once would put many more in a second.
    assert took >= (EXECUTIONS - 1) / STARTS_PER_SECOND - 0.5
    assert busiest <= STARTS_PER_SECOND + 2


def test_a_timed_execution__waits_for_its_start_outside_its_time_limit(celery_processes: Start) -> None:
    # Given one start every 4 s for the task, and a worker of two processes
    work_rules.save_limit(RateLimit(name="slow", every_tenant=True, task="tests.record", starts=1, per_seconds=4))
    worker = celery_processes("worker", "timed", concurrency=2)
    worker.wait_for_log(r"ready\.", timeout=60)

    # When two executions with a one-second time limit are submitted at once
    ids = [scheduler.submit("tests.record", kwargs={"label": f"t{n}"}, timeout=1).pk for n in range(2)]

    # Then both succeed at the first attempt: the second waited for its
    # turn as a message sent again, not in a pool process whose Celery
    # timer (its soft limit of 1 s) was already running
    assert wait_until(lambda: Execution.objects.filter(pk__in=ids, status=Status.SUCCEEDED).count() == 2, timeout=30), (
        list(Execution.objects.filter(pk__in=ids).values_list("status", "error"))
    )
    first, second = Execution.objects.filter(pk__in=ids).order_by("started_at")
    assert (first.attempt, second.attempt) == (1, 1)
    assert f"execution {second.pk} delayed by rate limit slow" in worker.log()
    # (its enqueued_at is when it was sent again for: it did not start before)
    assert second.enqueued_at is not None and second.started_at >= second.enqueued_at
    assert "Soft time limit" not in worker.log()
    assert not TaskResult.objects.filter(status="FAILURE").exists()
