"""The operator's first screen: is everything all right? One answer per question, each linking to the list behind it.

Who leads (or which shards have no owner), overdue schedules, failures in
the last hour by task, the oldest ``queued`` execution per queue, pauses in force,
paused schedules and notifications that could not be delivered, all within the
caller's scope. Every part reads an index range
and is capped, so the page costs the same at a million schedules as at ten.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Min, Q, QuerySet
from django.db.models.functions import Greatest

from scheduler import dbclock, shards
from scheduler.conf import settings
from scheduler.models import Execution, Notification, PauseRule, Schedule
from scheduler.ops import cluster
from scheduler.owners import leases, notifications
from scheduler.tenancy import Scope
from scheduler.web.metrics import QUEUED_SAMPLE

#: Names listed per part; the count goes on past them up to ``COUNT_CAP``.
NAMES_SHOWN = 5
#: Past this many, a count reads "1000+": counting a million rows would cost more than the answer is worth.
COUNT_CAP = 1000
#: Failures are looked for among executions created this recently (an index range), then by when they ended.
FAILURE_LOOKBACK = timedelta(days=1)
FAILURE_WINDOW = timedelta(hours=1)
FAILED_STATUSES = (Execution.Status.FAILED, Execution.Status.TIMED_OUT)


@dataclass(frozen=True)
class Listed:
    """A few names and how many there are in all (capped at ``COUNT_CAP``)."""

    names: list[str]
    count: int

    @property
    def capped(self) -> bool:
        return self.count >= COUNT_CAP


@dataclass(frozen=True)
class Overview:
    db_now: datetime
    #: The beats holding the lease (or any shard's), as their process ids; empty: nobody dispatches.
    leaders: list[str]
    #: Shard leases without a live holder (sharded only).
    shards_without_owner: list[str]
    overdue: Listed
    #: The pause rules that hold the caller's work, described ("hold queue reports of every tenant").
    pauses: list[str]
    paused: Listed
    #: (task, failures) in the last hour, most failures first.
    failures: list[tuple[str, int]]
    #: (queue, seconds its oldest queued execution has waited), longest first.
    oldest_queued: list[tuple[str, float]]
    #: Notifications given up on (their attempts ran out), capped at ``COUNT_CAP``.
    undelivered: int

    @property
    def all_right(self) -> bool:
        return bool(self.leaders) and not (
            self.shards_without_owner or self.overdue.count or self.failures or self.undelivered
        )


def overview(scope: Scope) -> Overview:
    """Read the overview of what ``scope`` may see."""
    now = dbclock.now()
    leaders, without_owner = _leadership()
    schedules = scope.filter(Schedule.objects.all())
    executions = scope.filter(Execution.objects.all())
    return Overview(
        db_now=now,
        leaders=leaders,
        shards_without_owner=without_owner,
        overdue=_listed(schedules.overdue(now=now).order_by("overdue_at", "id")),
        pauses=[rule.describe() for rule in pauses_holding(scope)],
        paused=_listed(schedules.exclude(paused_reason="").order_by("name")),
        failures=_failures(executions, now=now),
        oldest_queued=_oldest_queued(executions, now=now),
        undelivered=scope.filter(Notification.objects.filter(notifications.undelivered()))
        .values("pk")[:COUNT_CAP]
        .count(),
    )


def pauses_holding(scope: Scope) -> QuerySet[PauseRule]:
    """The pause rules that hold work of ``scope``: its tenant's and every tenant's."""
    rules = PauseRule.objects.order_by("pk")
    if scope.every_tenant:
        return rules
    return rules.filter(Q(every_tenant=True) | Q(tenant=scope.tenant)) if scope.tenant else rules.none()


def _leadership() -> tuple[list[str], list[str]]:
    if shards.is_sharded():
        view = cluster.shard_view()
        if view is not None:
            return sorted(view.holders), [state.name for state in view.not_held]
    state = leases.current(settings.LEASE_NAME)
    return ([state.holder] if state.is_held else []), []


def _listed(rows: QuerySet[Schedule]) -> Listed:
    names = list(rows.values_list("name", flat=True)[:NAMES_SHOWN])
    count = len(names) if len(names) < NAMES_SHOWN else rows.values("pk")[:COUNT_CAP].count()
    return Listed(names, count)


def _failures(executions: QuerySet[Execution], *, now: datetime) -> list[tuple[str, int]]:
    rows = (
        executions.filter(
            status__in=FAILED_STATUSES, created_at__gte=now - FAILURE_LOOKBACK, finished_at__gte=now - FAILURE_WINDOW
        )
        .values_list("task")
        .annotate(failures=Count("pk"))
        .order_by("-failures", "task")
    )
    return list(rows[: NAMES_SHOWN * 2])


def _oldest_queued(executions: QuerySet[Execution], *, now: datetime) -> list[tuple[str, float]]:
    # The oldest queued rows only, through an index of the status, as /metrics reads them: a
    # queue nobody consumes has its oldest rows among them.
    oldest = executions.filter(status=Execution.Status.QUEUED).order_by("created_at").values("pk")[:QUEUED_SAMPLE]
    rows = (
        Execution.objects.filter(pk__in=oldest)
        .values_list("queue")
        .annotate(due=Min(Greatest("created_at", "scheduled_for")))
        .order_by("due")
    )
    return [(queue, max((now - due).total_seconds(), 0.0)) for queue, due in rows[: NAMES_SHOWN * 2]]
