"""Concurrency limits at the claim: a key's slots, its line (oldest first), the offer when a slot frees, reconcile's pass.

The claims run in this process against the real database; the workers'
side (real processes, 3 workers) is ``tests/acceptance/test_concurrency_limits.py``.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.models import ConcurrencyLimit, Execution
from scheduler.ops import reconcile
from scheduler.owners import concurrency, executions

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
TASK = "tests.record"


@pytest.fixture(autouse=True)
def _fresh_limits() -> None:
    concurrency.forget()


def per_customer(limit: int = 2, **fields: Any) -> concurrency.Limit:
    row = concurrency.save(
        ConcurrencyLimit(name="per customer", every_tenant=True, task="tests.*", key="customer", limit=limit, **fields)
    )
    return concurrency.Limit.of(row)


def queued(customer: object, *, label: str = "") -> Execution:
    return Execution.objects.create(
        idempotency_key=f"limited-{uuid.uuid4()}",
        task=TASK,
        kwargs={"customer": customer, "label": label},
        scheduled_for=dbclock.now(),
        celery_task_id=str(uuid.uuid4()),
        status=Status.QUEUED,
        enqueued_at=dbclock.now(),
    )


def claim(execution: Execution, limit: concurrency.Limit) -> Execution | None:
    return executions.claim(
        worker="w@host:1",
        task=execution.task,
        celery_task_id=execution.celery_task_id,
        execution_id=execution.pk,
        slot=limit.slot(execution.args, execution.kwargs),
    )


def test_claim__takes_a_slot_while_the_key_has_one_and_leaves_the_rest_waiting_in_line() -> None:
    # Given a limit of 2 per customer and three executions of customer 7
    limit = per_customer(2)
    first, second, third = queued(7), queued(7), queued(7)

    # When each is claimed in turn
    claimed = [claim(first, limit), claim(second, limit), claim(third, limit)]

    # Then two run, and the third waits first in line, its message no longer out
    assert [row is not None for row in claimed] == [True, True, False]
    assert executions.wait_for_slot(execution_id=third.pk) == (f"{limit.pk}:7", 1)
    third.refresh_from_db()
    assert (third.status, third.concurrency_key, third.enqueued_at) == (Status.QUEUED, f"{limit.pk}:7", None)
    assert executions.place_in_line(third) == 1


def test_claim__another_key_has_slots_of_its_own() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    assert claim(queued(8), limit) is not None
    assert claim(queued(7), limit) is None


def test_claim__a_newer_execution_does_not_pass_one_waiting_ahead_of_it() -> None:
    # Given customer 7's two slots taken and one execution waiting
    limit = per_customer(2)
    running = [queued(7), queued(7)]
    for execution in running:
        assert claim(execution, limit) is not None
    older = queued(7)
    assert claim(older, limit) is None
    executions.wait_for_slot(execution_id=older.pk)

    # When one slot frees and a newer execution's message comes before the offer reaches the older one
    executions.finish(executions.Claim.of(Execution.objects.get(pk=running[0].pk)), status=Status.SUCCEEDED)
    newer = queued(7)

    # Then the newer one waits behind it, and the older one takes the slot
    assert claim(newer, limit) is None
    assert claim(older, limit) is not None


def test_offer_waiting__sends_as_many_as_slots_are_free_oldest_first_and_not_twice_within_the_grace() -> None:
    # Given customer 7's two slots taken and three executions waiting
    limit = per_customer(2)
    holders = [claim(queued(7), limit) for _ in range(2)]
    waiting = [queued(7) for _ in range(3)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_slot(execution_id=execution.pk)

    # When both slots free and the slots are offered twice
    for holder in holders:
        assert holder is not None
        executions.finish(executions.Claim.of(holder), status=Status.SUCCEEDED)
    now = dbclock.now()
    first = executions.offer_waiting(f"{limit.pk}:7", limit.limit, now=now)
    again = executions.offer_waiting(f"{limit.pk}:7", limit.limit, now=now)

    # Then the two oldest are offered once, the third keeps waiting
    assert [row["id"] for row in first] == [waiting[0].pk, waiting[1].pk]
    assert again == []


def test_offer_waiting__a_deleted_limit_lets_every_waiting_execution_go() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    waiting = [queued(7) for _ in range(2)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_slot(execution_id=execution.pk)

    concurrency.delete(ConcurrencyLimit.objects.get(pk=limit.pk))
    offered = outbox.offer_slots(app, executions.waiting_keys(), max_age=0)

    assert sorted(offered) == [execution.pk for execution in waiting]
    assert not Execution.objects.filter(pk__in=offered).exclude(concurrency_key="").exists()


def test_reconcile__frees_the_slot_of_a_dead_worker_and_offers_it_to_the_oldest_waiting(redis_url: str) -> None:
    # Given customer 7's only slot held by a worker that stopped renewing its claim, and two waiting
    limit = per_customer(1)
    holder = queued(7)
    assert claim(holder, limit) is not None
    waiting = [queued(7) for _ in range(2)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_slot(execution_id=execution.pk)
    Execution.objects.filter(pk=holder.pk).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))

    # When reconcile passes
    report = reconcile.reconcile(now=dbclock.now(), app=app)

    # Then the dead worker's execution is lost (to be retried) and the oldest waiting one is sent
    kinds = {(change.kind, change.execution_id) for change in report.changes}
    assert ("lost_retrying", holder.pk) in kinds
    assert ("offered", waiting[0].pk) in kinds
    assert ("offered", waiting[1].pk) not in kinds
    assert not {("republished", execution.pk) for execution in waiting} & kinds


def test_key_problem__only_argument_names_and_positions() -> None:
    assert concurrency.key_problem("customer_id") == ""
    assert concurrency.key_problem("{customer_id}-{0}") == ""
    for bad in ("{0.__class__}", "{customer[0]}", "{customer!r}", "{customer:>10}", "no fields here!", "{"):
        assert concurrency.key_problem(bad), bad


def test_key_value__missing_arguments_share_the_empty_key_and_long_values_are_digested() -> None:
    assert concurrency.key_value("customer", (), {"customer": 7}) == "7"
    assert concurrency.key_value("{0}-{region}", ("acme",), {"region": "eu"}) == "acme-eu"
    assert concurrency.key_value("customer", (), {}) == ""
    assert concurrency.key_value("customer", (), {"customer": "x" * 500}).startswith("sha256-")
