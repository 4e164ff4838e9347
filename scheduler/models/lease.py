"""Lease: named, time-bounded ownership with a fencing token."""

from __future__ import annotations

from django.db import models


class Lease(models.Model):
    """One row per lease name; the row is the source of truth for leadership.

    All arithmetic on these timestamps happens in SQL against the database
    clock (see ``scheduler/owners/leases.py``), never against a replica's own clock.
    """

    name = models.CharField(max_length=100, primary_key=True)
    #: Instance id (``<host>:<pid>:<token>``, ``process_ids.process_id``) of the holder; empty when released.
    holder = models.CharField(max_length=255, blank=True, default="")
    #: Fencing token: increases on every acquisition, never on a renewal.
    token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    #: Renewals refused because the holder had lost the lease (a metric).
    renew_failures = models.PositiveIntegerField(default=0)

    # Not columns: the API's cluster view sets these on the rows it serializes.
    held: bool
    seconds_left: float | None

    class Meta:
        verbose_name = "lease"

    def __str__(self) -> str:
        return f"{self.name} held by {self.holder or 'nobody'} (token {self.token})"
