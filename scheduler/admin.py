"""Django admin for schedules, executions and the cluster (leases and instances).

Lists stay fast at millions of rows: indexed default orderings, no full
result counts, raw-id widgets for foreign keys, and columns that read only
the row itself (``last_status`` is kept on the schedule for that reason).
Actions call the same domain functions as the management commands.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path
from django.urls import reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince, timeuntil
from django.utils.translation import ngettext

from scheduler import backfill, clock, cluster, dispatch, leases, metrics, operations, timing
from scheduler.conf import settings
from scheduler.exceptions import BackfillRefused, ScheduleInvalid
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.models.schedule import EARLIEST, LATEST

#: How many upcoming slots the schedule page previews.
PREVIEW_COUNT = 5
#: How many recent executions the schedule page lists.
RECENT_EXECUTIONS = 20

#: Written by the beat and the workers; shown, never edited by hand.
RUNNING_STATE_FIELDS = (
    "next_run_at",
    "last_run_at",
    "last_status",
    "total_runs",
    "total_missed",
    "disabled_reason",
    "consecutive_failures",
    "last_error",
    "created_at",
    "updated_at",
)

_STATUS_COLOURS = {
    Execution.Status.SUCCEEDED: "#2e7d32",
    Execution.Status.FAILED: "#c62828",
    Execution.Status.TIMED_OUT: "#c62828",
    Execution.Status.LOST: "#c62828",
    Execution.Status.CANCELLED: "#6d4c41",
    Execution.Status.MISSED: "#ef6c00",
    Execution.Status.SKIPPED: "#757575",
}


def status_badge(status: str) -> str:
    if not status:
        return "—"
    colour = _STATUS_COLOURS.get(status, "#1565c0")
    return format_html('<strong style="color:{}">{}</strong>', colour, status)


def when(moment: Any) -> str:
    """A time as "in 3 minutes" / "5 minutes ago", with the absolute UTC time under it."""
    if moment is None:
        return "—"
    now = timezone.now()
    relative = f"in {timeuntil(moment, now)}" if moment > now else f"{timesince(moment, now)} ago"
    return format_html('{}<br><span class="quiet">{}</span>', relative, f"{moment:%Y-%m-%d %H:%M:%S} UTC")


class LastStatusFilter(admin.SimpleListFilter):
    title = "last run status"
    parameter_name = "last_status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(status, status) for status in sorted(Execution.FINAL_STATUSES)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        return queryset.filter(last_status=self.value()) if self.value() else queryset


class EstimatedCountPaginator(Paginator):
    """Exact counts for filtered lists; PostgreSQL's own estimate for a whole large table.

    Counting ten million rows on every page view takes seconds; the page
    number of the last page does not need to be exact.
    """

    #: Below this many rows (estimated) the exact count is cheap enough.
    ESTIMATE_ABOVE = 100_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if connection.vendor == "postgresql" and isinstance(queryset, QuerySet) and not queryset.query.where:
            with connection.cursor() as cursor:
                cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE relname = %s", [queryset.model._meta.db_table])
                row = cursor.fetchone()
            if row and row[0] > self.ESTIMATE_ABOVE:
                return int(row[0])
        return super().count


class InputFilter(admin.SimpleListFilter):
    """A text box filtering on one field's exact value.

    Django's per-value filters list every distinct value, a full scan at a
    million schedules; typing the value costs one indexed lookup.
    """

    template = "admin/scheduler/input_filter.html"
    field = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("", "")]  # non-empty, so the filter is shown

    def queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        value = (self.value() or "").strip()
        return queryset.filter(**{self.field: value}) if value else queryset

    def choices(self, changelist: Any) -> Iterator[dict[str, Any]]:
        # The other active filters, kept as hidden fields of the text box's form.
        others = {k: v for k, v in changelist.get_filters_params().items() if k != self.parameter_name}
        yield {"value": self.value() or "", "others": [(k, v[-1] if isinstance(v, list) else v) for k, v in others.items()]}


def input_filter(field: str) -> type[InputFilter]:
    return type(f"{field.title()}Filter", (InputFilter,), {"title": field, "parameter_name": field, "field": field})


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "active"), ("paused", "paused"), ("disabled", "disabled")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        if self.value() == "active":
            return queryset.filter(enabled=True, paused_reason="")
        if self.value() == "paused":
            return queryset.exclude(paused_reason="")
        if self.value() == "disabled":
            return queryset.filter(enabled=False)
        return queryset


class ActionsNeedPermission:
    """Answer 403 to an action the user may not run, instead of Django's silent "no action"."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        action = request.POST.get("action") if request.method == "POST" else None
        if action and action not in self.get_actions(request):  # type: ignore[attr-defined]
            raise PermissionDenied(f"You may not run {action!r}.")
        return super().changelist_view(request, extra_context)  # type: ignore[misc]


