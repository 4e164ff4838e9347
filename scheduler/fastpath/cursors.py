"""PostgreSQL cursors that bind parameters on the server, checked and logged by Django as its own.

Django's PostgreSQL backend hands out psycopg's ``ClientCursor``: every
statement reaches the server as text with its values inlined, and is parsed
and planned again on every call. A server-binding cursor sends the values
apart, in binary where psycopg can, and may run the statement as a named
prepared statement: parsed and planned once per connection, which halves
what the worker's claim and outcome cost (docs/performance.md, "Prepared
statements").

A transaction pooler (PgBouncer in transaction mode before 1.21, or
without ``max_prepared_statements``) hands a connection's transactions to
different server sessions, where a prepared statement is unknown:
``SCHEDULER_PREPARED_STATEMENTS = False`` keeps every statement unnamed,
and a process that meets a lost prepared statement anyway stops preparing
them (``FAST_PATH``, one warning and one count).

Mirrors, checked against Django 5.2.19 and psycopg 3.3.9 (``requirements.txt``):
``BaseDatabaseWrapper.validate_thread_sharing``, ``wrap_database_errors``,
``make_cursor``, ``make_debug_cursor`` (``django/db/backends/base/base.py``)
and psycopg's ``Cursor.execute(prepare=...)``.
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from scheduler.conf import settings
from scheduler.fastpath.guard import FastPath

#: Whether this process runs the worker's statements as prepared statements; else unnamed, planned per call.
FAST_PATH = FastPath("prepared_statements", slow_path="statements planned on every call")
#: The SQLSTATEs of a prepared statement the server session does not know, or knows already: a pooler between.
_LOST_PREPARED_STATEMENT = {"26000", "42P05"}
#: psycopg prepares a statement run this many times; the worker's are prepared when asked, nothing else by count.
_NEVER_BY_COUNT = 2**31


def prepares(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements on ``connection`` are to run as prepared statements.

    On PostgreSQL, allowed and not fallen back from; and not while Django
    logs queries (``DEBUG``, a test capturing them): a prepared statement's
    run leaves Django no text to log.
    """
    return (
        connection.vendor == "postgresql"
        and settings.PREPARED_STATEMENTS
        and not FAST_PATH.fallen
        and not connection.queries_logged
    )


def binding_cursor(connection: BaseDatabaseWrapper, *, prepare: bool) -> CursorWrapper:
    """Return a cursor of ``connection`` that binds on the server; ``prepare`` runs every statement prepared."""
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        if prepare and connection.connection.prepare_threshold is None:
            # Django's default, None, turns preparing off even when asked; a count never
            # reached prepares only what is asked to be, the statements of other cursors as before.
            connection.connection.prepare_threshold = _NEVER_BY_COUNT
        raw = _cursor_class(prepare)(connection.connection)
    return connection.make_debug_cursor(raw) if connection.queries_logged else connection.make_cursor(raw)


def lost_prepared_statement(exc: DatabaseError) -> bool:
    """Whether ``exc`` says the server session does not have the prepared statement psycopg names (a pooler)."""
    return getattr(exc.__cause__, "sqlstate", None) in _LOST_PREPARED_STATEMENT


@functools.cache
def _cursor_class(prepare: bool) -> type:
    """psycopg's server-binding cursor, every statement prepared or none.

    Made on first use: only PostgreSQL gets here, and an install for SQLite
    alone has no psycopg.
    """
    import psycopg

    always = prepare

    class BindingCursor(psycopg.Cursor):
        def execute(
            self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
        ) -> Any:
            return super().execute(query, params, prepare=always, binary=binary)

    return BindingCursor
