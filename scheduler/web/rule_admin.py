"""The admin's rules kept per tenant: concurrency and rate limits, and calendars.

Each is written through ``operations`` (``save_limit``, ``save_calendar``), audited;
a concurrency limit's page shows its keys' running / limit and what waits.

A staff user bound to a tenant sees its tenant's limits and those of every
tenant, and adds, changes and deletes its own tenant's only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django.forms.models import construct_instance
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join

from scheduler.celery_app import celery_app
from scheduler.models import Calendar, ConcurrencyLimit, RateLimit
from scheduler.ops import audit, operations
from scheduler.owners import executions
from scheduler.tenancy import Scope, scope_of_user
from scheduler.web.admin_lists import StorableLookups
from scheduler.web.two_editors import KeepsOthersChanges, LocksEditedRow

#: Keys shown on a limit's page, busiest first.
KEYS_SHOWN = 50


HELP_TEXTS = {
    "tenant": "Empty: every tenant's work (a user bound to a tenant always limits its own).",
    "task": "Tasks whose name matches, * and ? as in a shell; empty: any task.",
    "queue": "Only work on this queue; empty: any queue.",
    "key": "An argument's name (customer_id) or a template ({customer_id}-{region}, {0}): "
    "the limit holds per value; empty: everything matched shares the limit.",
    "limit": "How many may run at once, per key, across every worker.",
    "starts": "How many may start per period, per key, across every worker, spread evenly.",
    "per_seconds": "The period, in seconds.",
    "rules": 'A JSON list of rules, each one of: {"dates": ["2026-12-24", "2026-12-27/2026-12-31"]}, '
    '{"yearly": ["12-25"]}, {"weekdays": ["sat", "sun"]}, {"holidays": {"country": "US", "subdivision": "NY"}}, '
    '{"holidays": {"market": "NYSE"}}, {"cron": "* * 1 * *"}, {"union": "<calendar>"}, {"except": "<calendar>"}.',
}


class TenantRuleForm(KeepsOthersChanges):
    """A limit's or calendar's form: its admin's ``keep`` checks and writes what the page changed in ``clean()``."""

    #: The user's request and its admin's ``keep``; ``_TenantRuleAdmin.get_form`` sets them.
    request: HttpRequest
    keep: Callable[[HttpRequest, Any], None]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors:
            return cleaned
        construct_instance(self, self.instance, self._meta.fields)
        try:
            self.keep(self.request, self.instance)
        except operations.ActionRefused as exc:
            raise forms.ValidationError(str(exc)) from None
        except ValidationError as exc:
            self.add_error(None, exc)
        return cleaned

    def _post_clean(self) -> None:
        """Nothing more to check or copy: ``keep`` validated and wrote the row in ``clean()``."""


class _TenantRuleAdmin(LocksEditedRow, StorableLookups, admin.ModelAdmin):
    """A tenant's user sees its own rows and every tenant's, and changes its own only."""

    def keep(self, request: HttpRequest, obj: Any) -> None:
        operations.save_limit(
            obj, actor=audit.user_actor(request.user), scope=scope_of_user(request.user), app=celery_app()
        )

    def drop(self, request: HttpRequest, obj: Any) -> None:
        operations.delete_limit(
            obj, actor=audit.user_actor(request.user), scope=scope_of_user(request.user), app=celery_app()
        )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        scope = scope_of_user(request.user)
        rows = super().get_queryset(request)
        if scope.every_tenant:
            return rows
        return rows.filter(Q(every_tenant=True) | Q(tenant=scope.tenant)) if scope.tenant else rows.none()

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if scope_of_user(request.user).is_bound:
            return ("tenant", *self.readonly_fields)  # its own tenant, whatever it types
        return self.readonly_fields

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.every_tenant and not scope_of_user(request.user).every_tenant:
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_change_permission(request, obj) and super().has_delete_permission(request, obj)

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        # The row is written in the form's clean(), where a refusal can still be a form error.
        kwargs["form"] = TenantRuleForm
        kwargs["help_texts"] = HELP_TEXTS
        form = super().get_form(request, obj, change, **kwargs)
        return type("TenantRuleFormOfRequest", (form,), {"request": request, "keep": staticmethod(self.keep)})

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Already saved and audited by the form's ``keep``."""

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        try:
            self.drop(request, obj)
        except operations.ActionRefused as exc:
            self.message_user(request, str(exc), level=messages.ERROR)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for limit in queryset:  # each audited, as one deleted on its own page
            self.delete_model(request, limit)

    @admin.display(description="what it limits")
    def describe(self, obj: Any) -> str:
        return str(obj.describe())


