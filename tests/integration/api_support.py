"""Helpers of the HTTP API tests: tokens, clients and tenant fixtures' data."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.test import Client

import tests.support.tasks
from scheduler import dbclock
from scheduler.models import (
    ApiToken,
    AuditEvent,
    Calendar,
    Execution,
    NotificationTarget,
    OperatorProfile,
    PauseRule,
    Schedule,
)
from tests.support import factories

TENANT_A = "tenant-a"
TENANT_B = "tenant-b"
#: A task a tenant may run (``scheduler.*`` and ``celery.*`` are reserved); importing
#: ``tests.support.tasks`` registers it in this process.
TENANT_TASK = tests.support.tasks.record.name


def token_client(name: str, *, role: str, tenant: str = "") -> Client:
    """Return a test client sending a fresh token's ``Authorization: Bearer`` header (no tenant: all tenants)."""
    _, raw = ApiToken.issue(name, role=role, tenant=tenant, all_tenants=not tenant)
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


def bind(user: Any, tenant: str = "") -> Any:
    """Bind a staff user to ``tenant``, or to all tenants when none is given; return the user."""
    OperatorProfile.objects.create(user=user, tenant=tenant, all_tenants=not tenant)
    return user


def operator_session(tenant: str = "") -> Client:
    """A test client logged in as a staff user of the operator group, bound to ``tenant`` (none: every tenant)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from scheduler.web.permissions import OPERATOR_GROUP

    user = bind(get_user_model().objects.create_user(f"op-{tenant or 'all'}", password="pw", is_staff=True), tenant)
    user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    client = Client()
    client.force_login(user)
    return client


def make_schedule(name: str, *, tenant: str = "", **fields: Any) -> Schedule:
    """A schedule of ``tenant``'s (running a task a tenant may run), or of the deployer's when none is given."""
    fields.setdefault("task", TENANT_TASK if tenant else "scheduler.echo")
    return factories.make_schedule(name, tenant=tenant, **fields)


def make_execution(schedule: Schedule, key: str, status: str) -> Execution:
    """An execution of ``schedule``, in its tenant, due five minutes ago."""
    return factories.make_execution(
        key,
        schedule=schedule,
        tenant=schedule.tenant,
        status=status,
        scheduled_for=dbclock.now() - timedelta(minutes=5),
        celery_task_id="",
    )


def tables() -> dict[str, list[dict[str, Any]]]:
    """Return every row of the tables the API changes, to compare before and after a call."""
    models = (Schedule, Execution, AuditEvent, PauseRule, NotificationTarget, Calendar)
    return {model.__name__: list(model.objects.order_by("pk").values()) for model in models}
