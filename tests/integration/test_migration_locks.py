"""LockTables: a migration that changes two busy tables under a running cluster deadlocks with nobody (PostgreSQL).

Migration 0028 changes an index of the executions, then ones of the
schedules. Beside it, a transaction writes a schedule and, once the
migration waits for that schedule, an execution: the cluster's own order
(a worker's outcome: its execution, then its schedule; here the other way,
so the cycle closes). Without ``LockTables`` the migration holds the
executions while it waits, the two wait for each other, and PostgreSQL
ends one. With it, the migration lets go after a short try, the other
transaction commits, and the migration then gets both tables.
"""

from __future__ import annotations

import copy
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection
from django.db.migrations.executor import MigrationExecutor

from scheduler.migration_locks import LockTables
from scheduler.session_limits import DEADLOCK_DETECTED
from tests.support.factories import make_schedule
from tests.support.schema_migrations import migrate_to
from tests.support.threads import closing_a_cycle

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="PostgreSQL only: on SQLite a migration holds the one write lock, and nothing can cross it",
    ),
]

BOUND = 30.0  # seconds: the other transaction must be done by then
BEFORE = ("scheduler", "0027_limits_and_calendars")


def apply_0028(*, locking: bool) -> DatabaseError | None:
    """Apply migration 0028 (without its ``LockTables`` unless ``locking``); return what it raised."""
    executor = MigrationExecutor(connection)
    migration = executor.loader.get_migration("scheduler", "0028_plain_indexes")
    if not locking:
        migration = copy.copy(migration)
        migration.operations = [op for op in migration.operations if not isinstance(op, LockTables)]
    try:
        executor.apply_migration(executor.loader.project_state(BEFORE, at_end=True), migration)
    except DatabaseError as exc:
        return exc
    return None


def execute(sql: str, params: list[object]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def deadlocked(error: BaseException | None) -> bool:
    return getattr(getattr(error, "__cause__", None), "sqlstate", None) == DEADLOCK_DETECTED


@pytest.mark.parametrize("locking", [True, False], ids=["its tables locked first", "without: the deadlock it prevents"])
def test_0028_beside_a_transaction_writing_a_schedule_then_an_execution(back_to_newest: None, locking: bool) -> None:
    # Given the schema before 0028, a schedule, and a transaction that updates it,
    # then an execution once the migration waits for the schedule
    busy = make_schedule("busy")
    migrate_to([BEFORE])
    connection.ensure_connection()
    errors: list[BaseException] = []
    other = closing_a_cycle(
        lambda: execute("UPDATE scheduler_schedule SET description = 'edited' WHERE id = %s", [busy.pk]),
        lambda: execute("UPDATE scheduler_execution SET attempt = attempt WHERE id = %s", [-1]),
        behind=connection.connection.info.backend_pid,
        errors=errors,
        timeout=BOUND,
    )

    # When 0028 runs
    raised = apply_0028(locking=locking)
    other.join(BOUND)
    assert not other.is_alive()

    if locking:
        # Then both finish: the other transaction committed, the migration applied
        assert raised is None and not errors, (raised, errors)
        assert MigrationExecutor(connection).loader.applied_migrations.keys() >= {("scheduler", "0028_plain_indexes")}
    else:
        # Then PostgreSQL ended one of them
        assert any(deadlocked(error) for error in (raised, *errors)), (raised, errors)


def test_sqlmigrate_shows_the_lock_first() -> None:
    # When an operator prints 0028's SQL to run it by hand
    out = StringIO()
    call_command("sqlmigrate", "scheduler", "0028_plain_indexes", stdout=out)
    # Then its first statement takes both tables' locks at once
    statements = [line for line in out.getvalue().splitlines() if line and not line.startswith("--")]
    assert statements[:2] == [
        "BEGIN;",
        'LOCK TABLE "scheduler_execution", "scheduler_schedule" IN ACCESS EXCLUSIVE MODE;',
    ], statements[:3]
