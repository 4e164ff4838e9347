"""The one lease a replica leads by: renewal, loss, and a rolling upgrade next to replicas from before the instance lock.

In a rolling upgrade both versions agree on who leads and who is gone.
Replicas of the old version prove they lead by a session-level advisory
lock keyed by the lease name, and a follower that gets it takes the lease
by force. The old replica is played here by a connection doing what it
did. Those tests are PostgreSQL only: on SQLite neither version has a lock,
both go by the TTL.
"""

from __future__ import annotations

import hashlib
import time

import psycopg
import pytest
from django.db import connection

from scheduler.beat import LeaderScheduler, liveness
from scheduler.beat.leadership import OneLease
from scheduler.models import Lease
from scheduler.owners import leases
from tests.support.replicas import BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)
#: The old version's lock is PostgreSQL's: on SQLite both versions go by the TTL alone.
postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="PostgreSQL only: no advisory lock on SQLite, in either version"
)

#: The key the old version's ``AdvisoryLock("beat")`` took.
OLD_LOCK_KEY = int.from_bytes(hashlib.blake2b(b"scheduler-lease:beat", digest_size=8).digest(), "big", signed=True)


def old_replica_session() -> psycopg.Connection:
    """A session of its own, as the old version's lock connection."""
    return liveness._connect("old-version-advisory-lock")


def try_old_lock(session: psycopg.Connection) -> bool:
    """What an old follower did every tick; when it got the lock it acquired the lease with ``force``."""
    row = session.execute("SELECT pg_try_advisory_lock(%s)", [OLD_LOCK_KEY]).fetchone()
    return bool(row and row[0])


@postgresql_only
def test_new_leader__holds_the_lock_an_old_follower_would_take_the_lease_by(beat_replica: BeatReplica) -> None:
    # Given a replica of this version leading
    leader = beat_replica()
    old_follower = old_replica_session()
    try:
        leader.tick()
        assert leader.leadership.held
        # When an old follower tries the lock, Then it does not get it, so it does not force the lease
        assert not try_old_lock(old_follower)
        # When the leader is renewed again, Then it still holds it
        leader.leadership._last_renew = 0.0  # type: ignore[attr-defined]  # a renewal due now
        leader.tick()
        assert leader.leadership.held and not try_old_lock(old_follower)
        # When the leader shuts down, Then the lock is free with the lease
        leader.close()
        assert not leases.current("beat").is_held
        assert try_old_lock(old_follower)
    finally:
        old_follower.close()


def run_ticks(scheduler: LeaderScheduler, seconds: float) -> None:
    """Tick as Celery's beat loop does (sleeping what each tick returns) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(scheduler.tick(), max(deadline - time.monotonic(), 0.0)))


@postgresql_only
def test_new_follower__leaves_a_live_old_leader_alone_and_takes_over_when_its_process_is_gone(
    beat_replica: BeatReplica,
) -> None:
    # Given a leader of the old version: the lease, and the old lock, but no instance lock
    old_leader = old_replica_session()
    assert try_old_lock(old_leader)
    held = leases.acquire("beat", "old-host-1-abcdef", ttl=30)
    assert held is not None
    follower = beat_replica()
    try:
        # When a follower of this version ticks for 3 s
        run_ticks(follower, 3.0)
        # Then it has not taken the lease: the old leader is alive
        state = leases.current("beat")
        assert not follower.leadership.held and (state.holder, state.token) == (held.holder, held.token)

        # When the old leader's process goes (its session ends) with 25 s left on its lease
        old_leader.close()
        run_ticks(follower, 3.0)
        # Then the follower took over at once, not a TTL later
        assert follower.leadership.held and follower.leadership.held[0].token > held.token
    finally:
        old_leader.close()


def test_one_lease__a_refused_renewal_drops_it_at_once() -> None:
    # Given a replica holding the one lease, taken over by another meanwhile
    one = OneLease("a", lock=None, sender=LeaderScheduler)
    assert one.hold()[0].holder == "a"
    leases.acquire("beat", "b", ttl=10, force=True)
    # When its renewal comes due
    one._last_renew = 0.0
    # Then it holds nothing (and does not take the lease back), and the refusal is counted
    assert one.hold() == {}
    assert leases.current("beat").holder == "b"
    assert Lease.objects.get(name="beat").renew_failures == 1


def test_one_lease__lost_by_the_fence_gives_the_row_up_so_another_replica_takes_it_at_once() -> None:
    # Given a replica holding the one lease, whose commit the fence refused while the row still names it
    # (the shard count changed under the commit)
    one = OneLease("a", lock=None, sender=LeaderScheduler)
    lease = one.hold()[0]
    # When it is told the lease is lost
    one.lost((lease.name,))
    # Then it holds nothing, and the row is free now, not a TTL later
    assert one.held == {}
    assert not leases.current("beat").is_held
    assert leases.acquire("beat", "b", ttl=10) is not None
