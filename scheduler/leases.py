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
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F

try:
    import psycopg
    from psycopg import pq
except ImportError:  # an install for SQLite alone: InstanceLock, PostgreSQL's, is never made there
    psycopg = pq = None  # type: ignore[assignment]  # bound, unused: the SQLite-only install never makes an InstanceLock

from scheduler import dbclock, shards
from scheduler.conf import settings
from scheduler.exceptions import LeaseLost
from scheduler.failpoints import failpoint
from scheduler.models import Lease

#: PostgreSQL channel of the NOTIFY ``release`` sends; the payload is the lease name.
RELEASE_CHANNEL = "scheduler_lease"
#: The payload on ``RELEASE_CHANNEL`` when the stored shard count changed: it wakes every waiting replica.
COUNT_CHANGED = "shard-count"
#: How long past its own bound the lock wait may take before it is dropped
#: (the server ends it at ``lock_timeout``; this only guards a silent server).
WAIT_GRACE_SECONDS = 2.0
#: How often (ms) the server checks that a replica blocked in a lock wait is still there.
CLIENT_CHECK_MS = 50
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
    #: The database clock when this holder took it under this token.
    acquired_at: datetime | None = None


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


def _ensure_rows(names: Sequence[str]) -> None:
    Lease.objects.bulk_create([Lease(name=name) for name in names], ignore_conflicts=True)


def _pairs(pairs: Sequence[tuple[Any, ...]]) -> tuple[str, list[Any]]:
    """SQL ``(VALUES (%s, %s), ...)`` for row-value matching, and its parameters."""
    rows = ", ".join("(" + ", ".join(["%s"] * len(pair)) + ")" for pair in pairs)
    return f"(VALUES {rows})", [value for pair in pairs for value in pair]


def _in(values: Sequence[Any]) -> str:
    return "(" + ", ".join(["%s"] * len(values)) + ")"


def _handle(
    name: str, holder: str, token: Any, expires_at: Any, db_now: Any, acquired_at: datetime | None = None
) -> LeaseHandle:
    db_now = dbclock.as_datetime(db_now)
    return LeaseHandle(name, holder, int(token), dbclock.as_datetime(expires_at), db_now, acquired_at or db_now)


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
    taken = acquire_many([name], holder, ttl=ttl, force=force, gone=[gone] if gone else ())
    return taken[0] if taken else None


def acquire_many(
    names: Sequence[str],
    holder: str,
    *,
    ttl: float,
    force: bool = False,
    gone: Sequence[tuple[str, int]] = (),
) -> list[LeaseHandle]:
    """Take, in one statement, each of ``names`` that is free, expired or ours (see ``acquire``); return those taken.

    On PostgreSQL a lease row locked by someone else's open transaction (a
    holder paused mid-commit) is skipped, never waited for: it is tried
    again on the next tick.
    """
    if not names:
        return []
    _ensure_rows(names)
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    takeable = f"(holder = %s OR holder = '' OR expires_at IS NULL OR expires_at < {now} OR %s"
    takeable_params: list[Any] = [holder, force]
    if gone:
        values, gone_params = _pairs(list(gone))
        takeable += f" OR (holder, token) IN {values}"
        takeable_params += gone_params
    takeable += ")"
    where, params = f"name IN {_in(names)} AND {takeable}", [*names, *takeable_params]
    if connection.features.has_select_for_update_skip_locked:
        where = f"name IN (SELECT name FROM scheduler_lease WHERE {where} FOR UPDATE SKIP LOCKED) AND {takeable}"
        params += takeable_params
    sql = (
        f"UPDATE scheduler_lease SET holder = %s, token = token + 1, "
        f"acquired_at = {now}, renewed_at = {now}, expires_at = {plus} "
        f"WHERE {where} RETURNING name, token, expires_at, {now}"
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, [holder, dbclock.seconds_param(ttl), *params])
        rows = cursor.fetchall()
        if rows:
            failpoint("lease.acquire")
    return sorted((_handle(name, holder, *rest) for name, *rest in rows), key=lambda handle: handle.name)


