"""The notifications owed: the only writer of their rows. They are recorded with their event, delivered later.

``record_failure`` runs in the transaction that writes the failed outcome,
so a failure and its notifications commit together or not at all; the
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

from scheduler.conf import settings
from scheduler.models import Execution, Notification, NotificationTarget, Schedule


def targets_for(*, schedule_id: int | None, tenant: str) -> list[NotificationTarget]:
    """The enabled targets of a schedule's (or a tenant's) notifications: its own, else its tenant's defaults, else the deployer's."""
    if schedule_id is not None:
        chosen = list(
            Schedule.notify.through.objects.filter(schedule_id=schedule_id).values_list(
                "notificationtarget_id", flat=True
            )
        )
        if chosen:
            return list(NotificationTarget.objects.filter(pk__in=chosen, enabled=True, tenant=tenant))
    defaults = NotificationTarget.objects.filter(is_default=True, enabled=True)
    return list(defaults.filter(tenant=tenant)) or (list(defaults.filter(tenant="")) if tenant else [])


def record_failure(execution_id: int) -> int:
    """Record a notification of the final failure of execution ``execution_id`` for each of its targets; return how many."""
    execution = (
        Execution.objects.filter(pk=execution_id)
        .values("pk", "schedule_id", "schedule__name", "task", "tenant", "status", "attempt", "error", "finished_at")
        .first()
    )
    if execution is None:
        return 0
    targets = targets_for(schedule_id=execution["schedule_id"], tenant=execution["tenant"])
    payload = {
        "event": Notification.Event.EXECUTION_FAILED,
        "execution": execution["pk"],
        "schedule": execution["schedule__name"],
        "task": execution["task"],
        "tenant": execution["tenant"],
        "status": execution["status"],
        "attempt": execution["attempt"],
        "error": execution["error"][:2000],
        "finished_at": execution["finished_at"].isoformat() if execution["finished_at"] else None,
    }
    rows = [
        Notification(
            key=f"execution_failed:{execution_id}:{execution['attempt']}",
            target=target,
            event=Notification.Event.EXECUTION_FAILED,
            tenant=execution["tenant"],
            payload=payload,
        )
        for target in targets
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
