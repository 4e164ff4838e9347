"""Execution: one row per (schedule, slot) or per ad-hoc submission."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import ExpressionWrapper, Q
from django.db.models.functions import Now

if TYPE_CHECKING:
    from django_celery_results.models import TaskResult


def _now_as_stored() -> ExpressionWrapper:
    """The database clock as a time written to a row reads (``Now()`` plus nothing).

    On SQLite, where times are text, ``Now()`` has three decimals and a
    written time six, so the two compare wrong within a millisecond: the
    sum is formatted as the written ones are.
    """
    return ExpressionWrapper(Now() + timedelta(0), output_field=models.DateTimeField())


class ExecutionQuerySet(models.QuerySet):
    def claimable(self) -> ExecutionQuerySet:
        """Return executions a worker may claim now (database clock): the one claim condition.

        Waiting ones (a ``retrying`` one once its retry is due: its
        ``enqueued_at``), and running ones whose worker stopped renewing its
        claim (it died, or froze past the claim). A message that comes before
        a retry is due (a redelivery of the failed attempt's, say) claims
        nothing, so the backoff holds whoever sends it.
        """
        waiting = Q(status__in=(Execution.Status.PENDING, Execution.Status.QUEUED))
        due = Q(status=Execution.Status.RETRYING) & (Q(enqueued_at__isnull=True) | Q(enqueued_at__lte=_now_as_stored()))
        abandoned = Q(status=Execution.Status.RUNNING, claim_expires_at__lt=Now())
        return self.filter(waiting | due | abandoned)

    def retry_not_due(self) -> ExecutionQuerySet:
        """Return the ``retrying`` executions whose retry is not due yet (database clock): not ``claimable``."""
        return self.filter(status=Execution.Status.RETRYING, enqueued_at__gt=_now_as_stored())


class Execution(models.Model):
    class Status(models.TextChoices):
        #: Committed by the leader, not yet sent to the broker.
        PENDING = "pending", "pending"
        #: Sent to the broker, not yet claimed by a worker.
        QUEUED = "queued", "queued"
        #: Claimed by a worker, which renews its claim (``claim_expires_at``) while it runs.
        RUNNING = "running", "running"
        #: Finished without error.
        SUCCEEDED = "succeeded", "succeeded"
        #: Raised an error and has no retries left.
        FAILED = "failed", "failed"
        #: Exceeded its time limit.
        TIMED_OUT = "timed_out", "timed out"
        #: Revoked by an operator or by the ``cancel_previous`` overlap policy.
        CANCELLED = "cancelled", "cancelled"
        #: Not run because of the ``skip`` overlap policy.
        SKIPPED = "skipped", "skipped"
        #: Not run because the slot was older than the catch-up window.
        MISSED = "missed", "missed"
        #: The worker died; reconcile decides between retry and failure.
        LOST = "lost", "lost"
        #: Failed, waiting for its next attempt.
        RETRYING = "retrying", "retrying"

    class Trigger(models.TextChoices):
        #: A slot the beat fired.
        SCHEDULED = "scheduled", "scheduled"
        #: "Run now" by an operator (admin, CLI).
        MANUAL = "manual", "manual (run now)"
        #: A past slot recorded by ``backfill``.
        BACKFILL = "backfill", "backfill"
        #: An operator's retry of a finished execution.
        RETRY = "retry", "retry"
        #: ``scheduler.submit()`` or a plain Celery call.
        SUBMIT = "submit", "submit"

    #: Message header that carries the execution id from the sender to the worker.
    MESSAGE_HEADER = "execution_id"

    #: States in which an execution of a schedule counts as in flight for the
    #: overlap policies. ``lost`` does too: reconcile is about to retry it, and
    #: its worker may only have lost touch, so its body may still be running.
    IN_FLIGHT_STATUSES = frozenset({Status.PENDING, Status.QUEUED, Status.RUNNING, Status.RETRYING, Status.LOST})

    #: States of an execution no worker has claimed yet.
    WAITING_STATUSES = frozenset({Status.PENDING, Status.QUEUED, Status.RETRYING})

    #: States an execution never leaves.
    FINAL_STATUSES = frozenset(
        {
            Status.SUCCEEDED,
            Status.FAILED,
            Status.TIMED_OUT,
            Status.CANCELLED,
            Status.SKIPPED,
            Status.MISSED,
        }
    )

    #: The allowed status changes, {from: {to, ...}}; ``scheduler.owners.executions``
    #: writes every change through it, so a move not listed here changes no row.
    #: A row is created ``pending`` (``queued`` for a plain Celery call, or
    #: ``running`` when its worker records it claimed) or already final
    #: (``missed``, ``skipped``). ``running -> running`` is a
    #: claim taken over from a worker that stopped renewing it.
    TRANSITIONS: dict[str, frozenset[str]] = {
        Status.PENDING: frozenset({Status.QUEUED, Status.RUNNING, Status.CANCELLED, Status.FAILED}),
        Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED, Status.FAILED}),
        Status.RETRYING: frozenset({Status.RUNNING, Status.CANCELLED, Status.FAILED}),
        Status.RUNNING: frozenset(
            {
                Status.RUNNING,
                Status.SUCCEEDED,
                Status.FAILED,
                Status.TIMED_OUT,
                Status.RETRYING,
                Status.LOST,
                Status.CANCELLED,
            }
        ),
        Status.LOST: frozenset({Status.RETRYING, Status.FAILED, Status.CANCELLED}),
        **{final: frozenset() for final in FINAL_STATUSES},
    }

    #: ``schedule:<id>:<slot ISO-8601>`` for beat fires, the caller's key for
    #: submissions. The unique constraint is what makes every fire happen once.
    idempotency_key = models.CharField(max_length=255, unique=True)
    #: What created it; set once, by the owner of the row's life (``scheduler.owners.executions``).
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.SCHEDULED)
    schedule = models.ForeignKey(
        "scheduler.Schedule",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="executions",
        # ``execution_schedule_slot`` (schedule, slot) serves every lookup by schedule:
        # one index less to write per dispatched row.
        db_index=False,
    )
    #: The execution this one re-runs (``executions retry``), if any.
    retry_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="retries",
        # ``execution_retry_of``, partial: almost every row has none, and would still cost every write an index entry.
        db_index=False,
    )
    task = models.CharField(max_length=255)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    queue = models.CharField(max_length=200, blank=True, default="")
    #: Broker message priority (Redis: 0-9, lower runs first); empty sends none.
    priority = models.PositiveSmallIntegerField(null=True, blank=True)
    scheduled_for = models.DateTimeField()
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    #: The attempt running now or that ran last; 1 for the first run.
    attempt = models.PositiveIntegerField(default=1)
    #: Seconds before the soft time limit; copied from the schedule or the submission.
    timeout = models.PositiveIntegerField(null=True, blank=True, help_text="Seconds; empty means no time limit.")
    #: Attempts allowed after the first one fails.
    max_retries = models.PositiveIntegerField(default=0)
    #: Seconds; base of the exponential backoff between attempts.
    retry_backoff = models.PositiveIntegerField(default=1)
    celery_task_id = models.CharField(max_length=255, blank=True, default="")
    #: Buffered by ``overlap=buffer_one``: kept ``pending`` and not sent until
    #: the schedule has nothing else in flight. (Columns keep their first
    #: names, see migration 0021.)
    buffered = models.BooleanField(default=False, db_column="held")
    #: Hostname / instance id of the worker that claimed it.
    worker = models.CharField(max_length=255, blank=True, default="")
    #: Fencing token of the beat lease this execution was committed under.
    lease_token = models.BigIntegerField(null=True, blank=True)
    #: The beat lease it was committed under (``beat``, or ``beat:<k>`` for shard k); empty when not by the beat.
    lease_name = models.CharField(max_length=100, blank=True, default="")
    #: Instance id of the beat replica that committed it.
    dispatcher = models.CharField(max_length=255, blank=True, default="")
    #: When the worker's claim on it runs out unless renewed.
    claim_expires_at = models.DateTimeField(null=True, blank=True, db_column="lease_expires_at")
    enqueued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    #: Progress a task saved with ``current_execution().checkpoint(data)``; the
    #: next attempt reads it to resume where the last one stopped.
    progress = models.JSONField(null=True, blank=True, db_column="checkpoint")
    #: ``<limit id>:<value>`` of the concurrency limit that governs it, set when a worker first
    #: takes it under one (``scheduler.owners.work_rules``): a ``queued`` row with a key waits for a slot.
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)
    error = models.TextField(blank=True, default="")
    #: The error of every earlier attempt, oldest first: ``[{"attempt": n, "error": "...", "at": ISO}]``.
    attempt_errors = models.JSONField(default=list, blank=True)
    traceback = models.TextField(blank=True, default="")
    tenant = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ExecutionQuerySet.as_manager()

    class Meta:
        ordering = ("-scheduled_for", "-id")
        indexes = [
            # Every write of a row (its claim, its outcome) updates each index: a
            # plain one, not Django's extra pattern (LIKE) index per CharField.
            models.Index(fields=["celery_task_id"], name="execution_celery_task"),
            models.Index(fields=["schedule", "-scheduled_for"], name="execution_schedule_slot"),
            models.Index(fields=["-scheduled_for", "-id"], name="execution_recent"),
            models.Index(fields=["status", "created_at"], name="execution_status_created"),
            # The leader looks for buffered rows every tick; there are few.
            models.Index(fields=["schedule"], name="execution_buffered", condition=Q(buffered=True)),
            # An execution's re-runs, and the re-runs a delete detaches (on_delete=SET_NULL).
            models.Index(fields=["retry_of"], name="execution_retry_of", condition=Q(retry_of__isnull=False)),
            # The admin's trigger filter on a large table.
            models.Index(fields=["trigger", "-scheduled_for"], name="execution_trigger"),
            # /metrics: the dispatch lag of scheduled slots sent lately, newest first.
            models.Index(
                fields=["-enqueued_at"],
                name="execution_sent",
                condition=Q(trigger="scheduled", enqueued_at__isnull=False),
            ),
            # /metrics: waiting and running executions by status and queue, from the index alone.
            models.Index(
                fields=["status", "queue"],
                name="execution_current",
                condition=Q(status__in=["pending", "queued", "running"]),
            ),
            # A claim under a concurrency limit counts its key's running and waiting rows.
            models.Index(
                fields=["concurrency_key", "status", "id"],
                name="execution_concurrency",
                condition=Q(concurrency_key__isnull=False),
            ),
        ]

    @classmethod
    def moves_to(cls, status: str) -> frozenset[str]:
        """Return the statuses from which ``TRANSITIONS`` allows a move to ``status``."""
        return frozenset(source for source, targets in cls.TRANSITIONS.items() if status in targets)

    def __str__(self) -> str:
        return f"{self.task} @ {self.scheduled_for:%Y-%m-%d %H:%M:%S} [{self.status}]"

    @property
    def task_result(self) -> TaskResult | None:
        """Return the django-celery-results row of this execution's Celery task, if stored."""
        from django_celery_results.models import TaskResult

        if not self.celery_task_id:
            return None
        return TaskResult.objects.filter(task_id=self.celery_task_id).first()

    def attempt_history(self) -> list[dict[str, Any]]:
        """Return the error of every attempt that failed, oldest first, as ``attempt_errors`` entries.

        ``attempt_errors`` holds the attempts that were retried; a finished
        execution's last attempt has its error in ``error``.
        """
        history = list(self.attempt_errors or [])
        if self.error and self.status in self.FINAL_STATUSES:
            at = self.finished_at.isoformat() if self.finished_at else None
            history.append({"attempt": self.attempt, "error": self.error, "at": at})
        return history

    @property
    def duration_seconds(self) -> float | None:
        """Return how long the last attempt ran, when it has started and finished."""
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None
