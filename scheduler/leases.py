"""Named leases with fencing tokens, decided by the database clock.

Every comparison of a lease's expiry happens inside SQL against the database
server's clock, so a replica whose own clock is wrong can neither steal an
unexpired lease nor keep an expired one. Acquiring bumps the fencing token;
renewing never does. The lease row is the source of truth: on PostgreSQL a
replica's advisory lock (``InstanceLock``) only tells a follower that the
holder's process is gone so it may take over before the TTL runs out, and
``release`` sends a NOTIFY so followers take a released lease at once.
"""
from __future__ import annotations

import enum
import hashlib
import os
import secrets
import select
import selectors
import socket
import time
from dataclasses import dataclass
from datetime import datetime

import psycopg
from django.db import DatabaseError, connection, transaction
from django.db.models import F
from psycopg import pq

from scheduler import dbclock
from scheduler.exceptions import LeaseLost
from scheduler.models import Lease

#: PostgreSQL channel of the NOTIFY ``release`` sends; the payload is the lease name.
RELEASE_CHANNEL = "scheduler_lease"
#: How long past its own bound the lock wait may take before it is dropped
#: (the server ends it at ``lock_timeout``; this only guards a silent server).
WAIT_GRACE_SECONDS = 2.0
LOCK_NOT_AVAILABLE = b"55P03"
QUERY_CANCELED = b"57014"


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


