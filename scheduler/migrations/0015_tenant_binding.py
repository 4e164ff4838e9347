"""Binding fails closed: explicit "all tenants" on profiles and tokens; schedule names unique per tenant.

Until now a staff user without a profile, a profile without a tenant and a
token without a tenant saw every tenant. From now on they see nothing unless
marked "all tenants", so the migration marks the existing ones, and says how
many, so that nobody loses access silently.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import migrations, models

from scheduler.migration_locks import LockTables


def mark_existing_all_tenants(apps: Any, schema_editor: Any) -> None:
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    OperatorProfile = apps.get_model("scheduler", "OperatorProfile")
    ApiToken = apps.get_model("scheduler", "ApiToken")
    using = schema_editor.connection.alias
    profiles = OperatorProfile.objects.using(using).filter(tenant="").update(all_tenants=True)
    unbound = User.objects.using(using).filter(is_staff=True, is_superuser=False, operator_profile__isnull=True)
    created = OperatorProfile.objects.using(using).bulk_create(
        [OperatorProfile(user_id=pk, all_tenants=True) for pk in unbound.values_list("pk", flat=True)]
    )
    tokens = ApiToken.objects.using(using).filter(tenant="").update(all_tenants=True)
    users = profiles + len(created)
    if users or tokens:
        print(
            f'\n  scheduler: marked {users} staff user(s) and {tokens} API token(s) "all tenants", as they saw every '
            "tenant before; review them (admin: operator profiles; manage.py api_tokens list).",
        )


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0014_shards"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        # It changes more than one busy table: all their locks first.
        LockTables("apitoken", "operatorprofile", "schedule"),
        migrations.AddField(
            model_name="apitoken",
            name="all_tenants",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="operatorprofile",
            name="all_tenants",
            field=models.BooleanField(
                default=False, help_text="Every tenant's rows, and the platform's own tasks. Leave the tenant empty."
            ),
        ),
        migrations.AlterField(
            model_name="schedule",
            name="name",
            field=models.CharField(db_index=True, max_length=200),
        ),
        migrations.AddConstraint(
            model_name="operatorprofile",
            constraint=models.CheckConstraint(
                condition=models.Q(("all_tenants", False), ("tenant", ""), _connector="OR"),
                name="operator_profile_one_binding",
            ),
        ),
        migrations.AddConstraint(
            model_name="schedule",
            constraint=models.UniqueConstraint(fields=("tenant", "name"), name="schedule_name_per_tenant"),
        ),
        migrations.RunPython(mark_existing_all_tenants, migrations.RunPython.noop),
    ]
