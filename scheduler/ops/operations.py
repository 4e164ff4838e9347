"""Operator actions: schedule edits, run now, retry, cancel, API tokens, shard moves and the long writes.

The admin, the API and the management commands call these, so an action
means the same wherever it is taken, and each adapter only says who acts
(an ``audit.Actor``). Each action checks before it writes, writes its
change and its audit event in one transaction (the change rolls back,
the event with it), and talks to the broker only once that transaction has
committed: a broker outage leaves a ``pending`` row that the beat leader
sends later, or a ``cancelled`` row that no worker will claim. A long
write (backfill, reconcile, prune, a shard count change) is many
transactions: its event is committed "started" before the work and
completed with the work's counts after, so a crash part-way leaves it
"started".
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import transaction

from scheduler import dbclock, limits, outbox, shards, task_policy
from scheduler.exceptions import BrokerUnavailable, SchedulerError, TaskRefused, first_line
from scheduler.models import (
    ApiToken,
    Calendar,
    ConcurrencyLimit,
    Execution,
    NotificationTarget,
    PauseRule,
    RateLimit,
    Schedule,
)
from scheduler.models.schedule import argument_shape_problems
from scheduler.ops import audit, backfill, bulk, prune, reconcile, resharding
from scheduler.outbox import broker
from scheduler.owners import calendars as calendar_owner
from scheduler.owners import executions, schedules, work_rules
from scheduler.tenancy import Scope

if TYPE_CHECKING:
    from celery import Celery

#: Executions an operator may run again: finished ones, and ones whose worker died.
RETRYABLE_STATUSES = Execution.FINAL_STATUSES | {Execution.Status.LOST}
#: Executions an operator may cancel: not finished yet (a lost one is reconcile's to retry or fail).
CANCELLABLE_STATUSES = Execution.IN_FLIGHT_STATUSES - {Execution.Status.LOST}
CANCEL_ERROR = "Cancelled by an operator"
#: Pause rules one tenant (or the deployer) may have in force at once.
MAX_PAUSE_RULES = 50
#: Every limit is matched at each claim, every calendar read for every slot: a tenant may not pile them up (of each kind).
MAX_LIMITS = 50
#: What a run now may replace of the schedule's stored values, for that run only.
RUN_OVERRIDES = ("args", "kwargs", "queue", "priority")
#: A one-off time (or an end) this little behind the database clock still counts as "now".
RUN_AT_GRACE = timedelta(seconds=10)


class ActionRefused(SchedulerError):
    """The action cannot be taken: its task is unknown or not the caller's to run, or the execution is in the wrong state."""


