"""One index write fewer for every execution published: the ``(queue, created_at)`` index of queued rows goes.

No query reads it: PostgreSQL plans the oldest queued executions
(``/metrics``, the cluster page) and the queued rows of one queue through
``execution_current`` (status, queue) with or without it, yet each
publish wrote an entry into it, and on SQLite each claim removed one.
``RemoveIndex`` is a ``DROP INDEX`` on both databases: SQLite keeps its
table, and the execution tallies' triggers.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("scheduler", "0030_partial_retry_of_index"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="execution", name="execution_queued"),
    ]
