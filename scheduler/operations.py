"""Operator actions on schedules and executions: validate, run now, retry, cancel.

The management commands and the admin call these, so an action means the
same wherever it is taken. Each one checks before it writes, writes in one
transaction, and talks to the broker only once that transaction has
committed: a broker outage leaves a ``pending`` row that the beat leader
sends later, or a ``cancelled`` row that no worker will claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from django.core.exceptions import ValidationError
from django.db import transaction

from scheduler import broker, executions, leases, outbox, task_policy
from scheduler.exceptions import BrokerUnavailable, SchedulerError, TaskRefused
from scheduler.models import Execution, Schedule
from scheduler.tenancy import Scope

if TYPE_CHECKING:
    from celery import Celery

#: Executions an operator may run again: finished ones, and ones whose worker died.
RETRYABLE_STATUSES = Execution.FINAL_STATUSES | {Execution.Status.LOST}
#: Executions an operator may cancel: not finished yet (a lost one is reconcile's to retry or fail).
CANCELLABLE_STATUSES = Execution.ACTIVE_STATUSES - {Execution.Status.LOST}
CANCEL_ERROR = "Cancelled by an operator"
#: A one-off time this little behind the database clock still counts as "now": it runs.
RUN_AT_GRACE = timedelta(seconds=10)


class ActionRefused(SchedulerError):
    """The action cannot be taken: its task is unknown or not the caller's to run, or the execution is in the wrong state."""


class RunAtInPast(SchedulerError):
    """A one-off time is already past: the beat would record it missed and never run it."""


@dataclass
class ActionResult:
    """The execution an action wrote, and how its broker step went after the commit.

    Not frozen, unlike other reports: the broker step runs on commit and
    fills ``broker_error`` in then (at once when called outside a transaction).
    """

    execution: Execution
    #: Why the message (or the revoke) could not reach the broker; empty when it did.
    broker_error: str = ""


def ensure_task(app: Celery, name: str, *, tenant: str, scope: Scope) -> None:
    """Raise ``ActionRefused`` unless a caller of ``scope`` may run ``name`` for a row of ``tenant``, and it is a task of ``app``.

    The task policy (``scheduler.task_policy``) is asked first, so a reserved
    task is refused as such whether or not this process registered it.
    """
    try:
        task_policy.ensure_scope_allows(name, tenant=tenant, scope=scope)
    except TaskRefused as exc:
        raise ActionRefused(str(exc)) from None
    if not task_policy.is_task_registered(name, app=app):
        raise ActionRefused(f"Unknown task {name!r}: no task with that name is registered.")
    if not task_policy.is_task_guarded(name, app=app):
        raise ActionRefused(task_policy.unguarded_message(name))


def validate_schedule(schedule: Schedule, *, app: Celery, scope: Scope) -> None:
    """Run the model's validation and check that the task exists and ``scope`` may run it; raise one ValidationError with every problem."""
    errors: dict[str, list[ValidationError]] = {}
    try:
        schedule.full_clean()
    except ValidationError as exc:
        errors = exc.update_error_dict(errors)
    if schedule.task:
        try:
            ensure_task(app, schedule.task, tenant=schedule.tenant, scope=scope)
        except ActionRefused as exc:
            errors.setdefault("task", []).append(ValidationError(str(exc)))
    if errors:
        raise ValidationError(errors)


def ensure_run_at_ahead(run_at: datetime | None, *, now: datetime, hint: str) -> None:
    """Raise ``RunAtInPast`` (its message ends with ``hint``) when a one-off's new ``run_at`` is before ``now``.

    ``now`` is the database clock, the beat's; ``RUN_AT_GRACE`` lets "now" typed a moment ago through.
    """
    if run_at is not None and run_at < now - RUN_AT_GRACE:
        raise RunAtInPast(
            f"The one-off time {run_at.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC is in the past "
            f"(it is {now.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC): it would be recorded missed and "
            f"never run. {hint}"
        )


def run_now(schedule: Schedule, *, app: Celery, scope: Scope) -> ActionResult:
    """Record an execution of ``schedule`` for now, outside its timing, and send it after commit."""
    ensure_task(app, schedule.task, tenant=schedule.tenant, scope=scope)
    return _record_and_send(executions.run_now_for(schedule, now=leases.db_now()), app=app)


def ensure_retryable(execution: Execution) -> None:
    """Raise ``ActionRefused`` unless ``execution`` has finished (or its worker was lost)."""
    if execution.status not in RETRYABLE_STATUSES:
        raise ActionRefused(
            f"Execution {execution.pk} is {execution.status}; only finished or lost executions can be retried."
        )


def retry_execution(execution: Execution, *, app: Celery, scope: Scope) -> ActionResult:
    """Record a new execution that re-runs ``execution`` now, as attempt 1, and send it after commit."""
    ensure_retryable(execution)
    ensure_task(app, execution.task, tenant=execution.tenant, scope=scope)
    return _record_and_send(executions.retry_for(execution, now=leases.db_now()), app=app)


def ensure_cancellable(execution: Execution) -> None:
    """Raise ``ActionRefused`` unless ``execution`` is still waiting or running."""
    if execution.status not in CANCELLABLE_STATUSES:
        raise ActionRefused(
            f"Execution {execution.pk} is {execution.status}; only pending, queued, running or retrying "
            "executions can be cancelled."
        )


def cancel_execution(execution: Execution, *, app: Celery) -> ActionResult:
    """Record ``execution`` cancelled, then revoke its Celery task (terminating it) after commit.

    The update only applies while the row is still cancellable, so a worker
    that finishes it at the same moment wins cleanly and the action is
    refused. A revoke that cannot reach the broker leaves the row cancelled:
    workers never claim a cancelled execution.
    """
    ensure_cancellable(execution)
    with transaction.atomic():
        cancelled = executions.cancel(execution.pk, reason=CANCEL_ERROR, now=leases.db_now())
        execution.refresh_from_db()
        if not cancelled:
            raise ActionRefused(f"Execution {execution.pk} became {execution.status} meanwhile; not cancelled.")
        result = ActionResult(execution)
        if execution.celery_task_id:
            transaction.on_commit(lambda: _revoke(app, execution.celery_task_id, result))
    return result


def _record_and_send(execution: Execution, *, app: Celery) -> ActionResult:
    result = ActionResult(execution)
    executions.record_one(execution)  # its key is new: it always inserts
    transaction.on_commit(lambda: _publish(app, result))
    return result


def _publish(app: Celery, result: ActionResult) -> None:
    execution = result.execution
    row = executions.message_row(execution)
    try:
        outbox.publish(app, [row], now=leases.db_now())
    except BrokerUnavailable as exc:
        result.broker_error = _first_line(exc)  # the row stays pending; the beat leader sends it
    execution.refresh_from_db()


def _revoke(app: Celery, task_id: str, result: ActionResult) -> None:
    try:
        # One attempt: kombu's own retry loop would hold an operator for seconds.
        broker.revoke(app, task_id, once=True)
    except BrokerUnavailable as exc:
        result.broker_error = _first_line(exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
