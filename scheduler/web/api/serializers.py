"""Serializers: the API's shapes, and the one validation path shared with the admin and the CLI.

A schedule is validated by ``operations.validate_schedule`` (the model's
``full_clean`` and the registered-task check), so the API answers with the
admin's and the CLI's messages, as field errors.
"""

from __future__ import annotations

from copy import copy
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, models
from rest_framework import ISO_8601, serializers
from rest_framework.settings import api_settings

from scheduler import dbclock
from scheduler.celery_app import celery_app
from scheduler.conf import settings
from scheduler.limits import KEY_MAX, PAUSED_REASON_MAX_CHARS
from scheduler.models import AuditEvent, Calendar, Execution, Lease, NotificationTarget, PauseRule, Schedule
from scheduler.models.schedule import EARLIEST, LATEST, MESSAGE_OPTION_FIELDS, POLICY_FIELDS
from scheduler.ops import bulk, operations
from scheduler.ops.backfill import DEFAULT_LIMIT
from scheduler.owners import executions
from scheduler.web.api.authentication import caller

#: The timing fields: setting one replaces the others, as ``schedules update --cron`` does.
TIMING_FIELDS = ("cron", "interval", "run_at")
#: Most fire times ``next`` lists.
MAX_FIRE_TIMES = 1000


def drf_errors(exc: DjangoValidationError) -> serializers.ValidationError:
    """Return the DRF form of a model ValidationError: the same messages, by field."""
    if not hasattr(exc, "error_dict"):
        return serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: exc.messages})
    return serializers.ValidationError(
        {
            (api_settings.NON_FIELD_ERRORS_KEY if field == NON_FIELD_ERRORS else field): messages
            for field, messages in exc.message_dict.items()
        }
    )


class IsoDateTime(serializers.DateTimeField):
    """A date-time in ISO-8601, in and out, whatever ``DATETIME_FORMAT`` the host's ``REST_FRAMEWORK`` names."""

    format = ISO_8601
    input_formats = [ISO_8601]


class ApiModelSerializer(serializers.ModelSerializer):
    """The API's model serializers: model date-times as ``IsoDateTime``."""

    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.DateTimeField: IsoDateTime,
    }


