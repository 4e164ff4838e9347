"""The dispatch commit writes due schedules by groups: one UPDATE per distinct write, each outcome kept."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


def schedule_updates(queries: CaptureQueriesContext) -> list[str]:
    return [
        query["sql"] for query in queries.captured_queries if query["sql"].startswith('UPDATE "scheduler_schedule"')
    ]


def test_commit__one_offs_due_together_turn_off_in_one_update(lease: leases.LeaseHandle) -> None:
    # Given 30 one-offs due at the same instant
    run_at = dbclock.now() - timedelta(seconds=1)
    targets = [make_schedule(f"once-{number}", run_at=run_at) for number in range(30)]

    # When the leader dispatches them
    with CaptureQueriesContext(connection) as queries:
        report = dispatch.dispatch_due(lease)

    # Then each has one pending execution and turned itself off with its reason...
    reason = f"One-off: its slot at {run_at.isoformat()} has been dispatched"
    assert sorted(report.completed) == sorted((target.name, reason) for target in targets)
    rows = Schedule.objects.filter(pk__in=[target.pk for target in targets])
    assert set(rows.values_list("enabled", "next_run_at", "slots_committed", "disabled_reason")) == {
        (False, None, 1, reason)
    }
    assert Execution.objects.filter(status=Status.PENDING, schedule__in=targets).count() == 30
    # ...written by one set-based UPDATE, not one per schedule nor a CASE over every row
    updates = schedule_updates(queries)
    assert len(updates) == 1 and "CASE" not in updates[0]


def test_commit__different_outcomes_in_one_pass_each_get_their_own_write(lease: leases.LeaseHandle) -> None:
    # Given, due in the same pass: an interval schedule, one with max_runs=1,
    # two one-offs at different instants, one that missed slots and one whose
    # time zone no longer exists
    now = dbclock.now()
    start = now - timedelta(seconds=2)
    hourly = make_schedule("hourly", interval=3600, start_at=start)
    last_run = make_schedule("last-run", interval=3600, start_at=start, max_runs=1)
    early = make_schedule("early", run_at=now - timedelta(seconds=3))
    late = make_schedule("late", run_at=now - timedelta(seconds=1))
    behind = make_schedule("behind", interval=1, start_at=now - timedelta(seconds=120), catchup_window=5)
    broken = make_schedule("broken", cron="0 * * * *")
    Schedule.objects.filter(pk__in=[hourly.pk, last_run.pk]).update(next_run_at=start)
    Schedule.objects.filter(pk=behind.pk).update(next_run_at=now - timedelta(seconds=60))
    Schedule.objects.filter(pk=broken.pk).update(timezone="Nowhere/Gone", next_run_at=now - timedelta(seconds=1))

    # When the leader dispatches them
    report = dispatch.dispatch_due(lease)

    # Then each schedule got its own outcome
    for target in (hourly, last_run, early, late, behind, broken):
        target.refresh_from_db()
    assert (hourly.enabled, hourly.next_run_at, hourly.slots_committed) == (True, start + timedelta(hours=1), 1)
    assert (last_run.enabled, last_run.next_run_at, last_run.disabled_reason) == (
        False,
        None,
        "Used all 1 runs (max_runs)",
    )
    assert early.disabled_reason == f"One-off: its slot at {early.run_at.isoformat()} has been dispatched"
    assert late.disabled_reason == f"One-off: its slot at {late.run_at.isoformat()} has been dispatched"
    assert (early.enabled, late.enabled, early.slots_committed, late.slots_committed) == (False, False, 1, 1)
    assert behind.enabled and behind.next_run_at > now - timedelta(seconds=60)
    assert behind.total_missed == report.missed + report.missed_not_recorded > 0
    assert behind.disabled_reason == "" and hourly.total_missed == 0
    assert broken.paused_reason.startswith("Invalid timing:") and broken.enabled and broken.slots_committed == 0
    assert not Execution.objects.filter(schedule=broken).exists()
