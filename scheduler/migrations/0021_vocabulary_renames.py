"""Three fields renamed so each word has one meaning (see docs/glossary.md).

- ``Execution.lease_expires_at`` -> ``claim_expires_at``: it is a worker's
  claim; "lease" means the beat's leadership only.
- ``Execution.held`` -> ``buffered``: the row ``overlap=buffer_one`` keeps
  back (its partial index is renamed to match).
- ``Schedule.slots_sent`` -> ``slots_committed``: it counts slots the beat
  committed to run, before any is sent.

The columns keep their names (``db_column``): replicas of the previous
release still read and write them during a rolling upgrade, which a renamed
column would break mid-flight. Only the index name changes in the database.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0020_namespaced_groups"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameField(
                    model_name="execution", old_name="lease_expires_at", new_name="claim_expires_at"
                ),
                migrations.AlterField(
                    model_name="execution",
                    name="claim_expires_at",
                    field=models.DateTimeField(blank=True, db_column="lease_expires_at", null=True),
                ),
                migrations.RemoveIndex(model_name="execution", name="execution_held"),
                migrations.RenameField(model_name="execution", old_name="held", new_name="buffered"),
                migrations.AlterField(
                    model_name="execution",
                    name="buffered",
                    field=models.BooleanField(db_column="held", default=False),
                ),
                migrations.AddIndex(
                    model_name="execution",
                    index=models.Index(
                        condition=models.Q(buffered=True), fields=["schedule"], name="execution_buffered"
                    ),
                ),
                migrations.RenameField(model_name="schedule", old_name="slots_sent", new_name="slots_committed"),
                migrations.AlterField(
                    model_name="schedule",
                    name="slots_committed",
                    field=models.PositiveIntegerField(db_column="slots_sent", default=0, editable=False),
                ),
            ],
            database_operations=[
                migrations.RenameIndex(
                    model_name="execution", new_name="execution_buffered", old_name="execution_held"
                ),
            ],
        ),
    ]
