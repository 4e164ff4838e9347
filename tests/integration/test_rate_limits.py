"""Rate limits: starts taken one interval apart per key, across processes; the admin keeps them, audited.

The workers' side (real processes) is ``tests/acceptance/test_rate_limits.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.models import AuditEvent, RateLimit, RateLimitKey
from scheduler.owners import work_rules
from tests.integration.api_support import TENANT_A, operator_session

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_rules() -> None:
    work_rules.forget()


def ten_a_second() -> work_rules.Rate:
    row = RateLimit(name="api", every_tenant=True, task="tests.*", key="customer", starts=10, per_seconds=1)
    work_rules.save_limit(row)
    return work_rules.Rate.of(row)


def test_reserve_start__starts_one_interval_apart_and_none_beyond_the_wait_allowed() -> None:
    # Given 2 starts per 10 seconds: one every 5 s
    row = RateLimit(name="slow", every_tenant=True, starts=2, per_seconds=10)
    work_rules.save_limit(row)
    rate = work_rules.Rate.of(row)

    # When four starts of one key are asked for at one instant, each willing to wait up to 7 s
    taken = [work_rules.reserve_start(rate, f"{rate.pk}:7", within=7, now=1000.0) for _ in range(4)]

    # Then the first starts at once, the second 5 s later, and the others are told the next one is 10 s away
    assert [(entry.reserved, entry.seconds) for entry in taken] == [(True, 0), (True, 5), (False, 10), (False, 10)]
    # and a later ask, 3 s on, finds it 7 s away: within its wait, so taken
    assert work_rules.reserve_start(rate, f"{rate.pk}:7", within=7, now=1003.0) == work_rules.Reservation(True, 7)


def test_reserve_start__each_key_has_a_rate_of_its_own() -> None:
    rate = ten_a_second()
    first = work_rules.reserve_start(rate, f"{rate.pk}:7", within=0, now=1000.0)
    other = work_rules.reserve_start(rate, f"{rate.pk}:8", within=0, now=1000.0)
    again = work_rules.reserve_start(rate, f"{rate.pk}:7", within=0, now=1000.0)
    assert (first.reserved, other.reserved, again.reserved) == (True, True, False)


def test_deleting_a_rate_limit_forgets_its_keys() -> None:
    rate = ten_a_second()
    work_rules.reserve_start(rate, f"{rate.pk}:7", within=1)
    work_rules.delete_limit(RateLimit.objects.get(pk=rate.pk))
    assert not RateLimitKey.objects.exists()


def _form(**fields: Any) -> dict[str, Any]:
    return {
        "name": "api",
        "tenant": "",
        "task": "api.*",
        "queue": "",
        "key": "",
        "starts": 10,
        "per_seconds": 1,
        **fields,
    }


def test_admin__an_operator_adds_a_rate_limit_audited_and_bad_input_changes_nothing() -> None:
    admin = operator_session()
    for bad, message in (
        ({"starts": 0}, "A rate lets at least 1 start per period."),
        ({"per_seconds": 0}, "A period is at least 1 second."),
        ({"key": "{0!r}"}, "may only name arguments"),
    ):
        page = admin.post("/admin/scheduler/ratelimit/add/", _form(**bad))
        assert page.status_code == 200 and message in page.content.decode(), bad
    assert not RateLimit.objects.exists()

    admin.post("/admin/scheduler/ratelimit/add/", _form(), follow=True)
    row = RateLimit.objects.get()
    assert (row.every_tenant, row.starts, row.per_seconds, row.created_by) == (True, 10, 1, "op-all")
    assert "10 starts per 1 s of tasks api.*, every tenant" in admin.get("/admin/scheduler/ratelimit/").content.decode()
    assert AuditEvent.objects.filter(object_type="scheduler.ratelimit", action="create").count() == 1


def test_admin__a_tenants_operator_rates_its_own_work_only() -> None:
    everyone = RateLimit(name="global", every_tenant=True, starts=100, per_seconds=1)
    work_rules.save_limit(everyone)
    admin = operator_session(TENANT_A)
    admin.post("/admin/scheduler/ratelimit/add/", _form(tenant="someone-else"), follow=True)
    assert RateLimit.objects.get(name="api").tenant == TENANT_A
    admin.post(f"/admin/scheduler/ratelimit/{everyone.pk}/change/", _form(name="global", starts=1))
    admin.post(f"/admin/scheduler/ratelimit/{everyone.pk}/delete/", {"post": "yes"})
    assert RateLimit.objects.get(pk=everyone.pk).starts == 100
