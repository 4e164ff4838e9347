"""The fence under a real race: the leader is held inside ``dispatch_due`` while a follower takes over.

The sequential fencing tests let a usurper take the lease before a tick
starts. Here the leader is stopped at the two points that matter, between
planning and its commit, and between its lease check and its commit, on its
own thread and database connection, while a follower on another connection
tries to take the lease.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.exceptions import LeaseLost
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TTL = 1.0  # seconds: short, so the leader's lease expires while it is held
BOUND = 20.0  # seconds: no wait in these tests may take longer


class HeldLeader:
    """Runs one ``dispatch_due`` pass on a thread, stopping it at a gate until released."""

    def __init__(self, lease: leases.LeaseHandle) -> None:
        self.lease = lease
        self.at_gate = threading.Event()
        self.go = threading.Event()
        self.outcome: Any = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="held-leader")

    def gate(self) -> None:
        """Called by the patched code on the leader's thread only."""
        if threading.current_thread() is self.thread:
            self.at_gate.set()
            assert self.go.wait(BOUND), "the test never released the leader"

    def _run(self) -> None:
        try:
            self.outcome = dispatch.dispatch_due(self.lease)
        except LeaseLost as exc:
            self.outcome = exc
        finally:
            self.done.set()
            connection.close()  # this thread's own connection

    def start(self) -> None:
        self.thread.start()
        assert self.at_gate.wait(BOUND), "the leader never reached the gate"

    def release(self) -> None:
        self.go.set()
        self.thread.join(BOUND)
        assert self.done.is_set(), "the leader did not finish after being released"


@pytest.fixture
def due_schedule() -> Schedule:
    schedule = schedules.create(name="every-second", task="scheduler.echo", interval=1)
    Schedule.objects.filter(pk=schedule.pk).update(next_run_at=dbclock.now().replace(microsecond=0))
    return Schedule.objects.get(pk=schedule.pk)


@pytest.fixture
def held_leader(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], HeldLeader]]:
    """Return a function that makes a leader held at ``"before_commit"`` or ``"after_lease_check"``."""
    made: list[HeldLeader] = []

    def make(where: str) -> HeldLeader:
        leader = HeldLeader(leases.acquire("beat", "leader", ttl=TTL))
        if where == "before_commit":
            original_commit = dispatch._commit

            def commit(*args: Any, **kwargs: Any) -> None:
                leader.gate()
                original_commit(*args, **kwargs)

            monkeypatch.setattr(dispatch, "_commit", commit)
        else:
            original_check = leases.assert_held_many

            def assert_held_many(handles: list[leases.LeaseHandle]) -> Any:
                now = original_check(handles)
                leader.gate()
                return now

            monkeypatch.setattr(leases, "assert_held_many", assert_held_many)
        made.append(leader)
        return leader

    yield make
    for leader in made:
        leader.go.set()
        leader.thread.join(BOUND)


def lease_expired() -> bool:
    state = leases.current("beat")
    return state.expires_at is not None and state.expires_at < state.db_now


def test_leader_held_between_planning_and_commit__follower_takes_over_and_leader_commits_nothing(
    due_schedule: Schedule, held_leader: Callable[[str], HeldLeader]
) -> None:
    # Given a leader that planned the due slot and stopped before its commit
    leader = held_leader("before_commit")
    leader.start()
    old_token = leader.lease.token

    # When its lease expires and a follower takes over
    assert wait_until(lease_expired, timeout=BOUND)
    follower = leases.acquire("beat", "follower", ttl=10)
    assert follower is not None and follower.token == old_token + 1
    leader.release()

    # Then the old leader's commit is refused and writes nothing
    assert isinstance(leader.outcome, LeaseLost)
    assert not Execution.objects.filter(lease_token=old_token).exists()
    assert Schedule.objects.get(pk=due_schedule.pk).next_run_at == due_schedule.next_run_at
    # and the new leader dispatches the slot instead
    report = dispatch.dispatch_due(follower)
    assert [slot for _, slot in report.fired][:1] == [due_schedule.next_run_at]
    assert set(Execution.objects.values_list("lease_token", flat=True)) == {follower.token}


def test_leader_held_between_lease_check_and_commit__nobody_takes_over_until_it_commits(
    due_schedule: Schedule, held_leader: Callable[[str], HeldLeader]
) -> None:
    # Given a leader stopped inside its commit transaction, right after its lease check
    leader = held_leader("after_lease_check")
    leader.start()
    old_token = leader.lease.token
    events: list[str] = []

    # When its lease expires (on the database clock) and a follower keeps trying to take it
    assert wait_until(lease_expired, timeout=BOUND)

    def follow() -> None:
        try:
            handle = wait_until(lambda: leases.acquire("beat", "follower", ttl=10), timeout=BOUND, interval=0.05)
            events.append(f"acquired {handle.token if handle else None}")
        finally:
            connection.close()

    follower = threading.Thread(target=follow, name="follower")
    follower.start()
    # (PostgreSQL: each try gives up on the locked lease row; SQLite: the try
    # waits for the write lock. Either way it cannot get in while the leader holds it.)
    follower.join(2 * TTL)
    assert not events, "a follower took the lease while the leader held it between check and commit"
    events.append("leader released")
    leader.release()
    follower.join(BOUND)

    # Then the leader's commit went through under its token, and only after it did the follower lead
    assert not isinstance(leader.outcome, LeaseLost), leader.outcome
    assert events == ["leader released", f"acquired {old_token + 1}"]
    assert set(Execution.objects.values_list("lease_token", flat=True)) == {old_token}
    assert leases.current("beat").token == old_token + 1
