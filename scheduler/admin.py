"""Django admin for schedules, executions, leases and instances."""
from __future__ import annotations

from typing import Any
from zoneinfo import ZoneInfo

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join

from scheduler import clock
from scheduler.exceptions import ScheduleInvalid
from scheduler.models import Execution, Instance, Lease, Schedule

#: How many upcoming slots the schedule page previews.
PREVIEW_COUNT = 5


#: Written by the beat and the workers; shown, never edited by hand.
RUNNING_STATE_FIELDS = (
    "next_run_at",
    "last_run_at",
    "total_runs",
    "total_missed",
    "disabled_reason",
    "consecutive_failures",
    "last_error",
    "created_at",
    "updated_at",
)


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    list_display = ("name", "task", "cron", "interval", "run_at", "timezone", "next_run_at", "enabled")
    list_filter = ("enabled", "queue", "tenant")
    search_fields = ("name", "task", "description")
    readonly_fields = ("next_fire_times", *RUNNING_STATE_FIELDS)
    show_full_result_count = False
    fieldsets = (
        (None, {"fields": ("name", "task", "args", "kwargs", "queue", "priority", "description", "tenant")}),
        (
            "Timing",
            {"fields": ("cron", "interval", "run_at", "timezone", "start_at", "end_at", "max_runs", "next_fire_times")},
        ),
        (
            "Policies",
            {
                "fields": (
                    "overlap",
                    "catchup_window",
                    "misfire",
                    "jitter",
                    "dst_gap",
                    "dst_fold",
                    "timeout",
                    "max_retries",
                    "retry_backoff",
                    "pause_after_failures",
                )
            },
        ),
        ("State", {"fields": ("enabled", "paused_reason", *RUNNING_STATE_FIELDS)}),
    )


    @admin.display(description="Next fire times")
    def next_fire_times(self, schedule: Schedule) -> str:
        """The next slots in the schedule's zone (with its DST abbreviation) and in UTC."""
        if schedule.pk is None:
            return "Shown once the schedule is saved."
        try:
            times = schedule.next_fire_times(PREVIEW_COUNT, after=clock.now())
            zone = ZoneInfo(schedule.timezone)
        except (ScheduleInvalid, ValueError, KeyError) as exc:
            return f"Invalid timing: {exc}"
        if not times:
            return "No upcoming slots."
        return format_html(
            "<ol>{}</ol>",
            format_html_join(
                "",
                "<li>{} <span class='quiet'>({} UTC)</span></li>",
                (
                    (t.astimezone(zone).strftime("%a %Y-%m-%d %H:%M:%S %Z"), t.strftime("%Y-%m-%d %H:%M:%S"))
                    for t in times
                ),
            ),
        )


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by machines: viewable, never edited by hand."""

    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Execution)
class ExecutionAdmin(ReadOnlyAdmin):
    list_display = ("id", "task", "schedule", "scheduled_for", "status", "attempt", "worker")
    list_filter = ("status",)
    search_fields = ("idempotency_key", "celery_task_id", "task")
    raw_id_fields = ("schedule",)


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    list_display = ("name", "holder", "token", "acquired_at", "renewed_at", "expires_at")


@admin.register(Instance)
class InstanceAdmin(ReadOnlyAdmin):
    list_display = ("instance_id", "role", "hostname", "pid", "last_seen", "is_leader")
    list_filter = ("role", "is_leader")
