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
from django.db.models import Count, Exists, F, OuterRef, Q
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
    skipped: int = 0
    #: (schedule name, slot) of every fire committed to run, for logging.
    fired: list[tuple[str, datetime]] = field(default_factory=list)
    #: Celery task ids of executions cancelled by ``overlap=cancel_previous``;
    #: the caller revokes them once the transaction has committed.
    cancelled_task_ids: list[str] = field(default_factory=list)
    #: (schedule name, reason) of schedules that turned themselves off.
    completed: list[tuple[str, str]] = field(default_factory=list)


def execution_for(
    schedule: Schedule, slot: datetime, *, status: str, now: datetime, token: int | None = None, held: bool = False
) -> Execution:
    """Return an unsaved Execution of ``schedule`` for ``slot`` (``token``: the beat lease it is under).

    A ``pending`` one gets its Celery task id now, so a re-send reuses it;
    any other status is final and finished at ``now``.
    """
    sent = status == Execution.Status.PENDING
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
        held=held,
        timeout=schedule.timeout,
        max_retries=schedule.max_retries,
        retry_backoff=schedule.retry_backoff,
        lease_token=token,
        # Chosen before sending so a re-publish after a crash reuses the id.
        celery_task_id=str(uuid.uuid4()) if sent else "",
        finished_at=None if sent else now,
    )


def _in_flight(schedules: list[Schedule]) -> dict[int, tuple[int, int]]:
    """Return {schedule id: (executions in flight, of which held)} for non-``allow`` schedules."""
    ids = [s.pk for s in schedules if s.overlap != Schedule.Overlap.ALLOW]
    if not ids:
        return {}
    rows = (
        Execution.objects.filter(schedule_id__in=ids, status__in=Execution.ACTIVE_STATUSES)
        .values("schedule_id")
        .annotate(total=Count("id"), held=Count("id", filter=Q(held=True)))
    )
    return {row["schedule_id"]: (row["total"], row["held"]) for row in rows}


def _runs_used(schedules: list[Schedule]) -> dict[int, int]:
    """Return {schedule id: slots sent so far} for schedules with ``max_runs`` or ``run_at``."""
    ids = [s.pk for s in schedules if s.max_runs or s.run_at]
    if not ids:
        return {}
    rows = (
        Execution.objects.filter(schedule_id__in=ids)
        .exclude(status__in=[Execution.Status.MISSED, Execution.Status.SKIPPED])
        .values("schedule_id")
        .annotate(total=Count("id"))
    )
    return {row["schedule_id"]: row["total"] for row in rows}


def _cancel_in_flight(schedule_ids: list[int], *, now: datetime) -> list[str]:
    """Record the in-flight executions of these schedules ``cancelled``; return their Celery ids."""
    if not schedule_ids:
        return []
    in_flight = Execution.objects.filter(schedule_id__in=schedule_ids, status__in=Execution.ACTIVE_STATUSES)
    task_ids = [task_id for task_id in in_flight.values_list("celery_task_id", flat=True) if task_id]
    in_flight.update(
        status=Execution.Status.CANCELLED,
        held=False,
        finished_at=now,
        lease_expires_at=None,
        error="Cancelled by overlap=cancel_previous: a newer slot started",
    )
    return task_ids


def _completion_reason(schedule: Schedule, *, runs_used: int) -> str:
    if schedule.run_at is not None:
        return f"One-off: its slot at {schedule.run_at.isoformat()} has been dispatched"
    if schedule.max_runs and runs_used >= schedule.max_runs:
        return f"Used all {schedule.max_runs} runs (max_runs)"
    if schedule.end_at is not None:
        return f"Past its end at {schedule.end_at.isoformat()}"
    return "No more slots"