def renew(handle: LeaseHandle, *, ttl: float) -> LeaseHandle:
    """Extend the lease for the same holder and token while it is unexpired.

    Raise ``LeaseLost`` when the lease expired or was taken over.
    """
    renewed = renew_many([handle], ttl=ttl)
    if not renewed:
        raise LeaseLost(names=(handle.name,))
    return renewed[0]


def renew_many(handles: Sequence[LeaseHandle], *, ttl: float) -> list[LeaseHandle]:
    """Extend, in one statement, each lease still held unexpired under its holder and token; return those renewed.

    A handle missing from the answer was lost (expired or taken over).
    """
    if not handles:
        return []
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    values, params = _pairs([(handle.name, handle.holder, handle.token) for handle in handles])
    sql = (
        f"UPDATE scheduler_lease SET renewed_at = {now}, expires_at = {plus} "
        f"WHERE (name, holder, token) IN {values} AND expires_at > {now} "
        f"RETURNING name, expires_at, {now}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [dbclock.seconds_param(ttl), *params])
        rows = {name: (expires_at, db_now) for name, expires_at, db_now in cursor.fetchall()}
    return [
        _handle(handle.name, handle.holder, handle.token, *rows[handle.name], acquired_at=handle.acquired_at)
        for handle in handles
        if handle.name in rows
    ]


def record_renew_failure(*names: str) -> None:
    """Count a refused renewal on each lease row (exported as a metric)."""
    Lease.objects.filter(name__in=names).update(renew_failures=F("renew_failures") + 1)


def release(handle: LeaseHandle) -> bool:
    """Give the lease up so a follower can take it at once; return whether we still held it.

    On PostgreSQL the release also notifies ``RELEASE_CHANNEL`` (delivered
    when it commits), which waiting followers listen for.
    """
    return bool(release_many([handle]))


def release_many(handles: Sequence[LeaseHandle]) -> list[str]:
    """Give up, in one statement, each lease still held under its holder and token; return the names released.

    On PostgreSQL each release is notified on ``RELEASE_CHANNEL`` (payload:
    the lease name), delivered when the transaction commits.
    """
    if not handles:
        return []
    values, params = _pairs([(handle.name, handle.holder, handle.token) for handle in handles])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE scheduler_lease SET holder = '', expires_at = NULL "
            f"WHERE (name, holder, token) IN {values} RETURNING name",
            params,
        )
        released = sorted(name for (name,) in cursor.fetchall())
        if released and connection.vendor == "postgresql":
            notified, names = _pairs([(name,) for name in released])
            cursor.execute(f"SELECT pg_notify(%s, name) FROM {notified} AS released(name)", [RELEASE_CHANNEL, *names])
        if released:
            failpoint("lease.release")
    return released


def assert_held(handle: LeaseHandle) -> datetime:
    """Lock the lease row and check it is still ours; return the database clock.

    Call inside ``transaction.atomic()``: the row lock (PostgreSQL) or the
    write lock (SQLite) is held until commit, so nobody can take the lease
    over between this check and the commit of what the caller writes.
    Raise ``LeaseLost`` when the holder, token or expiry no longer match.
    """
    return assert_held_many([handle])


