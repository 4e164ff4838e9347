"""Bulk actions by filter, from the CLI and the API: batched, counted exactly by a dry run, tenant-scoped, audited."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import redis
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler.models import AuditEvent, Execution, Schedule
from scheduler.ops import bulk
from tests.integration import command_support
from tests.integration.api_support import TENANT_A, TENANT_B, TENANT_TASK, make_schedule, tables, token_client
from tests.integration.command_support import run

pytestmark = pytest.mark.django_db

schedules = partial(run, "schedules")
refused = partial(command_support.refused, "schedules")


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


def _many(count: int, prefix: str, **fields: Any) -> None:
    Schedule.objects.bulk_create(
        [Schedule(name=f"{prefix}{n:05d}", task="scheduler.echo", interval=60, **fields) for n in range(count)],
        batch_size=2000,
    )


def _paused(prefix: str) -> int:
    return Schedule.objects.filter(name__startswith=prefix).exclude(paused_reason="").count()


def test_cli__a_bulk_pause_over_10000_schedules_runs_in_batches_and_its_dry_run_counts_exactly() -> None:
    # Given 10,000 schedules that match, 7 of them paused already, and 50 that do not match
    _many(10_000, "billing-")
    _many(50, "reports-")
    already = list(Schedule.objects.filter(name__startswith="billing-").order_by("pk").values_list("pk", flat=True)[:7])
    Schedule.objects.filter(pk__in=already).update(paused_reason="earlier", next_run_at=None)

    # When a dry run counts them
    before = tables()
    preview = json.loads(schedules("pause", "--filter", "name=billing-*", "--dry-run", "--json"))
    # Then it counts exactly, names the first ones, and writes nothing
    assert (preview["matched"], preview["changed"]) == (10_000, 9_993)
    assert preview["first_names"][:2] == ["billing-00000", "billing-00001"]
    assert tables() == before

    # When the pause runs
    with CaptureQueriesContext(connection) as queries:
        out = schedules("pause", "--filter", "name=billing-*", "--reason", "vendor outage")
    # Then it changed what the dry run said, one UPDATE per batch, and nothing else
    assert out.startswith("Paused 9993 of 10000 matching schedule(s): billing-00000, billing-00001")
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('UPDATE "scheduler_schedule"')]
    assert len(updates) == 10_000 // bulk.BATCH
    assert _paused("billing-") == 10_000 and _paused("reports-") == 0
    assert Schedule.objects.filter(paused_reason="vendor outage").count() == 9_993
    assert not Schedule.objects.filter(name__startswith="billing-", next_run_at__isnull=False).exists()
    # and one audit event says what was done
    (event,) = AuditEvent.objects.filter(action="bulk_pause")
    assert (event.actor_type, event.changes["matched"], event.changes["changed"]) == ("cli", 10_000, 9_993)
    assert event.changes["filter"] == {"name": "billing-*"}


def test_cli__resume_enable_disable_by_filter(redis_url: str) -> None:
    make_schedule("a-paused", interval=60, paused_reason="x", queue="q1")
    make_schedule("a-off", interval=60, enabled=False, queue="q1")
    make_schedule("b-on", interval=60, queue="q2")

    assert schedules("resume", "--filter", "queue=q1").startswith("Resumed 1 of 2 matching schedule(s)")
    assert schedules("enable", "--filter", "queue=q1").startswith("Enabled 1 of 2 matching schedule(s)")
    assert schedules("disable", "--filter", "queue=q2").startswith("Disabled 1 of 1 matching schedule(s)")
    states = {s.name: (s.enabled, s.paused_reason, s.next_run_at is not None) for s in Schedule.objects.all()}
    assert states == {"a-paused": (True, "", True), "a-off": (True, "", True), "b-on": (False, "", False)}


@pytest.mark.django_db(transaction=True)
def test_cli__run_now_by_filter_records_and_sends_one_execution_each(redis_client: redis.Redis) -> None:
    make_schedule("nightly-a", interval=3600, queue="bulk")
    make_schedule("nightly-b", interval=3600, queue="bulk")
    make_schedule("other", interval=3600, queue="bulk")
    out = schedules("run-now", "--filter", "name=nightly-?")
    assert out.startswith("Ran 2 of 2 matching schedule(s)")
    assert sorted(Execution.objects.values_list("schedule__name", "status", "trigger")) == [
        ("nightly-a", "queued", "manual"),
        ("nightly-b", "queued", "manual"),
    ]
    assert redis_client.llen("bulk") == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("pause",), "give the schedule's NAME, or --filter KEY=VALUE for every schedule that matches"),
        (("pause", "one", "--filter", "task=x"), "give one NAME or --filter, not both"),
        (("pause", "--filter", "task"), "--filter 'task': expected KEY=VALUE, for example name=nightly-*"),
        (("pause", "--filter", "colour=red"), "unknown filter colour; filters are "),
        (("pause", "--filter", "overdue=maybe"), "--filter overdue=maybe: expected true or false"),
        (("pause", "--filter", "last_status=great"), "filter last_status must be one of "),
        (("pause", "--filter", "name=*a*a*a*a*a*"), "filter name: a pattern may hold at most 4 *, not 6"),
        (("pause", "--filter", "task=x", "--reason", "r" * 2000), "reason: "),
        (("run-now", "--filter", "task=x", "--queue", "q"), "apply to one schedule's run, not to --filter"),
    ],
)
def test_cli__bad_filters_are_refused_in_one_line_and_change_nothing(arguments: tuple[str, ...], message: str) -> None:
    make_schedule("one", interval=60)
    before = tables()
    assert message in refused(*arguments)
    assert tables() == before


# --- API ------------------------------------------------------------------------------


def _bulk(client: Any, body: dict[str, Any]) -> Any:
    return client.post("/api/v1/schedules/bulk/", body, content_type="application/json")


def test_api__acts_only_on_the_callers_tenant_whatever_the_filter_says(redis_url: str) -> None:
    # Given the same names in two tenants
    for tenant in (TENANT_A, TENANT_B):
        for n in range(3):
            make_schedule(f"sync-{n}", tenant=tenant, task=TENANT_TASK, interval=60)
    operator_a = token_client("ops-a", role="operator", tenant=TENANT_A)

    # When tenant A's operator pauses by name, and then asks for tenant B's by filter
    preview = _bulk(operator_a, {"action": "pause", "filter": {"name": "sync-*"}}).json()
    paused = _bulk(operator_a, {"action": "pause", "filter": {"name": "sync-*"}, "dry_run": False}).json()
    theirs = _bulk(operator_a, {"action": "pause", "filter": {"tenant": TENANT_B}, "dry_run": False}).json()

    # Then only A's schedules matched and changed, and B's did not even count
    assert (preview["dry_run"], preview["matched"], preview["changed"]) == (True, 3, 3)
    assert (paused["matched"], paused["changed"]) == (3, 3)
    assert (theirs["matched"], theirs["changed"]) == (0, 0)
    assert _paused_in(TENANT_A) == 3 and _paused_in(TENANT_B) == 0
    (event,) = AuditEvent.objects.filter(action="bulk_pause", changes__changed=3)
    assert (event.actor_type, event.tenant) == ("token", TENANT_A)


def _paused_in(tenant: str) -> int:
    return Schedule.objects.filter(tenant=tenant).exclude(paused_reason="").count()


def test_api__a_viewer_is_refused_and_bad_bodies_are_400s_that_change_nothing() -> None:
    make_schedule("sync", tenant=TENANT_A, task=TENANT_TASK, interval=60)
    before = tables()
    viewer = token_client("viewer", role="viewer", tenant=TENANT_A)
    assert _bulk(viewer, {"action": "pause", "filter": {"name": "*"}, "dry_run": False}).status_code == 403
    operator = token_client("ops", role="operator", tenant=TENANT_A)
    for body, field in [
        ({"action": "explode", "filter": {"name": "*"}}, "action"),
        ({"action": "pause", "filter": {}}, "filter"),
        ({"action": "pause", "filter": {"last_status": "great"}}, "filter"),
        ({"action": "pause", "filter": {"name": "*"}, "reason": "r" * 2000}, "reason"),
        ({"action": "pause"}, "filter"),
    ]:
        response = _bulk(operator, body)
        assert response.status_code == 400, (body, response.content)
        assert field in response.json(), (body, response.json())
    assert tables() == before
