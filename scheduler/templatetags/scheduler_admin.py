"""Admin template tags: the warning every admin page shows while no beat leads."""
from __future__ import annotations

from typing import Any

from django import template

from scheduler import health

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
