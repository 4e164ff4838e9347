"""Counting runs: ``max_runs`` and one-offs count the slots the beat sent, nothing else."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.ops.prune import prune_executions
from scheduler.owners import executions, leases
from scheduler.tenancy import EVERY_TENANT
from tests.support.factories import make_schedule
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


def last_slot(every: int) -> datetime:
    """The latest interval slot at or before the database clock."""
    now = dbclock.now()
    return now - timedelta(seconds=now.timestamp() % every)


def slots_since(seconds: float) -> datetime:
    """A ``start_at`` ``seconds`` ago, for slots whose last is a fraction of their interval old.

    On slots aligned on the clock's own seconds, one could come due the
    instant after the test read the clock, adding a row it does not count.
    """
    return dbclock.now() - timedelta(seconds=seconds)


def statuses(target: Schedule) -> list[str]:
    return list(Execution.objects.filter(schedule=target).order_by("scheduled_for").values_list("status", flat=True))


def wait_until_due(target: Schedule) -> None:
    target.refresh_from_db()
    assert wait_until(lambda: dbclock.now() >= target.next_run_at, timeout=5)


def test_one_off__run_now_first_does_not_use_up_its_slot(lease: leases.LeaseHandle, redis_url: str) -> None:
    from project.celery import app
    from scheduler.ops import audit, operations

    # Given a one-off that is due, run by hand once to try it out
    run_at = dbclock.now() - timedelta(seconds=1)
    target = make_schedule("once", run_at=run_at)
    operations.run_now(target, app=app, scope=EVERY_TENANT, actor=audit.CLI)

    # When the leader dispatches
    report = dispatch.dispatch_due(lease)

    # Then its own slot fires too, and only then does it turn itself off
    assert report.fired == [("once", run_at)]
    assert Execution.objects.filter(idempotency_key=executions.key(target, run_at)).exists()
    target.refresh_from_db()
    assert (target.enabled, target.slots_committed) == (False, 1)


def test_max_runs__skipped_slots_do_not_count(lease: leases.LeaseHandle) -> None:
    # Given max_runs=2, overlap=skip, and three slots due at once
    start = slots_since(2.5)  # slots at -2.5, -1.5 and -0.5 s; the next half a second away
    target = make_schedule("s", interval=1, max_runs=2, overlap="skip", start_at=start)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=start)

    # When the leader dispatches them
    dispatch.dispatch_due(lease)

    # Then one runs, two are skipped, and one run is left
    target.refresh_from_db()
    assert statuses(target) == [Status.PENDING, Status.SKIPPED, Status.SKIPPED]
    assert (target.enabled, target.slots_committed) == (True, 1)
    assert target.next_run_at is not None

    # When the first one ends and the next slot comes due
    Execution.objects.filter(schedule=target, status=Status.PENDING).update(status=Status.SUCCEEDED)
    wait_until_due(target)
    report = dispatch.dispatch_due(lease)

    # Then that slot is its second run, and its last
    target.refresh_from_db()
    assert len(report.fired) == 1
    assert (target.enabled, target.slots_committed, target.disabled_reason) == (False, 2, "Used all 2 runs (max_runs)")


def test_max_runs__applied_after_the_misfire_policy(lease: leases.LeaseHandle) -> None:
    # Given max_runs=2, misfire=run_once, and five slots late inside the catch-up window
    start = slots_since(41)  # slots 41 to 1 s ago; the next 9 s away
    latest = start + timedelta(seconds=40)
    target = make_schedule("s", interval=10, max_runs=2, misfire="run_once", start_at=start)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=start)

    # When the leader dispatches them
    report = dispatch.dispatch_due(lease)

    # Then the latest one runs and the four before it are recorded missed
    assert report.fired == [("s", latest)]
    assert statuses(target) == [Status.MISSED] * 4 + [Status.PENDING]
    target.refresh_from_db()
    assert (target.enabled, target.slots_committed) == (True, 1)


def test_max_runs__pruning_does_not_reset_the_count(lease: leases.LeaseHandle) -> None:
    # Given max_runs=2 and one slot sent, run and finished
    target = make_schedule("s", interval=1, max_runs=2)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=last_slot(1))
    assert len(dispatch.dispatch_due(lease).fired) == 1
    Execution.objects.filter(schedule=target).update(status=Status.SUCCEEDED, finished_at=dbclock.now())

    # When its executions are pruned and the next slot fires
    assert prune_executions(older_than=dbclock.now() + timedelta(seconds=1)).deleted == 1
    wait_until_due(target)
    report = dispatch.dispatch_due(lease)

    # Then that was its second and last run
    target.refresh_from_db()
    assert len(report.fired) == 1
    assert (target.enabled, target.disabled_reason) == (False, "Used all 2 runs (max_runs)")


def test_max_runs__a_slot_that_already_has_an_execution_is_not_counted(lease: leases.LeaseHandle) -> None:
    # Given max_runs=1 and its due slot already recorded by someone else (a backfill over it)
    slot = last_slot(86400)
    target = make_schedule("s", interval=86400, max_runs=1, catchup_window=2 * 86400)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=slot)
    executions.record_slots(target, [(slot, Status.PENDING)], now=dbclock.now(), trigger=Execution.Trigger.BACKFILL)

    # When the leader dispatches that slot, its insert ignored by the unique key
    report = dispatch.dispatch_due(lease)

    # Then the beat sent nothing, counts nothing, and keeps its one run for the next slot
    assert report.fired == []
    target.refresh_from_db()
    assert (target.enabled, target.slots_committed, target.disabled_reason) == (True, 0, "")
    assert target.next_run_at == slot + timedelta(days=1)
    assert Execution.objects.filter(schedule=target).count() == 1


def test_missed__a_slot_that_already_has_an_execution_is_not_counted_missed_again(lease: leases.LeaseHandle) -> None:
    # Given slots far older than the catch-up window, one of them already recorded missed (reconcile --repair)
    latest = last_slot(60)
    target = make_schedule("s", interval=60, catchup_window=60)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=latest - timedelta(minutes=5))
    executions.record_slots(target, [(latest - timedelta(minutes=5), Status.MISSED)], now=dbclock.now())

    # When the leader dispatches them
    report = dispatch.dispatch_due(lease)

    # Then each slot is missed once, and the schedule counts each once
    target.refresh_from_db()
    recorded = Execution.objects.filter(schedule=target, status=Status.MISSED).count()
    assert recorded == report.missed + 1
    assert target.total_missed == report.missed + report.missed_not_recorded
