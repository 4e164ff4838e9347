"""Tallies: counters the database keeps as executions finish, so ``/metrics`` reads counters that only grow.

Executions are pruned, so counting their rows cannot give a counter that
only increases. A trigger on the execution table appends a ``TallyIncrement``
row in the same statement that moves an execution to a final status (or
inserts it already final: ``missed``, ``skipped``), so the count commits or
rolls back with the status change, whichever process or path made it, and
survives pruning and restarts.

The trigger only ever inserts: it updates no shared row, so concurrent
statements take no lock on the tallies and cannot deadlock there, in
whatever order their rows come (two sharded leaders recording missed slots
of the same tasks, the leader beside ``reconcile --repair``). Migration 0012
had the trigger add to counter rows in place, in row order, which did
deadlock (migration 0019 replaced it). ``fold`` moves the increments into
the totals (``ExecutionTally``, ``DurationTally``), one folder at a time;
each scrape and each reconcile pass folds, so the increments stay few and
``/metrics`` reads stay bounded. Reads add the totals and the increments
not folded yet in one statement (``execution_counts``, ``duration_counts``),
so a fold committing meanwhile is seen whole or not at all.

On SQLite, a migration that rebuilds ``scheduler_execution`` (most field
changes do) drops its triggers: it must create them again, with the SQL of
migration 0019 (``recreate_sqlite_triggers`` there), as 0013 did with 0012's.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models import Count, Sum

#: Upper bounds (seconds) of the run-time buckets; the trigger in migration 0019 writes the same list.
DURATION_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: ``status`` of the increments (and tally rows) that count messages a worker refused (not an execution's
#: status: ``executions.claim`` appends them, no trigger); ``trigger`` holds the reason and ``task`` is empty.
MESSAGE_REFUSED = "refused"
#: ``status`` of the increments that count a process leaving a fast path for its slow path
#: (``scheduler.fastpath.guard`` appends them); ``trigger`` holds the path's name and ``task`` is empty.
FASTPATH_FALLBACK = "fastpath_fallback"
#: Increments one fold transaction moves into the totals at most.
FOLD_BATCH = 20_000


class ExecutionTally(models.Model):
    """How many executions reached ``status``, by task and trigger (one shard of the count).

    ``fold`` writes shard 0; the trigger of migration 0012 spread its counts
    over shards 0-7 (the execution id modulo 8), and those rows still count.
    """

    status = models.CharField(max_length=20)
    task = models.CharField(max_length=255)
    trigger = models.CharField(max_length=20)
    shard = models.PositiveSmallIntegerField()
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["status", "task", "trigger", "shard"], name="execution_tally_key")
        ]


class DurationTally(models.Model):
    """Finished executions of ``task`` whose run time fell in the bucket up to ``le`` (one shard).

    ``le`` is the bucket's upper bound as exposed (``"0.5"``, ``"+Inf"``);
    ``seconds`` is the summed run time of the executions counted here.
    """

    task = models.CharField(max_length=255)
    le = models.CharField(max_length=20)
    shard = models.PositiveSmallIntegerField()
    count = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "le", "shard"], name="duration_tally_key")]


class TallyIncrement(models.Model):
    """One execution that reached a final status (or one refused message or fast path fallback), not yet folded.

    Written by the trigger of migration 0019 (and ``executions`` for a
    refused message, ``fastpath.guard`` for a fallback), read and deleted only by ``fold``. ``le`` is the
    run-time bucket and ``seconds`` the run time; empty and ``None`` when the
    execution never started.
    """

    status = models.CharField(max_length=20)
    task = models.CharField(max_length=255)
    trigger = models.CharField(max_length=20)
    le = models.CharField(max_length=20, blank=True, default="")
    seconds = models.FloatField(null=True, blank=True)


#: The PostgreSQL advisory lock a folder holds until it commits: one folder at a time.
_FOLD_LOCK = int.from_bytes(hashlib.blake2b(b"scheduler-tally-fold", digest_size=8).digest(), "big", signed=True)

_INCREMENTS = "scheduler_tallyincrement"
# ``WHERE true``: SQLite would read ``ON CONFLICT`` after a bare ``FROM`` as a join's ``ON``.
_ADD_COUNTS = """
    INSERT INTO scheduler_executiontally (status, task, "trigger", shard, count)
    SELECT status, task, "trigger", 0, COUNT(*) FROM {source} WHERE true GROUP BY status, task, "trigger"
    ON CONFLICT (status, task, "trigger", shard) DO UPDATE SET count = scheduler_executiontally.count + excluded.count
