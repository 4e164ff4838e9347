"""PauseRule: hold or drain the work of a queue, of tasks matching a pattern, of a tenant, or everything."""

from __future__ import annotations

from django.db import models

from scheduler.models.tenant_rule import WHOSE, WorkRule


class PauseRule(WorkRule):
    class Mode(models.TextChoices):
        #: Nothing new is dispatched or claimed; what runs finishes; what waits, waits.
        HOLD = "hold", "hold"
        #: As hold, and what waits is cancelled with the reason.
        DRAIN = "drain", "drain"

    mode = models.CharField(max_length=10, choices=Mode.choices, default=Mode.HOLD)
    reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ("-created_at", "-id")
        constraints = [models.CheckConstraint(name="pause_rule_whose_work", condition=WHOSE)]

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """``hold queue reports of every tenant``, ``drain tasks billing.* of tenant acme``, ``hold everything``."""
        work, whose = self.work(), self.whose()
        what = f"{work} of {whose}" if work else ("everything" if self.every_tenant else whose)
        return f"{self.mode} {what}"
