"""RateLimit: how many executions of a task pattern, a queue or an argument's value may start per period, cluster-wide."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class RateLimit(models.Model):
    """At most ``starts`` starts per ``per_seconds`` per key, spread evenly: one every ``per_seconds / starts``."""

    name = models.CharField(max_length=100)
    #: Whose work: one tenant's, or every tenant's (and the deployer's, which has none).
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    every_tenant = models.BooleanField(default=False)
    #: Only tasks whose name matches this pattern, ``*`` and ``?`` as in a shell ("" : any task).
    task = models.CharField(max_length=255, blank=True, default="")
    #: Only work on this queue ("" : any queue).
    queue = models.CharField(max_length=200, blank=True, default="")
    #: What splits the work into keys, each with its own rate (as ``ConcurrencyLimit.key``); "" : one key.
    key = models.CharField(max_length=200, blank=True, default="")
    starts = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    per_seconds = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="rate_limit_unique_name"),
            models.CheckConstraint(name="rate_limit_at_least_one", condition=Q(starts__gte=1, per_seconds__gte=1)),
            models.CheckConstraint(
                name="rate_limit_whose_work",
                condition=Q(every_tenant=True, tenant="") | (Q(every_tenant=False) & ~Q(tenant="")),
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """``10 starts per 1 s of tasks api.* per customer_id, every tenant``."""
        parts = []
        if self.task:
            parts.append(f"tasks {self.task}")
        if self.queue:
            parts.append(f"queue {self.queue}")
        what = " and ".join(parts) or "all work"
        per = f" per {self.key}" if self.key else ""
        whose = "every tenant" if self.every_tenant else f"tenant {self.tenant}"
        return f"{self.starts} starts per {self.per_seconds} s of {what}{per}, {whose}"


class RateLimitKey(models.Model):
    """When the next execution of one key of a rate limit may start: the reservations' state.

    ``next_start`` is seconds since the epoch on the database clock; each
    start taken moves it on by the limit's interval.
    """

    key = models.CharField(max_length=255, unique=True)
    next_start = models.FloatField()
