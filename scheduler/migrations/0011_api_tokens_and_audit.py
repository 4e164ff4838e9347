"""HTTP API tokens, tenant scoping and the audit trail."""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0010_execution_trigger"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ApiToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=100, unique=True)),
                ("token_hash", models.CharField(editable=False, max_length=64, unique=True)),
                ("role", models.CharField(choices=[("viewer", "viewer"), ("operator", "operator")], max_length=10)),
                ("tenant", models.CharField(blank=True, default="", max_length=100)),
                ("expires_at", models.DateTimeField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("last_used_at", models.DateTimeField(blank=True, editable=False, null=True)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={"verbose_name": "API token", "ordering": ("name",)},
        ),
        migrations.CreateModel(
            name="AuditEvent",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "actor_type",
                    models.CharField(choices=[("user", "user"), ("token", "token"), ("cli", "cli")], max_length=10),
                ),
                ("actor", models.CharField(max_length=150)),
                ("action", models.CharField(max_length=50)),
                ("object_type", models.CharField(max_length=100)),
                ("object_id", models.CharField(blank=True, default="", max_length=100)),
                ("object_repr", models.CharField(blank=True, default="", max_length=255)),
                ("changes", models.JSONField(blank=True, default=dict)),
                ("tenant", models.CharField(blank=True, db_index=True, default="", max_length=100)),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                "ordering": ("-created_at", "-id"),
                "indexes": [
                    models.Index(fields=["-created_at", "-id"], name="audit_recent"),
                    models.Index(fields=["object_type", "object_id"], name="audit_object"),
                ],
            },
        ),
        migrations.CreateModel(
            name="OperatorProfile",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("tenant", models.CharField(blank=True, default="", max_length=100)),
                (
                    "user",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="operator_profile",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={"verbose_name": "operator profile"},
        ),
    ]