class BackfillForm(forms.Form):
    start = forms.DateTimeField(help_text="UTC, e.g. 2026-03-01 00:00:00")
    end = forms.DateTimeField(help_text="UTC; not in the future")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for field in ("start", "end"):
            moment = cleaned.get(field)
            # Slot arithmetic overflows near year 1 (and 9999): the same span as a schedule's own times.
            if moment is not None and not EARLIEST <= moment < LATEST:
                self.add_error(field, "Must be from 1970-01-01 to 8999-12-31.")
        return cleaned


class ScheduleForm(forms.ModelForm):
    class Meta:
        model = Schedule
        fields = "__all__"

    def clean_task(self) -> str:
        name = self.cleaned_data["task"].strip()
        if not dispatch.is_task_registered(name):
            raise forms.ValidationError(
                "Unknown task %(name)s: no task with that name is registered with the Celery app.",
                params={"name": name},
            )
        return name


@admin.register(Schedule)
class ScheduleAdmin(ActionsNeedPermission, admin.ModelAdmin):
    form = ScheduleForm
    paginator = EstimatedCountPaginator
    list_display = ("name", "task", "timing_text", "timezone", "next_run", "last_run", "state")
    list_filter = (StateFilter, LastStatusFilter, "enabled", input_filter("task"), input_filter("queue"), input_filter("tenant"))
    # Exact, case-sensitive matches: each an index lookup (a substring or
    # case-insensitive search scans every row).
    search_fields = ("name__exact", "task__exact")
    readonly_fields = ("next_fire_times", "recent_executions", "backfill_link", *RUNNING_STATE_FIELDS)
    show_full_result_count = False
    list_per_page = 50
    actions = ("run_now", "enable", "disable", "pause", "resume")
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
        ("Recent executions", {"fields": ("recent_executions", "backfill_link")}),
    )

    # --- columns -------------------------------------------------------------------

    @admin.display(description="timing")
    def timing_text(self, schedule: Schedule) -> str:
        try:
            return timing.describe(schedule.timing)
        except ScheduleInvalid as exc:
            return f"invalid: {exc}"

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, schedule: Schedule) -> str:
        return when(schedule.next_run_at)

    @admin.display(description="last run", ordering="last_run_at")
    def last_run(self, schedule: Schedule) -> str:
        if schedule.last_run_at is None:
            return "—"
        return format_html("{} {}", status_badge(schedule.last_status), when(schedule.last_run_at))

    @admin.display(description="state")
    def state(self, schedule: Schedule) -> str:
        if not schedule.enabled:
            return format_html('<span title="{}">⏹ disabled</span>', schedule.disabled_reason)
        if schedule.is_paused:
            return format_html('<span title="{}" style="color:#ef6c00">⏸ paused</span>', schedule.paused_reason)
        return mark_safe('<span style="color:#2e7d32">▶ active</span>')

    # --- change page ---------------------------------------------------------------

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

    @admin.display(description="Last executions")
    def recent_executions(self, schedule: Schedule) -> str:
        if schedule.pk is None:
            return "—"
        recent = Execution.objects.filter(schedule=schedule).order_by("-scheduled_for", "-id")[:RECENT_EXECUTIONS]
        rows = [
            (
                reverse("admin:scheduler_execution_change", args=[execution.pk]),
                f"{execution.scheduled_for:%Y-%m-%d %H:%M:%S}",
                status_badge(execution.status),
                execution.attempt,
                f"{execution.duration_seconds:.2f}s" if execution.duration_seconds is not None else "",
                execution.error[:120],
            )
            for execution in recent
        ]
        if not rows:
            return "No executions yet."
        return format_html(
            "<table><thead><tr><th>slot (UTC)</th><th>status</th><th>attempt</th><th>duration</th><th>error</th></tr>"
            "</thead><tbody>{}</tbody></table>",
            format_html_join(
                "", '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>', rows
            ),
        )

    @admin.display(description="Backfill")
    def backfill_link(self, schedule: Schedule) -> str:
        if schedule.pk is None:
            return "—"
        url = reverse("admin:scheduler_schedule_backfill", args=[schedule.pk])
        return format_html('<a href="{}">Backfill a range of past slots…</a>', url)

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.backfill_view)
        return [path("<int:pk>/backfill/", view, name="scheduler_schedule_backfill"), *super().get_urls()]

    def backfill_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Range → preview (what would be recorded) → confirm; a bad range is a form error."""
        schedule = get_object_or_404(Schedule, pk=pk)
        if not self.has_change_permission(request, schedule):
            raise PermissionDenied("You may not backfill this schedule.")
        form = BackfillForm(request.POST or None)
        preview = None
        if request.method == "POST" and form.is_valid():
            from project.celery import app

            confirm = "confirm" in request.POST
            try:
                report = backfill.backfill(
                    schedule, start=form.cleaned_data["start"], end=form.cleaned_data["end"],
                    now=leases.db_now(), dry_run=not confirm, app=app,
                )
            except BackfillRefused as exc:
                form.add_error(None, str(exc))
            else:
                if confirm:
                    self.message_user(
                        request,
                        f"Backfill of {schedule.name}: {report.created} execution(s) recorded, "
                        f"{report.already_present} slot(s) already had one, {report.published} sent.",
                    )
                    if report.broker_error:
                        self.message_user(
                            request,
                            f"The broker is unreachable ({report.broker_error}): the "
                            f"{report.created - report.published} execution(s) not sent stay pending; "
                            "the beat leader sends them once it is back.",
                            level=messages.WARNING,
                        )
                    return redirect("admin:scheduler_schedule_change", schedule.pk)
                preview = report
        context = {
            **self.admin_site.each_context(request),
            "title": f"Backfill {schedule.name}",
            "schedule": schedule,
            "form": form,
            "preview": preview,
            "preview_slots": preview.slots[:20] if preview else (),
            "new_slots": sum(1 for slot in preview.slots if slot.execution_id is None) if preview else 0,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/scheduler/schedule/backfill.html", context)

    def save_model(self, request: HttpRequest, obj: Schedule, form: forms.ModelForm, change: bool) -> None:
        # Only the fields the operator changed: the leader and the workers write
        # next_run_at and the counters of this row meanwhile.
        operations.save_schedule(obj, fields=form.changed_data if change else None, now=leases.db_now())

    # --- actions -------------------------------------------------------------------

    def _each(self, request: HttpRequest, queryset: QuerySet[Schedule], change: Any, verb: str) -> None:
        count = 0
        for schedule in queryset:
            change(schedule)
            count += 1
        self.message_user(request, ngettext("%(n)d schedule %(verb)s.", "%(n)d schedules %(verb)s.", count) % {"n": count, "verb": verb})

    @admin.action(description="Run selected schedules now", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        from project.celery import app

        sent, problems = 0, []
        for schedule in queryset:
            try:
                with transaction.atomic():
                    result = operations.run_now(schedule, app=app)
            except operations.ActionRefused as exc:
                problems.append(str(exc))
                continue
            sent += 1
            if result.broker_error:
                problems.append(f"{schedule.name}: recorded, not sent yet ({result.broker_error}); the beat leader will send it")
        if sent:
            self.message_user(request, ngettext("%(n)d execution started.", "%(n)d executions started.", sent) % {"n": sent})
        for problem in problems:
            self.message_user(request, problem, level=messages.WARNING)

    @admin.action(description="Enable selected schedules", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(request, queryset, lambda s: operations.set_enabled(s, True, now=leases.db_now()), "enabled")

    @admin.action(description="Disable selected schedules", permissions=["change"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(request, queryset, lambda s: operations.set_enabled(s, False, now=leases.db_now()), "disabled")

    @admin.action(description="Pause selected schedules", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        reason = f"Paused by {request.user} in the admin"
        self._each(request, queryset, lambda s: operations.pause_schedule(s, reason, now=leases.db_now()), "paused")

    @admin.action(description="Resume selected schedules", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(request, queryset, lambda s: operations.resume_schedule(s, now=leases.db_now()), "resumed")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by machines: viewable, never edited by hand."""

    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # History and leases are removed by prune_executions and reconcile, not by hand.
        return False


