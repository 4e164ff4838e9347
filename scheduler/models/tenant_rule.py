"""What the rules kept per tenant share: whose they are, who made them, and for the work rules, which work they match."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

#: A tenant's rule names its tenant; an every-tenant one names none (each table's check constraint).
WHOSE = Q(every_tenant=True, tenant="") | (Q(every_tenant=False) & ~Q(tenant=""))


class TenantRule(models.Model):
    """A rule of one tenant, or of every tenant (and of the deployer, who has none)."""

    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    every_tenant = models.BooleanField(default=False)
    #: Who made it: the user's or token's name, ``cli``.
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        abstract = True

    def whose(self) -> str:
        return "every tenant" if self.every_tenant else f"tenant {self.tenant}"


class WorkRule(TenantRule):
    """A rule on work (a pause, a concurrency or a rate limit): it matches work by its task, queue and tenant."""

    #: Only tasks whose name matches this pattern, ``*`` and ``?`` as in a shell ("" : any task).
    task = models.CharField(max_length=255, blank=True, default="")
    #: Only work on this queue ("" : any queue).
    queue = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        abstract = True

    def work(self) -> str:
        """``tasks reports.* and queue slow``; "" when it matches all work."""
        parts = (f"tasks {self.task}" if self.task else "", f"queue {self.queue}" if self.queue else "")
        return " and ".join(part for part in parts if part)
