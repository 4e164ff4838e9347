"""Named leases with fencing tokens, decided by the database clock.

Every comparison of a lease's expiry happens inside SQL against the database
server's clock, so a replica whose own clock is wrong can neither steal an
unexpired lease nor keep an expired one. Acquiring bumps the fencing token;
renewing never does. The lease row is the source of truth: the PostgreSQL
advisory lock (``AdvisoryLock``) only tells a follower that the previous
holder's process is gone so it may take over before the TTL runs out.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError, connection, transaction
from django.db.models import F

from scheduler import dbclock
from scheduler.exceptions import LeaseLost
from scheduler.models import Lease


@dataclass(frozen=True)
class LeaseHandle:
    """Proof of holding a lease: who, under which token, until when (DB clock)."""

    name: str
    holder: str
    token: int
    expires_at: datetime
    #: The database clock when the lease was last acquired or renewed.
    db_now: datetime


@dataclass(frozen=True)
class LeaseState:
    """What the lease row says right now, as seen by the database clock."""

    name: str
    holder: str
    token: int
    acquired_at: datetime | None
    renewed_at: datetime | None
    expires_at: datetime | None
    db_now: datetime

    @property
    def is_held(self) -> bool:
        return bool(self.holder) and self.expires_at is not None and self.expires_at > self.db_now

    @property
    def seconds_left(self) -> float:
        if not self.is_held:
            return 0.0
        assert self.expires_at is not None
        return (self.expires_at - self.db_now).total_seconds()


def new_instance_id() -> str:
    """Return an id unique to this process start: ``hostname-pid-random``."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _ensure_row(name: str) -> None:
    Lease.objects.bulk_create([Lease(name=name)], ignore_conflicts=True)


# --- operations ----------------------------------------------------------------------


def acquire(name: str, holder: str, *, ttl: float, force: bool = False) -> LeaseHandle | None:
    """Take the lease if it is free, expired or already ours; bump its token.

    ``force`` takes it whatever its state; only a caller that has proof the
    holder's process is gone (the PostgreSQL advisory lock) may pass it.
    Return the handle, or ``None`` when someone else holds it.
    """
    _ensure_row(name)
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    sql = (
        f"UPDATE scheduler_lease SET holder = %s, token = token + 1, "
        f"acquired_at = {now}, renewed_at = {now}, expires_at = {plus} "
        f"WHERE name = %s AND (holder = %s OR holder = '' OR expires_at IS NULL "
        f"OR expires_at < {now} OR %s) "
        f"RETURNING token, expires_at, {now}"
    )
    params = [holder, dbclock.seconds_param(ttl), name, holder, force]
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                # A paused leader may hold the row lock mid-transaction; never
                # block behind it, just try again on the next tick.
                cursor.execute("SET LOCAL lock_timeout = '250ms'")
            cursor.execute(sql, params)
            row = cursor.fetchone()
    except DatabaseError as exc:
        if "lock timeout" in str(exc).lower():
            return None
        raise
    if row is None:
        return None
    token, expires_at, db_now = row
    return LeaseHandle(name, holder, int(token), dbclock.as_datetime(expires_at), dbclock.as_datetime(db_now))


def renew(handle: LeaseHandle, *, ttl: float) -> LeaseHandle:
    """Extend the lease for the same holder and token while it is unexpired.

    Raise ``LeaseLost`` when the lease expired or was taken over.
    """
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    sql = (
        f"UPDATE scheduler_lease SET renewed_at = {now}, expires_at = {plus} "
        f"WHERE name = %s AND holder = %s AND token = %s AND expires_at > {now} "
        f"RETURNING expires_at, {now}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [dbclock.seconds_param(ttl), handle.name, handle.holder, handle.token])
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost()
    expires_at, db_now = row
    return LeaseHandle(handle.name, handle.holder, handle.token, dbclock.as_datetime(expires_at), dbclock.as_datetime(db_now))


def record_renew_failure(name: str) -> None:
    """Count a refused renewal on the lease row (exported as a metric)."""
    Lease.objects.filter(name=name).update(renew_failures=F("renew_failures") + 1)


def release(handle: LeaseHandle) -> bool:
    """Give the lease up so a follower can take it at once; return whether we still held it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduler_lease SET holder = '', expires_at = NULL "
            "WHERE name = %s AND holder = %s AND token = %s",
            [handle.name, handle.holder, handle.token],
        )
        return cursor.rowcount == 1


def assert_held(handle: LeaseHandle) -> datetime:
    """Lock the lease row and check it is still ours; return the database clock.

    Call inside ``transaction.atomic()``: the row lock (PostgreSQL) or the
    write lock (SQLite) is held until commit, so nobody can take the lease
    over between this check and the commit of what the caller writes.
    Raise ``LeaseLost`` when the holder, token or expiry no longer match.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("assert_held() must run inside transaction.atomic()")
    now = dbclock.now_sql()
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {now} FROM scheduler_lease "
            f"WHERE name = %s AND holder = %s AND token = %s AND expires_at > {now}{lock}",
            [handle.name, handle.holder, handle.token],
        )
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost()
    return dbclock.as_datetime(row[0])


def current(name: str) -> LeaseState:
    """Return the lease's row and the database clock, read in one query."""
    now = dbclock.now_sql()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT holder, token, acquired_at, renewed_at, expires_at, {now} "
            f"FROM scheduler_lease WHERE name = %s",
            [name],
        )
        row = cursor.fetchone()
        if row is None:
            cursor.execute(f"SELECT {now}", [])
            (db_now,) = cursor.fetchone()
            return LeaseState(name, "", 0, None, None, None, dbclock.as_datetime(db_now))
    holder, token, acquired_at, renewed_at, expires_at, db_now = row
    return LeaseState(
        name,
        holder,
        int(token),
        dbclock.as_datetime(acquired_at),
        dbclock.as_datetime(renewed_at),
        dbclock.as_datetime(expires_at),
        dbclock.as_datetime(db_now),
    )


def db_now() -> datetime:
    """Return the database server's clock."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {dbclock.now_sql()}", [])
        return dbclock.as_datetime(cursor.fetchone()[0])


class AdvisoryLock:
    """A PostgreSQL session-level advisory lock on a dedicated connection.

    The lock lives as long as the connection: when the process holding it
    dies, the server closes the session and frees the lock. A follower that
    manages to take it therefore knows the previous leader's process is gone.
    """

    def __init__(self, name: str) -> None:
        digest = hashlib.blake2b(f"scheduler-lease:{name}".encode(), digest_size=8).digest()
        self.key = int.from_bytes(digest, "big", signed=True)
        self._conn = None
        self.held = False

    def _connect(self):  # noqa: ANN202 (psycopg connection, imported lazily)
        import psycopg

        params = connection.settings_dict
        return psycopg.connect(
            dbname=params["NAME"],
            user=params.get("USER") or None,
            password=params.get("PASSWORD") or None,
            host=params.get("HOST") or None,
            port=params.get("PORT") or None,
            autocommit=True,
            connect_timeout=3,
            application_name="scheduler-advisory-lock",
        )

    def try_acquire(self) -> bool:
        """Try once to take the lock; return whether this process holds it."""
        if self.held:
            return True
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", [self.key]).fetchone()
            self.held = bool(row and row[0])
        except Exception:  # noqa: BLE001 -- any driver error means "not held"; the lease row decides
            self.close()
        return self.held

    def release(self) -> None:
        """Free the lock (closing the connection frees it too)."""
        self.close()

    def close(self) -> None:
        self.held = False
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 -- closing a broken connection may fail; it is gone either way
                pass
