"""The admin's notification targets and the notifications sent (or not) to them.

Targets are the deployer's to manage: a webhook's URL is fetched by the
beat leader, inside the deployer's network, so a user bound to a tenant
sees its tenant's targets and what was sent to them, and changes nothing.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from scheduler.models import Notification, NotificationTarget
from scheduler.ops import audit, operations
from scheduler.tenancy import scope_of_user
from scheduler.web.admin_lists import StorableLookups
from scheduler.web.two_editors import KeepsOthersChanges, LocksEditedRow


class _DeployerManages(StorableLookups, admin.ModelAdmin):
    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return scope_of_user(request.user).filter(super().get_queryset(request))

    def _deployer(self, request: HttpRequest) -> bool:
        return scope_of_user(request.user).every_tenant

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self._deployer(request) and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._deployer(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._deployer(request) and super().has_delete_permission(request, obj)


class NotificationTargetForm(KeepsOthersChanges):
    """A target's form; its secret is typed in, never shown: left empty, the stored one stays."""

    never_shown = ("secret",)

    class Meta:
        model = NotificationTarget
        fields = "__all__"
        widgets = {"secret": forms.PasswordInput(render_value=False)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "secret" in self.fields and self.instance.pk is not None and self.instance.secret:
            self.fields["secret"].help_text = "Set; leave empty to keep it, or type a new one."


@admin.register(NotificationTarget)
class NotificationTargetAdmin(LocksEditedRow, _DeployerManages):
    form = NotificationTargetForm
    list_display = ("name", "tenant", "kind", "address", "is_default", "enabled")
    list_filter = ("kind", "is_default", "enabled")
    fields = ("name", "tenant", "kind", "address", "secret", "is_default", "enabled")

    def get_fields(self, request: HttpRequest, obj: NotificationTarget | None = None) -> Any:
        writes = self.has_add_permission(request) if obj is None else self.has_change_permission(request, obj)
        if writes:
            return self.fields
        return tuple(name for name in self.fields if name != "secret")  # a read-only field would show it

    def save_model(self, request: HttpRequest, obj: NotificationTarget, form: Any, change: bool) -> None:
        operations.save_target(obj, actor=audit.user_actor(request.user))

    def delete_model(self, request: HttpRequest, obj: NotificationTarget) -> None:
        operations.delete_target(obj, actor=audit.user_actor(request.user))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[NotificationTarget]) -> None:
        for target in queryset:  # each audited, as one deleted on its own page
            self.delete_model(request, target)


@admin.register(Notification)
class NotificationAdmin(_DeployerManages):
    list_display = ("created_at", "event", "target", "tenant", "attempts", "delivered_at", "gave_up_at", "last_error")
    list_filter = ("event", ("delivered_at", admin.EmptyFieldListFilter), ("gave_up_at", admin.EmptyFieldListFilter))
    readonly_fields = (
        "key",
        "event",
        "target",
        "tenant",
        "payload",
        "created_at",
        "next_attempt_at",
        "attempts",
        "last_error",
        "delivered_at",
        "gave_up_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # recorded with their events only

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