class ScheduleSerializer(ApiModelSerializer):
    """A schedule: what runs, when, its policies, and its running state (read-only)."""

    args = serializers.JSONField(required=False, help_text="JSON list of positional arguments.")
    kwargs = serializers.JSONField(required=False, help_text="JSON object of keyword arguments.")
    overdue = serializers.SerializerMethodField(
        help_text="Enabled, not paused, and no success within alert_after (or twice its longest gap between slots)."
    )

    class Meta:
        model = Schedule
        fields = (
            "id",
            "name",
            "task",
            "args",
            "kwargs",
            "queue",
            "priority",
            *MESSAGE_OPTION_FIELDS,
            "description",
            "tenant",
            "origin",
            "cron",
            "interval",
            "run_at",
            "timezone",
            "start_at",
            "end_at",
            "max_runs",
            "exclude_calendars",
            "only_calendar",
            *POLICY_FIELDS,
            "enabled",
            "paused_reason",
            "disabled_reason",
            "next_run_at",
            "last_run_at",
            "last_status",
            "last_success_at",
            "overdue",
            "total_runs",
            "total_missed",
            "consecutive_failures",
            "last_error",
            "created_at",
            "updated_at",
        )
        read_only_fields = (
            "id",
            "origin",
            "disabled_reason",
            "next_run_at",
            "last_run_at",
            "last_status",
            "last_success_at",
            "total_runs",
            "total_missed",
            "consecutive_failures",
            "last_error",
            "created_at",
            "updated_at",
        )
        # The model's validation (below) checks the name once, within the tenant, with the admin's message.
        extra_kwargs: dict[str, dict[str, Any]] = {"name": {"validators": []}}
        validators: list[Any] = []

    def get_overdue(self, schedule: Schedule) -> bool:
        # One database-clock reading per response, shared by a list's rows.
        now = self.context.setdefault("db_now", dbclock.now())
        return schedule.is_overdue_at(now)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Apply ``attrs`` to the schedule and validate it as the admin and the CLI do."""
        scope = caller(self.context["request"]).scope
        if scope.sees_nothing:
            raise serializers.ValidationError(
                {"tenant": ["You are bound to no tenant: ask an administrator to bind you to one."]}
            )
        if scope.is_bound and attrs.get("tenant", scope.tenant) != scope.tenant:
            raise serializers.ValidationError({"tenant": [f"You may only use your own tenant, {scope.tenant!r}."]})
        if scope.is_bound:
            attrs["tenant"] = scope.tenant
        if any(attrs.get(field) not in (None, "") for field in TIMING_FIELDS):
            # One timing replaces the others: a schedule has exactly one.
            attrs = {"cron": "", "interval": None, "run_at": None, **attrs}
        schedule = self.instance if self.instance is not None else Schedule()
        for field, value in attrs.items():
            setattr(schedule, field, value)
        app = celery_app()
        try:
            operations.validate_schedule(schedule, app=app, scope=scope)
            changed, now = schedule.changed_fields(), dbclock.now()
            if "run_at" in changed:
                operations.ensure_run_at_ahead(
                    schedule.run_at,
                    now=now,
                    hint="Give a future time; to run the task once now, use the run-now action.",
                )
            if "end_at" in changed:
                operations.ensure_end_at_ahead(schedule.end_at, now=now)
        except DjangoValidationError as exc:
            raise drf_errors(exc) from None
        except operations.TimeInPast as exc:
            raise serializers.ValidationError({exc.field: [str(exc)]}) from None
        self.candidate = schedule
        return attrs

    def create(self, validated_data: dict[str, Any]) -> Schedule:
        return self._save()

    def update(self, instance: Schedule, validated_data: dict[str, Any]) -> Schedule:
        return self._save()

    def _save(self) -> Schedule:
        schedule = self.candidate
        try:
            operations.save_schedule(schedule, actor=caller(self.context["request"]).actor, now=dbclock.now())
        except IntegrityError:
            # Another request took the name between the check and the write: the
            # unique constraint decides, with the validation's own message.
            if Schedule.objects.filter(tenant=schedule.tenant, name=schedule.name).exclude(pk=schedule.pk).exists():
                message = Schedule._meta.get_field("name").error_messages["unique"] % {
                    "model_name": "Schedule",
                    "field_label": "Name",
                }
                raise serializers.ValidationError({"name": [message]}) from None
            raise
        return schedule


class ExecutionSerializer(ApiModelSerializer):
    """One execution: a slot the beat fired, a run now, a backfill, a retry or a submission."""

    duration_seconds = serializers.FloatField(read_only=True, allow_null=True)
    place_in_line = serializers.SerializerMethodField(
        help_text="Where it waits for a slot of its concurrency limit's key (1: next); null when it does not wait."
    )

    class Meta:
        model = Execution
        fields = (
            "id",
            "idempotency_key",
            "trigger",
            "schedule",
            "retry_of",
            "task",
            "args",
            "kwargs",
            "queue",
            "priority",
            "scheduled_for",
            "status",
            "attempt",
            "timeout",
            "max_retries",
            "retry_backoff",
            "celery_task_id",
            "worker",
            "lease_token",
            "enqueued_at",
            "started_at",
            "finished_at",
            "duration_seconds",
            "result",
            "error",
            "attempt_errors",
            "traceback",
            "tenant",
            "created_at",
            "concurrency_key",
            "place_in_line",
        )
        read_only_fields = fields

    def get_place_in_line(self, execution: Execution) -> int | None:
        return executions.place_in_line(execution)


class AuditEventSerializer(ApiModelSerializer):
    class Meta:
        model = AuditEvent
        fields = (
            "id",
            "actor_type",
            "actor",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "changes",
            "tenant",
            "created_at",
        )
        read_only_fields = fields


class PauseSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=PAUSED_REASON_MAX_CHARS)


class NextQuerySerializer(serializers.Serializer):
    n = serializers.IntegerField(required=False, default=5, min_value=1, max_value=MAX_FIRE_TIMES)


class FireTimeSerializer(serializers.Serializer):
    utc = IsoDateTime()
    local = serializers.CharField(help_text="In the schedule's zone, with its abbreviation.")


class ExcludedTimeSerializer(FireTimeSerializer):
    calendar = serializers.CharField(help_text="The calendar that keeps this slot out.")


class NextSerializer(serializers.Serializer):
    times = FireTimeSerializer(many=True)
    excluded = ExcludedTimeSerializer(
        many=True, help_text="Slots among the next ones its calendars keep out: the schedule does not fire then."
    )
    note = serializers.CharField(allow_blank=True)


class CalendarSerializer(serializers.ModelSerializer):
    """A set of days schedules exclude or run only on; ``rules`` as in the calendars documentation."""

    class Meta:
        model = Calendar
        fields = ("id", "name", "tenant", "rules", "created_by", "created_at")
        read_only_fields = ("created_by", "created_at")
        # The unique name is checked by ``operations.save_calendar``, with the admin's message.
        validators: list[Any] = []


def _in_range(value: Any) -> Any:
    if not EARLIEST <= value < LATEST:
        raise serializers.ValidationError("Must be from 1970-01-01 to 8999-12-31.")
    return value


def _within_backfill_cap(value: int) -> None:
    cap = settings.BACKFILL_MAX_SLOTS
    if value > cap:
        raise serializers.ValidationError(f"At most {cap:,} (SCHEDULER_BACKFILL_MAX_SLOTS).")


class BackfillRequestSerializer(serializers.Serializer):
    start = IsoDateTime(validators=[_in_range])
    end = IsoDateTime(validators=[_in_range])
    dry_run = serializers.BooleanField(default=True, help_text="Preview only (the default); false records the slots.")
    limit = serializers.IntegerField(
        default=DEFAULT_LIMIT,
        min_value=1,
        validators=[_within_backfill_cap],
        help_text="Refuse a range of more slots than this; at most SCHEDULER_BACKFILL_MAX_SLOTS (10,000 by default).",
    )


class SlotSerializer(serializers.Serializer):
    scheduled_for = IsoDateTime()
    execution_id = serializers.IntegerField(allow_null=True)
    status = serializers.CharField(allow_blank=True)


class BackfillReportSerializer(serializers.Serializer):
    schedule = serializers.CharField()
    start = IsoDateTime()
    end = IsoDateTime()
    dry_run = serializers.BooleanField()
    slots = SlotSerializer(many=True)
    created = serializers.IntegerField()
    already_present = serializers.IntegerField()
    published = serializers.IntegerField()
    broker_error = serializers.CharField(allow_blank=True)
    not_recorded = serializers.IntegerField()


class BulkFilterSerializer(serializers.Serializer):
    """Which schedules: every criterion given must hold; at least one is needed."""

    name = serializers.CharField(required=False, help_text="The name; * matches any run of characters, ? one.")
    task = serializers.CharField(required=False)
    queue = serializers.CharField(required=False, allow_blank=True)
    tenant = serializers.CharField(required=False, allow_blank=True)
    # Text, checked by the filter itself: a second enum of the execution statuses would name them twice in the schema.
    last_status = serializers.CharField(required=False, help_text="An execution status: the schedule's last outcome.")
    overdue = serializers.BooleanField(required=False, allow_null=True, default=None)


class BulkRequestSerializer(serializers.Serializer):
    action = serializers.ChoiceField(choices=bulk.ACTIONS)
    filter = BulkFilterSerializer()
    reason = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=PAUSED_REASON_MAX_CHARS, help_text="For pause."
    )
    dry_run = serializers.BooleanField(
        default=True, help_text="Count only (the default): how many match, how many would change, the first names."
    )


class BulkReportSerializer(serializers.Serializer):
    action = serializers.CharField()
    dry_run = serializers.BooleanField()
    matched = serializers.IntegerField()
    changed = serializers.IntegerField()
    first_names = serializers.ListField(child=serializers.CharField())
    executions = serializers.IntegerField()
    broker_error = serializers.CharField(allow_blank=True)


class PauseRuleSerializer(serializers.ModelSerializer):
    """A pause in force: whose work, which queue and tasks, hold or drain."""

    description = serializers.CharField(source="describe", read_only=True)

    class Meta:
        model = PauseRule
        fields = (
            "id",
            "description",
            "tenant",
            "every_tenant",
            "queue",
            "task",
            "mode",
            "reason",
            "created_by",
            "created_at",
        )
        read_only_fields = fields


class NotificationTargetSerializer(serializers.ModelSerializer):
    """Where notifications go. The secret is write-only: it is never shown again."""

    class Meta:
        model = NotificationTarget
        fields = ("id", "name", "tenant", "kind", "address", "secret", "is_default", "enabled")
        extra_kwargs = {"secret": {"write_only": True}}
        # The model's constraint, checked by ``full_clean`` below with the message the admin shows.
        validators: list[Any] = []

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        target = copy(self.instance) if self.instance is not None else NotificationTarget()
        for name, value in attrs.items():
            setattr(target, name, value)
        try:
            target.full_clean()
        except DjangoValidationError as exc:
            raise drf_errors(exc) from None
        return attrs


class PauseRequestSerializer(serializers.Serializer):
    """What to pause: a queue, a task pattern, a tenant (an unscoped caller's), or everything; at least one."""

    queue = serializers.CharField(required=False, allow_blank=True, default="", max_length=200)
    task = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=255, help_text="A task name; * and ? match."
    )
    tenant = serializers.CharField(
        required=False,
        allow_null=True,
        default=None,
        max_length=100,
        help_text="A caller bound to a tenant pauses its own.",
    )
    everything = serializers.BooleanField(default=False)
    mode = serializers.ChoiceField(choices=PauseRule.Mode.choices, default=PauseRule.Mode.HOLD)
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=PAUSED_REASON_MAX_CHARS)


