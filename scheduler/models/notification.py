"""Notification targets, and the notifications owed to them: an outbox of its own, delivered by the beat leader."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator, URLValidator
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class NotificationTarget(models.Model):
    class Kind(models.TextChoices):
        #: Django's mail (``EMAIL_*`` settings) to ``address``.
        EMAIL = "email", "email"
        #: A JSON POST to ``address``, signed with HMAC-SHA256 over the shared ``secret``.
        WEBHOOK = "webhook", "webhook (signed JSON)"
        #: A Slack-compatible incoming webhook at ``address``.
        SLACK = "slack", "Slack incoming webhook"
        #: Check-ins of each run of the schedules that choose it, to a monitor's ping URL:
        #: ``<url>/start``, ``<url>``, ``<url>/fail`` (Healthchecks.io and compatible).
        HEALTHCHECKS = "healthchecks", "check-in: Healthchecks.io-style ping URL"
        #: The same to a Sentry Crons-style URL: ``?status=in_progress``, ``ok``, ``error``.
        SENTRY_CRONS = "sentry_crons", "check-in: Sentry Crons-style URL"

    name = models.CharField(max_length=200)
    #: Whose: a tenant's target serves that tenant's schedules and executions; "" the deployer's.
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    #: An e-mail address, or the URL to POST to.
    address = models.CharField(max_length=500)
    #: The webhook's shared secret (the receiver checks ``X-Scheduler-Signature`` with it).
    secret = models.CharField(max_length=200, blank=True, default="")
    #: Used for every schedule of its tenant that chooses no target (the deployer's: for every tenant's, last).
    is_default = models.BooleanField(default=False)
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ("tenant", "name")
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="notification_target_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"

    def clean(self) -> None:
        """An e-mail target needs an address, the others an http(s) URL; a signed webhook needs its secret."""
        if self.kind == self.Kind.EMAIL:
            validator: EmailValidator | URLValidator = EmailValidator(message="Enter an e-mail address.")
        else:
            validator = URLValidator(schemes=["http", "https"], message="Enter an http:// or https:// URL.")
        try:
            validator(self.address)
        except ValidationError as exc:
            raise ValidationError({"address": exc.messages}) from None
        if self.kind == self.Kind.WEBHOOK and not self.secret:
            raise ValidationError({"secret": "A signed webhook needs the secret its receiver checks."})
        if self.is_check_in and self.is_default:
            raise ValidationError(
                {"is_default": "A check-in URL is one job's monitor: choose it on its schedule, not as a default."}
            )

    @property
    def is_check_in(self) -> bool:
        return self.kind in CHECK_IN_KINDS


#: The kinds that check in each run of a schedule (start, success, failure) instead of telling about events.
CHECK_IN_KINDS = frozenset({NotificationTarget.Kind.HEALTHCHECKS, NotificationTarget.Kind.SENTRY_CRONS})


class Notification(models.Model):
    class Event(models.TextChoices):
        #: An execution ended ``failed`` or ``timed_out`` with no retry left.
        EXECUTION_FAILED = "execution_failed", "execution failed"
        #: The circuit breaker paused a schedule (``pause_after_failures``).
        SCHEDULE_PAUSED = "schedule_paused", "schedule paused by its circuit breaker"
        #: A schedule has had no success for longer than its window (the dead man's switch), and when that ended.
        SCHEDULE_OVERDUE = "schedule_overdue", "schedule overdue"
        SCHEDULE_RECOVERED = "schedule_recovered", "schedule no longer overdue"
        #: An attempt of a schedule that chose a check-in target started, and one succeeded (check-ins only).
        RUN_STARTED = "run_started", "run started"
        RUN_SUCCEEDED = "run_succeeded", "run succeeded"
        #: The leadership (or a shard's) has had no holder for ``SCHEDULER_NOTIFY_LEADERLESS_SECONDS``, and when one took it.
        LEADERLESS = "leaderless", "no leader"
        LEADER_BACK = "leader_back", "leader back"

    #: One event, one target, one row: the event's key makes a second recording of it a no-op.
    key = models.CharField(max_length=200)
    target = models.ForeignKey(NotificationTarget, on_delete=models.CASCADE, related_name="notifications")
    event = models.CharField(max_length=30, choices=Event.choices)
    tenant = models.CharField(max_length=100, blank=True, default="", db_index=True)
    #: What is sent: the JSON body of a webhook, the text of a message.
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(db_default=Now())
    #: When the next delivery attempt may start (moved forward by each attempt: its backoff, or its time to finish).
    next_attempt_at = models.DateTimeField(db_default=Now())
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    #: Set once the attempts ran out: not tried again (``SCHEDULER_NOTIFY_MAX_ATTEMPTS``).
    gave_up_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        constraints = [models.UniqueConstraint(fields=["key", "target"], name="notification_once_per_target")]
        indexes = [
            # What the leader delivers next: not delivered, not given up, due.
            models.Index(
                fields=["next_attempt_at"],
                name="notification_due",
                condition=Q(delivered_at__isnull=True, gave_up_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} → {self.target_id}"


class Incident(models.Model):
    """A condition that was announced and has not ended yet: an overdue schedule, a lease nobody holds.

    Its row exists exactly while the condition lasts, as last seen by a
    watch pass (``scheduler.ops.watch``): opening one records the
    notifications of its start, deleting it those of its end, each in the
    same transaction. One per condition (``kind``, ``subject``), so two
    watchers never announce it twice.
    """

    class Kind(models.TextChoices):
        OVERDUE = "overdue", "schedule overdue"
        LEADERLESS = "leaderless", "lease without holder"

    kind = models.CharField(max_length=20, choices=Kind.choices)
    #: What it is about: a schedule's id, a lease's name.
    subject = models.CharField(max_length=200)
    schedule = models.ForeignKey("scheduler.Schedule", null=True, blank=True, on_delete=models.CASCADE)
    tenant = models.CharField(max_length=100, blank=True, default="")
    opened_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("-opened_at",)
        constraints = [models.UniqueConstraint(fields=["kind", "subject"], name="incident_once_per_subject")]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject}"
