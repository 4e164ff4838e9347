"""A concurrency limit across real workers: never more bodies of a key at once than its limit, oldest first.

Three workers of four pool processes each run ``tests.limited`` executions
of one customer under a limit of 3 per customer. Each body keeps the start
and end of its every step in its execution's checkpoint, which saves only
while the body holds its claim; the test counts overlapping steps of
different executions from those records. A beat leads, so reconcile runs
(every second here) and frees the places of a worker that died or froze.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

import scheduler
from scheduler.models import ConcurrencyLimit, Execution
from scheduler.owners import work_rules
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
LIMIT = 3
EXECUTIONS = 50
CUSTOMER = 42
#: Short claims, so that a dead or frozen worker's place frees within seconds.
CLAIMS = {"claim_seconds": 3, "claim_renew_seconds": 0.5}
#: The beat's reconcile: often, and re-sending what waited unclaimed soon.
RECONCILE = {"reconcile_interval_seconds": 1, "reconcile_queued_after_seconds": 5}


@pytest.fixture
def limited_cluster(celery_processes: Start) -> list[CeleryProcess]:
    """A limit of 3 per customer, a beat, and 3 workers of 4 processes each, ready."""
    work_rules.save_limit(
        ConcurrencyLimit(name="per customer", every_tenant=True, task="tests.limited", key="customer", limit=LIMIT)
    )
    celery_processes("beat", "beat1", **CLAIMS, **RECONCILE)
    workers = [celery_processes("worker", f"limited{n}", concurrency=4, **CLAIMS) for n in (1, 2, 3)]
    for worker in workers:
        worker.wait_for_log(r"ready\.", timeout=60)
    return workers


def submit(count: int, *, steps: int = 5, until_go: bool = False) -> list[Execution]:
    kwargs = {"customer": CUSTOMER, "steps": steps, "until_go": until_go}
    return [scheduler.submit(test_tasks.limited, kwargs=kwargs) for _ in range(count)]


def all_succeeded(ids: list[int], timeout: float) -> None:
    done = wait_until(
        lambda: Execution.objects.filter(pk__in=ids, status=Status.SUCCEEDED).count() == len(ids), timeout=timeout
    )
    statuses = list(Execution.objects.filter(pk__in=ids).values_list("status", flat=True))
    assert done, f"not all succeeded: {sorted(set(statuses))}, {statuses.count(Status.SUCCEEDED)}/{len(ids)}"


def most_at_once(ids: list[int]) -> int:
    """The most executions whose recorded steps overlap at one instant."""
    edges: list[tuple[float, int, int]] = []
    for pk, spans in Execution.objects.filter(pk__in=ids).values_list("pk", "progress"):
        for start, end in spans or ():
            edges += [(start, 1, pk), (end, -1, pk)]
    running: dict[int, int] = {}
    most = 0
    for _, change, pk in sorted(edges, key=lambda edge: (edge[0], edge[1])):  # an end before a start at one instant
        running[pk] = running.get(pk, 0) + change
        most = max(most, sum(1 for count in running.values() if count > 0))
    return most


def first_starts(ids: list[int]) -> list[int]:
    """The executions in the order their bodies first started a step."""
    started = {pk: spans[0][0] for pk, spans in Execution.objects.filter(pk__in=ids).values_list("pk", "progress")}
    return sorted(ids, key=lambda pk: started[pk])


def most_passed_older(order: list[int]) -> int:
    """The most older executions (lower ids) that one execution of ``order`` started before.

    The claim takes an execution only while those of its key running, and
    those older waiting, are fewer than the limit. Every older one it
    starts before was one or the other when it was claimed (waiting, or
    running but slower to record its first step), so it passes at most
    limit - 1, however late a message of an older one arrives.
    """
    return max(sum(1 for later in order[index + 1 :] if later < pk) for index, pk in enumerate(order))


def test_fifty_executions_of_one_key__at_most_three_at_once_all_finish_oldest_first(
    limited_cluster: list[CeleryProcess], redis_client: redis.Redis
) -> None:
    # Given three executions of the customer taking its three places until told to go on
    blockers = submit(LIMIT, until_go=True)
    assert wait_until(lambda: Execution.objects.filter(status=Status.RUNNING).count() == LIMIT, timeout=30)

    # When 47 more arrive and wait their turn
    waiting = submit(EXECUTIONS - LIMIT)
    waiting_ids = [execution.pk for execution in waiting]
    # (each one's key is set when a worker first takes it under the limit, and nothing is offered yet)
    in_line = Execution.objects.filter(pk__in=waiting_ids, status=Status.QUEUED, concurrency_key__isnull=False)
    assert wait_until(lambda: in_line.count() == len(waiting_ids), timeout=30), Counter(
        Execution.objects.filter(pk__in=waiting_ids).values_list("status", "concurrency_key")
    )
    redis_client.set(test_tasks.GO_KEY, 1)

    # Then all 50 finish, never more than 3 at once by their own records
    ids = [execution.pk for execution in blockers] + waiting_ids
    all_succeeded(ids, timeout=180)
    assert most_at_once(ids) == LIMIT
    # and oldest first: each started among the LIMIT oldest not started yet (it passed at most LIMIT - 1 older ones)
    assert most_passed_older(first_starts(waiting_ids)) <= LIMIT - 1, first_starts(waiting_ids)


def test_a_worker_killed_mid_task__its_slots_free_when_its_claims_expire_and_the_limit_holds(
    limited_cluster: list[CeleryProcess],
) -> None:
    # Given 50 executions of one customer running three at a time
    executions = submit(EXECUTIONS, steps=10)
    ids = [execution.pk for execution in executions]
    victim = limited_cluster[0]
    assert wait_until(
        lambda: Execution.objects.filter(pk__in=ids, status=Status.RUNNING, worker__contains="limited1").exists(),
        timeout=60,
    ), "the first worker never ran one"

    # When that worker is killed with its bodies mid-task
    victim.kill_group(signal.SIGKILL)

    # Then all 50 finish on the other two, and never more than 3 ran at once
    all_succeeded(ids, timeout=240)
    assert most_at_once(ids) == LIMIT
    assert Execution.objects.filter(pk__in=ids, attempt__gt=1).exists(), "no execution was run again"


def test_a_worker_frozen_past_its_claims__the_limit_holds_and_all_finish(
    limited_cluster: list[CeleryProcess],
) -> None:
    # Given 50 executions of one customer running three at a time
    executions = submit(EXECUTIONS, steps=10)
    ids = [execution.pk for execution in executions]
    frozen = limited_cluster[0]
    assert wait_until(
        lambda: Execution.objects.filter(pk__in=ids, status=Status.RUNNING, worker__contains="limited1").exists(),
        timeout=60,
    ), "the first worker never ran one"

    # When that worker freezes well past its claims, while the others take its places, and then resumes
    frozen.kill_group(signal.SIGSTOP)
    assert wait_until(
        lambda: (
            Execution.objects.filter(pk__in=ids, status=Status.RUNNING).exclude(worker__contains="limited1").exists()
        ),
        timeout=30,
    ), "the frozen worker's places were not freed"
    time.sleep(3)
    frozen.kill_group(signal.SIGCONT)

    # Then all 50 finish, and never more than 3 ran at once by the records their claims let them keep
    all_succeeded(ids, timeout=240)
    assert most_at_once(ids) == LIMIT
