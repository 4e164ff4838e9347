"""The notifications owed, and the incidents they announce: the only writer of both. Recorded with their event, delivered later.

``record_failure`` and ``record_paused`` run in the transaction that writes
the failed outcome, so a failure and its notifications commit together or
not at all; ``open_incident`` and ``close_incident`` write the incident row
and its notifications in one transaction too. ``record_check_ins`` reads
the runs of the schedules that check in from their executions' rows. The
event's key makes a second recording (a retried transaction, two
recorders) a no-op. Delivery (``scheduler.outbox.notifications``) takes a
due row, moves its next attempt past the time a delivery may take, sends
outside any transaction, and records the result: a row is sent once at a
time, and one whose sender died is taken again once that time has passed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from scheduler import limits
from scheduler.conf import settings
from scheduler.models import Execution, Incident, Notification, NotificationTarget, Schedule
from scheduler.models.notification import CHECK_IN_KINDS

Event = Notification.Event
#: The events of a run that only check-in targets get.
RUN_EVENTS = frozenset({Event.RUN_STARTED, Event.RUN_SUCCEEDED})


def targets_for(*, schedule_id: int | None, tenant: str, event: str) -> list[NotificationTarget]:
    """The enabled targets ``event`` of a schedule (or a tenant) goes to.

    Told targets: the schedule's own, else its tenant's defaults, else the
    deployer's. Check-in targets are only ever the schedule's own, and get
    only the runs: each start and success, and the final failure.
    """
    chosen = (
        list(NotificationTarget.objects.filter(schedules__pk=schedule_id, enabled=True, tenant=tenant))
        if schedule_id is not None
        else []
    )
    check_ins = [target for target in chosen if target.is_check_in]
    if event in RUN_EVENTS:
        return check_ins
    told = [target for target in chosen if not target.is_check_in] or _defaults(tenant)
    return told + (check_ins if event == Event.EXECUTION_FAILED else [])


def _defaults(tenant: str) -> list[NotificationTarget]:
    defaults = NotificationTarget.objects.filter(is_default=True, enabled=True).exclude(kind__in=CHECK_IN_KINDS)
    return list(defaults.filter(tenant=tenant)) or (list(defaults.filter(tenant="")) if tenant else [])


def record_check_ins(*, since: datetime, until: datetime) -> int:
    """Record the check-ins of the runs that started, or succeeded, in (``since``, ``until``]; return how many are new.

    Only for schedules that chose an enabled check-in target. Read from the
    executions' rows by the leader's watch, not written by the worker's
    claim or outcome: the worker's path stays free of it, and a check-in is
    at most a watch interval late. Each run's key makes a second recording
    (overlapping windows, a new leader) a no-op.
    """
    checked_in = list(
        Schedule.notify.through.objects.filter(
            notificationtarget__kind__in=CHECK_IN_KINDS, notificationtarget__enabled=True
        ).values_list("schedule_id", flat=True)
    )
    if not checked_in:  # the usual case: no look at the executions at all
        return 0
    started = Q(started_at__gt=since, started_at__lte=until)
    succeeded = Q(status=Execution.Status.SUCCEEDED, finished_at__gt=since, finished_at__lte=until)
    runs = (
        Execution.objects.filter(started | succeeded, schedule_id__in=checked_in)
        .order_by("started_at", "pk")
        .values(
            "pk", "schedule_id", "schedule__name", "task", "tenant", "status", "attempt", "started_at", "finished_at"
        )
    )
    due = []
    for run in runs:
        if run["started_at"] and since < run["started_at"] <= until:
            due.append((Event.RUN_STARTED, "started", run))
        if run["status"] == Execution.Status.SUCCEEDED and run["finished_at"] and since < run["finished_at"] <= until:
            due.append((Event.RUN_SUCCEEDED, "succeeded", run))
    # Windows overlap (see ``ops.watch``): what was recorded already is passed over without a write.
    keys = {f"{event}:{run['pk']}:{run['attempt']}" for event, _, run in due}
    recorded_before = set(Notification.objects.filter(key__in=keys).values_list("key", flat=True))
    recorded = 0
    for event, verb, run in due:
        key = f"{event}:{run['pk']}:{run['attempt']}"
        if key in recorded_before:
            continue
        payload = {
            "execution": run["pk"],
            "schedule": run["schedule__name"],
            "task": run["task"],
            "status": run["status"],
            "attempt": run["attempt"],
            "summary": f"schedule {run['schedule__name']!r}: execution {run['pk']} attempt {run['attempt']} {verb}",
        }
        recorded += _record(event, key, schedule_id=run["schedule_id"], tenant=run["tenant"], payload=payload)
    return recorded


def record_failure(execution_id: int) -> int:
    """Record a notification of the final failure of execution ``execution_id`` for each of its targets; return how many."""
    execution = (
        Execution.objects.filter(pk=execution_id)
        .values("pk", "schedule_id", "schedule__name", "task", "tenant", "status", "attempt", "error", "finished_at")
        .first()
    )
    if execution is None:
        return 0
    what = f"schedule {execution['schedule__name']!r}" if execution["schedule__name"] else f"task {execution['task']}"
    payload = {
        "execution": execution["pk"],
        "schedule": execution["schedule__name"],
        "task": execution["task"],
        "status": execution["status"],
        "attempt": execution["attempt"],
        "error": execution["error"][:2000],
        "finished_at": execution["finished_at"].isoformat() if execution["finished_at"] else None,
        "summary": f"{what}: execution {execution['pk']} {execution['status']} after attempt {execution['attempt']}: "
        f"{execution['error'][:300]}",
    }
    return _record(
        Event.EXECUTION_FAILED,
        f"execution_failed:{execution_id}:{execution['attempt']}",
        schedule_id=execution["schedule_id"],
        tenant=execution["tenant"],
        payload=payload,
    )


def record_paused(schedule_id: int, *, execution_id: int) -> int:
    """Record a notification that the circuit breaker paused schedule ``schedule_id`` (after ``execution_id`` failed)."""
    schedule = Schedule.objects.filter(pk=schedule_id).values("name", "task", "tenant", "paused_reason").first()
    if schedule is None:
        return 0
    payload = {
        "schedule": schedule["name"],
        "task": schedule["task"],
        "execution": execution_id,
        "reason": schedule["paused_reason"],
        "summary": f"schedule {schedule['name']!r} paused: {schedule['paused_reason'][:300]}",
    }
    return _record(
        Event.SCHEDULE_PAUSED,
        f"schedule_paused:{schedule_id}:{execution_id}",
        schedule_id=schedule_id,
        tenant=schedule["tenant"],
        payload=payload,
    )


def open_incident(
    kind: str, subject: str, *, schedule_id: int | None = None, tenant: str = "", payload: dict[str, Any]
) -> bool:
    """Open the incident (``kind``, ``subject``) and record its notifications, unless it is open already; return whether it was opened.

    ``payload`` is what its notifications say (a ``summary`` among it).
    """
    with transaction.atomic():
        incident, created = Incident.objects.get_or_create(
            kind=kind, subject=subject, defaults={"schedule_id": schedule_id, "tenant": tenant}
        )
        if created:
            event = _OPENS[kind]
            _record(event, f"{event}:{subject}:{incident.pk}", schedule_id=schedule_id, tenant=tenant, payload=payload)
    return created


def close_incident(incident: Incident, *, payload: dict[str, Any]) -> bool:
    """Close ``incident`` and record the notifications of its end, unless someone closed it first; return whether this did."""
    with transaction.atomic():
        closed = Incident.objects.filter(pk=incident.pk).delete()[0] > 0
        if closed:
            event = _CLOSES[incident.kind]
            key = f"{event}:{incident.subject}:{incident.pk}"
            _record(event, key, schedule_id=incident.schedule_id, tenant=incident.tenant, payload=payload)
    return closed


_OPENS: dict[str, str] = {Incident.Kind.OVERDUE: Event.SCHEDULE_OVERDUE, Incident.Kind.LEADERLESS: Event.LEADERLESS}
_CLOSES: dict[str, str] = {Incident.Kind.OVERDUE: Event.SCHEDULE_RECOVERED, Incident.Kind.LEADERLESS: Event.LEADER_BACK}


def _record(event: str, key: str, *, schedule_id: int | None, tenant: str, payload: dict[str, Any]) -> int:
    """Record ``event`` once for each target of the schedule (or tenant); return how many notifications that made."""
    body = {"event": event, "tenant": tenant, **payload}
    rows = [
        Notification(key=key, target=target, event=event, tenant=tenant, payload=body)
        for target in targets_for(schedule_id=schedule_id, tenant=tenant, event=event)
    ]
    return len(Notification.objects.bulk_create(rows, ignore_conflicts=True))


def take_due(*, limit: int, now: datetime) -> list[Notification]:
    """Take up to ``limit`` due notifications for one delivery attempt each; return them with their targets.

    Their next attempt moves past ``NOTIFY_TIMEOUT_SECONDS`` in the same short
    transaction, so no other deliverer takes them while this one sends.
    """
    due = Notification.objects.filter(delivered_at__isnull=True, gave_up_at__isnull=True, next_attempt_at__lte=now)
    if not due.exists():  # the usual case: no transaction (on SQLite one takes the database's write lock)
        return []
    with transaction.atomic():
        rows = list(
            due.select_for_update(skip_locked=True).select_related("target").order_by("next_attempt_at", "pk")[:limit]
        )
        busy_until = now + timedelta(seconds=settings.NOTIFY_TIMEOUT_SECONDS * 2)
        Notification.objects.filter(pk__in=[row.pk for row in rows]).update(next_attempt_at=busy_until)
    return rows


def delivered(notification: Notification) -> None:
    Notification.objects.filter(pk=notification.pk).update(
        delivered_at=Now(), attempts=notification.attempts + 1, last_error=""
    )


def failed(notification: Notification, error: str, *, now: datetime) -> None:
    """Record a failed attempt: try again after the backoff, or give up after ``NOTIFY_MAX_ATTEMPTS``."""
    attempts = notification.attempts + 1
    # (the reason comes from the receiver's answer, whatever it sent)
    fields: dict[str, Any] = {"attempts": attempts, "last_error": limits.storable(error[:2000])}
    if attempts >= settings.NOTIFY_MAX_ATTEMPTS:
        fields["gave_up_at"] = now
    else:
        fields["next_attempt_at"] = now + timedelta(seconds=settings.NOTIFY_RETRY_SECONDS * 2 ** (attempts - 1))
    Notification.objects.filter(pk=notification.pk).update(**fields)


def undelivered() -> Q:
    """Notifications given up on: what the overview and the admin point at."""
    return Q(gave_up_at__isnull=False, delivered_at__isnull=True)
