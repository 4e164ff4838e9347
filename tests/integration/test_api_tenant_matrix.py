"""The tenant-isolation matrix: every endpoint and action x every kind of caller.

Callers: anonymous, a viewer of tenant A, an operator of A, an operator of B,
and an operator bound to no tenant. Every call names tenant A's objects.
Each cell asserts the status; that a response to a caller of one tenant
holds no row of the other; and that a refused call changed no row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution
from scheduler.ops import audit
from tests.integration.api_support import (
    TENANT_A,
    TENANT_B,
    TENANT_TASK,
    make_execution,
    make_schedule,
    tables,
    token_client,
)

pytestmark = pytest.mark.django_db

Status = Execution.Status
CALLERS = ("anonymous", "viewer_a", "operator_a", "operator_b", "operator_all")


@dataclass(frozen=True)
class Endpoint:
    label: str
    method: str
    #: Formatted with the ids of tenant A's objects.
    path: str
    #: ``read`` / ``write`` of one of A's objects, ``list`` / ``create`` of a collection,
    #: ``global`` (no tenant object), ``reconcile`` (every tenant's rows).
    kind: str
    ok: int
    body: dict[str, Any] | None = None


ENDPOINTS = (
    Endpoint("schedules list", "get", "/api/v1/schedules/", "list", 200),
    Endpoint(
        "schedules create",
        "post",
        "/api/v1/schedules/",
        "create",
        201,
        {"name": "created-here", "task": TENANT_TASK, "interval": 30},
    ),
    Endpoint("schedule retrieve", "get", "/api/v1/schedules/{schedule}/", "read", 200),
    Endpoint("schedule update", "patch", "/api/v1/schedules/{schedule}/", "write", 200, {"description": "edited"}),
    Endpoint("schedule delete", "delete", "/api/v1/schedules/{schedule}/", "write", 204),
    Endpoint("schedule pause", "post", "/api/v1/schedules/{schedule}/pause/", "write", 200, {"reason": "x"}),
    Endpoint("schedule resume", "post", "/api/v1/schedules/{paused}/resume/", "write", 200),
    Endpoint("schedule enable", "post", "/api/v1/schedules/{disabled}/enable/", "write", 200),
    Endpoint("schedule disable", "post", "/api/v1/schedules/{schedule}/disable/", "write", 200),
    Endpoint("schedule run-now", "post", "/api/v1/schedules/{schedule}/run-now/", "write", 201),
    Endpoint("schedule next", "get", "/api/v1/schedules/{schedule}/next/?n=3", "read", 200),
    Endpoint("schedule backfill", "post", "/api/v1/schedules/{schedule}/backfill/", "write", 200, "BACKFILL"),
    Endpoint("executions list", "get", "/api/v1/executions/", "list", 200),
    Endpoint("execution retrieve", "get", "/api/v1/executions/{finished}/", "read", 200),
    Endpoint("execution retry", "post", "/api/v1/executions/{finished}/retry/", "write", 201),
    Endpoint("execution cancel", "post", "/api/v1/executions/{waiting}/cancel/", "write", 200),
    Endpoint("audit events list", "get", "/api/v1/audit-events/", "list", 200),
    Endpoint("audit event retrieve", "get", "/api/v1/audit-events/{event}/", "read", 200),
    Endpoint("cluster", "get", "/api/v1/cluster/", "global", 200),
    Endpoint("stats", "get", "/api/v1/stats/", "list", 200),
    Endpoint("stats of a schedule", "get", "/api/v1/stats/?schedule={schedule}", "read", 200),
    Endpoint("reconcile", "post", "/api/v1/reconcile/", "reconcile", 200, {"dry_run": True}),
)


def expected_status(caller: str, endpoint: Endpoint) -> int:
    if caller == "anonymous":
        return 401
    writes = endpoint.kind in ("create", "write", "reconcile")
    if caller == "viewer_a" and writes:
        return 403
    if endpoint.kind == "reconcile" and caller != "operator_all":
        return 403  # a tenant's operator may not repair every tenant's rows
    if caller == "operator_b" and endpoint.kind in ("read", "write"):
        return 404  # A's object does not exist for B
    return endpoint.ok


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


@pytest.fixture
def world() -> dict[str, Any]:
    """Tenant A's and tenant B's schedules, executions and audit events, and a client per caller."""
    ids: dict[str, Any] = {}
    for tenant, suffix in ((TENANT_A, "a"), (TENANT_B, "b")):
        schedule = make_schedule(f"sched-{suffix}", tenant=tenant)
        paused = make_schedule(f"paused-{suffix}", tenant=tenant, paused_reason="held")
        disabled = make_schedule(f"off-{suffix}", tenant=tenant, enabled=False)
        finished = make_execution(schedule, f"k-{suffix}-1", Status.FAILED)
        waiting = make_execution(schedule, f"k-{suffix}-2", Status.QUEUED)
        event = audit.record(audit.CLI, "create", schedule)
        if tenant == TENANT_A:
            ids = {
                "schedule": schedule.pk,
                "paused": paused.pk,
                "disabled": disabled.pk,
                "finished": finished.pk,
                "waiting": waiting.pk,
                "event": event.pk,
            }
    clients = {
        "anonymous": Client(),
        "viewer_a": token_client("viewer-a", role="viewer", tenant=TENANT_A),
        "operator_a": token_client("operator-a", role="operator", tenant=TENANT_A),
        "operator_b": token_client("operator-b", role="operator", tenant=TENANT_B),
        "operator_all": token_client("operator-all", role="operator"),
    }
    return {"ids": ids, "clients": clients}


def _body(endpoint: Endpoint) -> dict[str, Any] | None:
    if endpoint.body == "BACKFILL":
        now = dbclock.now()
        return {"start": (now - timedelta(hours=1)).isoformat(), "end": (now - timedelta(minutes=30)).isoformat()}
    return endpoint.body


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.label)
def test_api_tenant_matrix__status_isolation_and_no_change_when_refused(
    world: dict[str, Any], endpoint: Endpoint, caller: str
) -> None:
    # Given: both tenants' rows, and the caller
    client: Client = world["clients"][caller]
    path = endpoint.path.format(**world["ids"])
    before = tables()

    # When: the caller calls the endpoint on tenant A's objects
    body = _body(endpoint)
    call = getattr(client, endpoint.method)
    response = call(path, data=json.dumps(body) if body else None, content_type="application/json")

    # Then: the expected status ...
    expected = expected_status(caller, endpoint)
    assert response.status_code == expected, (endpoint.label, caller, response.content[:500])
    text = response.content.decode()
    # ... no row of the other tenant in the answer ...
    if caller in ("viewer_a", "operator_a"):
        assert TENANT_B not in text and "sched-b" not in text
    if caller == "operator_b":
        assert TENANT_A not in text and "sched-a" not in text
    # ... and a refused call changed nothing.
    if expected >= 400:
        assert tables() == before


def test_api_tenant_matrix__lists_hold_only_the_callers_tenant(world: dict[str, Any]) -> None:
    # Given: both tenants' rows
    # When: each scoped operator lists schedules, executions and audit events
    for caller, own in (("operator_a", TENANT_A), ("operator_b", TENANT_B)):
        client: Client = world["clients"][caller]
        for path in ("/api/v1/schedules/", "/api/v1/executions/", "/api/v1/audit-events/"):
            rows = client.get(path).json()["results"]
            # Then: rows, all of its own tenant
            assert rows and {row["tenant"] for row in rows} == {own}, (caller, path)
    # And the unscoped operator sees both tenants
    rows = world["clients"]["operator_all"].get("/api/v1/schedules/").json()["results"]
    assert {row["tenant"] for row in rows} == {TENANT_A, TENANT_B}
    # And a tenant filter naming the other tenant finds nothing
    rows = world["clients"]["operator_a"].get(f"/api/v1/schedules/?tenant={TENANT_B}").json()["results"]
    assert rows == []


def test_api_tenant_matrix__created_schedules_get_the_callers_tenant(world: dict[str, Any]) -> None:
    # Given: an operator of tenant A
    client: Client = world["clients"]["operator_a"]
    before = tables()

    # When: it creates a schedule naming tenant B
    response = client.post(
        "/api/v1/schedules/",
        {"name": "sneaky", "task": TENANT_TASK, "interval": 30, "tenant": TENANT_B},
        content_type="application/json",
    )

    # Then: refused with a field error, and nothing was written
    assert response.status_code == 400
    assert "tenant" in response.json()
    assert tables() == before

    # When: it creates one without a tenant; Then: the schedule is A's
    response = client.post(
        "/api/v1/schedules/", {"name": "mine", "task": TENANT_TASK, "interval": 30}, content_type="application/json"
    )
    assert response.status_code == 201
    assert response.json()["tenant"] == TENANT_A
    # And it cannot move one of its schedules to B
    response = client.patch(
        f"/api/v1/schedules/{response.json()['id']}/", {"tenant": TENANT_B}, content_type="application/json"
    )
    assert response.status_code == 400
