"""PauseRule: hold or drain the work of a queue, of tasks matching a pattern, of a tenant, or everything."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class PauseRule(models.Model):
    class Mode(models.TextChoices):
        #: Nothing new is dispatched or claimed; what runs finishes; what waits, waits.
        HOLD = "hold", "hold"
        #: As hold, and what waits is cancelled with the reason.
        DRAIN = "drain", "drain"

    #: Whose work: one tenant's, or every tenant's (and the deployer's, which has none).
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    every_tenant = models.BooleanField(default=False)
    #: Only work on this queue ("" : any queue).
    queue = models.CharField(max_length=200, blank=True, default="")
    #: Only tasks whose name matches this pattern, ``*`` and ``?`` as in a shell ("" : any task).
    task = models.CharField(max_length=255, blank=True, default="")
    mode = models.CharField(max_length=10, choices=Mode.choices, default=Mode.HOLD)
    reason = models.TextField(blank=True, default="")
    #: Who paused: the user's or token's name, ``cli``.
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("-created_at", "-id")
        constraints = [
            # A tenant's rule names its tenant; an every-tenant one names none.
            models.CheckConstraint(
                name="pause_rule_whose_work",
                condition=Q(every_tenant=True, tenant="") | (Q(every_tenant=False) & ~Q(tenant="")),
            ),
        ]

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """``hold queue reports of every tenant``, ``drain tasks billing.* of tenant acme``, ``hold everything``."""
        parts = []
        if self.queue:
            parts.append(f"queue {self.queue}")
        if self.task:
            parts.append(f"tasks {self.task}")
        whose = "every tenant" if self.every_tenant else f"tenant {self.tenant}"
        what = " and ".join(parts) + f" of {whose}" if parts else ("everything" if self.every_tenant else whose)
        return f"{self.mode} {what}"