class TimeInPast(SchedulerError):
    """An edit sets a one-off time or an end that is already past: the schedule would never run.

    ``field`` is the one to blame, ``run_at`` or ``end_at``, for a form or
    a payload to put the message on.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    """Raise ``TimeInPast`` (its message ends with ``hint``) when a one-off's new ``run_at`` is before ``now``.

    ``now`` is the database clock, the beat's; ``RUN_AT_GRACE`` lets "now" typed a moment ago through.
    """
    if run_at is not None and run_at < now - RUN_AT_GRACE:
        raise TimeInPast(
            "run_at",
            f"The one-off time {_utc(run_at)} is in the past (it is {_utc(now)}): it would be recorded missed "
            f"and never run. {hint}",
        )


def ensure_end_at_ahead(end_at: datetime | None, *, now: datetime) -> None:
    """Raise ``TimeInPast`` when a schedule's new ``end_at`` is before ``now``: it would have no slot left.

    Called only when the edit sets the end: a schedule that has since passed
    its end can still be edited otherwise.
    """
    if end_at is not None and end_at < now - RUN_AT_GRACE:
        raise TimeInPast(
            "end_at",
            f"The end {_utc(end_at)} is in the past (it is {_utc(now)}): the schedule would never run again. "
            "Give a future end, or leave it empty.",
        )


def _utc(moment: datetime) -> str:
    return f"{moment.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


# --- schedules --------------------------------------------------------------------------


def save_schedule(
    schedule: Schedule,
    *,
    actor: audit.Actor,
    fields: Iterable[str] | None = None,
    now: datetime | None = None,
    action: str = "",
) -> None:
    """Insert ``schedule`` or write its edit (``schedules.save``), audited as ``action`` (default "create" or "update").

    The event's ``before`` is the stored row, read in the transaction: the
    caller's object already holds the edit.
    """
    adding = schedule._state.adding
    with transaction.atomic():
        before = {} if adding else audit.snapshot(Schedule.objects.filter(pk=schedule.pk).first())
        schedules.save(schedule, fields=fields, now=now)
        audit.record(actor, action or ("create" if adding else "update"), schedule, before=before)


def delete_schedule(schedule: Schedule, *, actor: audit.Actor) -> None:
    """Delete ``schedule`` (its executions stay), audited with every field it had."""
    with transaction.atomic():
        before = audit.snapshot(schedule)
        schedules.delete(schedule)
        audit.record(actor, "delete", schedule, before=before, deleted=True)


def save_target(target: NotificationTarget, *, actor: audit.Actor) -> None:
    """Insert or write a notification target (already validated), audited; the secret is masked in the event."""
    adding = target._state.adding
    with transaction.atomic():
        before = {} if adding else audit.snapshot(NotificationTarget.objects.filter(pk=target.pk).first())
        target.save()
        audit.record(actor, "create" if adding else "update", target, before=before)


def delete_target(target: NotificationTarget, *, actor: audit.Actor) -> None:
    """Delete a notification target (and what is still owed to it), audited."""
    with transaction.atomic():
        before = audit.snapshot(target)
        target.delete()
        audit.record(actor, "delete", target, before=before, deleted=True)


def save_limit(limit: ConcurrencyLimit | RateLimit, *, actor: audit.Actor, scope: Scope, app: Celery) -> None:
    """Insert or write a concurrency or rate limit, audited; then offer the places a higher concurrency limit frees.

    As ``save_tenant_rule``.
    """
    _save_tenant_rule(limit, actor=actor, scope=scope, problems=work_rules.problems, write=work_rules.save_limit)
    _offer_places_of(limit, app)


def delete_limit(limit: ConcurrencyLimit | RateLimit, *, actor: audit.Actor, scope: Scope, app: Celery) -> None:
    """Delete a concurrency or rate limit, audited; what waited for a concurrency limit's places is sent."""
    _delete_tenant_rule(limit, actor=actor, scope=scope, delete=work_rules.delete_limit)
    _offer_places_of(limit, app)


def save_calendar(calendar: Calendar, *, actor: audit.Actor, scope: Scope) -> None:
    """Insert or write a calendar, audited; the schedules that name it move their next slot and deadline to follow it."""
    _save_tenant_rule(calendar, actor=actor, scope=scope, problems=calendar_owner.problems, write=calendar_owner.save)
    now = dbclock.now()
    for schedule in calendar_owner.schedules_of(calendar):
        schedules.follow_calendars(schedule, now=now)


def delete_calendar(calendar: Calendar, *, actor: audit.Actor, scope: Scope) -> None:
    """Delete a calendar no schedule or calendar names, audited; ``ActionRefused`` names those that do."""
    users = calendar_owner.users(calendar)
    if users:
        raise ActionRefused(f"Calendar {calendar.name!r} is in use by {', '.join(users[:10])}: change them first.")
    _delete_tenant_rule(calendar, actor=actor, scope=scope, delete=calendar_owner.delete)


_TenantRule = ConcurrencyLimit | RateLimit | Calendar


