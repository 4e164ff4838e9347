"""Named leases with fencing tokens, decided by the database clock: acquire, renew, release, and the fence check.

Every comparison of a lease's expiry happens inside SQL against the database
server's clock, so a replica whose own clock is wrong can neither steal an
unexpired lease nor keep an expired one. Acquiring bumps the fencing token;
renewing never does. The lease row is the source of truth: what
``liveness`` learns (a holder's process gone, a lease released) only tells
a replica when to try again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F

from scheduler import dbclock, shards
from scheduler.beat import liveness
from scheduler.conf import settings
from scheduler.exceptions import LeaseLost
from scheduler.failpoints import failpoint
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

    @classmethod
    def from_row(cls, row: Sequence[Any], db_now: datetime) -> LeaseState:
        """Build it from a lease row's ``name, holder, token, acquired_at, renewed_at, expires_at`` as the driver returns them."""
        name, holder, token, acquired_at, renewed_at, expires_at = row
        return cls(
            name,
            holder,
            int(token),
            dbclock.as_datetime(acquired_at),
            dbclock.as_datetime(renewed_at),
            dbclock.as_datetime(expires_at),
            db_now,
        )

    @property
    def is_held(self) -> bool:
        return bool(self.holder) and self.expires_at is not None and self.expires_at > self.db_now

    @property
    def seconds_left(self) -> float:
        if not self.is_held:
            return 0.0
        assert self.expires_at is not None
        return (self.expires_at - self.db_now).total_seconds()


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
    ``liveness.InstanceLock`` came free): the lease is taken even unexpired, but only
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

    On PostgreSQL the release also notifies ``liveness.RELEASE_CHANNEL`` (delivered
    when it commits), which waiting followers listen for.
    """
    return bool(release_many([handle]))


def release_many(handles: Sequence[LeaseHandle]) -> list[str]:
    """Give up, in one statement, each lease still held under its holder and token; return the names released.

    On PostgreSQL each release is notified on ``liveness.RELEASE_CHANNEL`` (payload:
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
            cursor.execute(
                f"SELECT pg_notify(%s, name) FROM {notified} AS released(name)", [liveness.RELEASE_CHANNEL, *names]
            )
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
    now = dbclock.as_datetime(row[-1])
    assert now is not None
    return LeaseState.from_row((name, *row[:-1]), now)
