"""A column a migration adds to an existing table can be left out of an older release's inserts (docs/deploying.md).

During a rolling upgrade the older release's replicas write rows after
this release's ``migrate``, naming none of its new columns: each must be
nullable or have a database default. Checked from ``FIRST_CHECKED`` on (see
``tests/unit/test_migration_locks.py``); ``tests/acceptance/test_rolling_upgrade.py``
has the older release write a schedule on the new schema.
"""

from __future__ import annotations

from django.db import migrations as m
from django.db.migrations.loader import MigrationLoader
from django.db.models.fields import NOT_PROVIDED

FIRST_CHECKED = "0017"


def test_every_column_added_to_an_existing_table_is_nullable_or_has_a_database_default() -> None:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    refused = []
    for (app, name), migration in sorted(loader.disk_migrations.items()):
        if app != "scheduler" or name < FIRST_CHECKED:
            continue
        created = {op.name_lower for op in migration.operations if isinstance(op, m.CreateModel)}
        for op in migration.operations:
            if not isinstance(op, m.AddField) or op.model_name_lower in created or op.field.many_to_many:
                continue
            if not op.field.null and op.field.db_default is NOT_PROVIDED:
                refused.append(f"{name}: {op.model_name}.{op.name} is NOT NULL without a database default")
    assert not refused, "\n".join(refused)
