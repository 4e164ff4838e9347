"""Delete old finished executions in batches, keeping the newest of each schedule if asked.

Each batch moves its schedules' ``pruned_through`` up to the newest slot it
deleted, in the same transaction: reconcile's audit starts after that mark,
so it never finds a slot without its row and without the mark, and never
records again a slot that ran and was pruned (SPEC guarantee 10).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Max, OuterRef, Q, Subquery

from scheduler.models import AuditEvent, Execution, Schedule
from scheduler.owners import executions, schedules

#: Rows deleted per statement: bounded so a prune never holds long locks.
BATCH_SIZE = 5000
#: Executions whose key is a slot of their schedule (``executions.key``): the ones reconcile's audit looks for.
_SLOT_TRIGGERS = (Execution.Trigger.SCHEDULED, Execution.Trigger.BACKFILL)
#: Schedules whose ``pruned_through`` one UPDATE writes.
_MARK_BATCH = 500


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
    are deleted: a schedule's counters (``total_runs``, ``slots_committed``,
    ``total_missed``) are kept on the schedule, so what it has used of its
    ``max_runs`` or one-off never changes with a prune. A prune that
    deletes nothing moves no schedule's ``pruned_through``.
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
        deleted += _delete(ids)
        if progress:
            progress(deleted)
    return PruneReport(matched=matched, deleted=deleted, dry_run=False)


def _delete(ids: list[int]) -> int:
    """Delete the executions ``ids`` and mark their schedules' ``pruned_through``, in one transaction; return how many went.

    The mark is the newest slot deleted per schedule, and only ever moves
    forward. Schedule rows are locked before the executions are deleted, in
    id order: the project's lock order (schedule row, then its executions),
    so a prune does not deadlock with a worker's finish, and reconcile's
    repair, which reads the mark under the same lock, sees the delete and
    the mark together or neither.
    """
    rows = Execution.objects.filter(pk__in=ids)
    with transaction.atomic():
        newest = dict(
            rows.filter(schedule__isnull=False, trigger__in=_SLOT_TRIGGERS)
            .order_by()
            .values_list("schedule_id")
            .annotate(Max("scheduled_for"))
        )
        marked = list(
            Schedule.objects.select_for_update().filter(pk__in=list(newest)).order_by("pk").only("pk", "pruned_through")
        )
        # Nothing read into this process while the schedule rows are locked: a
        # transaction left idle that long stalls those schedules' dispatch and
        # can outlast the session's idle-in-transaction bound on a loaded machine.
        deleted = executions.delete(ids)
        if not deleted:
            return 0  # another prune took them, and marked them
        moved = [mark for mark in marked if mark.pruned_through is None or mark.pruned_through < newest[mark.pk]]
        for mark in moved:
            mark.pruned_through = newest[mark.pk]
        schedules.mark_pruned(moved, batch_size=_MARK_BATCH)
    return deleted


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
