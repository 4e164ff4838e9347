"""Liveness on PostgreSQL: a replica's instance lock tells the others when its process is gone; releases and changes are notified."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from scheduler import dbclock
from scheduler.beat import liveness
from scheduler.owners import leases
from tests.support.factories import make_schedule
from tests.support.processes import instance_lock_waiters, wait_until
from tests.support.replicas import BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting(holder: str, lease_name: str, timeout: float) -> tuple[threading.Thread, list[object]]:
    """Run ``InstanceLock("waiter").wait_for`` in a thread; the outcome lands in the returned list."""
    outcome: list[object] = []

    def wait() -> None:
        waiter = liveness.InstanceLock("waiter")
        try:
            assert waiter.try_acquire()
            outcome.append(waiter.wait_for(holder, lease_name, timeout=timeout))
        finally:
            waiter.close()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, outcome


def test_instance_lock__wait_ends_when_the_holder_session_ends(db_vendor: str, beat_replica: BeatReplica) -> None:
    if db_vendor == "sqlite":
        # SQLite has neither advisory locks nor LISTEN: a follower just sleeps its retry delay
        follower = beat_replica()
        assert follower.leadership.wait(1.0) == 1.0
        return
    # Given "a" holding its instance lock, and a follower waiting up to 30 s for it
    holder, impatient = liveness.InstanceLock("a"), liveness.InstanceLock("b")
    assert holder.try_acquire()
    try:
        assert impatient.wait_for("a", "beat", timeout=0.2) is liveness.Wait.TIMEOUT
        thread, outcome = _waiting("a", "beat", timeout=30)
        assert wait_until(lambda: instance_lock_waiters() == 1, timeout=10), "the follower is not blocked on the lock"
    finally:
        impatient.close()
        # When "a"'s session ends (its process died or shut down)
        holder.close()
    # Then the wait ends at once, saying the holder is gone, and leaves no lock behind
    thread.join(10)
    assert outcome == [liveness.Wait.GONE]
    assert instance_lock_waiters() == 0
    again = liveness.InstanceLock("a")
    try:
        assert again.try_acquire(), "the waiter kept the holder's lock"
    finally:
        again.close()


def test_release__notifies_a_waiting_follower(db_vendor: str) -> None:
    # Given "a" leading and holding its instance lock
    handle = leases.acquire("beat", "a", ttl=60)
    if db_vendor == "sqlite":
        # No LISTEN on SQLite: the release alone frees the lease for the next poll
        assert leases.release(handle) and leases.acquire("beat", "b", ttl=60) is not None
        return
    holder = liveness.InstanceLock("a")
    assert holder.try_acquire()
    try:
        # ... and a follower waiting up to 30 s for it
        thread, outcome = _waiting("a", "beat", timeout=30)
        assert wait_until(lambda: instance_lock_waiters() == 1, timeout=10), "the follower is not blocked on the lock"
        # When "a" releases the lease but lives on
        assert leases.release(handle)
        # Then the wait ends on the notification, with the holder's lock still held
        thread.join(10)
        assert outcome == [liveness.Wait.RELEASED]
        assert holder.try_acquire()
        assert instance_lock_waiters() == 0
    finally:
        holder.close()


def test_new_leader__a_schedule_changed_before_its_first_sleep_wakes_that_sleep(
    db_vendor: str, beat_replica: BeatReplica
) -> None:
    # Given a replica that just took the lease and has not slept yet
    beat = beat_replica()
    assert beat.leadership.hold()

    # When a schedule is created to fire soon, before that first sleep
    make_schedule("soon", interval=3600, start_at=dbclock.now() + timedelta(seconds=2))

    # Then its first sleep is woken by that change on PostgreSQL (the NOTIFY was not lost); SQLite has none
    if db_vendor == "sqlite":
        assert beat.leadership.wait(5.0) == 5.0
    else:
        lock = beat._lock
        assert lock is not None
        woken = lock.wait_for(None, liveness.SCHEDULES_CHANGED, timeout=5.0)
        assert woken is liveness.Wait.RELEASED, f"the change was not notified to the new leader: {woken}"