def assert_held_many(handles: Sequence[LeaseHandle]) -> datetime:
    """``assert_held`` for several leases in one statement; ``LeaseLost.names`` lists those lost.

    The beat's leases fence only under the shard count they belong to: the
    one lease ``LEASE_NAME`` while the stored count is 1, a shard's lease
    ``LEASE_NAME:<k>`` while it is more. The same statement reads the stored
    count under a shared lock (PostgreSQL; SQLite's write lock covers it), so
    a change of the count (``resharding.store_count``) waits for the commits
    in flight, and the commits after it fail here under the other kind of
    lease: no schedule is ever committed under two fences at once. A lease
    of the wrong kind is reported lost. (Before any count is stored, each
    process goes by its own ``SCHEDULER_SHARDS``; a beat replica stores one
    before its first dispatch, ``shard_keeper.follow_count``.)
    """
    if not connection.in_atomic_block:
        raise RuntimeError("assert_held() must run inside transaction.atomic()")
    now = dbclock.now_sql()
    locking = connection.features.has_select_for_update
    lock, share = (" FOR UPDATE", " FOR SHARE") if locking else ("", "")
    values, params = _pairs([(handle.name, handle.holder, handle.token) for handle in handles])
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT name, {now}, (SELECT shards FROM {shards.LAYOUT_TABLE} WHERE id = 1{share}) FROM scheduler_lease "
            f"WHERE (name, holder, token) IN {values} AND expires_at > {now} ORDER BY name{lock}",
            params,
        )
        rows = {name: (db_now, stored) for name, db_now, stored in cursor.fetchall()}
    lost = {handle.name for handle in handles} - rows.keys()
    if rows:
        count = shards.resolve(next(iter(rows.values()))[1], shards.configured())
        lost |= {name for name in rows if not _fences_under(name, count)}
    if lost:
        raise LeaseLost(names=tuple(sorted(lost)))
    return dbclock.as_datetime(next(iter(rows.values()))[0])


def _fences_under(name: str, count: int) -> bool:
    """Whether lease ``name`` may fence a dispatch while the shard count is ``count`` (any other lease may)."""
    if name == settings.LEASE_NAME:
        return count == 1
    if shards.shard_of_lease(name) is not None:
        return count > 1
    return True


def current(name: str) -> LeaseState:
    """Return the lease's row and the database clock, read in one query."""
    now = dbclock.now_sql()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT holder, token, acquired_at, renewed_at, expires_at, {now} FROM scheduler_lease WHERE name = %s",
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


