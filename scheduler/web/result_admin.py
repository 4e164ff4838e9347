"""django-celery-results' admin pages, scoped like executions: a tenant's users see only their tenant's results.

A task result holds the task's arguments, its return value and its
traceback. django-celery-results' own pages list every result to anyone
allowed to view them, so they are replaced: a result is visible to a caller
whose scope holds the execution that ran it; the rest (results of tasks run
outside the execution guard, and groups) only to callers of every tenant.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django_celery_results import admin as results_admin
from django_celery_results.models import GroupResult, TaskResult

from scheduler.models import Execution
from scheduler.tenancy import scope_of_user
from scheduler.web.admin_lists import StorableLookups


def results_in_scope(request: HttpRequest, queryset: QuerySet[TaskResult]) -> QuerySet[TaskResult]:
    """Return the results ``request.user`` may see: all for every tenant, else those of its executions."""
    scope = scope_of_user(request.user)
    if scope.every_tenant:
        return queryset
    task_ids = scope.filter(Execution.objects.exclude(celery_task_id="")).values("celery_task_id")
    return queryset.filter(task_id__in=task_ids)


class ScopedTaskResultAdmin(StorableLookups, results_admin.TaskResultAdmin):
    # The scheduler's additions (stylesheet, no-leader warning) on these pages too.
    change_list_template = "admin/scheduler/change_list.html"
    change_form_template = "admin/scheduler/change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskResult]:
        return results_in_scope(request, super().get_queryset(request))

    def get_list_filter(self, request: HttpRequest) -> Any:
        # The worker and task-name filters list their values from every row, any tenant's.
        return (
            ("status", "date_done")
            if not scope_of_user(request.user).every_tenant
            else super().get_list_filter(request)
        )


class UnscopedOnlyGroupResultAdmin(StorableLookups, results_admin.GroupResultAdmin):
    """Group results name their members' results whatever the tenant: every-tenant callers only."""

    change_list_template = "admin/scheduler/change_list.html"
    change_form_template = "admin/scheduler/change_form.html"

    def has_module_permission(self, request: HttpRequest) -> bool:
        return scope_of_user(request.user).every_tenant and super().has_module_permission(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return scope_of_user(request.user).every_tenant and super().has_view_permission(request, obj)


admin.site.unregister(TaskResult)
admin.site.unregister(GroupResult)
admin.site.register(TaskResult, ScopedTaskResultAdmin)
admin.site.register(GroupResult, UnscopedOnlyGroupResultAdmin)
