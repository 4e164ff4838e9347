"""Helpers of the HTTP API tests: tokens, clients and tenant fixtures' data."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.test import Client

import tests.tasks
from scheduler import dbclock, schedules
from scheduler.models import ApiToken, AuditEvent, Execution, OperatorProfile, Schedule

TENANT_A = "tenant-a"
TENANT_B = "tenant-b"
#: A task a tenant may run (``scheduler.*`` and ``celery.*`` are reserved); importing
#: ``tests.tasks`` registers it in this process.
TENANT_TASK = tests.tasks.record.name


def token_client(name: str, *, role: str, tenant: str = "") -> Client:
    """Return a test client sending a fresh token's ``Authorization: Bearer`` header (no tenant: all tenants)."""
    _, raw = ApiToken.issue(name, role=role, tenant=tenant, all_tenants=not tenant)
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


def bind(user: Any, tenant: str = "") -> Any:
    """Bind a staff user to ``tenant``, or to all tenants when none is given; return the user."""
    OperatorProfile.objects.create(user=user, tenant=tenant, all_tenants=not tenant)
    return user


def make_schedule(name: str, *, tenant: str = "", **fields: Any) -> Schedule:
    schedule = Schedule(
        name=name, task=TENANT_TASK if tenant else "scheduler.echo", interval=60, tenant=tenant, **fields
    )
    schedule.full_clean()
    schedules.save(schedule, now=dbclock.now())
    return schedule


def make_execution(schedule: Schedule, key: str, status: str) -> Execution:
    now = dbclock.now()
    return Execution.objects.create(
        idempotency_key=key,
        schedule=schedule,
        task=schedule.task,
        tenant=schedule.tenant,
        status=status,
        scheduled_for=now - timedelta(minutes=5),
        celery_task_id="",
    )


def tables() -> dict[str, list[dict[str, Any]]]:
    """Return every row of the tables the API changes, to compare before and after a call."""
    return {model.__name__: list(model.objects.order_by("pk").values()) for model in (Schedule, Execution, AuditEvent)}
