"""How long a database session may hold rows: idle inside a transaction, or waiting for another's lock.

A process that freezes inside a transaction (SIGSTOP, a VM pause, a cut
network) keeps every row lock it took until its session ends: a worker
recording an outcome holds its schedule's row, a body's ``atomic()``
around ``checkpoint()`` its execution's row. So on PostgreSQL:

- every session of the project (web, command line, worker, beat) is ended
  by the server once it sits idle inside a transaction for
  ``idle_in_transaction_seconds()`` (the beat's own sessions keep their
  shorter-or-equal bound of one lease TTL, ``scheduler.beat``);
- the leader's commit waits for no lock longer than
  ``leader_lock_wait_seconds()`` (``bound_lock_wait``): what another
  transaction holds costs the leader the schedules that need it for one
  tick, never its lease.

SQLite has no such bounds: a writer holds the whole database, and the
others wait its busy timeout.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from django.db import connection

from scheduler.conf import settings

#: PostgreSQL's SQLSTATE for a lock wait that ``lock_timeout`` ended (``lock_not_available``).
LOCK_NOT_AVAILABLE = "55P03"
#: PostgreSQL's SQLSTATE for a lock wait it ended because it would never end (``deadlock_detected``).
DEADLOCK_DETECTED = "40P01"


def idle_in_transaction_seconds() -> float:
    """Return how long a session may sit idle inside a transaction: min(lease TTL, claim / 2), 10 s by default.

    Shorter than half the claim, so a frozen worker's locks are gone well
    before its claim runs out and reconcile or a successor finds its row
    free; at most one lease TTL, so a schedule whose row a frozen process
    holds (the leader passes over it meanwhile) is late by about one TTL at
    most.
    """
    return min(settings.LEASE_TTL_SECONDS, settings.CLAIM_SECONDS / 2)


def leader_lock_wait_seconds() -> float:
    """Return the longest one statement of the leader's commit waits for a lock: a tenth of the lease TTL."""
    return settings.LEASE_TTL_SECONDS / 10


def bound_idle_transactions(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: have PostgreSQL end this session once idle inside a transaction too long."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {_milliseconds(idle_in_transaction_seconds())}")


def bound_lock_wait(seconds: float) -> None:
    """Inside a transaction on PostgreSQL: make each later statement of it wait at most ``seconds`` for a lock.

    A wait that runs out raises the error ``lock_wait_ended`` recognises
    (and the transaction must be rolled back). Nothing on SQLite.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = {_milliseconds(seconds)}")


def lock_wait_ended(exc: BaseException) -> bool:
    """Return whether ``exc`` (a ``DatabaseError``) only says a lock was not free in time.

    PostgreSQL's ``lock_timeout`` (SQLSTATE 55P03), its deadlock detector
    (40P01: this transaction and another each waited for what the other
    holds, and this one was picked to give way) and SQLite's busy timeout
    ("database is locked"): the database answered, another transaction holds
    what the statement needed, and this one was rolled back.
    """
    cause = exc.__cause__ or exc
    if getattr(cause, "sqlstate", None) in (LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED):
        return True
    return isinstance(cause, sqlite3.OperationalError) and "locked" in str(cause)


def _milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))
