"""The rules kept per tenant (pauses, concurrency and rate limits, calendars): whose they are, and how they read."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, transaction

from scheduler.models import Calendar, ConcurrencyLimit, PauseRule, RateLimit
from scheduler.models.tenant_rule import TenantRule, WorkRule

pytestmark = pytest.mark.django_db

OWN_FIELDS: dict[type, dict[str, Any]] = {
    PauseRule: {},
    ConcurrencyLimit: {"name": "n", "limit": 1},
    RateLimit: {"name": "n", "starts": 1, "per_seconds": 1},
    Calendar: {"name": "n"},
}


@pytest.mark.parametrize("model", OWN_FIELDS, ids=lambda model: model.__name__)
@pytest.mark.parametrize(
    ("tenant", "every_tenant", "kept"),
    [("acme", False, True), ("", True, True), ("acme", True, False), ("", False, False)],
    ids=["a tenant's", "every tenant's", "both", "nobody's"],
)
def test_a_rule_is_one_tenants_or_every_tenants__the_database_refuses_both_and_neither(
    model: type, tenant: str, every_tenant: bool, kept: bool
) -> None:
    assert issubclass(model, TenantRule)

    # When a rule is written naming a tenant, every tenant, both or neither
    def write() -> None:
        with transaction.atomic():
            model.objects.create(tenant=tenant, every_tenant=every_tenant, **OWN_FIELDS[model])

    # Then only one tenant's or every tenant's is kept
    if kept:
        write()
        assert model.objects.get().created_at is not None
    else:
        with pytest.raises(IntegrityError):
            write()
        assert not model.objects.exists()


def test_a_work_rule_reads_as_the_work_it_matches_and_whose() -> None:
    assert all(issubclass(model, WorkRule) for model in (PauseRule, ConcurrencyLimit, RateLimit))
    mine = {"tenant": "acme"}
    every = {"every_tenant": True}
    assert PauseRule(**every).describe() == "hold everything"
    assert PauseRule(**mine, mode="drain").describe() == "drain tenant acme"
    assert (
        PauseRule(**every, task="billing.*", queue="slow").describe()
        == "hold tasks billing.* and queue slow of every tenant"
    )
    assert ConcurrencyLimit(**mine, limit=3, queue="slow").describe() == "3 at once of queue slow, tenant acme"
    assert (
        ConcurrencyLimit(**every, limit=2, key="customer_id").describe()
        == "2 at once of all work per customer_id, every tenant"
    )
    assert (
        RateLimit(**mine, starts=10, per_seconds=1, task="api.*").describe()
        == "10 starts per 1 s of tasks api.*, tenant acme"
    )
