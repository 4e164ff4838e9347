"""Django admin for schedules, executions and the cluster (leases and instances).

Lists stay fast at millions of rows: indexed default orderings, no full
result counts, raw-id widgets for foreign keys, and columns that read only
the row itself (``last_status`` is kept on the schedule for that reason).
Actions, in the lists and as buttons on each object's page, call the same
domain functions as the management commands. Times show seconds and their
zone everywhere (``project/formats`` for the model's own fields).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast
from zoneinfo import ZoneInfo

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import NON_FIELD_ERRORS, PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.core.validators import MinValueValidator
from django.db import connection
from django.db.models import Exists, OuterRef, QuerySet
from django.db.models.functions import Now
from django.forms.fields import InvalidJSONInput
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.timesince import timesince, timeuntil
from django.utils.translation import ngettext

from scheduler import clock, dbclock, shards, task_policy, timing
from scheduler.celery_app import celery_app
from scheduler.conf import settings
from scheduler.exceptions import BackfillRefused, BackfillTooLarge, ScheduleInvalid, TaskRefused
from scheduler.limits import (
    ARGUMENT_LABELS,
    PAUSED_REASON_MAX_CHARS,
    argument_problem,
    depth_problem,
    holds_unstorable_text,
    nests_deeper_than,
)
from scheduler.models import (
    AuditEvent,
    ConcurrencyLimit,
    Execution,
    Instance,
    Lease,
    NotificationTarget,
    OperatorProfile,
    Schedule,
)
from scheduler.models.schedule import (
    EARLIEST,
    HEADERS_LABEL,
    LATEST,
    MESSAGE_OPTION_FIELDS,
    POLICY_FIELDS,
    TIMING_REQUIRED,
    ScheduleQuerySet,
)
from scheduler.ops import audit, cluster, operations
from scheduler.owners import executions, leases, work_rules
from scheduler.tenancy import EVERY_TENANT, Scope, scope_of_user
from scheduler.web import (
    metrics,
    result_admin,  # noqa: F401  (imported to replace django-celery-results' pages with scoped ones)
)
from scheduler.web.admin_lists import ActionsNeedPermission, StorableLookups, TenantScoped
from scheduler.web.two_editors import KeepsOthersChanges, LocksEditedRow

#: How many upcoming slots the schedule page previews.
PREVIEW_COUNT = 5
#: How many recent executions the schedule page lists.
RECENT_EXECUTIONS = 20

#: Schedule fields validated at least 1; the form says so once, in one wording, for 0 and below.
AT_LEAST_ONE_FIELDS = ("interval", "max_runs", "timeout", "pause_after_failures")

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
    "last_success_at",
    "cadence",
    "overdue_at",
    "created_at",
    "updated_at",
)

_STATUS_COLOURS: dict[str, str] = {
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


def utc(moment: Any) -> str:
    """A time as ``2026-11-26 02:52:07 UTC``: seconds and zone, as the CLI's ISO times have."""
    return "—" if moment is None else f"{moment.astimezone(ZoneInfo('UTC')):%Y-%m-%d %H:%M:%S} UTC"


def seconds_between(start: Any, end: Any) -> str:
    """``end - start`` in seconds with two decimals, or a dash while either is unknown."""
    if start is None or end is None:
        return "—"
    return f"{(end - start).total_seconds():.2f}s"


def when(moment: Any) -> str:
    """A time as "in 3 minutes" / "5 minutes ago", with the absolute UTC time under it."""
    if moment is None:
        return "—"
    now = timezone.now()
    relative = f"in {timeuntil(moment, now)}" if moment > now else f"{timesince(moment, now)} ago"
    return format_html('{}<br><span class="quiet">{}</span>', relative, utc(moment))


def registered_task_names() -> list[str]:
    """The Celery app's task names an operator may schedule: its own, not Celery's internals.

    ``celery.backend_cleanup`` is the one internal task meant to be scheduled.
    """
    app = celery_app()
    app.loader.import_default_modules()
    return sorted(name for name in app.tasks if not name.startswith("celery.") or name == "celery.backend_cleanup")


class DatalistInput(forms.TextInput):
    """A text box that suggests values (an HTML ``<datalist>``) and still accepts any text."""

    def __init__(self, suggestions: Any, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs)
        #: Called at each render: tasks registered after start-up show up too.
        self.suggestions = suggestions

    def render(self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None) -> SafeString:
        list_id = f"{name}-suggestions"
        box = super().render(name, value, {**(attrs or {}), "list": list_id}, renderer)
        options = format_html_join("", '<option value="{}">', ((choice,) for choice in self.suggestions()))
        return format_html('{}<datalist id="{}">{}</datalist>', box, list_id, options)


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
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE relname = %s", [queryset.model._meta.db_table]
                )
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

    def choices(self, changelist: Any) -> Iterator[Any]:  # the text box's own keys, for its template
        # The other active filters, kept as hidden fields of the text box's form.
        others = {k: v for k, v in changelist.get_filters_params().items() if k != self.parameter_name}
        yield {
            "value": self.value() or "",
            "others": [(k, v[-1] if isinstance(v, list) else v) for k, v in others.items()],
        }


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


