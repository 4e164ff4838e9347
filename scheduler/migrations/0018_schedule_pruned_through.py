"""``Schedule.pruned_through``: the newest slot a prune deleted, where reconcile's audit starts.

Empty for every schedule at first: what prunes before this migration deleted
is not known, and the audit still never looks past the retention setting.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0017_shard_layout"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedule",
            name="pruned_through",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
    ]