@admin.register(RateLimit)
class RateLimitAdmin(_TenantRuleAdmin):
    list_display = ("name", "describe", "created_by")
    fields = ("name", "tenant", "task", "queue", "key", "starts", "per_seconds")


#: The scope of the user whose page is drawn: a display method gets no request.
_drawn_for: ContextVar[Scope] = ContextVar("drawn_for")


def _usage(limit: ConcurrencyLimit) -> list[tuple[str, int, int]]:
    """The usage of ``limit`` the page's user may see: a tenant's user, only the keys its own work uses."""
    scope = _drawn_for.get(None)
    if scope is None or scope.sees_nothing:
        return []
    return executions.place_usage(f"{limit.pk}:", of_tenant=None if scope.every_tenant else scope.tenant)


@admin.register(ConcurrencyLimit)
class ConcurrencyLimitAdmin(_TenantRuleAdmin):
    """A limit of every tenant is shared: its page shows a tenant's user the keys of its own work only."""

    list_display = ("name", "describe", "usage_summary", "created_by")
    fields = ("name", "tenant", "task", "queue", "key", "limit", "usage")
    readonly_fields = ("usage",)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        return self._drawn(request, super().changelist_view, request, extra_context)

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return self._drawn(request, super().changeform_view, request, *args, **kwargs)

    @staticmethod
    def _drawn(request: HttpRequest, view: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        token = _drawn_for.set(scope_of_user(request.user))
        try:
            response = view(*args, **kwargs)
            if isinstance(response, TemplateResponse):
                response.render()  # the columns are drawn now, while the scope is set
            return response
        finally:
            _drawn_for.reset(token)

    @admin.display(description="running / limit (busiest key), waiting")
    def usage_summary(self, obj: ConcurrencyLimit) -> str:
        usage = _usage(obj)
        if not usage:
            return f"0 / {obj.limit}, 0 waiting"
        key, running, _ = usage[0]
        waiting = sum(entry[2] for entry in usage)
        shown = key.split(":", 1)[1] or "(all)"
        return f"{running} / {obj.limit} ({shown}), {waiting} waiting"

    @admin.display(description="running / limit per key")
    def usage(self, obj: ConcurrencyLimit) -> str:
        if obj.pk is None:
            return "-"
        usage = _usage(obj)[:KEYS_SHOWN]
        if not usage:
            return "Nothing runs or waits under this limit."
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{} / {}</td><td>{}</td></tr>",
            ((key.split(":", 1)[1] or "(all)", running, obj.limit, waiting) for key, running, waiting in usage),
        )
        return format_html("<table><tr><th>key</th><th>running / limit</th><th>waiting</th></tr>{}</table>", rows)


@admin.register(Calendar)
class CalendarAdmin(_TenantRuleAdmin):
    list_display = ("name", "tenant", "rules", "created_by")
    fields = ("name", "tenant", "rules")

    def keep(self, request: HttpRequest, obj: Any) -> None:
        operations.save_calendar(obj, actor=audit.user_actor(request.user), scope=scope_of_user(request.user))

    def drop(self, request: HttpRequest, obj: Any) -> None:
        operations.delete_calendar(obj, actor=audit.user_actor(request.user), scope=scope_of_user(request.user))
