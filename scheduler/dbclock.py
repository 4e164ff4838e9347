"""SQL for the database server's clock, the one clock every replica agrees on.

Leases and execution claims compare times inside SQL against the server's
clock, never the local one. The fragments are written for ``cursor.execute``
with a parameter list (``%%`` escapes a literal ``%``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import overload

from django.db import connection
from django.utils.dateparse import parse_datetime


def now() -> datetime:
    """Return the database server's clock."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {now_sql()}", [])
        return as_datetime(cursor.fetchone()[0])


def now_sql() -> str:
    """SQL for "now" on the database clock."""
    if connection.vendor == "postgresql":
        # statement_timestamp(), not now(): inside a transaction now() is the
        # time the transaction began, which would make a lease look younger.
        return "statement_timestamp()"
    return "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"


def now_plus_sql() -> str:
    """SQL for "now + N seconds"; takes one parameter from ``seconds_param(N)``."""
    if connection.vendor == "postgresql":
        return "statement_timestamp() + make_interval(secs => %s)"
    return "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)"


def seconds_param(seconds: float) -> float | str:
    """Return the parameter ``now_plus_sql()`` takes for ``seconds`` (may be negative)."""
    if connection.vendor == "postgresql":
        return float(seconds)
    return f"{float(seconds):+.6f} seconds"


@overload
def as_datetime(value: None) -> None: ...
@overload
def as_datetime(value: datetime | str) -> datetime: ...
def as_datetime(value: datetime | str | None) -> datetime | None:
    """Return an aware UTC datetime from what the driver returned (SQLite gives text)."""
    if value is None:
        return None
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"Unparseable timestamp from the database: {value!r}")
        value = parsed
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)
