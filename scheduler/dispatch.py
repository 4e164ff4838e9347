"""Record due fires as Execution rows under the lease, then publish them (outbox).

The leader first commits what should run, in one transaction that re-checks
its lease, and only after the commit sends Celery messages. A crash between
the two leaves ``pending`` rows that whoever leads next publishes; a message
sent twice is harmless because the worker claims each execution once.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery import current_app
from django.db import IntegrityError, transaction
from kombu.exceptions import OperationalError as BrokerError

from scheduler import leases, policies
from scheduler.conf import settings
from scheduler.exceptions import ScheduleInvalid, SubmissionInvalid
from scheduler.models import Execution, Schedule

if TYPE_CHECKING:
    from celery import Celery, Task

logger = logging.getLogger(__name__)

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
        timeout=schedule.timeout,
        max_retries=schedule.max_retries,
        retry_backoff=schedule.retry_backoff,
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


#: Execution columns a message is built from.
_MESSAGE_FIELDS = ("id", "task", "args", "kwargs", "queue", "celery_task_id", "timeout", "scheduled_for")


def time_limits(timeout: int | None) -> dict[str, float]:
    """Return Celery's time-limit options for an execution ``timeout`` (none when unset).

    The soft limit raises ``SoftTimeLimitExceeded`` in the task at ``timeout``;
    the hard limit kills the worker child ``TIMEOUT_GRACE_SECONDS`` later.
    """
    if not timeout:
        return {}
    return {"soft_time_limit": float(timeout), "time_limit": float(timeout) + settings.TIMEOUT_GRACE_SECONDS}


def publish(app: Celery, rows: list[dict[str, Any]], *, now: datetime) -> list[int]:
    """Send one message per execution row (``_MESSAGE_FIELDS``); return the ids sent.

    Sending stops at the first broker error, which propagates; the ids sent
    so far are marked ``queued`` either way. Sending an execution twice is
    harmless: the worker claims each execution once.
    """
    sent: list[int] = []
    try:
        with app.connection_for_write() as conn:
            # One attempt, no retry loop: kombu would otherwise block the beat
            # for many seconds per outage; the rows simply stay pending.
            conn.ensure_connection(max_retries=0)
            producer = conn.Producer()
            for row in rows:
                options: dict[str, Any] = {
                    "task_id": row["celery_task_id"] or None,
                    "headers": {Execution.MESSAGE_HEADER: row["id"]},
                    "producer": producer,
                    # Fail fast: a broker outage must not stall the caller.
                    "retry": False,
                    **time_limits(row["timeout"]),
                }
                if row["queue"]:
                    options["queue"] = row["queue"]
                if row["scheduled_for"] > now:
                    options["eta"] = row["scheduled_for"]
                app.send_task(row["task"], args=row["args"], kwargs=row["kwargs"], **options)
                sent.append(row["id"])
    finally:
        if sent:
            Execution.objects.filter(id__in=sent, status=Execution.Status.PENDING).update(
                status=Execution.Status.QUEUED, enqueued_at=now
            )
    return sent


def publish_pending(app: Celery, *, limit: int | None = None) -> int:
    """Send ``pending`` executions to the broker and mark them ``queued``.

    Returns how many were sent. A broker error stops the pass and leaves the
    remaining rows ``pending`` for the next one; the caller decides whether to log.
    """
    limit = limit or settings.DISPATCH_BATCH_SIZE
    pending = list(
        Execution.objects.filter(status=Execution.Status.PENDING)
        .order_by("created_at", "id")
        .values(*_MESSAGE_FIELDS)[:limit]
    )
    if not pending:
        return 0
    return len(publish(app, pending, now=leases.db_now()))


def submit(
    task: str | Task,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    idempotency_key: str | None = None,
    timeout: int | None = None,
    queue: str | None = None,
    countdown: float | None = None,
    max_retries: int = 0,
    retry_backoff: int = 1,
    app: Celery | None = None,
) -> Execution:
    """Record an ad-hoc execution of ``task`` and send it once the transaction commits.

    The same ``idempotency_key`` again returns the existing Execution and sends
    nothing; concurrent calls with one key create one row (the database's
    unique constraint decides). Raises ``SubmissionInvalid`` before writing
    anything when the task is unknown or an argument is malformed.
    """
    app = app or current_app
    name = task if isinstance(task, str) else task.name
    if not _is_registered(app, name):
        raise SubmissionInvalid(f"Unknown task {name!r}: no task with that name is registered.")
    args, kwargs = _checked_arguments(args, kwargs)
    if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
        raise SubmissionInvalid(f"timeout must be a positive whole number of seconds, got {timeout!r}.")
    if countdown is not None and countdown < 0:
        raise SubmissionInvalid(f"countdown must not be negative, got {countdown!r}.")
    for label, value in (("max_retries", max_retries), ("retry_backoff", retry_backoff)):
        if not isinstance(value, int) or value < 0:
            raise SubmissionInvalid(f"{label} must be a non-negative integer, got {value!r}.")
    if idempotency_key is not None and not (0 < len(idempotency_key) <= 255):
        raise SubmissionInvalid("idempotency_key must be 1 to 255 characters long.")

    now = leases.db_now()
    execution = Execution(
        idempotency_key=idempotency_key or f"submit:{uuid.uuid4()}",
        task=name,
        args=args,
        kwargs=kwargs,
        queue=queue or "",
        scheduled_for=now + timedelta(seconds=countdown or 0),
        timeout=timeout,
        max_retries=max_retries,
        retry_backoff=retry_backoff,
        celery_task_id=str(uuid.uuid4()),
    )
    try:
        with transaction.atomic():
            execution.save(force_insert=True)
    except IntegrityError:
        existing = Execution.objects.filter(idempotency_key=execution.idempotency_key).first()
        if existing is None:  # the conflict was not the key: a real error
            raise
        return existing
    row = {field: getattr(execution, field) for field in _MESSAGE_FIELDS}

    def send() -> None:
        try:
            publish(app, [row], now=now)
        except (BrokerError, OSError) as exc:
            # The row stays pending; the leader publishes pending rows every tick.
            logger.warning(
                "execution %s recorded but not sent yet (%s); the beat leader will send it",
                execution.pk, exc, extra={"action": "submit_deferred", "execution_id": execution.pk},
            )

    transaction.on_commit(send)
    return execution


def _is_registered(app: Celery, name: str) -> bool:
    if name not in app.tasks:
        # Outside a worker, apps' tasks modules are imported on demand only.
        app.loader.import_default_modules()
    return name in app.tasks


def _checked_arguments(args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise SubmissionInvalid(f"args must be a list or tuple, got {type(args).__name__}.")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise SubmissionInvalid("kwargs must be a dict with string keys.")
    try:
        json.dumps([list(args), kwargs])
    except (TypeError, ValueError) as exc:
        raise SubmissionInvalid(f"args and kwargs must be JSON-serialisable: {exc}") from None
    return list(args), kwargs
