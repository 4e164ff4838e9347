"""``Execution.checkpoint`` -> ``progress``: the field is the progress saved;
``checkpoint(data)`` is the call that saves it (see docs/glossary.md).

The column keeps its name (``db_column``), as in 0021: replicas of the
previous release still use it during a rolling upgrade.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0021_vocabulary_renames"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameField(model_name="execution", old_name="checkpoint", new_name="progress"),
                migrations.AlterField(
                    model_name="execution",
                    name="progress",
                    field=models.JSONField(blank=True, db_column="checkpoint", null=True),
                ),
            ],
        ),
    ]
