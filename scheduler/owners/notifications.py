"""The notifications owed, and the incidents they announce: the only writer of both. Recorded with their event, delivered later.

``record_failure`` and ``record_paused`` run in the transaction that writes
the failed outcome, so a failure and its notifications commit together or
not at all; ``open_incident`` and ``close_incident`` write the incident row
and its notifications in one transaction too. The event's key makes a
second recording (a retried transaction, two recorders) a no-op. Delivery (``scheduler.outbox.notifications``) takes a
due row, moves its next attempt past the time a delivery may take, sends
outside any transaction, and records the result: a row is sent once at a
time, and one whose sender died is taken again once that time has passed.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from scheduler.conf import settings
from scheduler.models import Execution, Incident, Notification, NotificationTarget, Schedule
from scheduler.models.notification import CHECK_IN_KINDS

Event = Notification.Event


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


RUN_EVENTS = frozenset({Event.RUN_STARTED, Event.RUN_SUCCEEDED})
#: (monotonic time read, the ids of the schedules that chose an enabled check-in target).
_checked_in: tuple[float, frozenset[int]] | None = None


def checks_in(schedule_id: int | None, *, max_age: float = 1.0) -> bool:
    """Whether schedule ``schedule_id`` chose a check-in target: read at most every ``max_age`` seconds per process.

    Asked by every claim and success, so one query a second, not one a run.
    """
    global _checked_in
    if schedule_id is None:
        return False
    now = time.monotonic()
    if _checked_in is None or now - _checked_in[0] >= max_age:
        chosen = Schedule.notify.through.objects.filter(
            notificationtarget__kind__in=CHECK_IN_KINDS, notificationtarget__enabled=True
        )
        _checked_in = (now, frozenset(chosen.values_list("schedule_id", flat=True)))
    return schedule_id in _checked_in[1]


def forget_check_ins() -> None:
    """Read which schedules check in afresh next time (this process changed their targets)."""
    global _checked_in
    _checked_in = None


def record_run(execution_id: int, event: str) -> int:
    """Record a check-in of execution ``execution_id``'s attempt starting or succeeding (``RUN_EVENTS``); return how many.

    The caller asked ``checks_in`` first: a schedule without check-ins costs nothing.
    """
    execution = (
        Execution.objects.filter(pk=execution_id)
        .values("pk", "schedule_id", "schedule__name", "task", "tenant", "status", "attempt")
        .first()
    )
    if execution is None:
        return 0
    payload = {
        "execution": execution["pk"],
        "schedule": execution["schedule__name"],
        "task": execution["task"],
        "status": execution["status"],
        "attempt": execution["attempt"],
        "summary": f"schedule {execution['schedule__name']!r}: execution {execution['pk']} attempt "
        f"{execution['attempt']} {'started' if event == Event.RUN_STARTED else 'succeeded'}",
    }
    return _record(
        event,
        f"{event}:{execution_id}:{execution['attempt']}",
        schedule_id=execution["schedule_id"],
        tenant=execution["tenant"],
        payload=payload,
    )


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
    fields: dict[str, Any] = {"attempts": attempts, "last_error": error[:2000]}
    if attempts >= settings.NOTIFY_MAX_ATTEMPTS:
        fields["gave_up_at"] = now
    else:
        fields["next_attempt_at"] = now + timedelta(seconds=settings.NOTIFY_RETRY_SECONDS * 2 ** (attempts - 1))
    Notification.objects.filter(pk=notification.pk).update(**fields)


def undelivered() -> Q:
    """Notifications given up on: what the overview and the admin point at."""
    return Q(gave_up_at__isnull=False, delivered_at__isnull=True)