class OverdueFilter(admin.SimpleListFilter):
    """The dead man's switch: active schedules without a success for longer than their window."""

    title = "overdue"
    parameter_name = "overdue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "overdue")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        if self.value() == "yes":
            return cast(ScheduleQuerySet, queryset).overdue(now=Now())
        return queryset


class ArgumentsField(forms.JSONField):
    """The ``args`` form field: JSON within the argument limits (``scheduler.limits``), never a recursion."""

    #: How the limits' messages name the field, as the model's validation does.
    limit_label = ARGUMENT_LABELS["args"]

    def to_python(self, value: Any) -> Any:
        try:
            converted = super().to_python(value)
        except RecursionError:
            # Deeper than json.loads can go at all: far past the depth limit.
            raise forms.ValidationError(depth_problem(self.limit_label)) from None
        problem = argument_problem(converted, label=self.limit_label)
        if problem:
            raise forms.ValidationError(problem)
        return converted

    def bound_data(self, data: Any, initial: Any) -> Any:
        # The form shown again with its errors: JSON past the depth limit is shown
        # as typed, not decoded and encoded again (both recurse), and so is JSON
        # whose "\ud800" decodes to a character no page can be encoded with.
        try:
            value = super().bound_data(data, initial)
        except RecursionError:
            return InvalidJSONInput(data)
        if nests_deeper_than(value, settings.ARGS_MAX_DEPTH) or holds_unstorable_text(value):
            return InvalidJSONInput(data)
        return value


class KeywordArgumentsField(ArgumentsField):
    """The ``kwargs`` form field."""

    limit_label = ARGUMENT_LABELS["kwargs"]


class MessageHeadersField(ArgumentsField):
    """The ``headers`` form field: the same limits (the model adds its own checks of headers)."""

    limit_label = HEADERS_LABEL


class BackfillForm(forms.Form):
    start = forms.DateTimeField(help_text="UTC, e.g. 2026-03-01 00:00:00")
    end = forms.DateTimeField(help_text="UTC; not in the future")

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        for field in ("start", "end"):
            moment = cleaned.get(field)
            # Slot arithmetic overflows near year 1 (and 9999): the same span as a schedule's own times.
            if moment is not None and not EARLIEST <= moment < LATEST:
                self.add_error(field, "Must be from 1970-01-01 to 8999-12-31.")
        return cleaned


class RunNowForm(forms.Form):
    """One run's arguments, queue and priority: the schedule's own, unless changed here."""

    args = forms.JSONField(required=False, help_text='JSON list, e.g. [1, "two"]')
    kwargs = forms.JSONField(required=False, help_text='JSON object, e.g. {"key": 1}')
    queue = forms.CharField(required=False, help_text="Empty: Celery's default queue")
    priority = forms.IntegerField(required=False, help_text="Empty: no priority")

    def __init__(self, schedule: Schedule, data: Any = None) -> None:
        super().__init__(data, initial={field: getattr(schedule, field) for field in operations.RUN_OVERRIDES})
        self.schedule = schedule

    def overrides(self) -> dict[str, Any]:
        """The fields changed from the schedule's stored values (a blank JSON box means an empty list or object)."""
        blank: dict[str, Any] = {"args": [], "kwargs": {}}
        values = {field: self.cleaned_data[field] for field in operations.RUN_OVERRIDES}
        values = {field: blank.get(field) if value is None else value for field, value in values.items()}
        return {field: value for field, value in values.items() if value != getattr(self.schedule, field)}


