"""Concurrency limits at the claim: a key's places, its line (oldest first), the offer when a place frees, reconcile's pass.

The claims run in this process against the real database; the workers'
side (real processes, 3 workers) is ``tests/acceptance/test_concurrency_limits.py``.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.models import AuditEvent, ConcurrencyLimit, Execution
from scheduler.ops import reconcile
from scheduler.owners import executions, work_rules
from tests.integration.api_support import TENANT_A, TENANT_B, operator_session, token_client
from tests.support.factories import make_execution

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
TASK = "tests.record"


@pytest.fixture(autouse=True)
def _fresh_limits() -> None:
    work_rules.forget()


def per_customer(limit: int = 2, **fields: Any) -> work_rules.Limit:
    row = ConcurrencyLimit(
        name="per customer", every_tenant=True, task="tests.*", key="customer", limit=limit, **fields
    )
    work_rules.save_limit(row)
    return work_rules.Limit.of(row)


def queued(customer: object, *, label: str = "") -> Execution:
    return Execution.objects.create(
        idempotency_key=f"limited-{uuid.uuid4()}",
        task=TASK,
        kwargs={"customer": customer, "label": label},
        scheduled_for=dbclock.now(),
        celery_task_id=str(uuid.uuid4()),
        status=Status.QUEUED,
        enqueued_at=dbclock.now(),
    )


def claim(execution: Execution, limit: work_rules.Limit) -> Execution | None:
    return executions.claim(
        worker="w@host:1",
        task=execution.task,
        celery_task_id=execution.celery_task_id,
        execution_id=execution.pk,
        place=limit.place(execution.args, execution.kwargs),
    )


def test_claim__takes_a_slot_while_the_key_has_one_and_leaves_the_rest_waiting_in_line() -> None:
    # Given a limit of 2 per customer and three executions of customer 7
    limit = per_customer(2)
    first, second, third = queued(7), queued(7), queued(7)

    # When each is claimed in turn
    claimed = [claim(first, limit), claim(second, limit), claim(third, limit)]

    # Then two run, and the third waits first in line, its message no longer out
    assert [row is not None for row in claimed] == [True, True, False]
    assert executions.wait_for_place(execution_id=third.pk) == (f"{limit.pk}:7", 1)
    third.refresh_from_db()
    assert (third.status, third.concurrency_key, third.enqueued_at) == (Status.QUEUED, f"{limit.pk}:7", None)
    assert executions.place_in_line(third) == 1


def test_claim__another_key_has_slots_of_its_own() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    assert claim(queued(8), limit) is not None
    assert claim(queued(7), limit) is None


def test_claim__a_newer_execution_does_not_pass_one_waiting_ahead_of_it() -> None:
    # Given customer 7's two places taken and one execution waiting
    limit = per_customer(2)
    running = [queued(7), queued(7)]
    for execution in running:
        assert claim(execution, limit) is not None
    older = queued(7)
    assert claim(older, limit) is None
    executions.wait_for_place(execution_id=older.pk)

    # When one place frees and a newer execution's message comes before the offer reaches the older one
    executions.finish(executions.Claim.of(Execution.objects.get(pk=running[0].pk)), status=Status.SUCCEEDED)
    newer = queued(7)

    # Then the newer one waits behind it, and the older one takes the place
    assert claim(newer, limit) is None
    assert claim(older, limit) is not None


def test_offer_waiting__sends_as_many_as_slots_are_free_oldest_first_and_not_twice_within_the_grace() -> None:
    # Given customer 7's two places taken and three executions waiting
    limit = per_customer(2)
    holders = [claim(queued(7), limit) for _ in range(2)]
    waiting = [queued(7) for _ in range(3)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_place(execution_id=execution.pk)

    # When both places free and the places are offered twice
    for holder in holders:
        assert holder is not None
        executions.finish(executions.Claim.of(holder), status=Status.SUCCEEDED)
    now = dbclock.now()
    first = executions.offer_waiting(f"{limit.pk}:7", limit.limit, now=now)
    again = executions.offer_waiting(f"{limit.pk}:7", limit.limit, now=now)

    # Then the two oldest are offered once, the third keeps waiting
    assert [row["id"] for row in first] == [waiting[0].pk, waiting[1].pk]
    assert again == []


def test_offer_waiting__a_deleted_limit_lets_every_waiting_execution_go() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    waiting = [queued(7) for _ in range(2)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_place(execution_id=execution.pk)

    work_rules.delete_limit(ConcurrencyLimit.objects.get(pk=limit.pk))
    offered = outbox.offer_places(app, executions.waiting_keys(), max_age=0)

    assert sorted(offered) == [execution.pk for execution in waiting]
    assert not Execution.objects.filter(pk__in=offered).filter(concurrency_key__isnull=False).exists()


def test_reconcile__frees_the_slot_of_a_dead_worker_and_offers_it_to_the_oldest_waiting(redis_url: str) -> None:
    # Given customer 7's only place held by a worker that stopped renewing its claim, and two waiting
    limit = per_customer(1)
    holder = queued(7)
    assert claim(holder, limit) is not None
    waiting = [queued(7) for _ in range(2)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_place(execution_id=execution.pk)
    Execution.objects.filter(pk=holder.pk).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))

    # When reconcile passes
    report = reconcile.reconcile(now=dbclock.now(), app=app)

    # Then the dead worker's execution is lost (to be retried) and the oldest waiting one is sent
    kinds = {(change.kind, change.execution_id) for change in report.changes}
    assert ("lost_retrying", holder.pk) in kinds
    assert ("offered", waiting[0].pk) in kinds
    assert ("offered", waiting[1].pk) not in kinds
    assert not {("republished", execution.pk) for execution in waiting} & kinds


def test_key_problem__only_argument_names_and_positions() -> None:
    assert work_rules.key_problem("customer_id") == ""
    assert work_rules.key_problem("{customer_id}-{0}") == ""
    for bad in ("{0.__class__}", "{customer[0]}", "{customer!r}", "{customer:>10}", "no fields here!", "{"):
        assert work_rules.key_problem(bad), bad


def test_key_value__missing_arguments_share_the_empty_key_and_long_values_are_digested() -> None:
    assert work_rules.key_value("customer", (), {"customer": 7}) == "7"
    assert work_rules.key_value("{0}-{region}", ("acme",), {"region": "eu"}) == "acme-eu"
    assert work_rules.key_value("customer", (), {}) == ""
    assert work_rules.key_value("customer", (), {"customer": "x" * 500}).startswith("sha256-")


# --- admin and metrics ----------------------------------------------------------------


def _form(**fields: Any) -> dict[str, Any]:
    return {
        "name": "reports",
        "tenant": "",
        "task": "reports.*",
        "queue": "",
        "key": "customer_id",
        "limit": 3,
        **fields,
    }


def test_admin__an_operator_adds_a_limit_audited_and_bad_input_is_a_form_error_that_changes_nothing() -> None:
    admin = operator_session()
    # Bad input: each a form error naming the field, and no row
    for bad, message in (
        ({"key": "{0.__class__}"}, "may only name arguments"),
        ({"limit": 0}, "A limit lets at least 1 run at once."),
        ({"task": "a*b*c*d*e*f"}, "at most 4 *"),
        ({"name": ""}, "This field is required"),
    ):
        page = admin.post("/admin/scheduler/concurrencylimit/add/", _form(**bad))
        assert page.status_code == 200 and message in page.content.decode(), bad
    assert not ConcurrencyLimit.objects.exists()
    assert not AuditEvent.objects.filter(object_type="scheduler.concurrencylimit").exists()

    # A good one is kept, of every tenant, audited
    added = admin.post("/admin/scheduler/concurrencylimit/add/", _form(), follow=True)
    assert added.status_code == 200
    limit = ConcurrencyLimit.objects.get()
    assert (limit.every_tenant, limit.key, limit.limit, limit.created_by) == (True, "customer_id", 3, "op-all")
    assert AuditEvent.objects.filter(object_type="scheduler.concurrencylimit", action="create").count() == 1
    # and a second of the same name is refused
    page = admin.post("/admin/scheduler/concurrencylimit/add/", _form())
    assert "A concurrency limit of that name exists already." in page.content.decode()


def test_admin__a_tenants_operator_limits_its_own_work_and_cannot_touch_another_tenants_or_every_tenants_limit() -> (
    None
):
    everyone = ConcurrencyLimit(name="global", every_tenant=True, limit=10)
    theirs = ConcurrencyLimit(name="theirs", tenant=TENANT_B, limit=1)
    for row in (everyone, theirs):
        work_rules.save_limit(row)
    admin = operator_session(TENANT_A)

    # It adds a limit: of its own tenant, whatever tenant it names
    admin.post("/admin/scheduler/concurrencylimit/add/", _form(tenant=TENANT_B), follow=True)
    mine = ConcurrencyLimit.objects.get(name="reports")
    assert (mine.tenant, mine.every_tenant) == (TENANT_A, False)
    # it sees its own and every tenant's, not another tenant's
    listing = admin.get("/admin/scheduler/concurrencylimit/").content.decode()
    assert "reports" in listing and "global" in listing and "theirs" not in listing
    assert admin.get(f"/admin/scheduler/concurrencylimit/{theirs.pk}/change/").status_code in (302, 404)
    # and it can change neither every tenant's limit nor delete it
    admin.post(f"/admin/scheduler/concurrencylimit/{everyone.pk}/change/", _form(name="global", limit=1))
    admin.post(f"/admin/scheduler/concurrencylimit/{everyone.pk}/delete/", {"post": "yes"})
    admin.post(f"/admin/scheduler/concurrencylimit/{theirs.pk}/delete/", {"post": "yes"})
    assert ConcurrencyLimit.objects.get(pk=everyone.pk).limit == 10
    assert ConcurrencyLimit.objects.filter(pk=theirs.pk).exists()


def test_admin__a_tenants_operator_sees_the_keys_its_own_work_runs_under_not_another_tenants() -> None:
    # Given a limit of every tenant, per customer, under which both tenants' work runs and waits
    limit = per_customer(1)
    for tenant, customer in ((TENANT_A, "a-customer"), (TENANT_B, "b-customer"), (TENANT_B, "a-customer")):
        for status in (Status.RUNNING, Status.QUEUED):
            make_execution(
                f"{tenant}-{customer}-{status}",
                task=TASK,
                tenant=tenant,
                status=status,
                concurrency_key=f"{limit.pk}:{customer}",
            )
    admin = operator_session(TENANT_A)

    # When tenant A's operator looks at the limits and at this one
    listing = admin.get("/admin/scheduler/concurrencylimit/").content.decode()
    page = admin.get(f"/admin/scheduler/concurrencylimit/{limit.pk}/change/").content.decode()

    # Then it sees the key its own work runs under, with everyone's counts there (the limit is shared),
    # and nothing of the key only tenant B's work uses
    assert "<td>a-customer</td><td>2 / 1</td><td>2</td>" in page
    assert "b-customer" not in page and "b-customer" not in listing
    assert "2 / 1 (a-customer), 2 waiting" in listing


def test_admin_and_metrics__show_running_over_limit_per_key_and_each_waiting_executions_place() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    waiting = [queued(7), queued(7)]
    for execution in waiting:
        assert claim(execution, limit) is None
        executions.wait_for_place(execution_id=execution.pk)
    admin = operator_session()

    page = admin.get(f"/admin/scheduler/concurrencylimit/{limit.pk}/change/").content.decode()
    assert "<td>7</td><td>1 / 1</td><td>2</td>" in page
    second = admin.get(f"/admin/scheduler/execution/{waiting[1].pk}/change/").content.decode()
    assert "number 2 in line for key 7 of limit per customer" in second

    text = Client().get("/metrics").content.decode()
    assert 'scheduler_concurrency_limit{limit="per customer",tenant=""} 1.0' in text
    assert 'scheduler_concurrency_running{limit="per customer",tenant=""} 1.0' in text
    assert 'scheduler_concurrency_waiting{limit="per customer",tenant=""} 2.0' in text


def test_api__shows_a_waiting_executions_place_in_line() -> None:
    limit = per_customer(1)
    assert claim(queued(7), limit) is not None
    waiting = queued(7)
    assert claim(waiting, limit) is None
    executions.wait_for_place(execution_id=waiting.pk)
    body = token_client("ops", role="operator").get(f"/api/v1/executions/{waiting.pk}/").json()
    assert (body["concurrency_key"], body["place_in_line"]) == (f"{limit.pk}:7", 1)
