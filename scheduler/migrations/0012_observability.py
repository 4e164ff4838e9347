"""Dead man's switch and monotonic execution counters.

Hand-written. The tallies are kept by a trigger on the execution table, in
the statement that moves a row to a final status (or inserts it final), so
they commit with it whatever path made the change; the trigger's SQL is
spelled once per database below. The current rows seed the tallies and the
schedules' last success, cadence and overdue deadline.
"""

from __future__ import annotations

import django.core.validators
from django.db import migrations, models
from django.db.models import OuterRef, Q, Subquery

from scheduler.migration_locks import LockTables

#: Final statuses as of this migration (Execution.FINAL_STATUSES).
FINAL = ("succeeded", "failed", "timed_out", "cancelled", "skipped", "missed")
#: Run-time bucket bounds as of this migration (scheduler.models.tally.DURATION_BUCKETS).
BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
SHARDS = 8

_FINAL_LIST = ", ".join(f"'{status}'" for status in FINAL)
#: Run time in seconds of the row ``{row}``, per database.
_SECONDS = {
    "postgresql": "GREATEST(EXTRACT(EPOCH FROM {row}.finished_at - {row}.started_at), 0)",
    "sqlite": "MAX((julianday({row}.finished_at) - julianday({row}.started_at)) * 86400.0, 0)",
}


def _le(seconds: str) -> str:
    """Return SQL naming the bucket (its upper bound as exposed: '0.5', '+Inf') of ``seconds``."""
    cases = " ".join(f"WHEN {seconds} <= {bound} THEN '{bound}'" for bound in BUCKETS)
    return f"CASE {cases} ELSE '+Inf' END"


def _upserts(vendor: str) -> str:
    """Return the two statements that count the final row ``NEW``."""
    seconds = _SECONDS[vendor].format(row="NEW")
    return f"""
        INSERT INTO scheduler_executiontally (status, task, "trigger", shard, count)
        VALUES (NEW.status, NEW.task, NEW."trigger", NEW.id % {SHARDS}, 1)
        ON CONFLICT (status, task, "trigger", shard) DO UPDATE SET count = scheduler_executiontally.count + 1;
        INSERT INTO scheduler_durationtally (task, le, shard, count, seconds)
        SELECT NEW.task, {_le(seconds)}, NEW.id % {SHARDS}, 1, {seconds}
        WHERE NEW.started_at IS NOT NULL AND NEW.finished_at IS NOT NULL
        ON CONFLICT (task, le, shard) DO UPDATE SET
            count = scheduler_durationtally.count + 1,
            seconds = scheduler_durationtally.seconds + excluded.seconds;
    """


_BECAME_FINAL = f"NEW.status IN ({_FINAL_LIST}) AND OLD.status NOT IN ({_FINAL_LIST})"
_INSERTED_FINAL = f"NEW.status IN ({_FINAL_LIST})"


def _create_triggers_sql(vendor: str) -> list[str]:
    if vendor == "postgresql":
        return [
            f"""
            CREATE FUNCTION scheduler_execution_tally() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                {_upserts(vendor)}
                RETURN NULL;
            END
            $$
            """,
            f"""
            CREATE TRIGGER scheduler_execution_tally_insert AFTER INSERT ON scheduler_execution
            FOR EACH ROW WHEN ({_INSERTED_FINAL}) EXECUTE FUNCTION scheduler_execution_tally()
            """,
            f"""
            CREATE TRIGGER scheduler_execution_tally_update AFTER UPDATE OF status ON scheduler_execution
            FOR EACH ROW WHEN ({_BECAME_FINAL}) EXECUTE FUNCTION scheduler_execution_tally()
            """,
        ]
    return [
        f"""
        CREATE TRIGGER scheduler_execution_tally_insert AFTER INSERT ON scheduler_execution
        FOR EACH ROW WHEN {_INSERTED_FINAL} BEGIN {_upserts(vendor)} END
        """,
        f"""
        CREATE TRIGGER scheduler_execution_tally_update AFTER UPDATE OF status ON scheduler_execution
        FOR EACH ROW WHEN {_BECAME_FINAL} BEGIN {_upserts(vendor)} END
        """,
    ]


def _seed_sql(vendor: str) -> list[str]:
    seconds = _SECONDS[vendor].format(row="e")
    return [
        f"""
        INSERT INTO scheduler_executiontally (status, task, "trigger", shard, count)
        SELECT status, task, "trigger", id % {SHARDS}, COUNT(*) FROM scheduler_execution
        WHERE status IN ({_FINAL_LIST}) GROUP BY status, task, "trigger", id % {SHARDS}
        """,
        f"""
        INSERT INTO scheduler_durationtally (task, le, shard, count, seconds)
        SELECT task, le, shard, COUNT(*), SUM(seconds) FROM (
            SELECT e.task AS task, {_le(seconds)} AS le, e.id % {SHARDS} AS shard, {seconds} AS seconds
            FROM scheduler_execution e
            WHERE e.status IN ({_FINAL_LIST}) AND e.started_at IS NOT NULL AND e.finished_at IS NOT NULL
        ) AS finished GROUP BY task, le, shard
        """,
    ]


