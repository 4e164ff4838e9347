"""Which beat replicas are alive, told by PostgreSQL sessions: each replica's advisory lock, and the beat's NOTIFYs.

A replica's process is alive exactly while the database session holding its
advisory lock (``InstanceLock``) lives: the server frees the lock when the
process dies or shuts down, so a replica waiting for it learns that within
moments, instead of a lease TTL later. A release of a lease is notified on
``RELEASE_CHANNEL``, so a waiting replica takes it at once too, and so is a
schedule that may now fire sooner, which wakes the leader. Neither is
ever a proof of leading: the lease row and its fencing token stay the truth
(``leases``); liveness only tells a replica when to look again. PostgreSQL
only: on SQLite the TTL decides.
"""

from __future__ import annotations

import enum
import hashlib
import select
import selectors
import time
from collections.abc import Collection

from django.db import connection

try:
    import psycopg
    from psycopg import pq
except ImportError:  # an install for SQLite alone: InstanceLock, PostgreSQL's, is never made there
    psycopg = pq = None  # type: ignore[assignment]  # bound, unused: the SQLite-only install never makes an InstanceLock

#: PostgreSQL channel of the NOTIFY ``leases.release`` sends; the payload is the lease name.
RELEASE_CHANNEL = "scheduler_lease"
#: The payload on ``RELEASE_CHANNEL`` when the stored shard count changed: it wakes every waiting replica.
COUNT_CHANGED = "shard-count"
#: The payload on ``RELEASE_CHANNEL`` when a schedule may fire sooner than the leader would look
#: (``schedules.save``): it wakes the leader, which otherwise sleeps until its next slot.
SCHEDULES_CHANGED = "schedules"
#: How long past its own bound the lock wait may take before it is dropped
#: (the server ends it at ``lock_timeout``; this only guards a silent server).
WAIT_GRACE_SECONDS = 2.0
#: How often (ms) the server checks that a replica blocked in a lock wait is still there.
CLIENT_CHECK_MS = 50
LOCK_NOT_AVAILABLE = b"55P03"
QUERY_CANCELED = b"57014"


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

    A second connection LISTENs for the NOTIFY that ``leases.release`` sends, so a
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
            # Listening before this replica may lead: a schedule changed between its taking
            # the lease and its first sleep is notified to that sleep, not lost.
            self._listening()
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

        ``lease_name`` is the payload that ends the wait (a lease's name, or
        ``SCHEDULES_CHANGED``); a changed shard count ends it too.

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
