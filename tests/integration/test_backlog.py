"""A leader back to a day of backlog drains it without stalling dispatch, losing its lease or blocking workers."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models import F, Max
from django.db.models.functions import Coalesce

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

BACKLOG = 600


def test_backlog__a_day_behind_drains_while_an_every_second_probe_stays_on_time(celery_processes) -> None:
    # Given 600 minute crons whose next slot is 24 hours ago, and an every-second probe
    day_ago = dbclock.now().replace(second=0, microsecond=0) - timedelta(hours=24)
    Schedule.objects.bulk_create(
        [
            Schedule(name=f"behind-{n}", task="scheduler.echo", cron="* * * * *", queue="backlog", next_run_at=day_ago)
            for n in range(BACKLOG)
        ]
    )
    probe = Schedule(name="probe", task="scheduler.echo", interval=1, queue="probe")
    probe.full_clean()
    schedules.save(probe)
    # ... a worker for the probe's queue, and one leader
    worker = celery_processes("worker", "probe-worker", queues="probe")
    worker.wait_for_log(r"ready", timeout=60)
    celery_processes("beat", "beat")
    assert wait_until(lambda: leases.current("beat").is_held, timeout=30), "no leader"
    leader = leases.current("beat")

    # When it works through the backlog
    def drained() -> bool:
        now = dbclock.now()
        return not Schedule.objects.filter(name__startswith="behind-", next_run_at__lte=now).exists()

    # Then within a minute every schedule has moved past now
    assert wait_until(drained, timeout=60, interval=0.5), Schedule.objects.filter(
        name__startswith="behind-", next_run_at__lte=dbclock.now()
    ).count()
    drained_at = dbclock.now()
    assert wait_until(
        lambda: Execution.objects.filter(schedule=probe, scheduled_for__gt=drained_at + timedelta(seconds=3)).exists(),
        timeout=15,
    )
    # ... the leader never lost its lease
    now_state = leases.current("beat")
    assert (now_state.holder, now_state.token, now_state.is_held) == (leader.holder, leader.token, True)
    # ... every missed slot was counted on its schedule
    behind = Schedule.objects.filter(name__startswith="behind-")
    assert not behind.filter(total_missed__lt=24 * 60 - 10).exists()
    assert Execution.objects.filter(schedule__in=behind, status=Execution.Status.MISSED).count() == BACKLOG * 100

    # ... the worker claimed and ran every probe execution: no claim timed out
    Schedule.objects.filter(pk=probe.pk).update(enabled=False, next_run_at=None)
    probe_rows = Execution.objects.filter(schedule=probe)
    assert wait_until(lambda: not probe_rows.filter(status__in=Execution.IN_FLIGHT_STATUSES).exists(), timeout=60), (
        list(probe_rows.exclude(status=Execution.Status.SUCCEEDED).values_list("status", flat=True))
    )
    assert set(probe_rows.values_list("status", flat=True)) == {Execution.Status.SUCCEEDED}
    log = worker.log()
    assert "database is locked" not in log and "Traceback" not in log, log[-3000:]

    # ... and the probe was sent every second, never later than the bound SPEC guarantee 11 states
    # (2x the lease TTL): sent at enqueued_at, or before started_at when the worker claimed it
    # first (database clock both)
    slots = sorted(probe_rows.values_list("scheduled_for", flat=True))
    assert len(slots) >= 10 and len(slots) == (slots[-1] - slots[0]).total_seconds() + 1
    sent_at = Coalesce("enqueued_at", "started_at")
    wait = probe_rows.aggregate(longest=Max(sent_at - F("scheduled_for")))["longest"]
    assert wait is not None and wait <= timedelta(seconds=2 * settings.LEASE_TTL_SECONDS), wait


def test_backlog__a_pass_reads_its_batch_from_the_due_index_without_sorting_every_due_schedule() -> None:
    # Given 2,000 schedules due at the same instant (a burst, or a backlog)
    instant = dbclock.now().replace(microsecond=0) - timedelta(seconds=1)
    Schedule.objects.bulk_create(
        [Schedule(name=f"due-{n}", task="scheduler.echo", interval=60, next_run_at=instant) for n in range(2000)]
    )
    # When a pass reads one batch
    due = Schedule.objects.due(now=dbclock.now()).values_list("pk", flat=True)[:500]
    # Then it is the first 500 by id
    assert list(due) == sorted(Schedule.objects.values_list("pk", flat=True))[:500]
    if connection.vendor == "postgresql":
        # ... read in the due index's order (the id breaks ties), stopping after the batch: nothing is sorted
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ANALYZE scheduler_schedule")
            cursor.execute("SET LOCAL enable_seqscan = off")
            sql, params = due.query.sql_with_params()
            cursor.execute(f"EXPLAIN {sql}", params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "schedule_due" in plan and "Sort" not in plan, plan