def acquire(
    name: str, holder: str, *, ttl: float, force: bool = False, gone: tuple[str, int] | None = None
) -> LeaseHandle | None:
    """Take the lease if it is free, expired or already ours; bump its token.

    ``gone`` is a (holder, token) whose process is proven gone (its
    ``InstanceLock`` came free): the lease is taken even unexpired, but only
    while it still has that holder and token, so a replica that took it over
    meanwhile keeps it. ``force`` takes it whatever its state (operators and
    tests). Return the handle, or ``None`` when someone else holds it.
    """
    _ensure_row(name)
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    sql = (
        f"UPDATE scheduler_lease SET holder = %s, token = token + 1, "
        f"acquired_at = {now}, renewed_at = {now}, expires_at = {plus} "
        f"WHERE name = %s AND (holder = %s OR holder = '' OR expires_at IS NULL "
        f"OR expires_at < {now} OR %s OR (holder = %s AND token = %s)) "
        f"RETURNING token, expires_at, {now}"
    )
    gone_holder, gone_token = gone or (None, None)
    params = [holder, dbclock.seconds_param(ttl), name, holder, force, gone_holder, gone_token]
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
    """Give the lease up so a follower can take it at once; return whether we still held it.

    On PostgreSQL the release also notifies ``RELEASE_CHANNEL`` (delivered
    when it commits), which waiting followers listen for.
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduler_lease SET holder = '', expires_at = NULL "
            "WHERE name = %s AND holder = %s AND token = %s",
            [handle.name, handle.holder, handle.token],
        )
        released = cursor.rowcount == 1
        if released and connection.vendor == "postgresql":
            cursor.execute("SELECT pg_notify(%s, %s)", [RELEASE_CHANNEL, handle.name])
    return released


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


class Wait(enum.Enum):
    """How ``InstanceLock.wait_for`` ended."""

    #: The holder's instance lock came to us: its process is gone.
    GONE = "gone"
    #: A release of the lease was notified: it is free.
    RELEASED = "released"
    TIMEOUT = "timeout"


def _lock_key(instance_id: str) -> int:
    digest = hashlib.blake2b(f"scheduler-instance:{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class InstanceLock:
    """PostgreSQL only: a replica's advisory lock on its own instance id, and the wait for another's.

    Each beat replica holds a session-level advisory lock keyed by its
    instance id, on a dedicated connection, for as long as it runs; the
    server frees it when that session ends, that is when the process dies or
    shuts down. A follower that waits for the lease holder's lock and gets it
    therefore knows the holder's process is gone. A frozen process keeps its
    session and its lock: then the lease's TTL decides, as on SQLite. The
    lock is the holder's, not the lease's, so a replica that won by TTL is
    never taken over because some stepped-down replica let a lock go.

    A second connection LISTENs for the NOTIFY that ``release`` sends, so a
    holder that gives the lease up is noticed at once too; the wait ends on
    whichever comes first. Neither connection ever holds a transaction or a
    row lock: the wait is one ``pg_advisory_lock`` statement, bounded by
    ``lock_timeout``.
    """

    def __init__(self, instance_id: str) -> None:
        self.key = _lock_key(instance_id)
        self.held = False
        self._conn: psycopg.Connection | None = None
        self._listener: psycopg.Connection | None = None

    def try_acquire(self) -> bool:
        """Take this replica's own lock, or check the session holding it still lives; return whether held."""
        try:
            conn = self._connection()
            if self.held:
                conn.execute("SELECT 1")  # the same session, so the lock is still ours
            else:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", [self.key]).fetchone()
                self.held = bool(row and row[0])
        except psycopg.Error:  # the lease row decides; the next tick reconnects
            self.close()
        return self.held

    def wait_for(self, holder: str, lease_name: str, *, timeout: float) -> Wait | None:
        """Wait up to ``timeout`` seconds for ``holder``'s process to go or for ``lease_name`` to be released.

        Return how the wait ended, or ``None`` when it could not run (a driver
        error: the connections are dropped and the caller sleeps instead).
        An interruption (SIGTERM's ``SystemExit``) drops the connections and
        propagates, so a shutdown never waits for the lock.
        """
        key = _lock_key(holder)
        try:
            if self._released(lease_name):  # notified since the last wait
                return Wait.RELEASED
            conn = self._connection()
            conn.execute(f"SET lock_timeout = {max(1, round(timeout * 1000))}")
            pgconn = conn.pgconn
            pgconn.send_query_params(b"SELECT pg_advisory_lock($1)", [str(key).encode()])
            while pgconn.flush():
                select.select([], [pgconn.socket], [], WAIT_GRACE_SECONDS)
            deadline = time.monotonic() + timeout + WAIT_GRACE_SECONDS
            with selectors.DefaultSelector() as selector:
                selector.register(pgconn.socket, selectors.EVENT_READ, "lock")
                selector.register(self._listening().pgconn.socket, selectors.EVENT_READ, "listen")
                while True:
                    ready = {found.data for found, _ in selector.select(max(0.0, deadline - time.monotonic()))}
                    if "lock" in ready:
                        pgconn.consume_input()
                        if not pgconn.is_busy():
                            return Wait.GONE if self._lock_result(key, deadline) else Wait.TIMEOUT
                    released = "listen" in ready and self._released(lease_name)
                    if released or time.monotonic() >= deadline:
                        conn.cancel_safe(timeout=WAIT_GRACE_SECONDS)
                        if self._lock_result(key, deadline + WAIT_GRACE_SECONDS):
                            return Wait.GONE
                        return Wait.RELEASED if released else Wait.TIMEOUT
        except (psycopg.Error, OSError):
            self.close()
            return None
        except BaseException:
            # Interrupted (SIGTERM): end the server's wait too, so no orphan
            # session queues for the lock, then drop the connections.
            if self._conn is not None and self._conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                try:
                    self._conn.cancel_safe(timeout=WAIT_GRACE_SECONDS)
                except Exception:  # noqa: BLE001 -- best effort: the server ends the wait at lock_timeout anyway
                    pass
            self.close()
            raise

    def close(self) -> None:
        """Drop both connections (which frees this replica's lock)."""
        self.held = False
        for conn in (self._conn, self._listener):
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 -- closing a broken connection may fail; it is gone either way
                    pass
        self._conn = self._listener = None

    # --- helpers -----------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self.held = False
            self._conn = _connect("scheduler-instance-lock")
        return self._conn

    def _listening(self) -> psycopg.Connection:
        if self._listener is None or self._listener.closed:
            self._listener = _connect("scheduler-lease-listener")
            self._listener.execute(f"LISTEN {RELEASE_CHANNEL}")
        return self._listener

    def _released(self, lease_name: str) -> bool:
        """Read the notifications received so far; return whether one released ``lease_name``."""
        pgconn = self._listening().pgconn
        pgconn.consume_input()
        released = False
        while (notify := pgconn.notifies()) is not None:
            released = released or notify.extra.decode() == lease_name
        return released

    def _lock_result(self, key: int, deadline: float) -> bool:
        """Read the answer to the pending ``pg_advisory_lock``; return whether it was granted.

        A granted lock is freed again at once: it only proved its owner gone.
        """
        assert self._conn is not None
        pgconn = self._conn.pgconn
        while pgconn.is_busy():
            if time.monotonic() >= deadline:
                raise psycopg.OperationalError("no answer to the advisory lock wait")
            select.select([pgconn.socket], [], [], WAIT_GRACE_SECONDS)
            pgconn.consume_input()
        granted = False
        while (result := pgconn.get_result()) is not None:
            if result.status == pq.ExecStatus.TUPLES_OK:
                granted = True
            elif result.error_field(pq.DiagnosticField.SQLSTATE) not in (LOCK_NOT_AVAILABLE, QUERY_CANCELED):
                raise psycopg.OperationalError((result.error_message or b"").decode(errors="replace").strip())
        if granted:
            self._conn.execute("SELECT pg_advisory_unlock(%s)", [key])
        return granted


def _connect(application_name: str) -> psycopg.Connection:
    """A connection of its own (autocommit) to the database Django uses."""
    params = connection.settings_dict
    return psycopg.connect(
        dbname=params["NAME"],
        user=params.get("USER") or None,
        password=params.get("PASSWORD") or None,
        host=params.get("HOST") or None,
        port=params.get("PORT") or None,
        autocommit=True,
        connect_timeout=3,
        application_name=application_name,
    )