@admin.register(Execution)
class ExecutionAdmin(ActionsNeedPermission, ReadOnlyAdmin):
    paginator = EstimatedCountPaginator
    list_display = ("id", "task", "schedule", "scheduled_for", "status_text", "attempt", "duration", "worker")
    list_filter = ("status", ("scheduled_for", admin.DateFieldListFilter))
    search_fields = ("idempotency_key__exact", "celery_task_id__exact")
    raw_id_fields = ("schedule", "retry_of")
    list_select_related = ("schedule",)
    list_per_page = 50
    readonly_fields = ("task_result_link", "traceback_text")
    exclude = ("traceback",)

    actions = ("retry", "cancel")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        # Executions are machine-written; whoever may change schedules may act on them.
        return request.user.has_perm("scheduler.change_schedule")

    has_cancel_permission = has_retry_permission

    @admin.action(description="Retry selected executions (as new executions)", permissions=["retry"])
    def retry(self, request: HttpRequest, queryset: QuerySet[Execution]) -> None:
        from project.celery import app

        self._apply(request, queryset, lambda e: operations.retry_execution(e, app=app), "retried")

    @admin.action(description="Cancel selected executions", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Execution]) -> None:
        from project.celery import app

        self._apply(request, queryset, lambda e: operations.cancel_execution(e, app=app), "cancelled")

    def _apply(self, request: HttpRequest, queryset: QuerySet[Execution], action: Any, verb: str) -> None:
        done = 0
        for execution in queryset:
            try:
                with transaction.atomic():
                    result = action(execution)
            except operations.ActionRefused as exc:
                self.message_user(request, str(exc), level=messages.WARNING)
                continue
            done += 1
            if result.broker_error:
                self.message_user(request, f"execution {execution.pk}: broker unreachable ({result.broker_error})", level=messages.WARNING)
        if done:
            self.message_user(request, ngettext("%(n)d execution %(verb)s.", "%(n)d executions %(verb)s.", done) % {"n": done, "verb": verb})

    @admin.display(description="status", ordering="status")
    def status_text(self, execution: Execution) -> str:
        return status_badge(execution.status)

    @admin.display(description="duration")
    def duration(self, execution: Execution) -> str:
        seconds = execution.duration_seconds
        return "—" if seconds is None else f"{seconds:.2f}s"

    @admin.display(description="task result")
    def task_result_link(self, execution: Execution) -> str:
        result = execution.task_result
        if result is None:
            return "—"
        url = reverse("admin:django_celery_results_taskresult_change", args=[result.pk])
        return format_html('<a href="{}">{} ({})</a>', url, result.task_id, result.status)

    @admin.display(description="traceback")
    def traceback_text(self, execution: Execution) -> str:
        if not execution.traceback:
            return "—"
        return format_html('<pre style="white-space:pre-wrap">{}</pre>', execution.traceback)


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    """The cluster page: who leads, since when, and every replica's and worker's heartbeat."""

    list_display = ("name", "holder", "token", "acquired_at", "renewed_at", "expires_at")
    change_list_template = "admin/scheduler/lease/cluster.html"

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {"title": "Cluster: leases and instances", **(extra_context or {}), **cluster_context()}
        return super().changelist_view(request, extra_context=context)


