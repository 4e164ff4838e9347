"""Shards: ``Schedule.shard`` with its due index, and who committed each execution under which lease.

Existing schedules start in shard 0; ``manage.py shards --assign`` moves them
to ``id % SCHEDULER_SHARDS`` when sharding is turned on. On SQLite, adding a
column with a default rebuilds ``scheduler_execution``, which drops its
triggers: the tallies' triggers (migration 0012) are created again after it.
"""

from importlib import import_module

from django.db import migrations, models

from scheduler.migration_locks import LockTables

tallies = import_module("scheduler.migrations.0013_fewer_execution_indexes")


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0013_fewer_execution_indexes"),
    ]

    operations = [
        # It changes more than one busy table: all their locks first.
        LockTables("execution", "schedule"),
        # Backwards, this runs last: after the rebuilds below are undone.
        migrations.RunPython(migrations.RunPython.noop, tallies.recreate_sqlite_triggers),
        migrations.AddField(
            model_name="execution",
            name="dispatcher",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
        migrations.AddField(
            model_name="execution",
            name="lease_name",
            field=models.CharField(blank=True, default="", max_length=100),
        ),
        migrations.RunPython(tallies.recreate_sqlite_triggers, migrations.RunPython.noop),
        migrations.AddField(
            model_name="schedule",
            name="shard",
            field=models.PositiveSmallIntegerField(default=0, editable=False),
        ),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(
                condition=models.Q(("enabled", True), ("next_run_at__isnull", False), ("paused_reason", "")),
                fields=["shard", "next_run_at"],
                name="schedule_shard_due",
            ),
        ),
    ]
