"""One action on every schedule a filter matches: pause, resume, enable, disable or run now, in batches.

The filter is read within the caller's scope, so a tenant's operator acts
on that tenant's schedules only, whatever the filter says. The schedules
are taken ``BATCH`` at a time, in id order, each batch in its own short
transaction: a bulk action over 100,000 schedules never holds more than
one batch of rows locked, and the beat's commits go on between batches.
A schedule already in the wanted state is left alone and not counted as
changed. ``operations.bulk_action`` audits the whole action as one
operation (started, then completed with its counts); a dry run counts what
matches and writes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from scheduler import dbclock, limits, outbox
from scheduler.exceptions import BrokerUnavailable, SchedulerError, first_line
from scheduler.models import Execution, Schedule
from scheduler.models.schedule import ScheduleQuerySet
from scheduler.owners import executions, schedules, work_rules
from scheduler.tenancy import Scope

if TYPE_CHECKING:
    from celery import Celery

ACTIONS = ("pause", "resume", "enable", "disable", "run_now")
#: Schedules locked and changed in one transaction.
BATCH = 1_000
#: Names a dry run lists.
FIRST_NAMES = 10
#: Which of the matched schedules each action changes: those not yet in its state.
_NOT_YET = {
    "pause": Q(paused_reason=""),
    "resume": ~Q(paused_reason=""),
    "enable": Q(enabled=False),
    "disable": Q(enabled=True),
    "run_now": Q(),
}


class BulkRefused(SchedulerError):
    """The bulk action or its filter is not valid; nothing was done."""


@dataclass(frozen=True)
class Filter:
    """Which schedules: every given criterion must hold (none given: refused, never "all" by accident)."""

    #: The name, with ``*`` for any run of characters and ``?`` for one.
    name: str | None = None
    task: str | None = None
    queue: str | None = None
    tenant: str | None = None
    last_status: str | None = None
    overdue: bool | None = None

    @classmethod
    def from_mapping(cls, given: dict[str, Any]) -> Filter:
        """Build a filter from ``{criterion: value}``; refuse unknown criteria, wrong types and an empty filter."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise BulkRefused(f"unknown filter {', '.join(unknown)}; filters are {', '.join(sorted(known))}")
        if not any(value is not None for value in given.values()):
            raise BulkRefused(f"give at least one filter ({', '.join(sorted(known))})")
        for key, value in given.items():
            wanted = bool if key == "overdue" else str
            if value is not None and not isinstance(value, wanted):
                raise BulkRefused(f"filter {key} must be {'true or false' if wanted is bool else 'text'}")
        if isinstance(given.get("name"), str) and work_rules.glob_problem(given["name"]):
            raise BulkRefused(f"filter name: {work_rules.glob_problem(given['name'])}")
        if given.get("last_status") not in (None, *Execution.Status.values):
            raise BulkRefused(f"filter last_status must be one of {', '.join(Execution.Status.values)}")
        return cls(**given)

    def matching(self, scope: Scope) -> ScheduleQuerySet:
        """The schedules in ``scope`` that match."""
        chosen = scope.filter(Schedule.objects.all())
        if self.name is not None:
            chosen = chosen.filter(name__regex=work_rules.glob_regex(self.name))
        for criterion in ("task", "queue", "tenant", "last_status"):
            value = getattr(self, criterion)
            if value is not None:
                chosen = chosen.filter(**{criterion: value})
        if self.overdue is not None:
            chosen = chosen.overdue(now=Now()) if self.overdue else chosen.not_overdue(now=Now())
        return chosen

    def as_dict(self) -> dict[str, Any]:
        return {
            field.name: getattr(self, field.name) for field in fields(self) if getattr(self, field.name) is not None
        }


@dataclass(frozen=True)
class BulkReport:
    action: str
    dry_run: bool
    #: Schedules the filter matched in the caller's scope.
    matched: int
    #: Of those, the ones the action changed (for a dry run: would change).
    changed: int
    #: The first few matched names, in id order.
    first_names: list[str]
    #: Run now: the executions recorded; and why some were not sent yet (they stay ``pending`` for the leader).
    executions: int = 0
    broker_error: str = ""


def check(action: str, *, reason: str) -> None:
    """Raise ``BulkRefused`` for an unknown action or a pause reason over its limit."""
    if action not in ACTIONS:
        raise BulkRefused(f"unknown action {action!r}; actions are {', '.join(ACTIONS)}")
    problems = limits.text_problems(reason, limits.PAUSED_REASON_MAX_CHARS)
    if problems:
        raise BulkRefused(f"reason: {' '.join(problems)}")


def act(
    action: str,
    chosen: Filter,
    *,
    scope: Scope,
    app: Celery,
    may_run: Callable[[str, str], bool],
    reason: str = "",
    dry_run: bool = False,
) -> BulkReport:
    """Take ``action`` on every schedule ``chosen`` matches in ``scope``, a batch at a time; return the counts.

    Run now skips a schedule whose task ``may_run(task, tenant)`` refuses
    (``operations.ensure_task``): it is matched, not changed.
    """
    check(action, reason=reason)
    matching = chosen.matching(scope)
    first_names = list(matching.order_by("pk").values_list("name", flat=True)[:FIRST_NAMES])
    if dry_run:
        return BulkReport(
            action,
            True,
            matched=matching.count(),
            changed=matching.filter(_NOT_YET[action]).count(),
            first_names=first_names,
        )
    runnable = functools.cache(may_run) if action == "run_now" else None
    matched = changed = 0
    broker_error = ""
    last = 0
    while True:
        ids = list(matching.filter(pk__gt=last).order_by("pk").values_list("pk", flat=True)[:BATCH])
        if not ids:
            break
        last = ids[-1]
        matched += len(ids)
        with transaction.atomic():
            batch = list(matching.filter(pk__in=ids).filter(_NOT_YET[action]).select_for_update().order_by("pk"))
            if runnable is not None:
                batch = [schedule for schedule in batch if runnable(schedule.task, schedule.tenant)]
            changed += _apply(action, batch, reason=reason)
            rows = _run_now(batch) if action == "run_now" else []
        broker_error = _send(app, rows) or broker_error
    executions_recorded = changed if action == "run_now" else 0
    return BulkReport(action, False, matched, changed, first_names, executions_recorded, broker_error)


def _apply(action: str, batch: list[Schedule], *, reason: str) -> int:
    """Change each schedule of the locked ``batch``; return how many changed."""
    if action == "pause":
        return schedules.pause_many([schedule.pk for schedule in batch], reason or "Paused in bulk")
    if action == "disable":
        return schedules.disable_many([schedule.pk for schedule in batch])
    now = dbclock.now()
    for schedule in batch:
        if action == "resume":
            schedules.resume(schedule, now=now)
        elif action == "enable":
            schedules.set_enabled(schedule, True, now=now)
    return len(batch)


def _run_now(batch: list[Schedule]) -> list[dict[str, Any]]:
    now = dbclock.now()
    return executions.record([executions.run_now_for(schedule, now=now) for schedule in batch])


def _send(app: Celery, rows: list[dict[str, Any]]) -> str:
    """Publish the recorded rows (after their commit); return the broker's error, if any (they stay ``pending``)."""
    if not rows:
        return ""
    try:
        outbox.publish(app, rows, now=dbclock.now())
    except BrokerUnavailable as exc:
        return first_line(exc)
    return ""
