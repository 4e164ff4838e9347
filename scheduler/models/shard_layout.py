"""ShardLayout: the one stored shard count every beat replica follows."""

from __future__ import annotations

from django.db import models

#: The primary key of the one row.
LAYOUT_ID = 1


class ShardLayout(models.Model):
    """How many shards the schedules are split into, stored once for every replica (``scheduler.shards``).

    One row. The first beat replica to start stores its ``SCHEDULER_SHARDS``
    here when no row exists; from then on every replica reads the count from
    this row on each tick, whatever its own setting, and only ``manage.py
    shards --set N`` changes it. Every dispatch commit reads the row under a
    shared lock (``leases.assert_held_many``), so a change of the count waits
    for the commits in flight and no commit straddles it.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=LAYOUT_ID)
    #: The shard count: 1 = one leader under the lease ``beat``, N > 1 = leases ``beat:0`` ... ``beat:<N-1>``.
    shards = models.PositiveSmallIntegerField()
    #: The count before the last change (empty when the row was first stored).
    previous = models.PositiveSmallIntegerField(null=True, blank=True)
    changed_at = models.DateTimeField()
    #: Who stored it: a beat replica's instance id (first start), or the command that changed it.
    changed_by = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        verbose_name = "shard layout"
        constraints = [
            models.CheckConstraint(condition=models.Q(id=LAYOUT_ID), name="shard_layout_one_row"),
            models.CheckConstraint(condition=models.Q(shards__gte=1), name="shard_layout_at_least_one"),
        ]

    def __str__(self) -> str:
        return f"{self.shards} shard{'s' if self.shards != 1 else ''}"
