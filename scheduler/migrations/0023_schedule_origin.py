"""``Schedule.origin``: where each schedule came from (the admin, ``beat_schedule``, a built-in, an import).

The column has a database default, so replicas of the previous release,
which insert schedules without it, keep working during a rolling upgrade.
The built-ins are known by their names; a schedule made from
``beat_schedule`` before this release is marked at the next beat start.
"""

from django.db import migrations, models


def mark_builtins(apps, schema_editor):
    Schedule = apps.get_model("scheduler", "Schedule")
    Schedule.objects.filter(tenant="", name__startswith="builtin: ").update(origin="builtin")


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0022_execution_progress"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedule",
            name="origin",
            field=models.CharField(
                choices=[
                    ("manual", "admin, API or command line"),
                    ("settings", "beat_schedule setting"),
                    ("builtin", "built-in"),
                    ("import", "import"),
                ],
                db_default="manual",
                default="manual",
                editable=False,
                max_length=20,
            ),
        ),
        migrations.RunPython(mark_builtins, migrations.RunPython.noop, elidable=True),
    ]
