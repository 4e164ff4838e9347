"""The admin's pauses: adding one pauses work (``operations.pause_work``), deleting one resumes it.

A staff user bound to a tenant sees the pauses that hold its tenant's work,
adds pauses of its own tenant only, and lifts only those; a pause of every
tenant is lifted by a user of every tenant.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest

from scheduler.celery_app import celery_app
from scheduler.models import PauseRule
from scheduler.ops import audit, operations
from scheduler.tenancy import scope_of_user
from scheduler.web import overview
from scheduler.web.admin_lists import StorableLookups


class PauseForm(forms.ModelForm):
    everything = forms.BooleanField(required=False, help_text="Every queue and task (of the tenant, if one is given).")

    class Meta:
        model = PauseRule
        fields = ("queue", "task", "tenant", "mode", "reason")
        help_texts = {
            "tenant": "Empty: every tenant's work (a user bound to a tenant always pauses its own).",
            "mode": "hold: nothing new is dispatched or claimed; drain: also cancel what waits.",
        }

    #: The user's request; ``PauseRuleAdmin.get_form`` sets it.
    request: HttpRequest

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors:
            return cleaned
        try:
            self.result = operations.pause_work(
                actor=audit.user_actor(self.request.user),
                scope=scope_of_user(self.request.user),
                queue=cleaned.get("queue", ""),
                task=cleaned.get("task", ""),
                tenant=cleaned.get("tenant") or None,
                everything=cleaned.get("everything", False),
                mode=cleaned.get("mode") or PauseRule.Mode.HOLD,
                reason=cleaned.get("reason", ""),
            )
        except operations.ActionRefused as exc:
            raise forms.ValidationError(str(exc)) from None
        except ValidationError as exc:
            raise forms.ValidationError(exc.messages) from None
        self.instance = self.result.rule
        return cleaned

    def _post_clean(self) -> None:
        """Nothing more to check or copy: ``pause_work`` validated and wrote the rule in ``clean()``."""


@admin.register(PauseRule)
class PauseRuleAdmin(StorableLookups, admin.ModelAdmin):
    form = PauseForm
    list_display = ("__str__", "reason", "created_by", "created_at")
    actions = ("resume",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[PauseRule]:
        return overview.pauses_holding(scope_of_user(request.user))

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        # The pause is taken in the form's clean(), where a refusal can still be a form error.
        return type("PauseFormOfRequest", (super().get_form(request, obj, change, **kwargs),), {"request": request})

    def save_model(self, request: HttpRequest, obj: PauseRule, form: Any, change: bool) -> None:
        """Already saved and audited by the form's ``pause_work``."""
        if form.result.cancelled:
            self.message_user(request, f"{form.result.cancelled} waiting execution(s) cancelled.")

    def has_change_permission(self, request: HttpRequest, obj: PauseRule | None = None) -> bool:
        return False  # a pause is lifted and made anew, never edited

    def has_delete_permission(self, request: HttpRequest, obj: PauseRule | None = None) -> bool:
        if obj is not None and obj.every_tenant and not scope_of_user(request.user).every_tenant:
            return False
        return super().has_delete_permission(request, obj)

    def delete_model(self, request: HttpRequest, obj: PauseRule) -> None:
        sent = operations.resume_work(obj, actor=audit.user_actor(request.user), app=celery_app())
        self.message_user(request, f"Resumed: {obj.describe()}; {sent} held execution(s) sent again.")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[PauseRule]) -> None:
        for rule in queryset:
            self.delete_model(request, rule)

    @admin.action(description="Resume (lift the selected pauses)", permissions=["delete"])
    def resume(self, request: HttpRequest, queryset: QuerySet[PauseRule]) -> None:
        scope = scope_of_user(request.user)
        mine = queryset if scope.every_tenant else queryset.filter(every_tenant=False)
        refused = queryset.count() - mine.count()
        self.delete_queryset(request, mine)
        if refused:
            self.message_user(
                request,
                f"{refused} pause(s) of every tenant left: lifting them needs a user of every tenant.",
                level=messages.WARNING,
            )
