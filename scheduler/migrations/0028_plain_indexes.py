"""Four fewer index writes per fire of a schedule, one fewer per write of an execution.

Django gives every CharField with ``db_index=True`` a second, pattern
(``LIKE``) index on PostgreSQL, and nothing here filters those columns by
pattern. The schedule's ``tenant`` index is served by the unique (tenant,
name) as its leading column. What is left of each field's index is declared
as a named index in ``Meta``.

The database side moves what exists rather than letting ``AlterField``
rebuild: on PostgreSQL the plain index is renamed, not built again on a
large table, and on SQLite altering the field would rebuild the table and
drop the execution tallies' triggers (migration 0012).
"""

from django.db import migrations, models

from scheduler.migration_locks import LockTables

#: (model, field, its new index's name; None: no index of its own any more).
MOVES = (
    ("execution", "celery_task_id", "execution_celery_task"),
    ("schedule", "name", "schedule_name"),
    ("schedule", "task", "schedule_task"),
    ("schedule", "tenant", None),
)


def _field_indexes(schema_editor, model, column):
    """Names of the indexes on ``column`` alone that Django made for ``db_index=True`` (plain, and PostgreSQL's ``_like``)."""
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, model._meta.db_table)
    made = f"{model._meta.db_table}_{column}_"  # Django's own names (these fit unshortened); not Meta's
    return sorted(
        name
        for name, info in found.items()
        if name.startswith(made) and info["index"] and not info["unique"] and info["columns"] == [column]
    )


def to_named_indexes(apps, schema_editor):
    quote = schema_editor.quote_name
    for model_name, field_name, new_name in MOVES:
        model = apps.get_model("scheduler", model_name)
        column = model._meta.get_field(field_name).column
        kept = None
        for name in _field_indexes(schema_editor, model, column):
            if new_name is not None and kept is None and not name.endswith("_like"):
                kept = name
                continue
            schema_editor.execute(f"DROP INDEX {quote(name)}")
        if new_name is None:
            continue
        if kept is not None and schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER INDEX {quote(kept)} RENAME TO {quote(new_name)}")
            continue
        if kept is not None:  # SQLite cannot rename an index: a small table there, built again
            schema_editor.execute(f"DROP INDEX {quote(kept)}")
        schema_editor.add_index(model, models.Index(fields=[field_name], name=new_name))


def to_field_indexes(apps, schema_editor):
    # Django's private helpers (5.2) name and build the indexes ``db_index=True`` makes.
    for model_name, field_name, new_name in MOVES:
        model = apps.get_model("scheduler", model_name)
        field = model._meta.get_field(field_name)
        if new_name is not None:
            schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(new_name)}")
        schema_editor.execute(schema_editor._create_index_sql(model, fields=[field]))
        like = getattr(schema_editor, "_create_like_index_sql", lambda *args: None)(model, field)  # PostgreSQL's
        if like is not None:
            schema_editor.execute(like)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0027_limits_and_calendars"),
    ]

    operations = [
        # It changes more than one busy table: all their locks first.
        LockTables("execution", "schedule"),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(to_named_indexes, to_field_indexes)],
            state_operations=[
                migrations.AlterField(
                    model_name="execution",
                    name="celery_task_id",
                    field=models.CharField(blank=True, default="", max_length=255),
                ),
                migrations.AlterField(
                    model_name="schedule",
                    name="name",
                    field=models.CharField(max_length=200),
                ),
                migrations.AlterField(
                    model_name="schedule",
                    name="task",
                    field=models.CharField(help_text="Dotted name of the Celery task.", max_length=255),
                ),
                migrations.AlterField(
                    model_name="schedule",
                    name="tenant",
                    field=models.CharField(blank=True, default="", max_length=100),
                ),
                migrations.AddIndex(
                    model_name="execution",
                    index=models.Index(fields=["celery_task_id"], name="execution_celery_task"),
                ),
                migrations.AddIndex(
                    model_name="schedule",
                    index=models.Index(fields=["name"], name="schedule_name"),
                ),
                migrations.AddIndex(
                    model_name="schedule",
                    index=models.Index(fields=["task"], name="schedule_task"),
                ),
            ],
        ),
    ]