def create_triggers(apps, schema_editor):
    """Count the executions already final, then every one that becomes final (one transaction)."""
    vendor = schema_editor.connection.vendor
    for sql in (*_seed_sql(vendor), *_create_triggers_sql(vendor)):
        schema_editor.execute(sql, params=None)  # no placeholders: ``%`` is the modulo operator


def drop_triggers(apps, schema_editor):
    for name in ("scheduler_execution_tally_insert", "scheduler_execution_tally_update"):
        on = " ON scheduler_execution" if schema_editor.connection.vendor == "postgresql" else ""
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {name}{on}")
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS scheduler_execution_tally()")


def fill_deadlines(apps, schema_editor):
    """Each schedule's last success (from its succeeded executions), cadence and overdue deadline."""
    from scheduler import timing  # pure functions of plain values, no models
    from scheduler.timing import overdue

    Schedule = apps.get_model("scheduler", "Schedule")
    Execution = apps.get_model("scheduler", "Execution")
    schedules = Schedule.objects.using(schema_editor.connection.alias)
    last_success = (
        Execution.objects.filter(schedule_id=OuterRef("pk"), status="succeeded")
        .order_by("-finished_at")
        .values("finished_at")[:1]
    )
    schedules.update(last_success_at=Subquery(last_success))
    batch = []
    for schedule in schedules.order_by("pk").iterator(chunk_size=1000):
        shape = timing.Timing(
            cron=schedule.cron or None,
            interval=schedule.interval,
            run_at=schedule.run_at,
            timezone=schedule.timezone,
            start_at=schedule.start_at,
            end_at=schedule.end_at,
            max_runs=schedule.max_runs,
            dst_gap=schedule.dst_gap,
            dst_fold=schedule.dst_fold,
        )
        schedule.cadence = overdue.cadence(shape)
        schedule.overdue_at = overdue.deadline(
            shape,
            window=schedule.alert_after or schedule.cadence,
            last_success_at=schedule.last_success_at,
            since=schedule.owed_since or schedule.created_at,
        )
        batch.append(schedule)
        if len(batch) == 1000:
            schedules.bulk_update(batch, ["cadence", "overdue_at"])
            batch = []
    schedules.bulk_update(batch, ["cadence", "overdue_at"])


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0011_api_tokens_and_audit"),
    ]

    operations = [
        # It changes more than one busy table: all their locks first.
        LockTables("execution", "schedule"),
        migrations.AddField(
            model_name="schedule",
            name="alert_after",
            field=models.PositiveIntegerField(
                blank=True,
                null=True,
                validators=[django.core.validators.MinValueValidator(1)],
                help_text="Seconds without a success after which the schedule is overdue; "
                "empty: twice the longest gap between its slots.",
            ),
        ),
        migrations.AddField(
            model_name="schedule",
            name="last_success_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="schedule",
            name="cadence",
            field=models.PositiveIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="schedule",
            name="overdue_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(
                condition=Q(enabled=True, paused_reason="", overdue_at__isnull=False),
                fields=["overdue_at"],
                name="schedule_overdue",
            ),
        ),
        migrations.AddIndex(
            model_name="execution",
            index=models.Index(
                condition=Q(trigger="scheduled", enqueued_at__isnull=False),
                fields=["-enqueued_at"],
                name="execution_sent",
            ),
        ),
        migrations.AddIndex(
            model_name="execution",
            index=models.Index(
                condition=Q(status__in=["pending", "queued", "running"]),
                fields=["status", "queue"],
                name="execution_current",
            ),
        ),
        migrations.CreateModel(
            name="ExecutionTally",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("status", models.CharField(max_length=20)),
                ("task", models.CharField(max_length=255)),
                ("trigger", models.CharField(max_length=20)),
                ("shard", models.PositiveSmallIntegerField()),
                ("count", models.BigIntegerField(default=0)),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("status", "task", "trigger", "shard"), name="execution_tally_key")
                ],
            },
        ),
        migrations.CreateModel(
            name="DurationTally",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("task", models.CharField(max_length=255)),
                ("le", models.CharField(max_length=20)),
                ("shard", models.PositiveSmallIntegerField()),
                ("count", models.BigIntegerField(default=0)),
                ("seconds", models.FloatField(default=0.0)),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("task", "le", "shard"), name="duration_tally_key")],
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers),
        migrations.RunPython(fill_deadlines, migrations.RunPython.noop),
    ]