def _save_tenant_rule(
    row: _TenantRule,
    *,
    actor: audit.Actor,
    scope: Scope,
    problems: Callable[[Any], dict[str, list[str]]],
    write: Callable[[Any], None],
) -> None:
    """Insert or write a limit or a calendar, audited.

    A caller bound to a tenant keeps its own tenant's only, and may not
    change one of every tenant. Raises ``ValidationError`` (by field) for a
    row that cannot be kept, and changes nothing then.
    """
    adding = row._state.adding
    model = type(row)
    noun = str(model._meta.verbose_name)
    before_row = None if adding else model.objects.filter(pk=row.pk).first()
    if adding:
        row.created_by = actor.name
    if scope.is_bound:
        if before_row is not None and before_row.every_tenant:
            raise ActionRefused(f"A {noun} of every tenant is changed by a user of every tenant only.")
        row.tenant, row.every_tenant = scope.tenant, False
    elif not scope.every_tenant:
        raise ActionRefused(f"You may not keep a {noun}: you are bound to no tenant.")
    else:
        row.every_tenant = not row.tenant
    found = problems(row)
    if adding and model.objects.filter(tenant=row.tenant).count() >= MAX_LIMITS:
        found.setdefault(NON_FIELD_ERRORS, []).append(
            f"At most {MAX_LIMITS} {model._meta.verbose_name_plural} per tenant; delete one first."
        )
    if model.objects.filter(tenant=row.tenant, name=row.name).exclude(pk=row.pk).exists():
        found.setdefault("name", []).append(f"A {noun} of that name exists already.")
    if found:
        raise ValidationError(found)
    with transaction.atomic():
        before = audit.snapshot(before_row) if before_row is not None else {}
        write(row)
        audit.record(actor, "create" if adding else "update", row, before=before, tenant=row.tenant)


def _delete_tenant_rule(row: _TenantRule, *, actor: audit.Actor, scope: Scope, delete: Callable[[Any], None]) -> None:
    noun = str(type(row)._meta.verbose_name)
    if row.every_tenant and not scope.every_tenant:
        raise ActionRefused(f"A {noun} of every tenant is deleted by a user of every tenant only.")
    if not scope.allows(row.tenant) and not row.every_tenant:
        raise ActionRefused(f"You may delete your own tenant's {noun}s only.")
    with transaction.atomic():
        before = audit.snapshot(row)
        delete(row)
        audit.record(actor, "delete", row, before=before, deleted=True, tenant=row.tenant)


def _offer_places_of(limit: ConcurrencyLimit | RateLimit, app: Celery) -> None:
    """Send what waits for the limit's places and may run now (a broker down: reconcile's next pass sends it)."""
    if not isinstance(limit, ConcurrencyLimit):
        return
    keys = [key for key, _, waiting in executions.place_usage(f"{limit.pk}:") if waiting]
    try:
        outbox.offer_places(app, keys, max_age=0)
    except BrokerUnavailable:
        pass


def pause_schedule(schedule: Schedule, reason: str, *, actor: audit.Actor, now: datetime | None = None) -> None:
    """Pause ``schedule`` with ``reason`` (``schedules.pause``), audited."""
    _change_schedule(schedule, "pause", actor, lambda: schedules.pause(schedule, reason, now=now))


def resume_schedule(schedule: Schedule, *, actor: audit.Actor, now: datetime | None = None) -> None:
    """Resume ``schedule`` from its next slot after ``now`` (``schedules.resume``), audited."""
    _change_schedule(schedule, "resume", actor, lambda: schedules.resume(schedule, now=now))


def set_schedule_enabled(schedule: Schedule, enabled: bool, *, actor: audit.Actor, now: datetime | None = None) -> None:
    """Turn ``schedule`` on or off (``schedules.set_enabled``), audited as "enable" or "disable"."""
    action = "enable" if enabled else "disable"
    _change_schedule(schedule, action, actor, lambda: schedules.set_enabled(schedule, enabled, now=now))


def _change_schedule(schedule: Schedule, action: str, actor: audit.Actor, change: Callable[[], None]) -> None:
    before = audit.snapshot(schedule)
    with transaction.atomic():
        change()
        audit.record(actor, action, schedule, before=before)


