"""Execution tallies without row locks: the trigger appends an increment instead of adding to a counter row.

Hand-written. Migration 0012's trigger added to counter rows in place, row
after row in the order of the statement's rows, so two statements whose
final rows met the same counters in opposite orders (sharded leaders
recording missed slots of the same tasks, the leader beside ``reconcile
--repair``, two bulk cancels) deadlocked, and the leader that lost dropped
its lease. Now the trigger only inserts into ``scheduler_tallyincrement``,
which no statement updates, and ``scheduler.models.tally.fold`` moves the
increments into the totals, one folder at a time. The totals counted so far
stay as they are.

On SQLite the triggers are dropped and created again with the new body; a
later migration that rebuilds ``scheduler_execution`` there must create them
again after the rebuild (``recreate_sqlite_triggers``), in both directions.
"""

from importlib import import_module

from django.db import migrations, models

observability = import_module("scheduler.migrations.0012_observability")

#: The trigger names and conditions are 0012's; only what the trigger does changes.
_TRIGGERS = (
    ("scheduler_execution_tally_insert", "INSERT", observability._INSERTED_FINAL),
    ("scheduler_execution_tally_update", "UPDATE OF status", observability._BECAME_FINAL),
)


def _append(vendor: str) -> str:
    """Return the statement that appends the increment of the final row ``NEW``."""
    seconds = observability._SECONDS[vendor].format(row="NEW")
    ran = "NEW.started_at IS NOT NULL AND NEW.finished_at IS NOT NULL"
    return f"""
        INSERT INTO scheduler_tallyincrement (status, task, "trigger", le, seconds)
        VALUES (
            NEW.status, NEW.task, NEW."trigger",
            CASE WHEN {ran} THEN {observability._le(seconds)} ELSE '' END,
            CASE WHEN {ran} THEN {seconds} ELSE NULL END
        );
    """


def _postgresql_function(body: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION scheduler_execution_tally() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            {body}
            RETURN NULL;
        END
        $$
    """


def _create_triggers_sql(vendor: str) -> list[str]:
    """Return the SQL that makes the triggers append increments (PostgreSQL: the function both triggers run)."""
    if vendor == "postgresql":
        return [_postgresql_function(_append(vendor))]
    return [
        f"""
        CREATE TRIGGER {name} AFTER {event} ON scheduler_execution
        FOR EACH ROW WHEN {condition} BEGIN {_append(vendor)} END
        """
        for name, event, condition in _TRIGGERS
    ]


def _drop_sqlite_triggers(schema_editor) -> None:
    for name, _, _ in _TRIGGERS:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {name}")


def recreate_sqlite_triggers(apps, schema_editor):
    """Create the triggers again after a rebuild of ``scheduler_execution`` on SQLite (which drops them)."""
    if schema_editor.connection.vendor != "sqlite":
        return
    _drop_sqlite_triggers(schema_editor)
    for sql in _create_triggers_sql("sqlite"):
        schema_editor.execute(sql, params=None)  # no placeholders: ``%`` would be read as one


def append_increments(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        _drop_sqlite_triggers(schema_editor)
    for sql in _create_triggers_sql(vendor):
        schema_editor.execute(sql, params=None)


def add_to_counters(apps, schema_editor):
    """Back to 0012's triggers, with every increment not folded yet added to the totals first."""
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        # No increment may be appended between the fold and the DELETE.
        schema_editor.execute("LOCK TABLE scheduler_tallyincrement IN EXCLUSIVE MODE")
    seconds = "COALESCE(SUM(seconds), 0)"
    for sql in (
        """
        INSERT INTO scheduler_executiontally (status, task, "trigger", shard, count)
        SELECT status, task, "trigger", 0, COUNT(*) FROM scheduler_tallyincrement WHERE true
        GROUP BY status, task, "trigger"
        ON CONFLICT (status, task, "trigger", shard) DO UPDATE SET count = scheduler_executiontally.count + excluded.count
        """,
        f"""
        INSERT INTO scheduler_durationtally (task, le, shard, count, seconds)
        SELECT task, le, 0, COUNT(*), {seconds} FROM scheduler_tallyincrement WHERE le <> ''
        GROUP BY task, le
        ON CONFLICT (task, le, shard) DO UPDATE SET
            count = scheduler_durationtally.count + excluded.count,
            seconds = scheduler_durationtally.seconds + excluded.seconds
        """,
        "DELETE FROM scheduler_tallyincrement",
    ):
        schema_editor.execute(sql)
    if vendor == "postgresql":
        schema_editor.execute(_postgresql_function(observability._upserts(vendor)), params=None)
        return
    _drop_sqlite_triggers(schema_editor)
    for sql in observability._create_triggers_sql("sqlite"):
        schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0018_schedule_pruned_through"),
    ]

    operations = [
        migrations.CreateModel(
            name="TallyIncrement",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("status", models.CharField(max_length=20)),
                ("task", models.CharField(max_length=255)),
                ("trigger", models.CharField(max_length=20)),
                ("le", models.CharField(blank=True, default="", max_length=20)),
                ("seconds", models.FloatField(blank=True, null=True)),
            ],
        ),
        migrations.RunPython(append_increments, add_to_counters),
    ]
