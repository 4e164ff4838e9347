"""What the test process does quicker than a production one, where only the time differs.

Only this process changes: the beats, workers and web servers a test
starts run Django and the project as they are.

**The flush after each ``transaction=True`` test.** Django empties every
table, then sends ``post_migrate`` for each of the 14 installed apps with
models, whose receivers write back the content types, the permissions and
the operator groups: about 80 queries, 120 ms a test on PostgreSQL (45 ms
on SQLite), over the thousand-odd such tests most of what made
PostgreSQL's run the longer one. Here the flush instead

- keeps the content types and permissions: they follow from the models,
  and no test writes them;
- sends ``post_migrate`` for this app alone, whose receiver puts the
  operator groups back (``scheduler.web.permissions.ensure_groups``);
- on PostgreSQL, deletes instead of one ``TRUNCATE`` of every table, which
  gives each table and index new files: a test leaves a few rows, and the
  foreign keys Django creates are checked at the commit, when all are gone.

Sequences are not reset, as before.

**Password hashes** take one PBKDF2 iteration instead of a million (a
quarter of a second each). Such a hash names its iteration count, so the
processes a test starts still check it.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from django.contrib.auth import hashers
from django.core.management.commands import flush
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.signals import post_migrate

#: Rows ``migrate`` derives from the models.
KEPT = frozenset({"django_content_type", "auth_permission"})


class OneIterationPBKDF2(hashers.PBKDF2PasswordHasher):
    iterations = 1


def install() -> None:
    """Make the flush after each ``transaction=True`` test, and password hashing, the quicker ones."""
    flush.sql_flush = _sql_flush  # type: ignore[attr-defined]
    flush.emit_post_migrate_signal = _post_migrate_of_this_app  # type: ignore[attr-defined]
    settings.PASSWORD_HASHERS = [f"{__name__}.{OneIterationPBKDF2.__name__}", *settings.PASSWORD_HASHERS]
    hashers.get_hashers.cache_clear()
    hashers.get_hashers_by_algorithm.cache_clear()


def _sql_flush(
    style: Any, connection: BaseDatabaseWrapper, reset_sequences: bool = True, allow_cascade: bool = False
) -> list[str]:
    tables = [
        table
        for table in connection.introspection.django_table_names(only_existing=True, include_views=False)
        if table not in KEPT
    ]
    if connection.vendor == "postgresql" and not reset_sequences:
        # One round trip for all of them.
        return [" ".join(f"DELETE FROM {connection.ops.quote_name(table)};" for table in tables)]
    return connection.ops.sql_flush(style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)


def _post_migrate_of_this_app(verbosity: int, interactive: bool, db: str, **kwargs: Any) -> None:
    app_config = apps.get_app_config("scheduler")
    post_migrate.send(
        sender=app_config, app_config=app_config, verbosity=verbosity, interactive=interactive, using=db, **kwargs
    )
