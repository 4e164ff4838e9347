"""Two fewer index writes per execution.

``execution_key_prefix`` duplicates the pattern index PostgreSQL already has
on the unique key, and ``execution_schedule_slot`` (schedule, slot) serves
every lookup the foreign key's own index did.

On SQLite, altering the foreign key rebuilds the table, which drops its
triggers: the execution tallies' triggers (migration 0012) are created again
after the rebuild, in both directions.
"""

from importlib import import_module

import django.db.models.deletion
from django.db import migrations, models

observability = import_module("scheduler.migrations.0012_observability")


def recreate_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "sqlite":
        return
    # A rebuild dropped them, or (backwards: re-adding an index rebuilds nothing) they are still there.
    observability.drop_triggers(apps, schema_editor)
    for sql in observability._create_triggers_sql("sqlite"):
        schema_editor.execute(sql, params=None)  # no placeholders: ``%`` is the modulo operator


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0012_observability"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="execution",
            name="execution_key_prefix",
        ),
        # Backwards, this runs last: after the rebuild below is undone.
        migrations.RunPython(migrations.RunPython.noop, recreate_sqlite_triggers),
        migrations.AlterField(
            model_name="execution",
            name="schedule",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="executions",
                to="scheduler.schedule",
            ),
        ),
        migrations.RunPython(recreate_sqlite_triggers, migrations.RunPython.noop),
    ]
