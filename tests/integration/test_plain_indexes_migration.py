"""Migrations 0028 and 0030: plain and partial indexes, named in Meta; the writes keep their triggers.

It renames what exists on PostgreSQL (no rebuild of a large table) and drops
Django's pattern (``LIKE``) indexes, which nothing filters by; backwards it
builds Django's own again. On SQLite it must not rebuild the tables: that
would drop the execution tallies' triggers.
"""

from __future__ import annotations

import pytest
from django.db import connection

from tests.support.schema_migrations import migrate_to, migrate_to_newest

pytestmark = pytest.mark.django_db(transaction=True)

#: (table, column): the one index on that column alone after 0028 (``None``: none; the unique (tenant, name) serves it).
AFTER = {
    ("scheduler_execution", "celery_task_id"): "execution_celery_task",
    ("scheduler_schedule", "name"): "schedule_name",
    ("scheduler_schedule", "task"): "schedule_task",
    ("scheduler_schedule", "tenant"): None,
}


def indexes_on(table: str, column: str) -> list[str]:
    """The indexes on ``column`` alone that are neither unique nor partial."""
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, table)
    names = [
        name for name, info in found.items() if info["index"] and not info["unique"] and info["columns"] == [column]
    ]
    partial = {"schedule_paused"}  # (name) WHERE paused: another index, kept as it was
    return sorted(set(names) - partial)


def triggers() -> set[str]:
    if connection.vendor != "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")
            return {name for (name,) in cursor.fetchall()}
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        return {name for (name,) in cursor.fetchall()}


def test_0028__one_named_plain_index_per_field_and_back(back_to_newest: None) -> None:
    # Given the schema before 0028: Django's index per field, and on PostgreSQL its pattern index too
    migrate_to([("scheduler", "0027_limits_and_calendars")])
    before = {key: indexes_on(*key) for key in AFTER}
    expected_each = 2 if connection.vendor == "postgresql" else 1
    assert all(len(names) == expected_each for names in before.values()), before
    trigger_names = triggers()
    assert trigger_names

    # When 0028 runs
    migrate_to_newest()

    # Then each field has its one named index, the tenant none of its own, and every trigger is still there
    assert {key: indexes_on(*key) for key in AFTER} == {
        key: [name] if name is not None else [] for key, name in AFTER.items()
    }
    assert triggers() == trigger_names

    # And backwards it builds Django's own indexes again, and forwards once more
    migrate_to([("scheduler", "0027_limits_and_calendars")])
    assert {key: indexes_on(*key) for key in AFTER} == before
    assert triggers() == trigger_names
    migrate_to_newest()
    assert {key: indexes_on(*key) for key in AFTER} == {
        key: [name] if name is not None else [] for key, name in AFTER.items()
    }


def test_0030__the_retry_of_index_holds_only_rows_that_re_run_another_and_back(back_to_newest: None) -> None:
    # Given the schema before 0030: Django's index of the foreign key
    migrate_to([("scheduler", "0029_due_index_ordered_by_id")])
    (django_index,) = indexes_on("scheduler_execution", "retry_of_id")
    trigger_names = triggers()

    # When 0030 runs, then the one index on the column is the partial one, and every trigger is still there
    migrate_to_newest()
    assert indexes_on("scheduler_execution", "retry_of_id") == ["execution_retry_of"]
    assert triggers() == trigger_names
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'execution_retry_of'")
            (definition,) = cursor.fetchone()
        assert "WHERE (retry_of_id IS NOT NULL)" in definition, definition

    # And backwards Django's own index is back
    migrate_to([("scheduler", "0029_due_index_ordered_by_id")])
    assert indexes_on("scheduler_execution", "retry_of_id") == [django_index]
    assert triggers() == trigger_names
