"""Delete old finished executions in batches, keeping the newest of each schedule if asked."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime

from django.db.models import OuterRef, Q, Subquery

from scheduler.models import AuditEvent, Execution

#: Rows deleted per statement: bounded so a prune never holds long locks.
BATCH_SIZE = 5000


@dataclass(frozen=True)
class PruneReport:
    """What a prune deleted (or, with ``dry_run``, would delete)."""

    matched: int
    deleted: int
    dry_run: bool


def prunable(*, older_than: datetime, statuses: list[str] | None = None) -> Q:
    """Return the filter for executions a prune removes.

    Only finished executions (final statuses; never ones in flight or
    ``lost``) that finished (or were created, when they never ran) before
    ``older_than``; ``statuses`` narrows that further.
    """
    final = set(Execution.FINAL_STATUSES)
    chosen = final & set(statuses) if statuses else final
    finished_before = Q(finished_at__lt=older_than) | Q(finished_at__isnull=True, created_at__lt=older_than)
    return Q(status__in=sorted(chosen)) & finished_before


def prune_executions(
    *,
    older_than: datetime,
    keep_last: int = 0,
    statuses: list[str] | None = None,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> PruneReport:
    """Delete matching executions, ``batch_size`` rows per statement.

    ``keep_last`` keeps the newest N executions of each schedule whatever
    their age, so a schedule never loses its whole history; executions
    without a schedule (ad-hoc) are pruned by age only. Only Execution rows
    are deleted: a schedule's counters (``total_runs``, ``slots_sent``,
    ``total_missed``) are kept on the schedule, so what it has used of its
    ``max_runs`` or one-off never changes with a prune.
    """
    candidates = Execution.objects.filter(prunable(older_than=older_than, statuses=statuses))
    if keep_last:
        # The slot of each schedule's N-th newest execution: one probe of the
        # (schedule, -scheduled_for) index per schedule. Older rows may go.
        nth_newest = (
            Execution.objects.filter(schedule_id=OuterRef("schedule_id"))
            .order_by("-scheduled_for", "-id")
            .values("scheduled_for")[keep_last - 1 : keep_last]
        )
        candidates = candidates.filter(Q(schedule__isnull=True) | Q(scheduled_for__lt=Subquery(nth_newest)))
    matched = candidates.count()
    if dry_run:
        return PruneReport(matched=matched, deleted=0, dry_run=True)
    deleted = 0
    while True:
        ids = list(candidates.values_list("pk", flat=True)[:batch_size])
        if not ids:
            break
        deleted += Execution.objects.filter(pk__in=ids).delete()[1].get(Execution._meta.label, 0)
        if progress:
            progress(deleted)
    return PruneReport(matched=matched, deleted=deleted, dry_run=False)


def prune_audit_events(*, older_than: datetime, keep: Collection[int] = (), batch_size: int = BATCH_SIZE) -> int:
    """Delete audit events recorded before ``older_than``, ``batch_size`` rows per statement; return how many.

    The events whose ids are in ``keep`` stay whatever their age: a prune's own event.
    """
    old = AuditEvent.objects.filter(created_at__lt=older_than).exclude(pk__in=keep)
    deleted = 0
    while True:
        ids = list(old.values_list("pk", flat=True)[:batch_size])
        if not ids:
            return deleted
        deleted += AuditEvent.objects.filter(pk__in=ids).delete()[0]