def assign_shards(*, actor: audit.Actor) -> int:
    """Move every schedule into shard ``id % count``; return how many moved (an event only when some did)."""
    count = shards.count()
    with transaction.atomic():
        moved = schedules.assign_shards(count=count)
        if moved:
            audit.record(
                actor,
                "assign_shards",
                object_type="scheduler.schedule",
                changes={"shards": count, "moved": moved},
                tenant="",
            )
    return moved


# --- executions -------------------------------------------------------------------------


def run_now(
    schedule: Schedule,
    *,
    app: Celery,
    scope: Scope,
    actor: audit.Actor,
    overrides: Mapping[str, Any] | None = None,
) -> ActionResult:
    """Record an execution of ``schedule`` for now, outside its timing, audited; send it after commit.

    ``overrides`` replaces some of the stored ``RUN_OVERRIDES`` for this run
    only: the execution records the values it ran with, the audit event
    both (stored, used); the schedule keeps its own. A value the schedule
    itself could not hold raises ``ValidationError`` by field, and nothing
    is written.
    """
    overrides = dict(overrides or {})
    check_run_overrides(schedule, overrides)
    ensure_task(app, schedule.task, tenant=schedule.tenant, scope=scope)
    with transaction.atomic():
        execution = executions.run_now_for(schedule, now=dbclock.now(), overrides=overrides)
        result = _record_and_send(execution, app=app)
        changes = {field: [getattr(schedule, field), value] for field, value in overrides.items()}
        audit.record(actor, "run_now", schedule, changes={"execution": [None, result.execution.pk], **changes})
    return result


def check_run_overrides(schedule: Schedule, overrides: Mapping[str, Any]) -> None:
    """Raise ``ValidationError`` by field unless each override is a value ``schedule`` could store itself."""
    unknown = sorted(set(overrides) - set(RUN_OVERRIDES))
    if unknown:
        raise ValidationError(
            {NON_FIELD_ERRORS: [f"A run now overrides only {', '.join(RUN_OVERRIDES)}; not {', '.join(unknown)}."]}
        )
    candidate = copy.copy(schedule)
    for field, value in overrides.items():
        setattr(candidate, field, value)
    errors: dict[str, list[str]] = {}
    try:
        candidate.clean_fields(exclude=[field.name for field in Schedule._meta.fields if field.name not in overrides])
    except ValidationError as exc:
        errors = exc.message_dict
    for field, message in argument_shape_problems(candidate).items():
        if field in overrides and field not in errors:
            errors[field] = [message]
    if errors:
        raise ValidationError(errors)


def ensure_retryable(execution: Execution) -> None:
    """Raise ``ActionRefused`` unless ``execution`` has finished (or its worker was lost)."""
    if execution.status not in RETRYABLE_STATUSES:
        raise ActionRefused(
            f"Execution {execution.pk} is {execution.status}; only finished or lost executions can be retried."
        )


def retry_execution(execution: Execution, *, app: Celery, scope: Scope, actor: audit.Actor) -> ActionResult:
    """Record a new execution that re-runs ``execution`` now, as attempt 1, audited; send it after commit."""
    ensure_retryable(execution)
    ensure_task(app, execution.task, tenant=execution.tenant, scope=scope)
    with transaction.atomic():
        result = _record_and_send(executions.retry_for(execution, now=dbclock.now()), app=app)
        audit.record(actor, "retry", execution, changes={"retried_by": [None, result.execution.pk]})
    return result


def ensure_cancellable(execution: Execution) -> None:
    """Raise ``ActionRefused`` unless ``execution`` is still waiting or running."""
    if execution.status not in CANCELLABLE_STATUSES:
        raise ActionRefused(
            f"Execution {execution.pk} is {execution.status}; only pending, queued, running or retrying "
            "executions can be cancelled."
        )


