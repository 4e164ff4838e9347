"""AuditEvent: who changed what, when, through the API, the admin or the CLI."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class AuditEvent(models.Model):
    class ActorType(models.TextChoices):
        #: A logged-in user (the admin, or the API with a session).
        USER = "user", "user"
        #: An API token.
        TOKEN = "token", "token"
        #: A management command.
        CLI = "cli", "cli"
        #: Nobody at hand: the daily prune, or code changing users outside a request.
        SYSTEM = "system", "system"

    actor_type = models.CharField(max_length=10, choices=ActorType.choices)
    #: The user's name, the token's name, ``cli`` or ``system``.
    actor = models.CharField(max_length=150)
    #: ``create``, ``update``, ``delete``, ``pause``, ``run_now``, ``retry``, ...
    action = models.CharField(max_length=50)
    #: The model's label (``scheduler.schedule``), or what a bulk action acted on (``reconcile``).
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=100, blank=True, default="")
    object_repr = models.CharField(max_length=255, blank=True, default="")
    #: ``{field: [before, after]}`` for the fields the write changed, or what the action did (a long
    #: one's parameters and counts, and its ``state``: started, completed or failed).
    changes = models.JSONField(default=dict, blank=True)
    #: The tenant of the object (or of the actor when the object has none).
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    #: The database clock's time: every replica and command agrees on the order.
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("-created_at", "-id")
        indexes = [
            # Newest first, and the retention prune's range scan.
            models.Index(fields=["-created_at", "-id"], name="audit_recent"),
            models.Index(fields=["object_type", "object_id"], name="audit_object"),
        ]

    def __str__(self) -> str:
        return f"{self.actor_type}:{self.actor} {self.action} {self.object_type} {self.object_repr}"
