"""The scheduler's two groups get namespaced names: "viewer" → "scheduler: viewer", "schedule operator" → "scheduler: operator".

Hand-written, data only. A group is renamed in place (same row: its members
and permissions stay) only if it is the scheduler's: it holds the
``scheduler.view_schedule`` permission, which ``ensure_groups`` gives both
after every ``migrate``. A host's own group that happens to be called
"viewer" holds no such permission (on a new installation the scheduler's
permissions do not even exist yet while this runs) and keeps its name. If
the new name is taken already, the old group's members join it and the old
group goes. Reversible.
"""

from django.db import migrations

RENAMES = (("viewer", "scheduler: viewer"), ("schedule operator", "scheduler: operator"))


def _rename(apps, schema_editor, pairs):
    Group = apps.get_model("auth", "Group")
    groups = Group.objects.using(schema_editor.connection.alias)
    for old, new in pairs:
        ours = groups.filter(
            name=old, permissions__content_type__app_label="scheduler", permissions__codename="view_schedule"
        ).first()
        if ours is None:
            continue
        taken = groups.filter(name=new).first()
        if taken is None:
            ours.name = new
            ours.save(update_fields=["name"])
        else:
            taken.user_set.add(*ours.user_set.all())
            ours.delete()


def forwards(apps, schema_editor):
    _rename(apps, schema_editor, RENAMES)


def backwards(apps, schema_editor):
    _rename(apps, schema_editor, [(new, old) for old, new in RENAMES])


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0019_tally_increments"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
