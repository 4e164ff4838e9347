"""One index write fewer for every execution row written: the ``retry_of`` index holds only the rows that have one.

Almost no execution re-runs another (``executions retry``), yet Django's
index of the foreign key took an entry from every row inserted and from
every update that is not HOT (each claim, outcome and publish). The index
is now partial, ``WHERE retry_of_id IS NOT NULL``, which serves every
lookup of a given execution's re-runs.

The database side drops Django's index and creates the partial one rather
than letting ``AlterField`` do it: on SQLite altering the field would rebuild
the table and drop the execution tallies' triggers (migration 0012).
"""

from importlib import import_module

from django.db import migrations, models

plain_indexes = import_module("scheduler.migrations.0028_plain_indexes")

PARTIAL = models.Index(fields=["retry_of"], name="execution_retry_of", condition=models.Q(retry_of__isnull=False))


def to_partial(apps, schema_editor):
    model = apps.get_model("scheduler", "execution")
    for name in plain_indexes._field_indexes(schema_editor, model, "retry_of_id"):
        schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(name)}")
    schema_editor.add_index(model, PARTIAL)


def to_field_index(apps, schema_editor):
    # Django's private helper (5.2) names and builds the index a foreign key gets.
    model = apps.get_model("scheduler", "execution")
    schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(PARTIAL.name)}")
    schema_editor.execute(schema_editor._create_index_sql(model, fields=[model._meta.get_field("retry_of")]))


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0029_due_index_ordered_by_id"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(to_partial, to_field_index)],
            state_operations=[
                migrations.AlterField(
                    model_name="execution",
                    name="retry_of",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=models.deletion.SET_NULL,
                        related_name="retries",
                        to="scheduler.execution",
                    ),
                ),
                migrations.AddIndex(model_name="execution", index=PARTIAL),
            ],
        ),
    ]
