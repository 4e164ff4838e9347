"""Changing the stored shard count while the beat replicas run: the count and the schedules, in the order that keeps every schedule owned.

A schedule is always fenced by exactly one lease: ``beat`` while the count is
1, ``beat:<its stored shard>`` while it is more (``leases.assert_held_many``
checks the kind against the count in every commit). So what must not happen
during a change is a schedule sitting in a shard that no replica holds:

- growing (or from 1): the count first, so the replicas take the new shards,
  then the schedules move into them once they are held;
- shrinking between counts above 1: the schedules first, into shards below the
  new count, which the old count's owners hold, then the count (and once more
  the schedules saved meanwhile);
- back to 1: the count first, so one replica leads under ``beat``, whatever
  shard a schedule is in; then the schedules move to shard 0 for a later change.

Each step is safe to interrupt: the schedules are then in shards the stored
count's owners hold, and running the change again finishes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.db import connection, transaction
from django.db.models import F

from scheduler import dbclock, shards
from scheduler.beat import liveness, shard_keeper
from scheduler.conf import settings
from scheduler.models import Schedule
from scheduler.ops import cluster
from scheduler.owners import schedules

#: Schedules one moving transaction covers (by id range), so no transaction locks many rows for long.
MOVE_BATCH = 10_000


@dataclass(frozen=True)
class Resharding:
    """What a change of the shard count did (or, dry, would do)."""

    previous: int
    shards: int
    #: Schedules moved into shard ``id % shards`` (dry: that would move).
    moved: int
    #: The replicas followed the new count (``settled``) before the schedules
    #: moved (after, when shrinking); ``None`` when no beat replica was live to
    #: wait for, or on a dry run.
    settled: bool | None
    dry_run: bool = False


def store_count(count: int, *, by: str) -> int:
    """Store ``count`` as the shard count every replica follows; return the count before.

    The row is locked for update, so this waits for the dispatch commits in
    flight (each reads it under a shared lock) and every later commit sees the
    new count. On PostgreSQL the waiting replicas are woken when it commits.
    """
    now = dbclock.now_sql()
    with transaction.atomic(), connection.cursor() as cursor:
        shards.seed(shards.configured(), by=by)  # what every process follows until now
        lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
        cursor.execute(f"SELECT shards FROM {shards.LAYOUT_TABLE} WHERE id = 1{lock}", [])
        (previous,) = cursor.fetchone()
        if previous != count:
            cursor.execute(
                f"UPDATE {shards.LAYOUT_TABLE} SET shards = %s, previous = %s, changed_at = {now}, changed_by = %s WHERE id = 1",
                [count, previous, by],
            )
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_notify(%s, %s)", [liveness.RELEASE_CHANNEL, liveness.COUNT_CHANGED])
    return int(previous)


def misplaced(count: int) -> int:
    """How many schedules are not in shard ``id % count``."""
    return Schedule.objects.exclude(shard=F("id") % count).count()


def move_schedules(count: int, *, batch: int = MOVE_BATCH) -> int:
    """Move every schedule whose shard is not ``id % count`` into it; return how many moved.

    Safe while the beats run: a commit planned before a move re-reads the
    schedule's shard under its row lock and leaves a moved schedule to its new
    shard's owner. One transaction per ``batch`` ids.
    """
    moved, after = 0, 0
    while True:
        bound = (
            Schedule.objects.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[batch - 1 : batch].first()
        )
        rows = Schedule.objects.filter(pk__gt=after)
        if bound is not None:
            rows = rows.filter(pk__lte=bound)
        with transaction.atomic():
            moved += schedules.assign_shards(rows, count=count)
        if bound is None:
            return moved
        after = bound


def settled(count: int) -> bool | None:
    """Whether the replicas follow ``count``; ``None`` when none is live.

    Every lease of ``count`` (the one lease, for 1) is held by a live
    replica, and no beat lease of another count is held any more.
    """
    live = shard_keeper.live_beats()
    if not live:
        return None
    view = cluster.shard_view(count)
    fencing = [view.state(settings.LEASE_NAME)] if count == 1 else view.leases
    names = {state.name for state in fencing}
    stray = [
        state
        for state in view.others
        if state.is_held
        and state.name not in names
        and (state.name == settings.LEASE_NAME or shards.shard_of_lease(state.name) is not None)
    ]
    return all(state.is_held and state.holder in live for state in fencing) and not stray


def wait_settled(count: int, *, timeout: float) -> bool | None:
    """Wait up to ``timeout`` seconds for ``settled(count)``; return the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = settled(count)
        if answer is not False or time.monotonic() >= deadline:
            return answer
        time.sleep(0.1)


def change_count(count: int, *, by: str, settle_seconds: float | None = None, dry_run: bool = False) -> Resharding:
    """Change the shard count to ``count`` and move every schedule into shard ``id % count``, while the beats run.

    Waits up to ``settle_seconds`` (default twice the lease TTL) for the
    replicas to follow the new count (``settled``) before moving schedules
    into its shards; when they do not in time (no replica runs, or one is
    frozen), the schedules move anyway and ``settled`` says so.
    """
    previous = shards.count()
    if dry_run:
        return Resharding(previous, count, misplaced(count), None, dry_run=True)
    timeout = 2 * settings.LEASE_TTL_SECONDS if settle_seconds is None else settle_seconds
    if 1 < count < previous:
        moved = move_schedules(count)
        previous = store_count(count, by=by)
        moved += move_schedules(count)
        return Resharding(previous, count, moved, wait_settled(count, timeout=timeout))
    previous = store_count(count, by=by)
    done = wait_settled(count, timeout=timeout)
    return Resharding(previous, count, move_schedules(count), done)
