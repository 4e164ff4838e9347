"""Record due fires as Execution rows under the lease, then publish them (outbox).

The leader first commits what should run, in one transaction that re-checks
its lease, and only after the commit sends Celery messages. A crash between
the two leaves ``pending`` rows that whoever leads next publishes; a message
sent twice is harmless because the worker claims each execution once.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from django.db import transaction

from scheduler import leases, policies
from scheduler.conf import settings
from scheduler.exceptions import ScheduleInvalid
from scheduler.models import Execution, Schedule

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Message header that carries the execution id to the worker.
EXECUTION_HEADER = "execution_id"


def idempotency_key(schedule: Schedule, scheduled_for: datetime) -> str:
    """Return the key that makes a (schedule, slot) fire at most once."""
    return f"schedule:{schedule.pk}:{scheduled_for.astimezone(timezone.utc).isoformat()}"


@dataclass
class DispatchReport:
    """What one dispatch pass committed."""

    db_now: datetime
    schedules: int = 0
    missed: int = 0
    missed_not_recorded: int = 0
    #: (schedule name, slot) of every fire committed to run, for logging.
    fired: list[tuple[str, datetime]] = field(default_factory=list)


def _execution_for(
    schedule: Schedule, slot: datetime, *, token: int, status: str, now: datetime
) -> Execution:
    missed = status == Execution.Status.MISSED
    return Execution(
        idempotency_key=idempotency_key(schedule, slot),
        schedule=schedule,
        task=schedule.task,
        args=schedule.args,
        kwargs=schedule.kwargs,
        queue=schedule.queue,
        tenant=schedule.tenant,
        scheduled_for=slot,
        status=status,
        lease_token=token,
        # Chosen before sending so a re-publish after a crash reuses the id.
        celery_task_id="" if missed else str(uuid.uuid4()),
        finished_at=now if missed else None,
    )


def dispatch_due(lease: leases.LeaseHandle, *, batch_size: int | None = None) -> DispatchReport:
    """Commit Execution rows for every due slot and advance the schedules.

    Runs in one transaction that first locks the lease row and checks that
    ``lease`` still holds it; raises ``LeaseLost`` otherwise, and then
    nothing is written. Conflicting idempotency keys are ignored, so a slot
    that already has an execution is never recorded twice.
    """
    batch_size = batch_size or settings.DISPATCH_BATCH_SIZE
    with transaction.atomic():
        now = leases.assert_held(lease)
        due = list(
            Schedule.objects.due(now=now).select_for_update(skip_locked=True)[:batch_size]
        )
        report = DispatchReport(db_now=now, schedules=len(due))
        rows: list[Execution] = []
        for schedule in due:
            try:
                plan = policies.plan_due(
                    schedule.timing,
                    next_run_at=schedule.next_run_at,
                    now=now,
                    catchup_window=schedule.catchup_window,
                    misfire=schedule.misfire,
                    runs_so_far=schedule.total_runs,
                )
            except ScheduleInvalid as exc:
                # One broken schedule (e.g. a zone gone from tzdata) must not
                # block the others: pause it with the reason and move on.
                logger.error("schedule %s paused: %s", schedule.name, exc, extra={"action": "schedule_invalid"})
                schedule.paused_reason = f"Invalid timing: {exc}"
                continue
            for slot in plan.missed:
                rows.append(_execution_for(schedule, slot, token=lease.token, status=Execution.Status.MISSED, now=now))
            for slot in plan.run:
                rows.append(_execution_for(schedule, slot, token=lease.token, status=Execution.Status.PENDING, now=now))
                report.fired.append((schedule.name, slot))
            report.missed += len(plan.missed)
            report.missed_not_recorded += plan.missed_not_recorded
            if plan.missed or plan.missed_not_recorded:
                logger.warning(
                    "schedule %s: %d slot(s) older than its catch-up window (%ss) or skipped by "
                    "misfire=%s recorded as missed, %d more not recorded",
                    schedule.name, len(plan.missed), schedule.catchup_window, schedule.misfire,
                    plan.missed_not_recorded,
                    extra={"action": "slots_missed", "schedule": schedule.name},
                )
            schedule.next_run_at = plan.next_run_at
        Execution.objects.bulk_create(rows, ignore_conflicts=True, batch_size=1000)
        if due:
            Schedule.objects.bulk_update(due, ["next_run_at", "paused_reason"], batch_size=1000)
    return report


def publish_pending(app: Celery, *, limit: int | None = None) -> int:
    """Send ``pending`` executions to the broker and mark them ``queued``.

    Returns how many were sent. A broker error stops the pass and leaves the
    remaining rows ``pending`` for the next one; the caller decides whether to log.
    """
    limit = limit or settings.DISPATCH_BATCH_SIZE
    pending = list(
        Execution.objects.filter(status=Execution.Status.PENDING)
        .order_by("created_at", "id")
        .values("id", "task", "args", "kwargs", "queue", "celery_task_id")[:limit]
    )
    if not pending:
        return 0
    sent: list[int] = []
    try:
        with app.connection_for_write() as conn:
            # One attempt, no retry loop: kombu would otherwise block the beat
            # for many seconds per outage; the rows simply stay pending.
            conn.ensure_connection(max_retries=0)
            producer = conn.Producer()
            for row in pending:
                options: dict[str, Any] = {
                    "task_id": row["celery_task_id"] or None,
                    "headers": {EXECUTION_HEADER: row["id"]},
                    "producer": producer,
                    # Fail fast: a broker outage must not stall the beat loop;
                    # the row stays pending and the next tick tries again.
                    "retry": False,
                }
                if row["queue"]:
                    options["queue"] = row["queue"]
                app.send_task(row["task"], args=row["args"], kwargs=row["kwargs"], **options)
                sent.append(row["id"])
    finally:
        if sent:
            Execution.objects.filter(id__in=sent, status=Execution.Status.PENDING).update(
                status=Execution.Status.QUEUED, enqueued_at=leases.db_now()
            )
    return len(sent)