class PauseResultSerializer(serializers.Serializer):
    rule = PauseRuleSerializer()
    cancelled = serializers.IntegerField(help_text="Waiting executions a drain cancelled.")


class ResumeResultSerializer(serializers.Serializer):
    resumed = serializers.CharField(help_text="The pause lifted.")
    sent = serializers.IntegerField(help_text="Held executions sent again.")


class RunNowRequestSerializer(serializers.Serializer):
    """What one run now changes of the schedule's stored values; a field left out keeps the stored one."""

    args = serializers.JSONField(required=False, help_text="Positional arguments for this run only (a JSON list).")
    kwargs = serializers.JSONField(required=False, help_text="Keyword arguments for this run only (a JSON object).")
    queue = serializers.CharField(required=False, allow_blank=True, help_text="Queue for this run only.")
    priority = serializers.IntegerField(required=False, allow_null=True, help_text="Priority for this run only.")


class ActionResultSerializer(serializers.Serializer):
    """The execution an action recorded, and why it was not sent yet, if it was not."""

    execution = ExecutionSerializer()
    broker_error = serializers.CharField(allow_blank=True)


class ReconcileRequestSerializer(serializers.Serializer):
    dry_run = serializers.BooleanField(default=True, help_text="Report only (the default); false repairs.")
    repair = serializers.BooleanField(default=False, help_text="Also record owed slots that have no execution.")