def cancel_execution(execution: Execution, *, app: Celery, actor: audit.Actor) -> ActionResult:
    """Record ``execution`` cancelled, audited, then revoke its Celery task (terminating it) after commit.

    The update only applies while the row is still cancellable, so a worker
    that finishes it at the same moment wins cleanly and the action is
    refused. A revoke that cannot reach the broker leaves the row cancelled:
    workers never claim a cancelled execution.
    """
    ensure_cancellable(execution)
    before = audit.snapshot(execution)
    with transaction.atomic():
        cancelled = executions.cancel(execution.pk, reason=CANCEL_ERROR, now=dbclock.now())
        execution.refresh_from_db()
        if not cancelled:
            raise ActionRefused(f"Execution {execution.pk} became {execution.status} meanwhile; not cancelled.")
        audit.record(actor, "cancel", execution, before=before)
        result = ActionResult(execution)
        if execution.celery_task_id:
            transaction.on_commit(lambda: _revoke(app, execution.celery_task_id, result))
    return result


# --- API tokens -------------------------------------------------------------------------


def issue_token(
    name: str, *, actor: audit.Actor, role: str, tenant: str, all_tenants: bool, expires_at: datetime | None
) -> tuple[ApiToken, str]:
    """Issue an API token (``ApiToken.issue``), audited; return it and its secret, which is shown once."""
    with transaction.atomic():
        token, raw = ApiToken.issue(name, role=role, tenant=tenant, all_tenants=all_tenants, expires_at=expires_at)
        audit.record(actor, "create", token, tenant=tenant)
    return token, raw


def revoke_token(token: ApiToken, *, actor: audit.Actor) -> None:
    """Revoke ``token`` now (the database clock), audited; the caller has locked its row."""
    before = audit.snapshot(token)
    with transaction.atomic():
        token.revoked_at = dbclock.now()
        token.save(update_fields=["revoked_at"])
        audit.record(actor, "revoke", token, before=before, tenant=token.tenant)


# --- pausing work by queue, task or tenant ----------------------------------------------


@dataclass(frozen=True)
class PauseResult:
    rule: PauseRule
    #: Waiting executions a drain cancelled.
    cancelled: int = 0


def pause_work(
    *,
    actor: audit.Actor,
    scope: Scope,
    queue: str = "",
    task: str = "",
    tenant: str | None = None,
    everything: bool = False,
    mode: str = PauseRule.Mode.HOLD,
    reason: str = "",
) -> PauseResult:
    """Hold (or drain) the work a new pause rule matches, audited; return the rule and what a drain cancelled.

    A caller bound to a tenant pauses that tenant's work only, whatever it
    asks. The rule is committed before a drain cancels anything, so no
    new claim slips in behind the cancellations.
    """
    whose = _pause_owner(scope, tenant=tenant, everything=everything)
    if everything and (queue or task):
        raise ActionRefused("Pause everything, or a queue or tasks: not both.")
    if not (queue or task or everything or tenant is not None):
        raise ActionRefused("Say what to pause: a queue, a task pattern, a tenant, or everything.")
    if work_rules.glob_problem(task):
        raise ActionRefused(f"Task pattern refused: {work_rules.glob_problem(task)}.")
    if mode not in PauseRule.Mode.values:
        raise ActionRefused(f"Mode {mode!r} is not one of {', '.join(PauseRule.Mode.values)}.")
    problems = limits.text_problems(reason, limits.PAUSED_REASON_MAX_CHARS)
    if problems:
        raise ValidationError({"reason": problems})
    fields = {**whose, "queue": queue, "task": task}
    # Every rule is matched at each beat pass and each claim: a tenant may not pile them up.
    if PauseRule.objects.filter(tenant=whose["tenant"]).count() >= MAX_PAUSE_RULES:
        raise ActionRefused(f"At most {MAX_PAUSE_RULES} pauses in force; resume one first.")
    if PauseRule.objects.filter(**fields, mode=mode).exists():
        raise ActionRefused("That work is paused so already.")
    with transaction.atomic():
        rule = work_rules.create_pause(**fields, mode=mode, reason=reason, created_by=actor.name)
        audit.record(actor, "pause_work", rule, before={}, tenant=rule.tenant)
    cancelled = 0
    if mode == PauseRule.Mode.DRAIN:
        condition = work_rules.Rule.of(rule).condition()
        cancelled = executions.cancel_waiting(condition, reason=f"Drained: {reason or 'paused'}", now=dbclock.now())
    return PauseResult(rule, cancelled)


