from __future__ import annotations

from django.db import migrations, models

from scheduler.migration_locks import LockTables


def backfill_counters(apps, schema_editor):
    """Start ``slots_sent`` from the beat's own rows and ``owed_since`` at creation."""
    alias = schema_editor.connection.alias
    Schedule = apps.get_model("scheduler", "Schedule")
    Execution = apps.get_model("scheduler", "Execution")
    for schedule in Schedule.objects.using(alias).filter(
        models.Q(max_runs__isnull=False) | models.Q(run_at__isnull=False)
    ):
        # Beat keys are schedule:<id>:<ISO slot>; run-now keys are schedule:<id>:manual:<uuid>.
        sent = (
            Execution.objects.using(alias)
            .filter(schedule_id=schedule.pk, idempotency_key__startswith=f"schedule:{schedule.pk}:")
            .exclude(idempotency_key__startswith=f"schedule:{schedule.pk}:manual:")
            .exclude(status__in=["missed", "skipped"])
            .count()
        )
        Schedule.objects.using(alias).filter(pk=schedule.pk).update(slots_sent=sent)
    Schedule.objects.using(alias).update(owed_since=models.F("created_at"))


class Migration(migrations.Migration):
    dependencies = [("scheduler", "0007_admin_scale_indexes")]

    operations = [
        # It changes more than one busy table: all their locks first.
        LockTables("execution", "schedule"),
        migrations.AddField(
            model_name="schedule",
            name="slots_sent",
            field=models.PositiveIntegerField(default=0, editable=False),
        ),
        migrations.AddField(
            model_name="schedule",
            name="owed_since",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="execution",
            name="priority",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(backfill_counters, migrations.RunPython.noop),
    ]