def _lease_lock_key(lease_name: str) -> int:
    """The advisory lock that beat replicas from before the instance lock hold while they lead ``lease_name``.

    Those replicas take the lease by force from a holder once they get this
    lock: a leader of this version holds it too (``InstanceLock.hold_lease_lock``),
    so they wait for its TTL like for one of theirs, and a follower of this
    version reads it (``lease_lock_held``) before it calls a holder gone.
    """
    digest = hashlib.blake2b(f"scheduler-lease:{lease_name}".encode(), digest_size=8).digest()
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

    While it leads the one lease, a replica also holds the lock that beat
    replicas from before the instance lock took as their proof of leading
    (``hold_lease_lock``), so old and new replicas agree about who is gone
    during a rolling upgrade.
    """

    def __init__(self, instance_id: str) -> None:
        self.key = _lock_key(instance_id)
        self.held = False
        self._conn: psycopg.Connection | None = None
        self._listener: psycopg.Connection | None = None
        #: Lease names whose old-version lease lock this session holds.
        self._lease_locks: set[str] = set()

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

    def hold_lease_lock(self, lease_name: str) -> bool:
        """Take, or keep, the old-version lock of leading ``lease_name`` (``_lease_lock_key``); return whether held.

        Not held while a replica of the old version holds it (a leader that
        won by TTL from a frozen one): tried again at every renewal.
        """
        if lease_name in self._lease_locks:
            return True
        try:
            row = (
                self._connection().execute("SELECT pg_try_advisory_lock(%s)", [_lease_lock_key(lease_name)]).fetchone()
            )
        except psycopg.Error:
            self.close()
            return False
        if row and row[0]:
            self._lease_locks.add(lease_name)
        return lease_name in self._lease_locks

    def release_lease_lock(self, lease_name: str) -> None:
        """Let the old-version lock of leading ``lease_name`` go (after the lease row was given up or lost)."""
        if lease_name not in self._lease_locks:
            return
        self._lease_locks.discard(lease_name)
        try:
            self._connection().execute("SELECT pg_advisory_unlock(%s)", [_lease_lock_key(lease_name)])
        except psycopg.Error:
            self.close()  # closing the session frees it too

    def wait_for(self, holder: str | None, lease_name: str | None, *, timeout: float) -> Wait | None:
        """Wait up to ``timeout`` seconds for ``holder``'s process to go or for ``lease_name`` to be released.

        ``lease_name=None`` ends the wait on any notification of
        ``RELEASE_CHANNEL`` (a sharded replica: any shard released, any
        replica joined or gone), and ``holder=None`` waits for notifications only.
        Return how the wait ended, or ``None`` when it could not run (a driver
        error: the connections are dropped and the caller sleeps instead).
        An interruption (SIGTERM's ``SystemExit``) drops the connections and
        propagates, so a shutdown never waits for the lock.
        """
        try:
            if self._released(lease_name):  # notified since the last wait
                return Wait.RELEASED
            if holder is None:
                return self._listen(lease_name, timeout=timeout)
            key = _lock_key(holder)
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

    def notify(self, payload: str) -> None:
        """Wake every waiting replica (a sharded one's join, or a replica found gone); best effort."""
        try:
            self._connection().execute("SELECT pg_notify(%s, %s)", [RELEASE_CHANNEL, payload])
        except psycopg.Error:
            self.close()

    def close(self) -> None:
        """Drop both connections (which frees this replica's lock, and any lease lock it held)."""
        self.held = False
        self._lease_locks.clear()
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
            self._lease_locks.clear()
            self._conn = _connect("scheduler-instance-lock")
            # This session spends its time blocked in another replica's lock
            # (``wait_for``), where the server would not notice this process
            # die until the wait ended, and would keep its lock, the proof of
            # life, held that long: make it look for its client every 50 ms
            # (PostgreSQL 14 and later; older servers notice at the wait's end).
            if self._conn.info.server_version >= 140000:
                self._conn.execute(f"SET client_connection_check_interval = {CLIENT_CHECK_MS}")
        return self._conn

    def _listening(self) -> psycopg.Connection:
        if self._listener is None or self._listener.closed:
            self._listener = _connect("scheduler-lease-listener")
            self._listener.execute(f"LISTEN {RELEASE_CHANNEL}")
        return self._listener

    def _listen(self, lease_name: str | None, *, timeout: float) -> Wait:
        socket_ = self._listening().pgconn.socket
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            select.select([socket_], [], [], left)
            if self._released(lease_name):
                return Wait.RELEASED
        return Wait.TIMEOUT

    def _released(self, lease_name: str | None) -> bool:
        """Read the notifications received so far; return whether one released ``lease_name`` (any, for ``None``).

        A change of the stored shard count counts as a release of every lease:
        the waiting replica must read the new count now.
        """
        pgconn = self._listening().pgconn
        pgconn.consume_input()
        released = False
        while (notify := pgconn.notifies()) is not None:
            released = released or lease_name is None or notify.extra.decode() in (lease_name, COUNT_CHANGED)
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


def lease_lock_held(lease_name: str) -> bool:
    """PostgreSQL only: whether any session holds the old-version lock of leading ``lease_name`` (``_lease_lock_key``)."""
    key = _lease_lock_key(lease_name)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted "
            "AND (classid::bigint << 32) | objid::bigint = %s "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [key],
        )
        return cursor.fetchone() is not None


def locked_instances(instance_ids: Collection[str]) -> set[str]:
    """PostgreSQL only: those of ``instance_ids`` whose process holds its ``InstanceLock`` (is alive)."""
    wanted = {_lock_key(instance_id): instance_id for instance_id in instance_ids}
    with connection.cursor() as cursor:
        # A bigint advisory key shows as its high and low 32 bits.
        cursor.execute(
            "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks "
            "WHERE locktype = 'advisory' AND objsubid = 1 AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return {wanted[key] for (key,) in cursor.fetchall() if key in wanted}


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
