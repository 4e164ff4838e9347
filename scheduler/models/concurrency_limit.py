"""ConcurrencyLimit: how many executions of a task pattern, a queue or an argument's value may run at once, cluster-wide."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class ConcurrencyLimit(models.Model):
    """At most ``limit`` running executions per key: the rows it matches share a key, or one per value of ``key``."""

    name = models.CharField(max_length=100)
    #: Whose work: one tenant's, or every tenant's (and the deployer's, which has none).
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    every_tenant = models.BooleanField(default=False)
    #: Only tasks whose name matches this pattern, ``*`` and ``?`` as in a shell ("" : any task).
    task = models.CharField(max_length=255, blank=True, default="")
    #: Only work on this queue ("" : any queue).
    queue = models.CharField(max_length=200, blank=True, default="")
    #: What splits the work into keys, each with ``limit`` slots: an argument's name (``customer_id``)
    #: or a template of them (``{customer_id}-{region}``, ``{0}`` for the first positional one);
    #: "" : everything the limit matches shares one key.
    key = models.CharField(max_length=200, blank=True, default="")
    limit = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="concurrency_limit_unique_name"),
            models.CheckConstraint(name="concurrency_limit_at_least_one", condition=Q(limit__gte=1)),
            # A tenant's limit names its tenant; an every-tenant one names none.
            models.CheckConstraint(
                name="concurrency_limit_whose_work",
                condition=Q(every_tenant=True, tenant="") | (Q(every_tenant=False) & ~Q(tenant="")),
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """``3 at once of tasks reports.* per customer_id, every tenant``."""
        parts = []
        if self.task:
            parts.append(f"tasks {self.task}")
        if self.queue:
            parts.append(f"queue {self.queue}")
        what = " and ".join(parts) or "all work"
        per = f" per {self.key}" if self.key else ""
        whose = "every tenant" if self.every_tenant else f"tenant {self.tenant}"
        return f"{self.limit} at once of {what}{per}, {whose}"
