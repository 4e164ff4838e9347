"""Instance: the heartbeat registry of beat replicas and workers."""

from __future__ import annotations

from django.db import models


class Instance(models.Model):
    class Role(models.TextChoices):
        BEAT = "beat", "beat"
        WORKER = "worker", "worker"

    #: ``process_ids.process_id()``: ``<host>:<pid>``, and ``:<token>`` for a beat replica (unique per start).
    instance_id = models.CharField(max_length=255, primary_key=True)
    role = models.CharField(max_length=20, choices=Role.choices)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    version = models.CharField(max_length=50, blank=True, default="")
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)
    #: What a beat last wrote about itself; a beat killed with SIGKILL leaves it
    #: set. Who leads is read from the lease row (``scheduler.ops.cluster``).
    is_leader = models.BooleanField(default=False)

    class Meta:
        ordering = ("role", "instance_id")

    def __str__(self) -> str:
        return f"{self.role} {self.instance_id}"
