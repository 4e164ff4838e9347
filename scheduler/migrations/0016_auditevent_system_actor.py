"""Audit events by "system": the daily prune, and changes to users made by code outside a request.

Only the field's choices change; no column is altered.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0015_tenant_binding"),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="actor_type",
            field=models.CharField(
                choices=[("user", "user"), ("token", "token"), ("cli", "cli"), ("system", "system")], max_length=10
            ),
        ),
    ]
