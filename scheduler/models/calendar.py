"""Calendar: a named set of days, from rules (``scheduler.timing.calendars``), that schedules exclude or run only on."""

from __future__ import annotations

from django.db import models

from scheduler.models.tenant_rule import WHOSE, TenantRule


class Calendar(TenantRule):
    name = models.CharField(max_length=100)
    #: A list of rules, each ``{kind: value}`` (``scheduler.timing.calendars``).
    rules = models.JSONField(default=list)

    class Meta:
        ordering = ("tenant", "name")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="calendar_unique_name"),
            models.CheckConstraint(name="calendar_whose", condition=WHOSE),
        ]

    def __str__(self) -> str:
        return self.name
