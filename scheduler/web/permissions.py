"""The two operator groups, kept in step with the models after every ``migrate``.

- **scheduler: operator**: manages schedules and runs the actions (run now,
  pause, resume, backfill, retry and cancel executions), pauses and resumes
  work by queue, task or tenant, keeps concurrency and rate limits and calendars; sees everything else.
- **scheduler: viewer**: sees schedules, executions, leases, instances,
  pauses, limits, calendars, the audit trail and task results; changes nothing.

Their names carry the app's prefix so they do not meet a host's own groups;
releases before 0.1.0 called them "schedule operator" and "viewer" (migration
0020 renames them).
"""

from __future__ import annotations

from typing import Any

OPERATOR_GROUP = "scheduler: operator"
VIEWER_GROUP = "scheduler: viewer"

#: (app label, model) pairs both groups may view.
_VISIBLE = (
    ("scheduler", "schedule"),
    ("scheduler", "execution"),
    ("scheduler", "lease"),
    ("scheduler", "instance"),
    ("scheduler", "auditevent"),
    ("scheduler", "pauserule"),
    ("scheduler", "concurrencylimit"),
    ("scheduler", "ratelimit"),
    ("scheduler", "calendar"),
    ("scheduler", "notificationtarget"),
    ("scheduler", "notification"),
    ("django_celery_results", "taskresult"),
)


def ensure_groups(**kwargs: Any) -> None:
    """Create or update both groups (a ``post_migrate`` receiver; idempotent).

    ``migrate`` sends ``post_migrate`` once per installed app, so this runs
    several times in a row: one query finds the groups in step and leaves
    them. Restoring the permissions of a group someone changed is audited, by
    "system" (``scheduler.ops.access_audit``); a ``migrate`` that changes nothing
    records nothing. Creating a missing group is not: that is the
    installation (a new database, or each test's flush), not anyone's change.
    """
    from django.contrib.auth.models import Group, Permission

    from scheduler.ops.access_audit import unaudited

    view = [f"view_{model}" for _, model in _VISIBLE]
    # A pause rule is added (pause) and deleted (resume), never edited.
    manage = [
        *("add_schedule", "change_schedule", "delete_schedule", "add_pauserule", "delete_pauserule"),
        *("add_concurrencylimit", "change_concurrencylimit", "delete_concurrencylimit"),
        *("add_ratelimit", "change_ratelimit", "delete_ratelimit"),
        *("add_calendar", "change_calendar", "delete_calendar"),
    ]
    wanted = {VIEWER_GROUP: view, OPERATOR_GROUP: [*view, *manage]}
    held = Group.permissions.through.objects.filter(group__name__in=list(wanted)).values_list(
        "group__name", "permission__codename"
    )
    if set(held) == {(name, codename) for name, codenames in wanted.items() for codename in codenames}:
        return
    permissions = {p.codename: p for p in Permission.objects.filter(codename__in=[*view, *manage])}
    if len(permissions) < len(view) + len(manage):
        return  # permissions not created yet (first migrate of a partial app set)
    for name, codenames in wanted.items():
        group = Group.objects.filter(name=name).first()
        if group is None:
            with unaudited():
                Group.objects.create(name=name).permissions.set([permissions[c] for c in codenames])
        else:
            group.permissions.set([permissions[c] for c in codenames])
