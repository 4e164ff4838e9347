"""Which tasks a caller may schedule or run: the one rule every path that names a task goes through.

A task must be registered with the Celery app and run under the execution
guard (``is_task_registered``, ``is_task_guarded``): an unguarded task's
executions would never be recorded.

Reserved tasks are Celery's built-ins (``celery.*``: ``celery.group`` carries
whole task messages) and the platform's own (``scheduler.*``: the prune
deletes every tenant's history). Only a trusted caller may name them: a
superuser, an operator bound to every tenant, or the deployer (the command
line, settings, the built-in schedules). ``SCHEDULER_TENANT_TASKS`` narrows
what a tenant's rows may run, whoever writes them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from celery import current_app

from scheduler.conf import settings
from scheduler.exceptions import TaskRefused
from scheduler.tenancy import Scope

if TYPE_CHECKING:
    from celery import Celery

#: Task name patterns no tenant may schedule or run.
RESERVED = ("celery.*", "scheduler.*")
#: The key of ``SCHEDULER_TENANT_TASKS`` that applies to tenants not listed.
EVERY_OTHER_TENANT = "*"


def is_reserved(task: str) -> bool:
    return any(fnmatchcase(task, pattern) for pattern in RESERVED)


def allowed_patterns(tenant: str) -> list[str] | None:
    """Return the task patterns ``tenant``'s rows may run; ``None``: any task that is not reserved."""
    if not tenant:
        return None  # the platform's own rows: the deployer's
    rules = settings.TENANT_TASKS or {}
    return rules.get(tenant, rules.get(EVERY_OTHER_TENANT))


def ensure_allowed(task: str, *, tenant: str, trusted: bool) -> None:
    """Raise ``TaskRefused``, naming the rule, unless a row of ``tenant`` may run ``task``.

    ``trusted``: the caller may name reserved tasks (see the module's docstring).
    """
    if is_reserved(task):
        if not trusted:
            raise TaskRefused(
                f"{task!r} is reserved: Celery's built-in tasks (celery.*) and the platform's own (scheduler.*) "
                "may be scheduled or run only by a superuser or an operator bound to all tenants."
            )
        return
    patterns = allowed_patterns(tenant)
    if patterns is not None and not any(fnmatchcase(task, pattern) for pattern in patterns):
        allowed = ", ".join(patterns) or "none"
        raise TaskRefused(
            f"Tenant {tenant!r} may not run {task!r}: SCHEDULER_TENANT_TASKS allows only these tasks: {allowed}."
        )


def ensure_scope_allows(task: str, *, tenant: str, scope: Scope) -> None:
    """``ensure_allowed`` for a caller of ``scope`` acting on a row of ``tenant``."""
    ensure_allowed(task, tenant=tenant, trusted=scope.every_tenant)


def is_task_registered(name: str, *, app: Celery | None = None) -> bool:
    """Return whether a task of that name is registered with the Celery app."""
    app = app or current_app
    if name not in app.tasks:
        # Outside a worker, apps' tasks modules are imported on demand only.
        app.loader.import_default_modules()
    return name in app.tasks


def is_task_guarded(name: str, *, app: Celery) -> bool:
    """Return whether the registered task ``name`` runs under the execution guard (an ``ExecutionTask``, not opted out)."""
    return getattr(app.tasks[name], "guarded", False) is True


def unguarded_message(name: str) -> str:
    return (
        f"Task {name!r} is not guarded (guarded=False, or not an ExecutionTask): its executions would never be "
        "recorded. Give it base=scheduler.worker.ExecutionTask to schedule or submit it."
    )