def resume_work(rule: PauseRule, *, actor: audit.Actor, app: Celery) -> int:
    """Lift ``rule``, audited, then send again what it held; return how many executions were sent.

    What it held is what waited ``queued`` before the lift: the leader, woken
    by it, may send the work's next slot first, and that one is not sent
    twice. Executions another rule still holds stay waiting. A broker that does
    not answer leaves them ``queued``; reconcile sends them once it does.
    """
    with transaction.atomic():
        audit.record(actor, "resume_work", rule, changes={"rule": [rule.describe(), None]})
        work_rules.delete_pause(rule)
        # (before the commit: what the leader sends once it sees the rule gone is queued after)
        lifted_at = dbclock.now()
    condition = work_rules.Rule.of(rule).condition()
    still_held = work_rules.held(work_rules.pauses_in_force(max_age=0))
    if still_held is not None:
        condition &= ~still_held
    rows = executions.held_rows(condition, queued_before=lifted_at)
    try:
        return len(outbox.publish(app, rows, now=dbclock.now())) if rows else 0
    except BrokerUnavailable:
        return 0


def _pause_owner(scope: Scope, *, tenant: str | None, everything: bool) -> dict[str, Any]:
    """Whose work a rule of this caller holds: its own tenant's when bound to one."""
    if scope.is_bound:
        if tenant not in (None, scope.tenant):
            raise ActionRefused("You may pause your own tenant's work only.")
        return {"tenant": scope.tenant, "every_tenant": False}
    if not scope.every_tenant:
        raise ActionRefused("You may not pause work: you are bound to no tenant.")
    if tenant:
        return {"tenant": tenant, "every_tenant": False}
    return {"tenant": "", "every_tenant": True}


# --- long writes ------------------------------------------------------------------------


def bulk_action(
    action: str,
    chosen: bulk.Filter,
    *,
    app: Celery,
    scope: Scope,
    actor: audit.Actor,
    reason: str = "",
    dry_run: bool = False,
) -> bulk.BulkReport:
    """Take ``action`` on every schedule ``chosen`` matches in ``scope`` (``bulk.act``), audited as one operation.

    A dry run counts and records no event.
    """

    def may_run(task: str, tenant: str) -> bool:
        try:
            ensure_task(app, task, tenant=tenant, scope=scope)
        except ActionRefused:
            return False
        return True

    bulk.check(action, reason=reason)  # before the event: a refused action records none
    wanted = {"filter": chosen.as_dict(), **({"reason": reason} if reason else {})}
    tenant = scope.tenant if scope.is_bound else ""
    with audit.operation(
        actor, f"bulk_{action}", object_type="scheduler.schedule", changes=wanted, tenant=tenant, start=not dry_run
    ) as op:
        report = bulk.act(action, chosen, scope=scope, app=app, may_run=may_run, reason=reason, dry_run=dry_run)
        counts = {"matched": report.matched, "changed": report.changed}
        op.done({**counts, **({"broker_error": report.broker_error} if report.broker_error else {})})
    return report


