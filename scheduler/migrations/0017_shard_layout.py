"""The stored shard count: one row every beat replica follows, instead of each replica's own ``SCHEDULER_SHARDS``.

The table starts empty: the first beat replica of this version stores its
``SCHEDULER_SHARDS`` there (``scheduler.shards.follow``), and ``manage.py
shards --set N`` changes it. Until a row exists, every process reads its own
``SCHEDULER_SHARDS``, as before.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0016_auditevent_system_actor"),
    ]

    operations = [
        migrations.CreateModel(
            name="ShardLayout",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ("shards", models.PositiveSmallIntegerField()),
                ("previous", models.PositiveSmallIntegerField(blank=True, null=True)),
                ("changed_at", models.DateTimeField()),
                ("changed_by", models.CharField(blank=True, default="", max_length=255)),
            ],
            options={
                "verbose_name": "shard layout",
                "constraints": [
                    models.CheckConstraint(condition=models.Q(("id", 1)), name="shard_layout_one_row"),
                    models.CheckConstraint(condition=models.Q(("shards__gte", 1)), name="shard_layout_at_least_one"),
                ],
            },
        ),
    ]
