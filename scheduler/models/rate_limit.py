"""RateLimit: how many executions of a task pattern, a queue or an argument's value may start per period, cluster-wide."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from scheduler.models.tenant_rule import WHOSE, WorkRule


class RateLimit(WorkRule):
    """At most ``starts`` starts per ``per_seconds`` per key, spread evenly: one every ``per_seconds / starts``."""

    name = models.CharField(max_length=100)
    #: What splits the work into keys, each with its own rate (as ``ConcurrencyLimit.key``); "" : one key.
    key = models.CharField(max_length=200, blank=True, default="")
    starts = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    per_seconds = models.PositiveIntegerField(validators=[MinValueValidator(1)])

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="rate_limit_unique_name"),
            models.CheckConstraint(name="rate_limit_at_least_one", condition=Q(starts__gte=1, per_seconds__gte=1)),
            models.CheckConstraint(name="rate_limit_whose_work", condition=WHOSE),
        ]

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """``10 starts per 1 s of tasks api.* per customer_id, every tenant``."""
        per = f" per {self.key}" if self.key else ""
        return f"{self.starts} starts per {self.per_seconds} s of {self.work() or 'all work'}{per}, {self.whose()}"


class RateLimitKey(models.Model):
    """When the next execution of one key of a rate limit may start: the reservations' state.

    ``next_start`` is seconds since the epoch on the database clock; each
    start taken moves it on by the limit's interval.
    """

    key = models.CharField(max_length=255, unique=True)
    next_start = models.FloatField()
