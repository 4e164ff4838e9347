"""The audit trail: every write through the API, the admin and the CLI leaves an AuditEvent; the admin scopes by tenant."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.cache import cache
from django.core.management import call_command
from django.test import Client

from scheduler import dbclock, tasks
from scheduler.models import AuditEvent, Execution, OperatorProfile, Schedule
from scheduler.web.permissions import OPERATOR_GROUP
from tests.integration.api_support import TENANT_A, TENANT_B, TENANT_TASK, make_execution, make_schedule, token_client

pytestmark = pytest.mark.django_db

Status = Execution.Status


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


def events(**filters: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(**filters).order_by("id"))


def staff_client(username: str, *, superuser: bool = False, tenant: str = "") -> Client:
    users = get_user_model().objects
    user = (
        users.create_superuser(username, f"{username}@example.invalid", "pw")
        if superuser
        else users.create_user(username, f"{username}@example.invalid", "pw", is_staff=True)
    )
    if not superuser:
        user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    if not superuser:
        OperatorProfile.objects.create(user=user, tenant=tenant, all_tenants=not tenant)
    client = Client()
    client.force_login(user)
    return client


def test_audit__api_writes(redis_client: object) -> None:
    # Given: an operator token of tenant A
    client = token_client("deployer", role="operator", tenant=TENANT_A)

    # When: it creates, edits, pauses, runs and deletes a schedule
    created = client.post(
        "/api/v1/schedules/",
        {"name": "audited", "task": TENANT_TASK, "interval": 60},
        content_type="application/json",
    ).json()
    pk = created["id"]
    client.patch(f"/api/v1/schedules/{pk}/", {"description": "nightly sync"}, content_type="application/json")
    client.post(f"/api/v1/schedules/{pk}/pause/", {"reason": "vendor outage"}, content_type="application/json")
    run = client.post(f"/api/v1/schedules/{pk}/run-now/", content_type="application/json").json()
    client.delete(f"/api/v1/schedules/{pk}/")

    # Then: one event per write, by the token, with before and after
    trail = events(object_type="scheduler.schedule", object_id=str(pk))
    assert [e.action for e in trail] == ["create", "update", "pause", "run_now", "delete"]
    assert {(e.actor_type, e.actor, e.tenant) for e in trail} == {("token", "deployer", TENANT_A)}
    assert trail[0].changes["name"] == [None, "audited"]
    assert trail[1].changes["description"] == ["", "nightly sync"]
    assert trail[2].changes["paused_reason"] == ["", "vendor outage"]
    assert trail[3].changes == {"execution": [None, run["execution"]["id"]]}
    assert trail[4].changes["name"] == ["audited", None]
    # And a refused write records nothing
    count = AuditEvent.objects.count()
    assert client.patch("/api/v1/schedules/999999/", {"queue": "x"}, content_type="application/json").status_code == 404
    assert AuditEvent.objects.count() == count


def test_audit__api_execution_actions_and_read_only_endpoint() -> None:
    # Given: a failed and a queued execution, an operator and a viewer
    schedule = make_schedule("runs")
    failed = make_execution(schedule, "k-1", Status.FAILED)
    queued = make_execution(schedule, "k-2", Status.QUEUED)
    operator = token_client("ops", role="operator")
    viewer = token_client("eyes", role="viewer")

    # When: the operator retries one and cancels the other
    retried = operator.post(f"/api/v1/executions/{failed.pk}/retry/").json()
    assert operator.post(f"/api/v1/executions/{queued.pk}/cancel/").status_code == 200

    # Then: both are in the trail, readable through the API and not writable
    trail = events(object_type="scheduler.execution")
    assert [(e.action, e.object_id) for e in trail] == [("retry", str(failed.pk)), ("cancel", str(queued.pk))]
    assert trail[0].changes == {"retried_by": [None, retried["execution"]["id"]]}
    assert trail[1].changes["status"] == ["queued", "cancelled"]
    listed = viewer.get("/api/v1/audit-events/?action=cancel").json()["results"]
    assert [row["object_id"] for row in listed] == [str(queued.pk)]
    assert operator.delete(f"/api/v1/audit-events/{trail[0].pk}/").status_code == 405
    assert operator.post("/api/v1/audit-events/", {}, content_type="application/json").status_code == 405


def test_audit__admin_writes() -> None:
    # Given: a staff operator in the admin, and a schedule
    admin = staff_client("alice")
    schedule = make_schedule("admin-edited")

    # When: it disables it with the list action, pauses it with the button, and deletes it
    admin.post("/admin/scheduler/schedule/", {"action": "disable", "_selected_action": [schedule.pk]})
    admin.post(f"/admin/scheduler/schedule/{schedule.pk}/act/pause/", {"reason": "maintenance"})
    admin.post(f"/admin/scheduler/schedule/{schedule.pk}/delete/", {"post": "yes"})

    # Then: each is an event by the user, with the changed fields
    trail = events(object_type="scheduler.schedule", object_id=str(schedule.pk))
    assert [(e.actor_type, e.actor, e.action) for e in trail] == [
        ("user", "alice", "disable"),
        ("user", "alice", "pause"),
        ("user", "alice", "delete"),
    ]
    assert trail[0].changes["enabled"] == [True, False]
    assert trail[1].changes["paused_reason"] == ["", "maintenance"]
    assert not Schedule.objects.filter(pk=schedule.pk).exists()
    # And the trail is readable in the admin, never editable
    assert admin.get("/admin/scheduler/auditevent/").status_code == 200
    assert admin.get("/admin/scheduler/auditevent/add/").status_code == 403
    assert admin.post(f"/admin/scheduler/auditevent/{trail[0].pk}/delete/", {"post": "yes"}).status_code == 403


def test_audit__admin_execution_actions() -> None:
    # Given: a failed execution and a staff operator
    admin = staff_client("bob")
    failed = make_execution(make_schedule("for-retry"), "k-1", Status.FAILED)

    # When: it retries the execution with the button
    admin.post(f"/admin/scheduler/execution/{failed.pk}/act/retry/")

    # Then: the retry is in the trail
    (event,) = events(object_type="scheduler.execution")
    assert (event.actor, event.action, event.object_id) == ("bob", "retry", str(failed.pk))


def test_audit__cli_writes() -> None:
    # Given: the command line
    out = io.StringIO()

    # When: it creates, pauses and runs a schedule, and creates and revokes a token
    call_command("schedules", "create", "from-cli", "--task", "scheduler.echo", "--every", "60", stdout=out)
    call_command("schedules", "pause", "from-cli", "--reason", "by hand", stdout=out)
    call_command("schedules", "pause", "from-cli", "--reason", "dry", "--dry-run", stdout=out)
    call_command("api_tokens", "create", "ci", "--role", "viewer", "--all-tenants", stdout=out)
    call_command("api_tokens", "revoke", "ci", stdout=out)

    # Then: each write is an event by "cli"; the dry run left none
    trail = events()
    assert [(e.actor_type, e.actor, e.action, e.object_type) for e in trail] == [
        ("cli", "cli", "create", "scheduler.schedule"),
        ("cli", "cli", "pause", "scheduler.schedule"),
        ("cli", "cli", "create", "scheduler.apitoken"),
        ("cli", "cli", "revoke", "scheduler.apitoken"),
    ]
    assert trail[1].changes["paused_reason"] == ["", "by hand"]
    # The token's hash never reaches the trail.
    assert "token_hash" not in json.dumps([e.changes for e in trail])


def test_audit__pruned_with_the_executions() -> None:
    # Given: an old and a new audit event
    make_schedule("pruned")
    call_command("schedules", "disable", "pruned", stdout=io.StringIO())
    call_command("schedules", "enable", "pruned", stdout=io.StringIO())
    old, new = events()
    AuditEvent.objects.filter(pk=old.pk).update(created_at=dbclock.now() - timedelta(days=31))

    # When: the daily prune runs
    result = tasks.prune_executions(older_than_days=30)

    # Then: the old event is gone, the new one kept, and the prune recorded itself
    assert result["audit_events_deleted"] == 1
    kept, prune = events()
    assert kept.pk == new.pk
    assert (prune.actor_type, prune.action, prune.changes["audit_events_deleted"]) == ("system", "prune", 1)


def test_admin_tenant_scoping__staff_bound_to_a_tenant_sees_only_its_rows() -> None:
    # Given: schedules and executions of two tenants, a staff user bound to A and a superuser
    mine, theirs = make_schedule("a-one", tenant=TENANT_A), make_schedule("b-one", tenant=TENANT_B)
    make_execution(mine, "k-a", Status.FAILED)
    foreign = make_execution(theirs, "k-b", Status.FAILED)
    scoped = staff_client("carol", tenant=TENANT_A)
    root = staff_client("root", superuser=True)

    # When / Then: the bound user lists only A's rows; B's pages and actions are not found
    page = scoped.get("/admin/scheduler/schedule/").content.decode()
    assert "a-one" in page and "b-one" not in page
    executions = scoped.get("/admin/scheduler/execution/").context["cl"].result_list
    assert [e.idempotency_key for e in executions] == ["k-a"]
    assert scoped.get(f"/admin/scheduler/schedule/{theirs.pk}/change/").status_code == 302  # "does not exist"
    assert scoped.post(f"/admin/scheduler/schedule/{theirs.pk}/act/pause/").status_code == 404
    assert scoped.post(f"/admin/scheduler/execution/{foreign.pk}/act/retry/").status_code == 404
    assert not Schedule.objects.get(pk=theirs.pk).paused_reason
    # And the superuser sees both
    page = root.get("/admin/scheduler/schedule/").content.decode()
    assert "a-one" in page and "b-one" in page