def backfill_range(
    schedule: Schedule,
    *,
    actor: audit.Actor,
    start: datetime,
    end: datetime,
    dry_run: bool,
    limit: int = backfill.DEFAULT_LIMIT,
    max_slots: int | None = None,
    rate: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    app: Celery | None = None,
) -> backfill.BackfillReport:
    """Record one execution per past slot of ``schedule`` in [start, end] that has none (``backfill.backfill``).

    The event is committed once the range is accepted, before the first
    execution: a refused range or a dry run leaves none.
    """
    with audit.operation(actor, "backfill", schedule, changes={"start": start, "end": end}, start=False) as op:
        report = backfill.backfill(
            schedule,
            start=start,
            end=end,
            now=dbclock.now(),
            dry_run=dry_run,
            limit=limit,
            max_slots=max_slots,
            rate=rate,
            progress=progress,
            app=app,
            on_start=op.start,
        )
        op.done(report.outcome)
    return report


def reconcile_pass(
    *, actor: audit.Actor, dry_run: bool, repair: bool, app: Celery | None = None
) -> reconcile.ReconcileReport:
    """Run one reconcile pass (``reconcile.reconcile``); a dry run records no event."""
    with audit.operation(
        actor, "reconcile", object_type="reconcile", changes={"repair": repair}, start=not dry_run
    ) as op:
        report = reconcile.reconcile(now=dbclock.now(), dry_run=dry_run, repair=repair, app=app)
        op.done(report.outcome)
    return report


@dataclass
class Pruned:
    report: prune.PruneReport
    #: Audit events deleted with the executions (``None``: not asked to).
    audit_events_deleted: int | None = None


def prune_history(
    *,
    actor: audit.Actor,
    older_than: datetime,
    keep_last: int,
    statuses: list[str] | None = None,
    dry_run: bool = False,
    audit_events: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Pruned:
    """Delete executions finished before ``older_than`` (``prune.prune_executions``), and old audit events if asked.

    The audit trail is kept as long as the executions it speaks of: with
    ``audit_events`` the events older than the same cutoff go too, all but
    this prune's own.
    """
    wanted = {"older_than": older_than, "keep_last": keep_last, "statuses": statuses or []}
    with audit.operation(actor, "prune", object_type="scheduler.execution", changes=wanted, start=not dry_run) as op:
        pruned = Pruned(
            prune.prune_executions(
                older_than=older_than, keep_last=keep_last, statuses=statuses, dry_run=dry_run, progress=progress
            )
        )
        done: dict[str, Any] = {"deleted": pruned.report.deleted}
        if audit_events:
            keep = [op.event.pk] if op.event else []
            pruned.audit_events_deleted = prune.prune_audit_events(older_than=older_than, keep=keep)
            done["audit_events_deleted"] = pruned.audit_events_deleted
        op.done(done)
    return pruned


def change_shard_count(count: int, *, actor: audit.Actor, by: str) -> resharding.Resharding:
    """Store ``count`` shards and move the schedules into them (``resharding.change_count``)."""
    with audit.operation(
        actor, "set_shards", object_type="scheduler.shardlayout", changes={"shards": count}, tenant=""
    ) as op:
        change = resharding.change_count(count, by=by)
        op.done({"previous": change.previous, "moved": change.moved, "settled": change.settled})
    return change


# --- helpers ----------------------------------------------------------------------------


def _record_and_send(execution: Execution, *, app: Celery) -> ActionResult:
    result = ActionResult(execution)
    executions.record_one(execution)  # its key is new: it always inserts
    transaction.on_commit(lambda: _publish(app, result))
    return result


def _publish(app: Celery, result: ActionResult) -> None:
    execution = result.execution
    row = executions.message_row(execution)
    try:
        outbox.publish(app, [row], now=dbclock.now())
    except BrokerUnavailable as exc:
        result.broker_error = first_line(exc)  # the row stays pending; the beat leader sends it
    execution.refresh_from_db()


def _revoke(app: Celery, task_id: str, result: ActionResult) -> None:
    try:
        # One attempt: kombu's own retry loop would hold an operator for seconds.
        broker.revoke(app, task_id, once=True)
    except BrokerUnavailable as exc:
        result.broker_error = first_line(exc)
