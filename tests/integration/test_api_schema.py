"""Schemathesis against ``/api/schema/``: no 500 and responses that conform to the schema, for every operation.

Run twice: with an operator token for every tenant, and with one bound to
the tenant ``acme`` while other tenants' rows are present, which must come
out of the run unchanged.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import pytest
import schemathesis
from django.core.cache import cache
from django.core.wsgi import get_wsgi_application
from django.test import override_settings
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from scheduler.models import Calendar, Execution, NotificationTarget, PauseRule
from scheduler.ops import audit
from tests.integration.api_support import make_execution, make_schedule, tables, token_client

pytestmark = pytest.mark.django_db(transaction=True)

#: Examples per operation: enough to reach each parameter's edge cases, bounded for the suite's time.
EXAMPLES = 15
#: Examples aimed at another tenant's row: each must answer 404, so a few show it.
OTHER_TENANT_EXAMPLES = 5
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: The tenant of the bound token, and the tenants whose rows it must not change ("" is no tenant).
TENANT = "acme"
OTHER_TENANTS = ("globex", "")

Targets = dict[str, dict[str, int]]


def rows_to_aim_at(tenant: str) -> dict[str, int]:
    """Create a schedule, a finished execution, an audit event, a pause, a notification target and a calendar of ``tenant``; return their ids."""
    schedule = make_schedule(f"probe-{tenant or 'none'}", tenant=tenant)
    execution = make_execution(schedule, f"probe-{tenant or 'none'}-1", Execution.Status.FAILED)
    event = audit.record(audit.CLI, "create", schedule)
    pause = PauseRule.objects.create(tenant=tenant, every_tenant=not tenant, queue=f"probe-{tenant or 'none'}")
    target = NotificationTarget.objects.create(
        name=f"probe-{tenant or 'none'}", tenant=tenant, kind="slack", address="http://127.0.0.1:9/"
    )
    calendar = Calendar.objects.create(
        name=f"probe-{tenant or 'none'}", tenant=tenant, every_tenant=not tenant, rules=[{"weekdays": ["sun"]}]
    )
    return {
        "calendars": calendar.pk,
        "schedules": schedule.pk,
        "executions": execution.pk,
        "audit-events": event.pk,
        "pauses": pause.pk,
        "notification-targets": target.pk,
    }


@pytest.fixture(params=["every-tenant", TENANT])
def api(request: pytest.FixtureRequest, redis_client: object) -> Any:
    """Return (schema, headers, own ids, other tenants' ids, tenant of the token ("" for every tenant)).

    Run-now and retry really send (to the suite's Redis, emptied afterwards).
    """
    cache.clear()
    tenant = "" if request.param == "every-tenant" else request.param
    own = rows_to_aim_at(tenant)
    others = {other: rows_to_aim_at(other) for other in OTHER_TENANTS if other != tenant} if tenant else {}
    # The shared helper's token: bound to ``tenant``, or to every tenant.
    authorization = token_client("schemathesis", role="operator", tenant=tenant).defaults["HTTP_AUTHORIZATION"]
    schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    return schema, {"Authorization": authorization}, own, others, tenant


def strategies(operation: Any, own: dict[str, int], others: Targets) -> list[tuple[Any, int]]:
    """Return generated cases for ``operation``, each with its number of examples.

    Random ids mostly find nothing (404); aimed at an existing row, the
    actions run for real and their success answers are checked too. Aimed at
    another tenant's row, every operation must answer as if it did not exist.
    """
    generated = [(operation.as_strategy(), EXAMPLES)]
    if "{id}" in operation.path:
        collection = operation.path.split("/")[3]
        generated.append((operation.as_strategy(path_parameters={"id": own[collection]}), EXAMPLES))
        generated += [
            (operation.as_strategy(path_parameters={"id": ids[collection]}), OTHER_TENANT_EXAMPLES)
            for ids in others.values()
        ]
    if operation.label == "POST /api/v1/schedules/":
        body = {"name": "made", "task": "scheduler.echo", "cron": "0 3 * * *"}
        generated.append((operation.as_strategy(body=body), EXAMPLES))
        generated += [
            (operation.as_strategy(body={**body, "tenant": other}), OTHER_TENANT_EXAMPLES) for other in others
        ]
    return generated


def others_rows(tenant: str) -> dict[str, list[dict[str, Any]]]:
    """Return every row of the API's tables that does not belong to ``tenant``."""
    return {table: [row for row in rows if row["tenant"] != tenant] for table, rows in tables().items()}


@override_settings(SCHEDULER_API_THROTTLE_RATE="100000/minute")
def test_api_schema__every_operation_conforms_and_never_errors(api: Any) -> None:
    # Given: the schema the server serves, an operator token (for every tenant,
    # or bound to one while other tenants' rows are present)
    schema, headers, own, others, tenant = api
    before = others_rows(tenant) if tenant else None
    assert before is None or all(before.values())  # there are other tenants' rows to protect
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20  # every endpoint and action is in the schema
    # Deleting the aimed-at schedule last, so the other operations find it.
    operations.sort(key=lambda operation: operation.method.upper() == "DELETE")
    failures: list[str] = []

    for operation, (strategy, examples) in ((op, s) for op in operations for s in strategies(op, own, others)):
        # When: bounded generated requests hit the operation
        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @hypothesis.given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=headers, checks=CHECKS)

        # Then: no 500, and every answer is one the schema describes
        try:
            run()
        except Exception as exc:  # noqa: BLE001 -- collected, so one run reports every failing operation
            failures.append(f"{operation.label}: {str(exc)[:2000]}")
    assert not failures, "\n\n".join(failures)
    # And: a token bound to a tenant changed no other tenant's row
    if tenant:
        assert others_rows(tenant) == before
