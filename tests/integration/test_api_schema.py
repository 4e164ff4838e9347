"""Schemathesis against ``/api/schema/``: no 500 and responses that conform to the schema, for every operation."""
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

from scheduler import audit
from scheduler.models import ApiToken, Execution
from tests.integration.api_support import make_execution, make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

#: Examples per operation: enough to reach each parameter's edge cases, bounded for the suite's time.
EXAMPLES = 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def api(redis_client: object) -> Any:
    """Return (schema, headers, ids): the live schema through WSGI, an operator's token, rows to aim at.

    Run-now and retry really send (to the suite's Redis, emptied afterwards).
    """
    cache.clear()
    schedule = make_schedule("probe")
    execution = make_execution(schedule, "probe-1", Execution.Status.FAILED)
    event = audit.record(audit.CLI, "create", schedule)
    _, raw = ApiToken.issue("schemathesis", role="operator")
    app = get_wsgi_application()
    schema = schemathesis.openapi.from_wsgi("/api/schema/", app)
    ids = {"schedules": schedule.pk, "executions": execution.pk, "audit-events": event.pk}
    return schema, {"Authorization": f"Bearer {raw}"}, ids


def strategies(operation: Any, ids: dict[str, int]) -> list[Any]:
    """Return generated cases for ``operation``: any ids, and the id of a row that exists.

    Random ids mostly find nothing (404); aimed at an existing row, the
    actions run for real and their success answers are checked too.
    """
    generated = [operation.as_strategy()]
    if "{id}" in operation.path:
        collection = operation.path.split("/")[3]
        generated.append(operation.as_strategy(path_parameters={"id": ids[collection]}))
    if operation.label == "POST /api/v1/schedules/":
        generated.append(operation.as_strategy(body={"name": "made", "task": "scheduler.echo", "cron": "0 3 * * *"}))
    return generated


@override_settings(SCHEDULER_API_THROTTLE_RATE="100000/minute")
def test_api_schema__every_operation_conforms_and_never_errors(api: Any) -> None:
    # Given: the schema the server serves, and an operator token
    schema, headers, ids = api
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20  # every endpoint and action is in the schema
    # Deleting the aimed-at schedule last, so the other operations find it.
    operations.sort(key=lambda operation: operation.method.upper() == "DELETE")
    failures: list[str] = []

    for operation, strategy in ((op, strategy) for op in operations for strategy in strategies(op, ids)):
        # When: bounded generated requests hit the operation
        @hypothesis.settings(
            max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
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
