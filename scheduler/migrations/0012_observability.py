"""Dead man's switch and monotonic execution counters."""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("scheduler", "0011_api_tokens_and_audit"),
    ]

    operations = []
