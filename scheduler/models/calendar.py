"""Calendar: a named set of days, from rules (``scheduler.timing.calendars``), that schedules exclude or run only on."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class Calendar(models.Model):
    name = models.CharField(max_length=100)
    #: Whose: one tenant's, or every tenant's (and the deployer's, which has none).
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    every_tenant = models.BooleanField(default=False)
    #: A list of rules, each ``{kind: value}`` (``scheduler.timing.calendars``).
    rules = models.JSONField(default=list)
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="calendar_unique_name"),
            models.CheckConstraint(
                name="calendar_whose",
                condition=Q(every_tenant=True, tenant="") | (Q(every_tenant=False) & ~Q(tenant="")),
            ),
        ]

    def __str__(self) -> str:
        return self.name
