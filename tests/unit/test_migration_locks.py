"""Every migration that changes two or more busy tables takes their locks first (``scheduler.migration_locks``).

Read from the migrations' operations, without a database: the tables a
migration changes are the models its schema operations name, less those it
creates; where its database side is code (``RunPython``, ``RunSQL``), the
models its state side names.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.db import migrations as m
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations.base import Operation

from scheduler.migration_locks import LockTables

#: Schema operations on one existing model (``model_name``, or ``name`` for a model's own options).
CHANGES = (
    m.AddField,
    m.RemoveField,
    m.AlterField,
    m.RenameField,
    m.AddIndex,
    m.RemoveIndex,
    m.RenameIndex,
    m.AddConstraint,
    m.RemoveConstraint,
    m.AlterUniqueTogether,
    m.AlterModelTable,
    m.DeleteModel,
)


def changed_models(operations: Sequence[Operation], created: set[str]) -> set[str]:
    """The existing models ``operations`` change (``created`` gathers those they create)."""
    changed: set[str] = set()
    for operation in operations:
        if isinstance(operation, m.CreateModel):
            created.add(operation.name_lower)
        elif isinstance(operation, m.SeparateDatabaseAndState):
            code = any(isinstance(op, (m.RunPython, m.RunSQL)) for op in operation.database_operations)
            side = operation.state_operations if code else operation.database_operations
            changed |= changed_models(side, set(created))
        elif isinstance(operation, CHANGES):
            name = getattr(operation, "model_name_lower", None) or operation.name_lower
            if name not in created:
                changed.add(name)
    return changed


def test_a_migration_changing_two_busy_tables_locks_them_all_first() -> None:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    checked = {name: migration for (app, name), migration in loader.disk_migrations.items() if app == "scheduler"}
    assert len(checked) >= 30, sorted(checked)
    unlocked = []
    for name, migration in sorted(checked.items()):
        changed = changed_models(migration.operations, set())
        first = migration.operations[0]
        locked = set(first.model_names) if isinstance(first, LockTables) else set()
        if len(changed) > 1 and not changed <= locked:
            unlocked.append(f"{name}: changes {sorted(changed)}, locks {sorted(locked)} first")
    assert not unlocked, "\n".join(unlocked)


def test_the_check_sees_two_tables_changed_in_turn() -> None:
    # Given the operations of a migration that changes an execution field, then a schedule field
    operations = [
        m.CreateModel(name="Calendar", fields=[]),
        m.AddField(model_name="execution", name="a", field=None),
        m.AddField(model_name="calendar", name="b", field=None),
        m.SeparateDatabaseAndState(
            database_operations=[m.RunPython(m.RunPython.noop)],
            state_operations=[m.AlterField(model_name="schedule", name="c", field=None)],
        ),
    ]
    # Then it names both, and not the table it created
    assert changed_models(operations, set()) == {"execution", "schedule"}
