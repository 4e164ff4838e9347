"""Migration 0020: the scheduler's groups get namespaced names and keep their members and permissions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.support.schema_migrations import migrate_to, migrate_to_newest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("scheduler", "0019_tally_increments")]
AFTER = [("scheduler", "0020_namespaced_groups")]


@pytest.fixture
def before_rename() -> Iterator[Any]:
    apps = migrate_to(BEFORE)
    # Migrating back renamed this database's groups to the old names; each test makes its own
    apps.get_model("auth", "Group").objects.all().delete()
    yield apps
    migrate_to_newest()


def _group(apps: Any, name: str, codenames: list[str], members: list[str]) -> Any:
    Group, Permission, User = (apps.get_model("auth", m) for m in ("Group", "Permission", "User"))
    group = Group.objects.create(name=name)
    group.permissions.set(Permission.objects.filter(codename__in=codenames))
    for username in members:
        User.objects.create(username=username, is_staff=True).groups.add(group)
    return group


def _state(apps: Any) -> dict[str, tuple[int, list[str], list[str]]]:
    """{group name: (pk, member usernames, permission codenames)}."""
    Group = apps.get_model("auth", "Group")
    return {
        group.name: (
            group.pk,
            sorted(group.user_set.values_list("username", flat=True)),
            sorted(group.permissions.values_list("codename", flat=True)),
        )
        for group in Group.objects.order_by("name")
    }


def test_migration__renames_the_schedulers_groups_keeping_members_and_permissions(before_rename: Any) -> None:
    # Given: the two groups under their old names, each with members
    apps = before_rename
    viewer = _group(apps, "viewer", ["view_schedule", "view_execution"], ["vic", "val"])
    operator = _group(apps, "schedule operator", ["view_schedule", "change_schedule"], ["opal"])
    # And a group of the host's own that the scheduler never made
    _group(apps, "support", ["view_user"], ["sue"])

    # When
    apps = migrate_to(AFTER)

    # Then: the same groups, namespaced, with the same members and permissions
    assert _state(apps) == {
        VIEWER_GROUP: (viewer.pk, ["val", "vic"], ["view_execution", "view_schedule"]),
        OPERATOR_GROUP: (operator.pk, ["opal"], ["change_schedule", "view_schedule"]),
        "support": (_state(apps)["support"][0], ["sue"], ["view_user"]),
    }
    assert (VIEWER_GROUP, OPERATOR_GROUP) == ("scheduler: viewer", "scheduler: operator")

    # And back: the old names again
    apps = migrate_to(BEFORE)
    assert set(_state(apps)) == {"viewer", "schedule operator", "support"}
    assert _state(apps)["viewer"][:2] == (viewer.pk, ["val", "vic"])


def test_migration__leaves_a_hosts_own_viewer_group_alone(before_rename: Any) -> None:
    # Given: a host's "viewer" group that holds none of the scheduler's permissions
    apps = before_rename
    hosts = _group(apps, "viewer", ["view_user"], ["hal"])

    # When
    apps = migrate_to(AFTER)

    # Then: it keeps its name and members
    assert _state(apps)["viewer"] == (hosts.pk, ["hal"], ["view_user"])
    assert VIEWER_GROUP not in _state(apps)