def dispatch_due(lease: leases.LeaseHandle, *, batch_size: int | None = None) -> DispatchReport:
    """Commit Execution rows for every due slot and advance the schedules.

    Runs in one transaction that first locks the lease row and checks that
    ``lease`` still holds it; raises ``LeaseLost`` otherwise, and then
    nothing is written. Conflicting idempotency keys are ignored, so a slot
    that already has an execution is never recorded twice. The catch-up
    window, misfire and overlap policies decide which slots are sent and
    which are recorded ``missed`` or ``skipped``; a schedule with no slots
    left turns itself off with a reason.
    """
    batch_size = batch_size or settings.DISPATCH_BATCH_SIZE
    with transaction.atomic():
        now = leases.assert_held(lease)
        due = list(
            Schedule.objects.due(now=now).select_for_update(skip_locked=True)[:batch_size]
        )
        report = DispatchReport(db_now=now, schedules=len(due))
        in_flight, runs_used = _in_flight(due), _runs_used(due)
        rows: list[Execution] = []
        to_cancel: list[int] = []
        changed: list[Schedule] = []  # schedules with more than next_run_at to write
        for schedule in due:
            try:
                plan = policies.plan_due(
                    schedule.timing,
                    next_run_at=schedule.next_run_at,
                    now=now,
                    catchup_window=schedule.catchup_window,
                    misfire=schedule.misfire,
                    runs_so_far=runs_used.get(schedule.pk, 0),
                )
            except ScheduleInvalid as exc:
                # One broken schedule (e.g. a zone gone from tzdata) must not
                # block the others: pause it with the reason and move on.
                logger.error("schedule %s paused: %s", schedule.name, exc, extra={"action": "schedule_invalid"})
                schedule.paused_reason = f"Invalid timing: {exc}"
                changed.append(schedule)
                continue
            flying, held = in_flight.get(schedule.pk, (0, 0))
            overlap = policies.plan_overlap(schedule.overlap, plan.run, in_flight=flying, buffered=held)
            if overlap.cancel_in_flight:
                to_cancel.append(schedule.pk)
            for slot in plan.missed:
                rows.append(execution_for(schedule, slot, token=lease.token, status=Execution.Status.MISSED, now=now))
            for slot in overlap.skipped:
                rows.append(execution_for(schedule, slot, token=lease.token, status=Execution.Status.SKIPPED, now=now))
            for slot in overlap.run:
                rows.append(execution_for(schedule, slot, token=lease.token, status=Execution.Status.PENDING, now=now))
                report.fired.append((schedule.name, slot))
            if overlap.buffered is not None:
                rows.append(
                    execution_for(
                        schedule, overlap.buffered, token=lease.token, status=Execution.Status.PENDING, now=now, held=True
                    )
                )
            report.missed += len(plan.missed)
            report.missed_not_recorded += plan.missed_not_recorded
            report.skipped += len(overlap.skipped)
            if plan.missed or plan.missed_not_recorded:
                schedule.total_missed += len(plan.missed) + plan.missed_not_recorded
                changed.append(schedule)
            if plan.missed or plan.missed_not_recorded:
                logger.warning(
                    "schedule %s: %d slot(s) older than its catch-up window (%ss) or skipped by "
                    "misfire=%s recorded as missed, %d more not recorded",
                    schedule.name, len(plan.missed), schedule.catchup_window, schedule.misfire,
                    plan.missed_not_recorded,
                    extra={"action": "slots_missed", "schedule": schedule.name},
                )
            schedule.next_run_at = plan.next_run_at
            if plan.next_run_at is None:
                used = runs_used.get(schedule.pk, 0) + len(overlap.run) + (overlap.buffered is not None)
                schedule.enabled = False
                changed.append(schedule)
                schedule.disabled_reason = _completion_reason(schedule, runs_used=used)
                report.completed.append((schedule.name, schedule.disabled_reason))
        report.cancelled_task_ids = _cancel_in_flight(to_cancel, now=now)
        Execution.objects.bulk_create(rows, ignore_conflicts=True, batch_size=1000)
        if due:
            # Every due schedule moves on; the other fields change for a few only,
            # and bulk_update's cost grows with rows times fields.
            Schedule.objects.bulk_update(due, ["next_run_at"], batch_size=1000)
        if changed:
            Schedule.objects.bulk_update(
                set(changed), ["paused_reason", "enabled", "disabled_reason", "total_missed"], batch_size=1000
            )
    return report


#: Execution columns a message is built from.
MESSAGE_FIELDS = ("id", "task", "args", "kwargs", "queue", "celery_task_id", "timeout", "scheduled_for")


def time_limits(timeout: int | None) -> dict[str, float]:
    """Return Celery's time-limit options for an execution ``timeout`` (none when unset).

    The soft limit raises ``SoftTimeLimitExceeded`` in the task at ``timeout``;
    the hard limit kills the worker child ``TIMEOUT_GRACE_SECONDS`` later.
    """
    if not timeout:
        return {}
    return {"soft_time_limit": float(timeout), "time_limit": float(timeout) + settings.TIMEOUT_GRACE_SECONDS}


def message_row(execution: Execution) -> dict[str, Any]:
    """Return what ``publish`` needs of one execution."""
    return {field: getattr(execution, field) for field in MESSAGE_FIELDS}


def publish(app: Celery, rows: list[dict[str, Any]], *, now: datetime) -> list[int]:
    """Send one message per execution row; return the ids sent.

    A row has the ``MESSAGE_FIELDS`` (see ``message_row``), and ``schedule_id`` and ``jitter``
    when it belongs to a schedule with jitter.

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
                start_at = row["scheduled_for"] + timedelta(
                    seconds=policies.jitter_offset(row.get("schedule_id") or 0, row["scheduled_for"], row.get("jitter"))
                )
                if start_at > now:
                    options["eta"] = start_at
                app.send_task(row["task"], args=row["args"], kwargs=row["kwargs"], **options)
                sent.append(row["id"])
    finally:
        if sent:
            Execution.objects.filter(id__in=sent, status=Execution.Status.PENDING).update(
                status=Execution.Status.QUEUED, enqueued_at=now
            )
    return sent


def release_buffered() -> int:
    """Let ``buffer_one`` rows go once their schedule has nothing else in flight; return how many."""
    others_in_flight = Execution.objects.filter(
        schedule_id=OuterRef("schedule_id"), status__in=Execution.ACTIVE_STATUSES, held=False
    )
    return (
        Execution.objects.filter(held=True, status=Execution.Status.PENDING)
        .exclude(Exists(others_in_flight))
        .update(held=False)
    )


def publish_pending(app: Celery, *, limit: int | None = None) -> int:
    """Send ``pending`` executions to the broker and mark them ``queued``.

    Buffered rows whose schedule went idle are released first; rows still
    held are not sent. A schedule's ``jitter`` delays its message by a
    per-slot amount (``policies.jitter_offset``). Returns how many were
    sent. A broker error stops the pass and leaves the remaining rows
    ``pending`` for the next one; the caller decides whether to log.
    """
    limit = limit or settings.DISPATCH_BATCH_SIZE
    release_buffered()
    pending = list(
        Execution.objects.filter(status=Execution.Status.PENDING, held=False)
        .order_by("created_at", "id")
        .values(*MESSAGE_FIELDS, "schedule_id", jitter=F("schedule__jitter"))[:limit]
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
    if not is_task_registered(name, app=app):
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
    row = message_row(execution)

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


def is_task_registered(name: str, *, app: Celery | None = None) -> bool:
    """Return whether a task of that name is registered with the Celery app."""
    app = app or current_app
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
