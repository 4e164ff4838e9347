"""Helpers of the HTTP API tests: tokens, clients and tenant fixtures' data."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.test import Client

from scheduler import leases
from scheduler.models import ApiToken, AuditEvent, Execution, Schedule

TENANT_A = "tenant-a"
TENANT_B = "tenant-b"


def token_client(name: str, *, role: str, tenant: str = "") -> Client:
    """Return a test client sending a fresh token's ``Authorization: Bearer`` header."""
    _, raw = ApiToken.issue(name, role=role, tenant=tenant)
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


def make_schedule(name: str, *, tenant: str = "", **fields: Any) -> Schedule:
    schedule = Schedule(name=name, task="scheduler.echo", interval=60, tenant=tenant, **fields)
    schedule.full_clean()
    schedule.save(now=leases.db_now())
    return schedule


def make_execution(schedule: Schedule, key: str, status: str) -> Execution:
    now = leases.db_now()
    return Execution.objects.create(
        idempotency_key=key, schedule=schedule, task=schedule.task, tenant=schedule.tenant, status=status,
        scheduled_for=now - timedelta(minutes=5), celery_task_id="",
    )


def tables() -> dict[str, list[dict[str, Any]]]:
    """Return every row of the tables the API changes, to compare before and after a call."""
    return {
        model.__name__: list(model.objects.order_by("pk").values())
        for model in (Schedule, Execution, AuditEvent)
    }
