"""ConcurrencyLimit: how many executions of a task pattern, a queue or an argument's value may run at once, cluster-wide."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from scheduler.models.tenant_rule import WHOSE, WorkRule


class ConcurrencyLimit(WorkRule):
    """At most ``limit`` running executions per key: the rows it matches share a key, or one per value of ``key``."""

    name = models.CharField(max_length=100)
    #: What splits the work into keys, each with ``limit`` slots: an argument's name (``customer_id``)
    #: or a template of them (``{customer_id}-{region}``, ``{0}`` for the first positional one);
    #: "" : everything the limit matches shares one key.
    key = models.CharField(max_length=200, blank=True, default="")
    limit = models.PositiveIntegerField(validators=[MinValueValidator(1)])

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="concurrency_limit_unique_name"),
            models.CheckConstraint(name="concurrency_limit_at_least_one", condition=Q(limit__gte=1)),
            models.CheckConstraint(name="concurrency_limit_whose_work", condition=WHOSE),
        ]

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """``3 at once of tasks reports.* per customer_id, every tenant``."""
        per = f" per {self.key}" if self.key else ""
        return f"{self.limit} at once of {self.work() or 'all work'}{per}, {self.whose()}"
