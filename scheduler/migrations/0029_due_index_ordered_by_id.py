"""The due index ends with the id, the tie-break of a pass's read (``next_run_at``, ``id``).

Ordered by ``next_run_at`` alone, the index left every schedule due at the
same instant to be sorted before a pass took its batch: a burst of 10,000,
or a backlog, was read whole on every pass.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0028_plain_indexes"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="schedule", name="schedule_due"),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(
                fields=["next_run_at", "id"],
                name="schedule_due",
                condition=models.Q(enabled=True, paused_reason="", next_run_at__isnull=False),
            ),
        ),
    ]
