"""Database defaults for the message options an earlier 0026 added as ``NOT NULL`` columns without one.

Without them, a replica of the release before 0026 (its admin, API or
commands) could not write a schedule once this release's ``migrate`` ran:
its ``INSERT`` names none of these columns. 0026 now adds them with their
defaults, but a database that ran it earlier has none, and the migration
history cannot tell the two apart: so each field is first stated without
its default (no SQL), then given it (setting it again changes nothing).
One table: no ``LockTables``.
"""

from django.db import migrations, models


def _as_the_first_0026_added_it(name: str, field: models.Field) -> migrations.SeparateDatabaseAndState:
    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AlterField(model_name="schedule", name=name, field=field)]
    )


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0031_drop_queued_index"),
    ]

    operations = [
        _as_the_first_0026_added_it("exchange", models.CharField(blank=True, default="", max_length=200)),
        _as_the_first_0026_added_it(
            "headers", models.JSONField(blank=True, default=dict, help_text="JSON object of extra message headers.")
        ),
        _as_the_first_0026_added_it("routing_key", models.CharField(blank=True, default="", max_length=200)),
        migrations.AlterField(
            model_name="schedule",
            name="exchange",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AlterField(
            model_name="schedule",
            name="headers",
            field=models.JSONField(
                blank=True, db_default={}, default=dict, help_text="JSON object of extra message headers."
            ),
        ),
        migrations.AlterField(
            model_name="schedule",
            name="routing_key",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
    ]
