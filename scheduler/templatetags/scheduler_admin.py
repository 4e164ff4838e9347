"""Admin template tags: the warning the scheduler's admin pages show while no beat leads, and the overview.

The app's own admin templates (``admin/scheduler/*.html``) put
``{% leader_warning %}`` above the messages. A host that wants it on every
admin page adds the same to the ``messages`` block of its own
``admin/base_site.html``; it renders once per request, wherever it appears.
"""

from __future__ import annotations

from typing import Any

from django import template

from scheduler.tenancy import scope_of_user
from scheduler.web import health, overview

register = template.Library()


@register.simple_tag(takes_context=True)
def leader_problem(context: dict[str, Any]) -> str:
    """Return why no beat is dispatching, or "" while a leader renews the lease.

    One read of the lease row by its primary key. Only for signed-in staff:
    the login page neither reads it nor tells an anonymous visitor.
    """
    user = getattr(context.get("request"), "user", None)
    if user is None or not (user.is_active and user.is_staff):
        return ""
    check = health.check_leader()
    return "" if check.ok else check.detail


@register.inclusion_tag("scheduler/leader_warning.html", takes_context=True)
def leader_warning(context: dict[str, Any]) -> dict[str, Any]:
    """The no-leader warning (``<ul id="leader-warning">``) and the pauses in force, for signed-in staff, once per request.

    The pauses are those that hold the user's tenant's work (every pause, for
    a user of every tenant): one read of the small pause rule table.
    """
    request = context.get("request")
    if request is None or getattr(request, "_scheduler_leader_warning", False):
        return {"problem": ""}
    request._scheduler_leader_warning = True  # noqa: SLF001 -- our own per-request flag, read back above
    problem = leader_problem(context)
    user = getattr(request, "user", None)
    if user is None or not (user.is_active and user.is_staff):
        return {"problem": problem}
    return {"problem": problem, "pauses": list(overview.pauses_holding(scope_of_user(user)))}


@register.inclusion_tag("scheduler/overview.html", takes_context=True)
def scheduler_overview(context: dict[str, Any]) -> dict[str, Any]:
    """The overview (``scheduler.web.overview``) of what the signed-in user's scope may see.

    Which beats lead, by process id, is shown to users of every tenant only,
    as the cluster page is; a tenant's operator sees whether one leads.
    """
    user = getattr(context.get("request"), "user", None)
    if user is None or not (user.is_active and user.is_staff):
        return {"overview": None}
    scope = scope_of_user(user)
    return {"overview": overview.overview(scope), "show_cluster": scope.every_tenant}
