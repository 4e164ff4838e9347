"""Database defaults for the message options 0026 added as ``NOT NULL`` columns without one.

Without them, a replica of the release before 0026 (its admin, API or
commands) could not write a schedule once this release's ``migrate`` ran:
its ``INSERT`` names none of these columns. One table: no ``LockTables``.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0031_drop_queued_index"),
    ]

    operations = [
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