class ScheduleForm(KeepsOthersChanges):
    run_at_now = forms.BooleanField(
        required=False,
        label="Run it now",
        help_text="Set the one-off time to now, so it runs at once (a one-off time in the past is refused).",
    )

    #: The editing user's scope; ``ScheduleAdmin.get_form`` sets it for each request.
    scope: Scope = EVERY_TENANT

    class Meta:
        model = Schedule
        fields = "__all__"
        field_classes = {"args": ArgumentsField, "kwargs": KeywordArgumentsField, "headers": MessageHeadersField}
        widgets = {"task": DatalistInput(registered_task_names, attrs={"class": "vTextField", "autocomplete": "off"})}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scope.is_bound:
            # The tenant is read-only for a bound user: its name checks and task policy need it now.
            self.instance.tenant = self.scope.tenant
        if not self.scope.every_tenant and "task" in self.fields:
            self.fields["task"].widget.suggestions = lambda: [
                name for name in registered_task_names() if not task_policy.is_reserved(name)
            ]
        # The form field would say "≥ 0" for a negative number and the model "≥ 1" for 0.
        for name in AT_LEAST_ONE_FIELDS:
            field = cast("forms.IntegerField | None", self.fields.get(name))
            if field is None:  # read-only for a viewer
                continue
            field.min_value = 1
            field.widget.attrs["min"] = 1
            field.validators = [v for v in field.validators if not isinstance(v, MinValueValidator)]
            field.validators.append(MinValueValidator(1))

    def clean(self) -> dict[str, Any]:
        super().clean()  # (drops what this page left as shown: two_editors)
        cleaned = self.cleaned_data
        task = cleaned.get("task") or self.instance.task
        if task and "task" not in self.errors:
            tenant = self.instance.tenant if self.scope.is_bound else cleaned.get("tenant", self.instance.tenant)
            try:
                task_policy.ensure_scope_allows(task, tenant=tenant, scope=self.scope)
            except TaskRefused as exc:
                self.add_error("task" if "task" in self.fields else None, str(exc))
        now = dbclock.now()
        try:
            if cleaned.get("run_at_now"):
                cleaned["run_at"] = now
            elif "run_at" in self.changed_data:
                operations.ensure_run_at_ahead(
                    cleaned.get("run_at"), now=now, hint="Give a future time, or tick “Run it now”."
                )
            if "end_at" in self.changed_data:
                operations.ensure_end_at_ahead(cleaned.get("end_at"), now=now)
        except operations.TimeInPast as exc:
            self.add_error(exc.field, str(exc))
        return cleaned

    def _post_clean(self) -> None:
        super()._post_clean()  # type: ignore[misc]  # ModelForm's hook after clean(); not in the stubs
        # A timing field with its own error (a negative interval) left the
        # instance without that timing; "set exactly one" would only repeat it.
        if any(name in self.errors for name in ("cron", "interval", "run_at")):
            kept: list[Any] = [e for e in self.errors.get(NON_FIELD_ERRORS, []) if e != TIMING_REQUIRED]
            if kept:
                self.errors[NON_FIELD_ERRORS] = self.error_class(kept, error_class="nonfield")
            else:
                self.errors.pop(NON_FIELD_ERRORS, None)

    def clean_task(self) -> str:
        name = self.cleaned_data["task"].strip()
        if not task_policy.is_task_registered(name):
            raise forms.ValidationError(
                "Unknown task %(name)s: no task with that name is registered with the Celery app.",
                params={"name": name},
            )
        return name


