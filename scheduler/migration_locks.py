"""LockTables: a migration's first step, so it never deadlocks with the cluster it runs under.

A migration runs in one transaction, and each change it makes to a table
locks that table until the end. One that changes two busy tables in turn
(a field on executions, then one on schedules) while the cluster runs can
deadlock with a transaction writing both in the other order (the leader's
commit, a worker's outcome); PostgreSQL then aborts one side: ``migrate``,
or the leader's commit. ``LockTables`` takes every lock the migration will
need at once before its first change, each try bounded by a short
``lock_timeout`` and let go entirely when it runs out, so it never holds
one table while it waits for another: the cluster's transactions finish,
and the migration gets its tables between two of them.

Nothing on SQLite, where a migration holds the one write lock anyway.
Migrations import this class by name, and migrations are history: it
keeps its name, module and arguments for good.
"""

from __future__ import annotations

import random
import time
from typing import Any

from django.db import DatabaseError, transaction
from django.db.migrations.operations.base import Operation

from scheduler.session_limits import lock_wait_ended

#: How long one try waits for the locks before it lets go of what it took.
TRY_MILLISECONDS = 200
#: After this long trying, the last try waits as long as it takes (as a plain migration would).
TRYING_SECONDS = 120.0


class LockTables(Operation):
    """Lock the tables of ``model_names`` (of this app), all at once, for the rest of the migration."""

    reversible = True
    reduces_to_sql = True

    def __init__(self, *model_names: str) -> None:
        self.model_names = model_names

    def deconstruct(self) -> tuple[str, tuple[str, ...], dict[str, Any]]:
        return self.__class__.__name__, self.model_names, {}

    def describe(self) -> str:
        return f"Lock the tables of {', '.join(self.model_names)}"

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._lock(app_label, schema_editor, from_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        # Backwards, the tables are as this migration left them: ``to_state`` (Django passes the states swapped).
        self._lock(app_label, schema_editor, to_state)

    def _lock(self, app_label: str, schema_editor: Any, state: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return
        tables = [state.apps.get_model(app_label, name)._meta.db_table for name in self.model_names]
        statement = f"LOCK TABLE {', '.join(map(schema_editor.quote_name, tables))} IN ACCESS EXCLUSIVE MODE"
        if schema_editor.collect_sql:  # ``sqlmigrate``: the statement, as the migration's first
            schema_editor.execute(statement)
            return
        if not connection.in_atomic_block:  # a migration that is not atomic holds nothing from one change to the next
            return
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            (before,) = cursor.fetchone()
        until = time.monotonic() + TRYING_SECONDS
        while time.monotonic() < until:
            try:
                with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                    cursor.execute(f"SET LOCAL lock_timeout = {TRY_MILLISECONDS}")
                    cursor.execute(statement)
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [before])
                return
            except DatabaseError as exc:  # the savepoint's rollback let go of the locks this try took
                if not lock_wait_ended(exc):
                    raise
            time.sleep(random.uniform(0, TRY_MILLISECONDS / 1000))
        schema_editor.execute(statement)
