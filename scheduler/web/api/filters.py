"""Query filters of the list endpoints (django-filter: typed, validated, described in the schema)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import django_filters
from django import forms
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.db.models.functions import Now
from django_filters.fields import IsoDateTimeField

from scheduler import limits
from scheduler.models import AuditEvent, Execution, Schedule
from scheduler.models.schedule import EARLIEST, LATEST, ScheduleQuerySet


class IdFilter(django_filters.NumberFilter):
    """An id: a whole number a key can be, with no check that the row exists (another tenant's would be revealed)."""

    field_class = forms.IntegerField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (past 64 bits SQLite cannot bind it: a 500, not an empty list)
        super().__init__(*args, min_value=1, max_value=limits.KEY_MAX, **kwargs)


class MomentField(IsoDateTimeField):
    """An ISO-8601 time in the span schedules may name, in UTC (a database refuses some offsets and years)."""

    def clean(self, value: str) -> datetime | None:
        moment = super().clean(value)
        if moment is None:
            return None
        if not EARLIEST <= moment < LATEST:
            raise ValidationError("Must be from 1970-01-01 to 8999-12-31.")
        return moment.astimezone(timezone.utc)


class MomentFilter(django_filters.IsoDateTimeFilter):
    field_class = MomentField


class ScheduleFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(
        choices=[("active", "active"), ("paused", "paused"), ("disabled", "disabled")],
        method="filter_state",
    )
    overdue = django_filters.BooleanFilter(method="filter_overdue")

    class Meta:
        model = Schedule
        fields = {
            "name": ["exact"],
            "task": ["exact"],
            "queue": ["exact"],
            "tenant": ["exact"],
            "enabled": ["exact"],
            "last_status": ["exact"],
        }

    def filter_state(self, queryset: QuerySet[Schedule], name: str, value: str) -> QuerySet[Schedule]:
        if value == "active":
            return queryset.filter(enabled=True, paused_reason="")
        if value == "paused":
            return queryset.exclude(paused_reason="")
        return queryset.filter(enabled=False)

    def filter_overdue(self, queryset: ScheduleQuerySet, name: str, value: bool) -> ScheduleQuerySet:
        return queryset.overdue(now=Now()) if value else queryset.not_overdue(now=Now())


class ExecutionFilter(django_filters.FilterSet):
    schedule = IdFilter(field_name="schedule_id")
    status = django_filters.MultipleChoiceFilter(choices=Execution.Status.choices)
    scheduled_after = MomentFilter(field_name="scheduled_for", lookup_expr="gte")
    scheduled_before = MomentFilter(field_name="scheduled_for", lookup_expr="lt")

    class Meta:
        model = Execution
        fields = {
            "task": ["exact"],
            "queue": ["exact"],
            "tenant": ["exact"],
            "trigger": ["exact"],
        }


class AuditEventFilter(django_filters.FilterSet):
    since = MomentFilter(field_name="created_at", lookup_expr="gte")
    until = MomentFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = {
            "actor_type": ["exact"],
            "actor": ["exact"],
            "action": ["exact"],
            "object_type": ["exact"],
            "object_id": ["exact"],
            "tenant": ["exact"],
        }