@admin.register(Schedule)
class ScheduleAdmin(LocksEditedRow, StorableLookups, TenantScoped, ActionsNeedPermission, admin.ModelAdmin):
    form = ScheduleForm
    paginator = EstimatedCountPaginator
    list_display = ("name", "task", "timing_text", "timezone", "next_run", "last_run", "state", "origin")
    list_filter = (
        StateFilter,
        OverdueFilter,
        LastStatusFilter,
        "enabled",
        "origin",
        input_filter("task"),
        input_filter("queue"),
        input_filter("tenant"),
    )
    # Exact, case-sensitive matches: each an index lookup (a substring or
    # case-insensitive search scans every row).
    search_fields = ("name__exact", "task__exact")
    readonly_fields = ("origin", "next_fire_times", "recent_executions", "backfill_link", *RUNNING_STATE_FIELDS)
    show_full_result_count = False
    list_per_page = 50
    actions = ("run_now", "enable", "disable", "pause", "resume")
    fieldsets = (
        (
            None,
            {"fields": ("name", "task", "args", "kwargs", "queue", "priority", "description", "tenant", "origin")},
        ),
        (
            "Timing",
            {
                "fields": (
                    "cron",
                    "interval",
                    "run_at",
                    "run_at_now",
                    "timezone",
                    "start_at",
                    "end_at",
                    "max_runs",
                    "exclude_calendars",
                    "only_calendar",
                    "next_fire_times",
                )
            },
        ),
        (
            "Policies",
            {"fields": POLICY_FIELDS},
        ),
        ("Message options", {"fields": MESSAGE_OPTION_FIELDS, "classes": ("collapse",)}),
        ("Notifications", {"fields": ("notify",)}),
        ("State", {"fields": ("enabled", "paused_reason", *RUNNING_STATE_FIELDS)}),
        ("Recent executions", {"fields": ("recent_executions", "backfill_link")}),
    )

    def get_form(self, request: HttpRequest, obj: Schedule | None = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change, **kwargs)
        return type(form.__name__, (form,), {"scope": scope_of_user(request.user)})

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        initial = super().get_changeform_initial_data(request)
        # Django hands a link's ?start_at=... to the form as text, on which the date and time widget
        # fails (a 500): read each time as the form would, and leave out one it would refuse.
        for name in ("run_at", "start_at", "end_at"):
            if isinstance(initial.get(name), str):
                try:
                    initial[name] = forms.DateTimeField().clean(initial[name])
                except ValidationError:
                    del initial[name]
        return initial

    def get_readonly_fields(self, request: HttpRequest, obj: Schedule | None = None) -> Any:
        readonly = super().get_readonly_fields(request, obj)
        # Bound to a tenant: its schedules get that tenant, and cannot be given another.
        return (*readonly, "tenant") if scope_of_user(request.user).is_bound else readonly

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A user bound to no tenant has no tenant to add a schedule to.
        return super().has_add_permission(request) and not scope_of_user(request.user).sees_nothing

    def get_fieldsets(self, request: HttpRequest, obj: Schedule | None = None) -> Any:
        if obj is not None:
            return self.fieldsets
        # A schedule not saved yet has no running state, fire times or history to show.
        hidden = {*RUNNING_STATE_FIELDS, "next_fire_times"}
        return [
            (title, {**options, "fields": tuple(f for f in options["fields"] if f not in hidden)})
            for title, options in self.fieldsets
            if title != "Recent executions"
        ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        # Overdue on the database clock, the one successes are stamped with, in the list's own query.
        return cast(ScheduleQuerySet, super().get_queryset(request)).with_overdue_flag()

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
        # The icons are drawn by CSS (scheduler/admin.css): the media-control
        # glyphs are missing from common fonts and render as empty boxes.
        if not schedule.enabled:
            return format_html(
                '<span class="state state-disabled" title="{}"><i aria-hidden="true"></i>disabled</span>',
                schedule.disabled_reason,
            )
        if schedule.is_paused:
            return format_html(
                '<span class="state state-paused" title="{}"><i aria-hidden="true"></i>paused</span>',
                schedule.paused_reason,
            )
        active = mark_safe('<span class="state state-active"><i aria-hidden="true"></i>active</span>')
        if getattr(schedule, "is_overdue", False):
            return format_html(
                '{} <strong class="overdue" style="color:#c62828" title="No success since {}">overdue</strong>',
                active,
                utc(schedule.last_success_at) if schedule.last_success_at else "it started",
            )
        return active

    # --- change page ---------------------------------------------------------------

    @admin.display(description="Next fire times")
    def next_fire_times(self, schedule: Schedule) -> str:
        """The next slots in the schedule's zone (with its DST abbreviation) and in UTC."""
        if schedule.pk is None:
            return "Shown once the schedule is saved."
        try:
            times = schedule.preview_fire_times(PREVIEW_COUNT, after=clock.now())
            zone = ZoneInfo(schedule.timezone)
        except (ScheduleInvalid, ValueError, KeyError) as exc:
            return f"Invalid timing: {exc}"
        if not times:
            return "No upcoming slots."
        fired = "<li>{} <span class='quiet'>({} UTC)</span></li>"
        kept_out = "<li><del>{} <span class='quiet'>({} UTC)</span></del> excluded by calendar {}</li>"
        return format_html(
            "<ol>{}</ol>",
            format_html_join(
                "",
                "{}",
                (
                    (
                        format_html(
                            kept_out if calendar else fired,
                            t.astimezone(zone).strftime("%a %Y-%m-%d %H:%M:%S %Z"),
                            t.strftime("%Y-%m-%d %H:%M:%S"),
                            calendar,
                        ),
                    )
                    for t, calendar in times
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
                utc(execution.scheduled_for),
                execution.trigger,
                status_badge(execution.status),
                execution.attempt,
                f"{execution.duration_seconds:.2f}s" if execution.duration_seconds is not None else "",
                execution.error[:120],
            )
            for execution in recent
        ]
        if not rows:
            return "No executions yet."
        every = reverse("admin:scheduler_execution_changelist") + "?" + urlencode({"schedule__id__exact": schedule.pk})
        return format_html(
            "<table><thead><tr><th>slot</th><th>trigger</th><th>status</th><th>attempt</th><th>duration</th>"
            "<th>error</th></tr></thead><tbody>{}</tbody></table>"
            '<p><a href="{}" id="all-executions">All executions of this schedule →</a></p>',
            format_html_join(
                "", '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>', rows
            ),
            every,
        )

    @admin.display(description="Backfill")
    def backfill_link(self, schedule: Schedule) -> str:
        if schedule.pk is None:
            return "—"
        url = reverse("admin:scheduler_schedule_backfill", args=[schedule.pk])
        return format_html('<a href="{}">Backfill a range of past slots…</a>', url)

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.backfill_view)
        act = self.admin_site.admin_view(self.object_action_view)
        run = self.admin_site.admin_view(self.run_now_view)
        return [
            path("<int:pk>/backfill/", view, name="scheduler_schedule_backfill"),
            path("<int:pk>/run/", run, name="scheduler_schedule_run"),
            path("<int:pk>/act/<slug:action>/", act, name="scheduler_schedule_act"),
            *super().get_urls(),
        ]

    # --- buttons on the change page (templates/admin/scheduler/schedule/change_form.html) ---

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        schedule = self.get_object(request, object_id)
        buttons: list[tuple[str, str]] = []
        if schedule is not None and self.has_change_permission(request, schedule):
            buttons = [
                ("run_now", "Run now"),
                ("resume", "Resume") if schedule.is_paused else ("pause", "Pause"),
                ("disable", "Disable") if schedule.enabled else ("enable", "Enable"),
            ]
        context = {**(extra_context or {}), "buttons": buttons, "pause_reason_max": PAUSED_REASON_MAX_CHARS}
        return super().change_view(request, object_id, form_url, context)

    def object_action_view(self, request: HttpRequest, pk: int, action: str) -> HttpResponse:
        """One button of the schedule page: a POST, permission-checked as the list's actions are."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        schedule = get_object_or_404(self.get_queryset(request), pk=pk)
        if not self.has_change_permission(request, schedule):
            raise PermissionDenied(f"You may not {action.replace('_', ' ')} this schedule.")
        if action not in ("run_now", "pause", "resume", "enable", "disable"):
            raise Http404(f"No action {action!r}.")
        now = dbclock.now()
        if action == "run_now":
            self._run_one_now(request, schedule)
            return redirect("admin:scheduler_schedule_change", schedule.pk)
        refusal = self._refusal(request, schedule) if action in ("resume", "enable") else ""
        if refusal:
            self.message_user(request, refusal, level=messages.WARNING)
            return redirect("admin:scheduler_schedule_change", schedule.pk)
        actor = audit.user_actor(request.user)
        try:
            if action == "pause":
                reason = request.POST.get("reason", "").strip() or f"Paused by {request.user} in the admin"
                operations.pause_schedule(schedule, reason, actor=actor, now=now)
            elif action == "resume":
                operations.resume_schedule(schedule, actor=actor, now=now)
            else:
                operations.set_schedule_enabled(schedule, action == "enable", actor=actor, now=now)
        except ValidationError as exc:  # a pause reason over its length limit; nothing was written
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)
            return redirect("admin:scheduler_schedule_change", schedule.pk)
        if action == "pause":
            self.message_user(request, f"Schedule {schedule.name} paused: {schedule.paused_reason}")
        elif action == "resume":
            self.message_user(request, f"Schedule {schedule.name} resumed; next run {utc(schedule.next_run_at)}.")
        else:
            self.message_user(request, f"Schedule {schedule.name} {action}d.")
        return redirect("admin:scheduler_schedule_change", schedule.pk)

    def run_now_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Run once now with other arguments, queue or priority; a value the schedule could not hold is a form error."""
        schedule = get_object_or_404(self.get_queryset(request), pk=pk)
        if not self.has_change_permission(request, schedule):
            raise PermissionDenied("You may not run this schedule.")
        form = RunNowForm(schedule, request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                if self._run_one_now(request, schedule, overrides=form.overrides()):
                    return redirect("admin:scheduler_schedule_change", schedule.pk)
            except ValidationError as exc:
                for field, problems in exc.message_dict.items():
                    form.add_error(None if field == NON_FIELD_ERRORS else field, problems)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Run {schedule.name} now",
            "schedule": schedule,
            "form": form,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/scheduler/schedule/run_now.html", context)

    def _run_one_now(
        self, request: HttpRequest, schedule: Schedule, *, overrides: dict[str, Any] | None = None
    ) -> bool:
        """Run ``schedule`` now and say so; return whether an execution was recorded."""
        app = celery_app()
        try:
            result = operations.run_now(
                schedule,
                app=app,
                scope=scope_of_user(request.user),
                actor=audit.user_actor(request.user),
                overrides=overrides,
            )
        except operations.ActionRefused as exc:
            self.message_user(request, str(exc), level=messages.WARNING)
            return False
        execution = result.execution
        url = reverse("admin:scheduler_execution_change", args=[execution.pk])
        self.message_user(
            request, format_html('Execution <a href="{}">{}</a> of {} started.', url, execution.pk, schedule.name)
        )
        if result.broker_error:
            self.message_user(
                request,
                f"{schedule.name}: recorded, not sent yet ({result.broker_error}); the beat leader will send it",
                level=messages.WARNING,
            )
        return True

    def backfill_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Range → preview (what would be recorded) → confirm; a bad range is a form error."""
        schedule = get_object_or_404(self.get_queryset(request), pk=pk)
        if not self.has_change_permission(request, schedule):
            raise PermissionDenied("You may not backfill this schedule.")
        form = BackfillForm(request.POST or None)
        preview = None
        if request.method == "POST" and form.is_valid():
            app = celery_app()
            confirm = "confirm" in request.POST
            start, end = form.cleaned_data["start"], form.cleaned_data["end"]
            try:
                task_policy.ensure_scope_allows(
                    schedule.task, tenant=schedule.tenant, scope=scope_of_user(request.user)
                )
                report = operations.backfill_range(
                    schedule, actor=audit.user_actor(request.user), start=start, end=end, dry_run=not confirm, app=app
                )
            except BackfillTooLarge as exc:
                form.add_error("end", str(exc))
            except (BackfillRefused, TaskRefused) as exc:
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

    def formfield_for_manytomany(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "notify":
            # The user's tenant's targets only (every target, for a user of every tenant).
            kwargs["queryset"] = scope_of_user(request.user).filter(NotificationTarget.objects.filter(enabled=True))
        return super().formfield_for_manytomany(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: Schedule, form: forms.ModelForm, change: bool) -> None:
        scope = scope_of_user(request.user)
        if scope.is_bound and not change:
            obj.tenant = scope.tenant
        # Only the fields the operator changed: the leader and the workers write
        # next_run_at and the counters of this row meanwhile.
        # ("Run it now" is no column: it sets the one-off's time.)
        changed = [("run_at" if name == "run_at_now" else name) for name in form.changed_data]
        operations.save_schedule(
            obj, actor=audit.user_actor(request.user), fields=changed if change else None, now=dbclock.now()
        )

    def delete_model(self, request: HttpRequest, obj: Schedule) -> None:
        operations.delete_schedule(obj, actor=audit.user_actor(request.user))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for schedule in queryset:
            self.delete_model(request, schedule)

    # --- actions -------------------------------------------------------------------

    def _refusal(self, request: HttpRequest, schedule: Schedule) -> str:
        """Why the user may not let ``schedule`` fire (its task is not theirs to run); empty if they may."""
        try:
            task_policy.ensure_scope_allows(schedule.task, tenant=schedule.tenant, scope=scope_of_user(request.user))
        except TaskRefused as exc:
            return f"{schedule.name}: {exc}"
        return ""

    def _each(
        self, request: HttpRequest, queryset: QuerySet[Schedule], change: Any, verb: str, *, runs: bool = False
    ) -> None:
        """Apply ``change`` (an action, given the schedule and who acts) to each schedule; ``runs``: the change lets the schedule fire."""
        count = 0
        actor = audit.user_actor(request.user)
        for schedule in queryset:
            refusal = self._refusal(request, schedule) if runs else ""
            if refusal:
                self.message_user(request, refusal, level=messages.WARNING)
                continue
            change(schedule, actor)
            count += 1
        self.message_user(
            request,
            ngettext("%(n)d schedule %(verb)s.", "%(n)d schedules %(verb)s.", count) % {"n": count, "verb": verb},
        )

    @admin.action(description="Run selected schedules now", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        app = celery_app()
        sent, problems = 0, []
        scope, actor = scope_of_user(request.user), audit.user_actor(request.user)
        for schedule in queryset:
            try:
                result = operations.run_now(schedule, app=app, scope=scope, actor=actor)
            except operations.ActionRefused as exc:
                problems.append(str(exc))
                continue
            sent += 1
            if result.broker_error:
                problems.append(
                    f"{schedule.name}: recorded, not sent yet ({result.broker_error}); the beat leader will send it"
                )
        if sent:
            self.message_user(
                request, ngettext("%(n)d execution started.", "%(n)d executions started.", sent) % {"n": sent}
            )
        for problem in problems:
            self.message_user(request, problem, level=messages.WARNING)

    @admin.action(description="Enable selected schedules", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(
            request,
            queryset,
            lambda s, actor: operations.set_schedule_enabled(s, True, actor=actor, now=dbclock.now()),
            "enabled",
            runs=True,
        )

    @admin.action(description="Disable selected schedules", permissions=["change"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(
            request,
            queryset,
            lambda s, actor: operations.set_schedule_enabled(s, False, actor=actor, now=dbclock.now()),
            "disabled",
        )

    @admin.action(description="Pause selected schedules", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        reason = f"Paused by {request.user} in the admin"
        self._each(
            request,
            queryset,
            lambda s, actor: operations.pause_schedule(s, reason, actor=actor, now=dbclock.now()),
            "paused",
        )

    @admin.action(description="Resume selected schedules", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._each(
            request,
            queryset,
            lambda s, actor: operations.resume_schedule(s, actor=actor, now=dbclock.now()),
            "resumed",
            runs=True,
        )


class ReadOnlyAdmin(StorableLookups, admin.ModelAdmin):
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
class ExecutionAdmin(TenantScoped, ActionsNeedPermission, ReadOnlyAdmin):
    paginator = EstimatedCountPaginator
    # Fits 1400 px beside the filters: the attempt goes under the status, long values wrap (admin.css).
    list_display = (
        "id",
        "schedule_or_task",
        "trigger",
        "scheduled_for",
        "status_text",
        "lag",
        "queue_wait",
        "duration",
        "worker",
    )
    list_filter = ("status", "trigger", ("scheduled_for", admin.DateFieldListFilter))
    # Exact matches, each an index lookup; a term with a colon is a key prefix (see get_search_results).
    search_fields = ("idempotency_key__exact", "celery_task_id__exact")
    search_help_text = (
        "An idempotency key or Celery task id; a key prefix such as schedule:4: lists that schedule's slots."
    )
    raw_id_fields = ("schedule", "retry_of")
    list_select_related = ("schedule",)
    list_per_page = 50
    readonly_fields = ("attempt_history", "task_result_link", "traceback_text", "waiting_for_slot")
    exclude = ("traceback", "attempt_errors")
    change_form_template = "admin/scheduler/execution/change_form.html"

    actions = ("retry", "cancel")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Execution], search_term: str
    ) -> tuple[QuerySet[Execution], bool]:
        term = search_term.strip()
        if ":" in term:
            # Keys are ``schedule:<id>:<slot>``, ``retry:<id>:…``, ``celery:<task id>``: a
            # prefix is one range scan of the key's pattern index (PostgreSQL adds it for text keys)
            # (an exact key is a prefix of itself). Task ids have no colon.
            return queryset.filter(idempotency_key__startswith=term), False
        return super().get_search_results(request, queryset, search_term)

    def get_urls(self) -> list[Any]:
        act = self.admin_site.admin_view(self.object_action_view)
        return [path("<int:pk>/act/<slug:action>/", act, name="scheduler_execution_act"), *super().get_urls()]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        execution = self.get_object(request, object_id)
        buttons: list[tuple[str, str]] = []
        if execution is not None and self.has_retry_permission(request):
            if execution.status in operations.RETRYABLE_STATUSES:
                buttons.append(("retry", "Retry"))
            if execution.status in operations.CANCELLABLE_STATUSES:
                buttons.append(("cancel", "Cancel"))
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), "buttons": buttons})

    def object_action_view(self, request: HttpRequest, pk: int, action: str) -> HttpResponse:
        """Retry or Cancel on the execution page: a POST, permission-checked as the list's actions are."""
        app = celery_app()
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        execution = get_object_or_404(self.get_queryset(request), pk=pk)
        if not self.has_retry_permission(request):
            raise PermissionDenied(f"You may not {action} executions.")
        if action not in ("retry", "cancel"):
            raise Http404(f"No action {action!r}.")
        scope = scope_of_user(request.user)
        actor = audit.user_actor(request.user)
        try:
            if action == "retry":
                result = operations.retry_execution(execution, app=app, scope=scope, actor=actor)
            else:
                result = operations.cancel_execution(execution, app=app, actor=actor)
        except operations.ActionRefused as exc:
            self.message_user(request, str(exc), level=messages.WARNING)
            return redirect("admin:scheduler_execution_change", execution.pk)
        if result.broker_error:
            self.message_user(
                request, f"execution {execution.pk}: broker unreachable ({result.broker_error})", level=messages.WARNING
            )
        if action == "cancel":
            self.message_user(request, f"Execution {execution.pk} cancelled.")
            return redirect("admin:scheduler_execution_change", execution.pk)
        retry = result.execution
        self.message_user(request, f"Execution {retry.pk} retries execution {execution.pk}.")
        return redirect("admin:scheduler_execution_change", retry.pk)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        # Executions are machine-written; whoever may change schedules may act on them.
        return request.user.has_perm("scheduler.change_schedule")

    has_cancel_permission = has_retry_permission

    @admin.action(description="Retry selected executions (as new executions)", permissions=["retry"])
    def retry(self, request: HttpRequest, queryset: QuerySet[Execution]) -> None:
        app = celery_app()
        scope = scope_of_user(request.user)
        actor = audit.user_actor(request.user)
        self._apply(
            request, queryset, lambda e: operations.retry_execution(e, app=app, scope=scope, actor=actor), "retry"
        )

    @admin.action(description="Cancel selected executions", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Execution]) -> None:
        app = celery_app()
        actor = audit.user_actor(request.user)
        self._apply(request, queryset, lambda e: operations.cancel_execution(e, app=app, actor=actor), "cancel")

    def _apply(self, request: HttpRequest, queryset: QuerySet[Execution], action: Any, name: str) -> None:
        done = 0
        verb = {"retry": "retried", "cancel": "cancelled"}[name]
        for execution in queryset:
            try:
                result = action(execution)
            except operations.ActionRefused as exc:
                self.message_user(request, str(exc), level=messages.WARNING)
                continue
            done += 1
            if result.broker_error:
                self.message_user(
                    request,
                    f"execution {execution.pk}: broker unreachable ({result.broker_error})",
                    level=messages.WARNING,
                )
        if done:
            self.message_user(
                request,
                ngettext("%(n)d execution %(verb)s.", "%(n)d executions %(verb)s.", done) % {"n": done, "verb": verb},
            )

    @admin.display(description="status", ordering="status")
    def status_text(self, execution: Execution) -> str:
        if execution.attempt > 1:
            return format_html(
                '{}<br><span class="quiet">attempt {}</span>', status_badge(execution.status), execution.attempt
            )
        return status_badge(execution.status)

    @admin.display(description="schedule / task", ordering="schedule")
    def schedule_or_task(self, execution: Execution) -> str:
        if execution.schedule is None:
            return execution.task
        return format_html('{}<br><span class="quiet">{}</span>', execution.schedule.name, execution.task)

    @admin.display(description="lag")
    def lag(self, execution: Execution) -> str:
        """Slot to sent: how late the beat (or a re-send) got it to the broker."""
        return seconds_between(execution.scheduled_for, execution.enqueued_at)

    @admin.display(description="queue wait")
    def queue_wait(self, execution: Execution) -> str:
        """Sent to claimed: how long it waited for a worker."""
        return seconds_between(execution.enqueued_at, execution.started_at)

    @admin.display(description="duration")
    def duration(self, execution: Execution) -> str:
        seconds = execution.duration_seconds
        return "—" if seconds is None else f"{seconds:.2f}s"

    @admin.display(description="waiting for a concurrency limit's place")
    def waiting_for_slot(self, execution: Execution) -> str:
        place = executions.place_in_line(execution)
        if place is None or execution.concurrency_key is None:
            return "-"
        limit = ConcurrencyLimit.objects.filter(pk=work_rules.limit_id(execution.concurrency_key)).first()
        key = execution.concurrency_key.split(":", 1)[1] or "(all)"
        return f"number {place} in line for key {key} of limit {limit.name if limit else '(deleted)'}"

    @admin.display(description="errors of every attempt")
    def attempt_history(self, execution: Execution) -> str:
        attempts = execution.attempt_history()
        if not attempts:
            return "—"
        return format_html(
            "<ol class='attempt-errors'>{}</ol>",
            format_html_join(
                "",
                "<li value='{}'>{} <span class='quiet'>{}</span></li>",
                ((a["attempt"], a["error"], a.get("at") or "") for a in attempts),
            ),
        )

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
    """The lease with seconds left (with shards: every shard's), instances with heartbeat ages, and queue warnings.

    The leader is the lease's holder, never an instance's own flag; with
    shards, a beat leads while it holds any shard. An instance silent past
    ``cluster.stale_after`` is shown stale. A missing or stuck leader (a
    shard without an owner) is warned about on every admin page
    (``base_site.html``). Warned about here: a queue whose oldest queued
    execution has waited longer than ``QUEUED_WARNING_SECONDS``.
    """
    view = cluster.shard_view() if shards.is_sharded() else None
    if view is not None:
        now, leaders = view.db_now, view.holders
    else:
        state = leases.current(settings.LEASE_NAME)
        now, leaders = state.db_now, {state.holder} if state.is_held else set()
    members = cluster.members(leaders=leaders, now=now)
    if view is not None:
        lease_context: dict[str, Any] = {"shards": _shard_context(view, members)}
    else:
        renewed_age = (now - state.renewed_at).total_seconds() if state.renewed_at else None
        lease_context = {"lease": state, "renewed_age": renewed_age}
    # Workers do not record which queues they consume, so this cannot name a
    # queue with no consumer; a queue nobody claims from shows up by its age.
    stuck = [
        {"queue": queue or "(default routing)", "age": age}
        for queue, age in sorted(metrics.oldest_queued(now=now).items())
        if age > settings.QUEUED_WARNING_SECONDS
    ]
    return {
        **lease_context,
        "members": members,
        "stuck_queues": stuck,
        "queued_warning_seconds": settings.QUEUED_WARNING_SECONDS,
        "db_now": now,
    }


def _shard_context(view: cluster.ShardView, members: list[cluster.Member]) -> dict[str, Any]:
    """Every shard's lease, the shards per replica, the shards not held, and held leases of no current shard."""
    beats = cluster.fresh_beats(members)
    return {
        "count": view.count,
        "leases": [
            {
                "shard": shard,
                "state": state,
                "renewed_age": (view.db_now - state.renewed_at).total_seconds()
                if state.is_held and state.renewed_at
                else None,
            }
            for shard, state in enumerate(view.leases)
        ],
        "replicas": view.by_replica(live=beats),
        "not_held": [state.name for state in view.not_held],
        "stray": [state for state in view.others if state.is_held],
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
        # With shards a beat leads while it holds any of them.
        names = shards.lease_names() if shards.is_sharded() else [settings.LEASE_NAME]
        holds_lease = Lease.objects.filter(name__in=names, holder=OuterRef("instance_id"), expires_at__gt=Now())
        return super().get_queryset(request).annotate(holds_lease=Exists(holds_lease))

    @admin.display(boolean=True, description="leader", ordering="holds_lease")
    def leader(self, instance: Instance) -> bool:
        return instance.holds_lease  # type: ignore[attr-defined]  # annotated by get_queryset()


@admin.register(AuditEvent)
class AuditEventAdmin(TenantScoped, ReadOnlyAdmin):
    """The audit trail: who changed what through the API, the admin or the CLI; read-only."""

    list_display = ("created_at", "actor_type", "actor", "action", "object_type", "object_repr", "tenant")
    list_filter = ("actor_type", "action", "object_type")
    search_fields = ("actor__exact", "object_id__exact")
    list_per_page = 50


@admin.register(OperatorProfile)
class OperatorProfileAdmin(StorableLookups, admin.ModelAdmin):
    """Binds a staff user to a tenant: the admin and the API then show that user only that tenant's rows."""

    list_display = ("user", "tenant", "all_tenants")
    list_filter = ("all_tenants",)
    search_fields = ("user__username", "tenant")
    raw_id_fields = ("user",)

    # Binding decides what everyone else sees: only superusers change it,
    # whatever permissions a group grants.
    def has_module_permission(self, request: HttpRequest) -> bool:
        return request.user.is_active and request.user.is_superuser

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_module_permission(request)

    has_add_permission = has_module_permission
    has_change_permission = has_view_permission
    has_delete_permission = has_view_permission

    # No save_model/delete_model audit here: scheduler.ops.access_audit records
    # every profile change, the admin's included, once, in its transaction.