"""
_ADD_DURATIONS = """
    INSERT INTO scheduler_durationtally (task, le, shard, count, seconds)
    SELECT task, le, 0, COUNT(*), SUM(seconds) FROM {source} WHERE le <> '' GROUP BY task, le
    ON CONFLICT (task, le, shard) DO UPDATE SET
        count = scheduler_durationtally.count + excluded.count,
        seconds = scheduler_durationtally.seconds + excluded.seconds
"""


def fold(*, using: str = DEFAULT_DB_ALIAS, batch: int = FOLD_BATCH) -> int:
    """Move the increments into the totals, ``batch`` per transaction, until few are left; return how many moved.

    One folder at a time: on PostgreSQL a fold that finds another under way
    returns 0 at once (the other one folds); on SQLite the transaction's
    write lock serialises them. Only folds write the totals, so nothing
    else ever waits on a tally row.
    """
    moved = 0
    while True:
        # Nothing to fold (as at most scrapes of an idle system): no transaction, no write lock.
        if not TallyIncrement.objects.using(using).exists():
            return moved
        with transaction.atomic(using=using):
            batch_moved = _fold_batch(using, batch)
        if batch_moved is None:
            return moved
        moved += batch_moved
        if batch_moved < batch:
            return moved


def _fold_batch(using: str, batch: int) -> int | None:
    """Fold up to ``batch`` of the oldest increments in the caller's transaction; ``None``: another folder holds it."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_FOLD_LOCK])
            if not cursor.fetchone()[0]:
                return None
            # One statement: the rows deleted are exactly the rows added, whatever commits meanwhile.
            cursor.execute(
                f"""
                WITH moved AS (
                    DELETE FROM {_INCREMENTS}
                    WHERE id IN (SELECT id FROM {_INCREMENTS} ORDER BY id LIMIT %s)
                    RETURNING status, task, "trigger", le, seconds
                ),
                counted AS ({_ADD_COUNTS.format(source="moved")}),
                timed AS ({_ADD_DURATIONS.format(source="moved")})
                SELECT COUNT(*) FROM moved
                """,
                [batch],
            )
            return cursor.fetchone()[0]
        # SQLite: this transaction holds the database's write lock, so no increment
        # appears or goes between these statements.
        cursor.execute(f"SELECT MAX(id), COUNT(*) FROM (SELECT id FROM {_INCREMENTS} ORDER BY id LIMIT %s)", [batch])
        last, count = cursor.fetchone()
        if not count:
            return 0
        source = f"(SELECT * FROM {_INCREMENTS} WHERE id <= {int(last)})"
        cursor.execute(_ADD_COUNTS.format(source=source))
        cursor.execute(_ADD_DURATIONS.format(source=source))
        cursor.execute(f"DELETE FROM {_INCREMENTS} WHERE id <= %s", [last])
        return count


def execution_counts(*, using: str = DEFAULT_DB_ALIAS) -> dict[tuple[str, str, str], int]:
    """Return {(status, task, trigger): count}: the totals plus the increments not folded yet, read at one instant."""
    totals = ExecutionTally.objects.using(using).values_list("status", "task", "trigger").annotate(n=Sum("count"))
    pending = TallyIncrement.objects.using(using).values_list("status", "task", "trigger").annotate(n=Count("id"))
    counts: Counter[tuple[str, str, str]] = Counter()
    for status, task, trigger, count in totals.order_by().union(pending.order_by(), all=True):
        counts[(status, task, trigger)] += int(count)
    return dict(counts)


def duration_counts(*, using: str = DEFAULT_DB_ALIAS) -> dict[tuple[str, str], tuple[int, float]]:
    """Return {(task, le): (count, seconds)}: the totals plus the increments not folded yet, read at one instant."""
    totals = DurationTally.objects.using(using).values_list("task", "le").annotate(n=Sum("count"), s=Sum("seconds"))
    pending = (
        TallyIncrement.objects.using(using)
        .exclude(le="")
        .values_list("task", "le")
        .annotate(n=Count("id"), s=Sum("seconds"))
    )
    counts: dict[tuple[str, str], tuple[int, float]] = {}
    for task, le, count, seconds in totals.order_by().union(pending.order_by(), all=True):
        before = counts.get((task, le), (0, 0.0))
        counts[(task, le)] = (before[0] + int(count), before[1] + float(seconds or 0.0))
    return counts
