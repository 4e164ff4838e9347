"""Tallies: counters the database keeps as executions finish, so ``/metrics`` reads counters that only grow.

Executions are pruned, so counting their rows cannot give a counter that
only increases. A trigger on the execution table (migration 0012) adds to
these rows in the same statement that moves an execution to a final status
(or inserts it already final: ``missed``, ``skipped``), so the tally commits
or rolls back with the status change, whichever process or path made it,
and survives pruning and restarts. ``shard`` is the execution id modulo
``SHARDS``: concurrent finishes of one task spread over that many rows
instead of queueing on one.

On SQLite, a migration that rebuilds ``scheduler_execution`` (most field
changes do) drops its triggers: it must create them again, as 0013 does.
"""
from __future__ import annotations

from django.db import models

#: Rows per (status, task, trigger) or (task, le): the spread of concurrent increments.
SHARDS = 8
#: Upper bounds (seconds) of the run-time buckets; the trigger in migration 0012 writes the same list.
DURATION_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: ``ExecutionTally.status`` of the rows that count messages a worker refused (not an execution's status:
#: no trigger writes it); ``trigger`` holds the reason and ``task`` is empty (``executions.claim``).
MESSAGE_REFUSED = "refused"


class ExecutionTally(models.Model):
    """How many executions reached ``status``, by task and trigger (one shard of the count)."""

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
