"""HTTP API tokens, tenant scoping and the audit trail."""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("scheduler", "0010_execution_trigger"),
    ]

    operations = []
