"""Migration 0015: who saw every tenant before keeps it, explicitly, and the migration says how many it marked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.schema_migrations import migrate_to, migrate_to_newest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("scheduler", "0014_shards")]
AFTER = [("scheduler", "0015_tenant_binding")]


@pytest.fixture
def before_binding() -> Iterator[Any]:
    yield migrate_to(BEFORE)
    # Whatever the test did, leave the schema at the newest migration for the next test.
    migrate_to_newest()


def test_migration__marks_unbound_staff_profiles_and_tokens_all_tenants(before_binding: Any, capsys: Any) -> None:
    # Given: before 0015, a staff user without a profile, one with an empty tenant, one bound, a
    # superuser, a non-staff user; an unscoped token and a tenant's token
    apps = before_binding
    User = apps.get_model("auth", "User")
    Profile = apps.get_model("scheduler", "OperatorProfile")
    Token = apps.get_model("scheduler", "ApiToken")
    no_profile = User.objects.create(username="no-profile", is_staff=True)
    empty = User.objects.create(username="empty", is_staff=True)
    Profile.objects.create(user=empty, tenant="")
    bound = User.objects.create(username="bound", is_staff=True)
    Profile.objects.create(user=bound, tenant="acme")
    User.objects.create(username="root", is_staff=True, is_superuser=True)
    User.objects.create(username="customer", is_staff=False)
    Token.objects.create(name="unscoped", token_hash="a" * 64, role="viewer", tenant="")
    Token.objects.create(name="acme", token_hash="b" * 64, role="viewer", tenant="acme")

    # When
    apps = migrate_to(AFTER)

    # Then: the two who saw every tenant keep it, explicitly; the bound one stays bound
    Profile = apps.get_model("scheduler", "OperatorProfile")
    Token = apps.get_model("scheduler", "ApiToken")
    marked = dict(Profile.objects.values_list("user__username", "all_tenants"))
    assert marked == {"no-profile": True, "empty": True, "bound": False}
    assert dict(Token.objects.values_list("name", "all_tenants")) == {"unscoped": True, "acme": False}
    assert 'marked 2 staff user(s) and 1 API token(s) "all tenants"' in capsys.readouterr().out
    assert no_profile.pk in Profile.objects.values_list("user_id", flat=True)