def cluster_context() -> dict[str, Any]:
    """The lease with seconds left, instances with heartbeat ages, and queue warnings.

    The leader is the lease's holder, never an instance's own flag; an
    instance silent past ``cluster.stale_after`` is shown stale. A missing
    or stuck leader is warned about on every admin page (``base_site.html``).
    Warned about here: a queue whose oldest queued execution has waited
    longer than ``QUEUED_WARNING_SECONDS``.
    """
    state = leases.current(settings.LEASE_NAME)
    now = state.db_now
    renewed_age = (now - state.renewed_at).total_seconds() if state.renewed_at else None
    members = cluster.members(leaders={state.holder} if state.is_held else set(), now=now)
    # Workers do not record which queues they consume, so this cannot name a
    # queue with no consumer; a queue nobody claims from shows up by its age.
    stuck = [
        {"queue": queue or "(default routing)", "age": age}
        for queue, age in sorted(metrics.oldest_queued(now=now).items())
        if age > settings.QUEUED_WARNING_SECONDS
    ]
    return {
        "lease": state,
        "renewed_age": renewed_age,
        "members": members,
        "stuck_queues": stuck,
        "queued_warning_seconds": settings.QUEUED_WARNING_SECONDS,
        "db_now": now,
    }


@admin.register(Instance)
class InstanceAdmin(ReadOnlyAdmin):
    # No ``is_leader`` column or filter: a beat killed with SIGKILL leaves its
    # flag set; whether it leads is read from the lease row.
    list_display = ("instance_id", "role", "hostname", "pid", "last_seen", "leader")
    list_filter = ("role",)
    exclude = ("is_leader",)
    readonly_fields = ("leader",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Instance]:
        holds_lease = Lease.objects.filter(
            name=settings.LEASE_NAME, holder=OuterRef("instance_id"), expires_at__gt=Now()
        )
        return super().get_queryset(request).annotate(holds_lease=Exists(holds_lease))

    @admin.display(boolean=True, description="leader", ordering="holds_lease")
    def leader(self, instance: Instance) -> bool:
        return instance.holds_lease