class ChangeSerializer(serializers.Serializer):
    kind = serializers.CharField()
    detail = serializers.CharField()
    execution_id = serializers.IntegerField(allow_null=True)
    schedule_id = serializers.IntegerField(allow_null=True)


class ReconcileReportSerializer(serializers.Serializer):
    now = IsoDateTime()
    dry_run = serializers.BooleanField()
    repair = serializers.BooleanField()
    changes = ChangeSerializer(many=True)
    publish_error = serializers.CharField(allow_blank=True)
    counts = serializers.DictField(child=serializers.IntegerField())
    summary = serializers.CharField()


class LeaseSerializer(ApiModelSerializer):
    held = serializers.BooleanField(help_text="Its holder's lease has not expired.")
    seconds_left = serializers.FloatField(allow_null=True)

    class Meta:
        model = Lease
        fields = ("name", "holder", "token", "acquired_at", "renewed_at", "expires_at", "held", "seconds_left")


class InstanceSerializer(serializers.Serializer):
    instance_id = serializers.CharField()
    role = serializers.CharField()
    hostname = serializers.CharField()
    pid = serializers.IntegerField()
    version = serializers.CharField()
    started_at = IsoDateTime()
    last_seen = IsoDateTime()
    is_leader = serializers.BooleanField(help_text="It holds an unexpired lease.")
    heartbeat_age_seconds = serializers.FloatField()
    is_stale = serializers.BooleanField()


class ClusterSerializer(serializers.Serializer):
    db_now = IsoDateTime()
    shards = serializers.IntegerField()
    leases = LeaseSerializer(many=True)
    instances = InstanceSerializer(many=True)


class StatsQuerySerializer(serializers.Serializer):
    since = IsoDateTime(required=False, validators=[_in_range], help_text="Default: 24 hours ago.")
    until = IsoDateTime(required=False, validators=[_in_range], help_text="Default: now.")
    schedule = serializers.IntegerField(required=False, min_value=1, max_value=KEY_MAX)
    queue = serializers.CharField(required=False, allow_blank=True, max_length=200)
    task = serializers.CharField(required=False, max_length=255)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("since") and attrs.get("until") and attrs["until"] <= attrs["since"]:
            raise serializers.ValidationError({"until": ["Must be after since."]})
        return attrs


class LagSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Executions sent in the window that the figures cover.")
    p50_seconds = serializers.FloatField(allow_null=True)
    p95_seconds = serializers.FloatField(allow_null=True)
    max_seconds = serializers.FloatField(allow_null=True)


class BacklogSerializer(serializers.Serializer):
    due_schedules = serializers.IntegerField(help_text="Active schedules whose next run is already due.")
    pending = serializers.IntegerField()
    queued = serializers.IntegerField()
    oldest_queued_age_seconds = serializers.FloatField(allow_null=True)


class StatsSerializer(serializers.Serializer):
    since = IsoDateTime()
    until = IsoDateTime()
    by_status = serializers.DictField(child=serializers.IntegerField())
    dispatch_lag = LagSerializer()
    backlog = BacklogSerializer()


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
